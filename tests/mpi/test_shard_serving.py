"""A rank answers parameter fetches (``shard='parameters'``) whatever its
main thread does: waiting in a collective of ChainerMN's or mpi4py's
(objects or buffers), in a receive, or asleep.

Rank 0 enters the call at once while the other ranks first run a forward
(which fetches rank 0's pieces), as ChainerMN's multi-node evaluator does
when the ranks' validation shards differ in length.  Each test works on a
communicator of its own, made here: mpi4py's context for reductions of
objects is created on a communicator's first such reduction, with the
interpreter lock held (see ``sharding/server.py``), and a communicator that
an earlier test used would hide that.  The optimizers' limit is short, so
that a rank that does not answer fails the test in seconds.

Collective tests: every rank runs this file.
"""
import time

import numpy as np
import pytest

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions
import chainermn

import chainermn_overlap
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP

TIMEOUT = 20.0   # seconds; the defaults' 600 s would only slow a failure


@pytest.fixture
def fresh():
    """A ChainerMN communicator over a new duplicate of COMM_WORLD."""
    from mpi4py import MPI
    mpi_comm = MPI.COMM_WORLD.Dup()
    yield chainermn.create_communicator('naive', mpi_comm=mpi_comm)
    mpi_comm.Free()


def _model():
    eq.seed_for_rank(5)
    return L.Classifier(MLP(5, 7, 3))


def _optimizer(comm, model, shard):
    actual = chainer.optimizers.Adam(alpha=0.01)
    if shard is None:
        opt = chainermn.create_multi_node_optimizer(actual, comm)
    else:
        opt = chainermn_overlap.create_overlapped_optimizer(
            actual, comm, shard=shard, bucket_size=256, timeout=TIMEOUT)
    return opt.setup(model)


def _world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _receive_from_each(comm):
    if comm.rank == 0:
        return [comm.recv_obj(r, tag=7) for r in range(1, comm.size)]
    comm.send_obj(comm.rank, 0, tag=7)
    return None


# What the main thread of rank 0 does while the others fetch; the others
# join after their forward.
CALLS = {
    'allreduce_obj': lambda c: c.allreduce_obj(c.rank + 1),
    'bcast_obj': lambda c: c.bcast_obj('x' if c.rank == 0 else None),
    'gather_obj': lambda c: c.gather_obj(c.rank),
    'recv_obj': _receive_from_each,
    'allreduce': lambda c: c.allreduce(np.full(3, c.rank, np.float32)),
    'mpi_comm.reduce': lambda c: c.mpi_comm.reduce(c.rank),
    'mpi_comm.scan': lambda c: c.mpi_comm.scan(c.rank),
    'mpi_comm.exscan': lambda c: c.mpi_comm.exscan(c.rank),
    'mpi_comm.Barrier': lambda c: c.mpi_comm.Barrier(),
    # The optimizer's communicator is a duplicate of COMM_WORLD here; this
    # one fails without the fix only if nothing reduced objects on
    # COMM_WORLD before (checked once by hand, not in a session).
    'COMM_WORLD.allreduce': lambda c: _world().allreduce(c.rank),
    'sleep': lambda c: time.sleep(2.0),
}


def _forward(model, x):
    with chainer.using_config('train', False), \
            chainer.using_config('enable_backprop', False):
        return np.array(model.predictor(x).array)


@pytest.mark.parametrize('call', sorted(CALLS))
def test_fetch_answered_while_owner_waits_in(fresh, call):
    if fresh.size == 1:
        pytest.skip('one rank owns every piece')
    rng = np.random.RandomState(3)
    batches = [(rng.randn(6, 5).astype(np.float32),
                rng.randint(0, 3, 6).astype(np.int32)) for _ in range(3)]
    model, ref = _model(), _model()
    opt = _optimizer(fresh, model, 'parameters')
    ref_opt = _optimizer(fresh, ref, None)
    for x, t in batches[:2]:
        opt.update(model, x, t)
        ref_opt.update(ref, x, t)
    x = batches[2][0]
    start = time.perf_counter()
    if fresh.rank == 0:
        CALLS[call](fresh)
        ok, msg = True, ''
    else:
        time.sleep(1.0)   # rank 0 is in the call by now
        y = _forward(model, x)
        CALLS[call](fresh)
        ok = np.array_equal(y, _forward(ref, x))
        msg = 'forward differs from the unsharded model\'s'
    seconds = time.perf_counter() - start
    opt.close()
    eq.assert_all_ranks(ok, msg, fresh)
    eq.assert_all_ranks(seconds < 10, '{:.1f} s in the call'.format(seconds),
                        fresh)


def _train(comm, shard, tmp_path):
    """Two epochs of a Trainer with a multi-node evaluator after each, on
    validation shards of unequal length (rank r: 1 + 4 r examples, so rank
    0 waits in allreduce_obj while the others still evaluate)."""
    rng = np.random.RandomState(11 + comm.rank)
    train = chainer.datasets.TupleDataset(
        rng.randn(12, 5).astype(np.float32),
        rng.randint(0, 3, 12).astype(np.int32))
    n = 1 + 4 * comm.rank
    valid = chainer.datasets.TupleDataset(
        rng.randn(n, 5).astype(np.float32),
        rng.randint(0, 3, n).astype(np.int32))
    model = _model()
    opt = _optimizer(comm, model, shard)
    updater = training.StandardUpdater(
        chainer.iterators.SerialIterator(train, 6, shuffle=False), opt)
    trainer = training.Trainer(updater, (2, 'epoch'), out=str(tmp_path))
    evaluator = extensions.Evaluator(
        chainer.iterators.SerialIterator(valid, 1, repeat=False,
                                         shuffle=False), model)
    trainer.extend(chainermn.create_multi_node_evaluator(evaluator, comm),
                   trigger=(1, 'epoch'))
    reports = []

    @training.make_extension(trigger=(1, 'epoch'),
                             priority=training.PRIORITY_READER)
    def record(trainer):
        reports.append({k: float(v) for k, v in trainer.observation.items()
                        if k.startswith('validation/')})

    trainer.extend(record)
    trainer.run()
    if shard is not None:
        opt.synchronize()
    state = eq.param_state(model, persistents=False)
    if shard is not None:
        opt.close()
    return state, reports


def test_trainer_with_multi_node_evaluator(fresh, tmp_path):
    start = time.perf_counter()
    got, got_reports = _train(fresh, 'parameters', tmp_path)
    seconds = time.perf_counter() - start
    ref, ref_reports = _train(fresh, None, tmp_path)
    errors = eq.compare_states(got, ref, rtol=0, atol=0)
    eq.assert_all_ranks(not errors, str(errors[:3]), fresh)
    eq.assert_all_ranks(
        len(ref_reports) == 2 and got_reports == ref_reports,
        'evaluator reported {}, unsharded {}'.format(got_reports,
                                                     ref_reports), fresh)
    eq.assert_all_ranks(seconds < 10, '{:.1f} s to train'.format(seconds),
                        fresh)
