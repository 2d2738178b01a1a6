"""The snapshot test of the reliability suite with model and data on a GPU.

A run snapshotted right after update() k with reductions in flight, then
resumed into a fresh model, equals the uninterrupted run bit for bit (the
same device kernels run in the same order in both).
"""
import copy

import pytest
from chainer import serializers

from chainermn_overlap.testing import device
from chainermn_overlap.testing import equivalence as eq

import _gpu_device  # NOQA: E402  (tests/gpu)

DEV = _gpu_device.require()

import test_reliability as cpu  # NOQA: E402


def on_device(batch):
    return tuple(device.to_device(a, DEV) for a in batch)


@pytest.mark.parametrize('backend', ['mpi_priority', 'nccl'])
@pytest.mark.parametrize('wait', ['forward', 'update'])
def test_gpu_snapshot_with_updates_in_flight_resumes_bit_exact(
        comm, wait, backend, tmp_path):
    if backend == 'nccl':
        ok, why = device.nccl_usable(comm.mpi_comm)
        if not ok:
            pytest.skip('nccl engine: ' + why)
    steps, k = 8, 5
    data = [on_device(b) for b in cpu.batches(42, steps)]
    template = device.to_device(cpu.build(42), DEV)
    model = copy.deepcopy(template)
    opt = cpu.overlapped(comm, model, bucket_size=256, wait=wait,
                         backend=backend)
    path = str(tmp_path / 'snap-rank{}.npz'.format(comm.rank))
    for it in range(steps):
        opt.update(model, *data[it])
        if it == k - 1:
            serializers.save_npz(path, model)
            serializers.save_npz(path + '.opt.npz', opt)
    opt.synchronize()
    opt.close()
    resumed = device.to_device(cpu.build(43), DEV)
    serializers.load_npz(path, resumed)
    ropt = cpu.overlapped(comm, resumed, bucket_size=256, wait=wait,
                          backend=backend)
    serializers.load_npz(path + '.opt.npz', ropt)
    for it in range(k, steps):
        ropt.update(resumed, *data[it])
    ropt.synchronize()
    ropt.close()
    device.to_host(resumed)
    device.to_host(model)
    eq.assert_equivalent(resumed, model, rtol=0, atol=0,
                         what='resumed vs uninterrupted on {}'.format(DEV))
    assert ropt.t == opt.t
