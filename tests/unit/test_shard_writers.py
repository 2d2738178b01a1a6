"""The refusal of a one-writer multi_node_snapshot is the same on every rank.

:func:`~chainermn_overlap.optimizers.sharding.writers.check_extension`
decides from what every rank holds alike, with no communication; here each
rank's extension is built in one process (ChainerMN's ``__init__`` reads only
``comm.rank`` and ``comm.size``) and the decisions compared.  The 2-rank runs
of ChainerMN's own autoload test are in test_shard_faults.py.
"""
import types

import pytest

import chainer
from chainer import training
from chainer.training import extensions
from chainermn.extensions import multi_node_snapshot

from chainermn_overlap.optimizers.sharding import writers


class _Sharded(object):
    """Stands for the wrapper of a sharded optimizer."""

    def __init__(self):
        self.actual_optimizer = chainer.optimizers.SGD()
        self.target = chainer.Link()     # for the Trainer's reporter
        writers.register(self.actual_optimizer)


def _refused(opt, replica_sets, size, target=None):
    """For each rank: the error message check_extension raises, or None."""
    out = []
    for rank in range(size):
        comm = types.SimpleNamespace(rank=rank, size=size)
        snapshot = extensions.snapshot(target=target or opt)
        sets = replica_sets() if callable(replica_sets) else replica_sets
        ext = multi_node_snapshot(comm, snapshot, sets)
        try:
            writers.check_extension(ext, trainer=None)
        except RuntimeError as e:
            out.append(str(e).replace('rank {}:'.format(rank), 'rank R:', 1))
        else:
            out.append(None)
    return out


@pytest.mark.parametrize('replica_sets, size', [
    ([], 2), ([], 4),
    # Rank 0 is a set of its own, yet ranks 1-3 do not serialize: every
    # rank must refuse, rank 0 included.
    ([0], 4), ([0, 1], 4),
    # A generator, read by ChainerMN and by the check.
    (lambda: (r for r in range(0, 4, 2)), 4),
])
def test_every_rank_refuses_alike(replica_sets, size):
    got = _refused(_Sharded(), replica_sets, size)
    assert got[0] is not None
    assert 'multi_node_snapshot' in got[0] and writers.FIX in got[0]
    messages = {m.replace(m[m.index("this rank's set"):m.index(')')], '')
                for m in got}
    assert len(messages) == 1, got


def test_the_message_names_every_set():
    got = _refused(_Sharded(), [0], 4)
    assert 'replica sets: [[0], [1, 2, 3]]' in got[0]
    assert "this rank's set: [0]" in got[0]
    assert "this rank's set: [1, 2, 3]" in got[2]
    # A generator of sets: ChainerMN and the check each read all of it.
    got = _refused(_Sharded(), lambda: (r for r in (0, 2)), 4)
    assert 'replica sets: [[0], [2], [1, 3]]' in got[1], got[1]


def test_every_rank_its_own_set_is_accepted():
    assert _refused(_Sharded(), [[r] for r in range(4)], 4) == [None] * 4


def test_an_unsharded_optimizer_is_accepted():
    plain = types.SimpleNamespace(
        actual_optimizer=chainer.optimizers.SGD())
    assert _refused(plain, [], 2) == [None, None]


def test_the_optimizer_is_found_through_the_trainer_and_updater():
    opt = _Sharded()
    updater = training.StandardUpdater(
        chainer.iterators.SerialIterator([1, 2], 1), opt)
    assert None not in _refused(opt, [], 2, target=updater)
    # target=None: the trainer passed to the extension.
    comm = types.SimpleNamespace(rank=1, size=2)
    ext = multi_node_snapshot(comm, extensions.snapshot(), [])
    trainer = types.SimpleNamespace(updater=updater)
    writers.check_extension(ext, trainer)    # not a Trainer: not seen
    trainer = training.Trainer(updater)
    with pytest.raises(RuntimeError, match='rank 1: a snapshot of the '
                       'sharded optimizer is taken by'):
        ext.initialize(trainer)
    with pytest.raises(RuntimeError, match='rank 1: a snapshot'):
        ext(trainer)
