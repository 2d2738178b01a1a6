"""Bad input gets a clear error on every rank, never a hang."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

import chainermn_overlap


def _all_raised(comm, excinfo_ok):
    # Every rank must have raised: gather so a rank that did not would
    # fail the test everywhere instead of leaving others waiting.
    return all(comm.mpi_comm.allgather(bool(excinfo_ok)))


def test_not_a_communicator():
    with pytest.raises(TypeError, match='ChainerMN communicator'):
        chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), object())


def test_not_an_optimizer(comm):
    with pytest.raises(TypeError, match='chainer.Optimizer'):
        chainermn_overlap.create_overlapped_optimizer('sgd', comm)


@pytest.mark.parametrize('kwargs, match', [
    ({'wait': 'backward'}, "wait must be 'forward' or 'update'"),
    ({'bucket_size': 0}, 'at least 1 byte'),
    ({'chunk_size': '1MB', 'backend': 'mpi_thread'}, 'chunk_size applies'),
    ({'bucket_size': -5}, 'at least 1 byte'),
    ({'bucket_size': '25 parsecs'}, 'not understood'),
    ({'allreduce_grad_dtype': np.int32}, 'float16, float32 or float64'),
    ({'backend': 'carrier-pigeon'}, 'unknown communication backend'),
])
def test_option_values_out_of_range(comm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), comm, **kwargs)


def test_update_before_setup(comm):
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(), comm)
    with pytest.raises(RuntimeError, match='before setup'):
        opt.update()


class _Net(chainer.Chain):

    def __init__(self, n_out, extra=False):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, n_out)
            if extra:
                self.l3 = L.Linear(4, 2)

    def forward(self, x):
        return F.sum(self.l2(self.l1(x)))


def _one_step(comm, model):
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(), comm).setup(model)
    x = np.ones((2, 3), dtype=np.float32)
    try:
        opt.update(model, x)
    finally:
        opt.close()


def test_shapes_differ_between_ranks(comm):
    if comm.size == 1:
        pytest.skip('needs two ranks to differ')
    model = _Net(5 if comm.rank == comm.size - 1 else 2)
    with pytest.raises(ValueError) as e:
        _one_step(comm, model)
    msg = str(e.value)
    assert 'differs between ranks' in msg and '/l2/W' in msg, msg
    assert _all_raised(comm, True)


def test_names_differ_between_ranks(comm):
    if comm.size == 1:
        pytest.skip('needs two ranks to differ')
    model = _Net(2, extra=(comm.rank == 0))
    with pytest.raises(ValueError) as e:
        _one_step(comm, model)
    msg = str(e.value)
    assert 'model differs between ranks' in msg and '/l3/' in msg, msg
    assert _all_raised(comm, True)


@pytest.mark.parametrize('option, values', [
    ('allreduce_grad_dtype', (None, np.float16)),
    ('wait', ('update', 'forward')),
    ('backend', ('mpi_thread', 'mpi_priority')),
])
def test_options_differ_between_ranks(comm, option, values):
    # The options decide which collectives run (a float16 ring against an
    # allreduce, chunks against whole buckets): the last rank gives
    # another value, and every rank raises at the first update.
    if comm.size == 1:
        pytest.skip('needs two ranks to differ')
    mine = values[comm.rank == comm.size - 1]
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(), comm, timeout=20,
        **{option: mine}).setup(_Net(2))
    with pytest.raises(ValueError) as e:
        try:
            opt.update(opt.target, np.ones((2, 3), dtype=np.float32))
        finally:
            opt.close()
    msg = str(e.value)
    assert "optimizer's options differ between ranks" in msg, msg
    assert 'rank {}: {}='.format(comm.size - 1, option) in msg, msg
    assert _all_raised(comm, True)


def test_same_model_is_accepted(comm):
    # Negative control for the two tests above: no error when ranks agree.
    _one_step(comm, _Net(2))
