"""Options: gradients in float16 on the wire, bucket sizes, backends."""
import chainer
import chainermn
import numpy as np
import pytest

import chainermn_overlap
from chainermn_overlap.testing import models


def _mlp():
    # 6-16-4, ReLU, loss sum(tanh(y)) inside forward.
    return models.MLP(6, 16, 4, n_layers=2, loss=models.sum_of_tanh)


def _run(comm, make, steps=5):
    np.random.seed(3)
    model = _mlp()
    opt = make(chainer.optimizers.MomentumSGD(0.05))
    opt.setup(model)
    for i in range(steps):
        x = np.random.RandomState(10 * i + comm.rank).randn(4, 6).astype(
            np.float32)
        opt.update(model, x)
    stats = None
    if hasattr(opt, 'synchronize'):
        opt.synchronize()
        stats = opt.communication_stats()
        opt.close()
    return {n: p.array.copy() for n, p in model.namedparams()}, stats


def test_float16_on_the_wire(comm):
    ref, _ = _run(comm, lambda o: chainermn.create_multi_node_optimizer(
        o, comm))
    got32, s32 = _run(comm, lambda o: chainermn_overlap
                      .create_overlapped_optimizer(o, comm))
    got16, s16 = _run(comm, lambda o: chainermn_overlap
                      .create_overlapped_optimizer(
                          o, comm, allreduce_grad_dtype=np.float16))
    # Half the bytes per reduction, parameters stay float32.
    assert s16['bytes'] * 2 == s32['bytes']
    for n in ref:
        assert got16[n].dtype == np.float32
        np.testing.assert_allclose(got32[n], ref[n], rtol=1e-5, atol=1e-6)
        # float16 has 11 significant bits: ~5e-4 relative per gradient.
        np.testing.assert_allclose(got16[n], ref[n], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize('backend, bucket_size, chunk', [
    ('mpi_thread', 1, None), ('mpi_thread', '1GB', None),
    ('mpi_priority', 1, None), ('mpi_priority', '1KB', 256),
    ('mpi_priority', '1GB', None), ('mpi_priority', '1GB', 100)])
def test_backends_and_sizes_agree(comm, backend, bucket_size, chunk):
    ref, _ = _run(comm, lambda o: chainermn.create_multi_node_optimizer(
        o, comm))
    got, _ = _run(comm, lambda o: chainermn_overlap
                  .create_overlapped_optimizer(
                      o, comm, bucket_size=bucket_size, backend=backend,
                      chunk_size=chunk))
    for n in ref:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-5, atol=1e-6)


def test_default_engine_on_cpu_is_the_priority_engine(comm):
    # backend=None picks the engine from where the parameters live:
    # host-staged MPI for numpy ('nccl' only for GPU parameters).
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(), comm).setup(_mlp())
    try:
        assert opt._overlap.backend_name == 'mpi_priority'
        assert type(opt._overlap.engine).__name__ == 'PriorityMpiBackend'
    finally:
        opt.close()
    with pytest.raises(ValueError, match="chunk_size applies"):
        chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), comm, backend='mpi_thread',
            chunk_size='1MB')
