"""The NCCL engine on a GPU: cupy streams and events, NCCL collectives.

The same properties as the CPU stand-in's tests
(``tests/mpi/test_nccl_engine.py``), on the real stream set: results equal
MPI's allreduce of the same data, the reduction waits for a producing
kernel still running on the compute stream, and a wait leaves the host
free while the compute stream waits.  NCCL refuses ranks that share a GPU:
then these tests skip at more than one rank, saying so.
"""
import numpy as np
import pytest
from mpi4py import MPI

from chainermn_overlap.communication import nccl
from chainermn_overlap.communication import streams as streams_module
from chainermn_overlap.testing import device

import _gpu_device  # NOQA: E402  (tests/gpu)

DEV = _gpu_device.require()
WORLD = MPI.COMM_WORLD
OK, WHY = device.nccl_usable(WORLD)
pytestmark = pytest.mark.skipif(not OK, reason='nccl engine: ' + WHY)


def make(**options):
    return nccl.NcclEngine(WORLD, timeout=120, **options)


@pytest.mark.parametrize('sync', ['stream', 'host'])
@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.float16])
def test_gpu_results_equal_mpi_allreduce(sync, dtype):
    import cupy
    rng = np.random.RandomState(WORLD.rank)
    data = [rng.randint(-20, 20, size=n).astype(dtype)
            for n in (1, 1000, 3 << 20)]
    want = [WORLD.allreduce(d) for d in data]
    engine = make(sync=sync, chunk_bytes=1 << 20)
    try:
        arrays = [cupy.asarray(d) for d in data]
        hs = [engine.allreduce(a, label='item {}'.format(i),
                               slot=('r', i, len(arrays)), priority=i)
              for i, a in enumerate(arrays)]
        for h in hs:
            h.wait()
        got = [cupy.asnumpy(a) for a in arrays]  # after the stream wait
    finally:
        engine.close()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_gpu_reduction_waits_for_a_running_producer_kernel():
    import cupy
    # A long kernel writes the buffer on the compute stream; the post
    # happens right after the launch, while it still runs.
    engine = make()
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            a = cupy.zeros(1 << 22, dtype=cupy.float32)
            x = cupy.ones((2048, 2048), dtype=cupy.float32)
            for _ in range(20):
                x = x @ x / 2048.0     # busy work on this stream
            a[...] = (WORLD.rank + 1.0) * x[0, 0]
            h = engine.allreduce(a, label='late')
            h.wait()                   # the compute stream waits
            total = float(a[:4].sum().get()) / 4
        stream.synchronize()
    finally:
        engine.close()
    assert total == pytest.approx(WORLD.size * (WORLD.size + 1) / 2.0)


def test_gpu_default_backend_is_host_staged_until_nccl_is_proven():
    # Issue 43: backend=None picks the host-staged MPI engine for device
    # parameters until a GPU run has shown the NCCL engine to work
    # (nccl.NCCL_BY_DEFAULT); the rule it will then apply is checked too.
    import cupy
    available = streams_module.nccl_available()
    assert nccl.default_backend(cupy, available) == 'mpi_priority'
    assert nccl.default_backend(cupy, available, nccl_by_default=True) \
        == ('nccl' if available else 'mpi_priority')
