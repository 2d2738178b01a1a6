"""The user's ``chainer.config`` reaches update rules and optimizer hooks
wherever they run.

``chainer.config`` is thread-local.  With ``shard=`` a bucket's update rules
and per-parameter optimizer hooks run on the communication thread; with
``wait='forward'`` they run at the link's next forward, possibly under
other values (an evaluation's ``train=False``).  Either way they must see
the values in force when ``update()`` ran, as with ChainerMN's blocking
optimizer.  Each test first shows the fault without the capture (the
negative control), then the values seen with it.  Collective: every rank
runs this file.
"""
import threading

import numpy as np
import pytest

import chainer
import chainer.links as L

import chainermn_overlap
from chainermn_overlap.communication import ownership
from chainermn_overlap.optimizers.sharding import rules
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP

KEY = 'overlap_test_value'


class _Recorder(object):
    """A per-parameter optimizer hook that records the config it sees."""

    name = 'Recorder'
    call_for_each_param = True
    timing = 'pre'

    def __init__(self):
        self.seen = []

    def __call__(self, rule, param):
        self.seen.append((getattr(chainer.config, KEY, None),
                          chainer.config.train,
                          threading.current_thread()
                          is threading.main_thread()))


def _batch():
    rng = np.random.RandomState(5)
    return (rng.randn(6, 5).astype(np.float32),
            rng.randint(0, 3, 6).astype(np.int32))


def _setup(comm, **options):
    eq.seed_for_rank(3)
    model = L.Classifier(MLP(5, 7, 3))
    actual = chainer.optimizers.SGD(lr=0.1)
    opt = chainermn_overlap.create_overlapped_optimizer(
        actual, comm, bucket_size=256, **options).setup(model)
    hook = _Recorder()
    actual.add_hook(hook)
    return model, opt, hook


@pytest.fixture
def recorder_elementwise():
    rules.register_elementwise(_Recorder)
    yield
    rules._REGISTERED.discard(_Recorder)


def _sharded_run(comm):
    model, opt, hook = _setup(comm, shard='gradients', wait='update')
    x, t = _batch()
    try:
        for _ in range(3):
            with chainer.using_config(KEY, 7), \
                    chainer.using_config('train', False):
                opt.update(model, x, t)
    finally:
        opt.close()
    # The first update of a layout builds it (no hook on the thread).
    return [s for s in hook.seen if not s[2]]


@pytest.mark.usefixtures('recorder_elementwise')
def test_sharded_rules_see_the_users_config(comm, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(ownership, 'capture_config', lambda: None)
        uncaptured = _sharded_run(comm)
    # The fault: on the communication thread, Chainer's defaults.
    eq.assert_all_ranks(bool(uncaptured) and all(
        s[:2] == (None, True) for s in uncaptured),
        'negative control: hooks on the thread saw {}'.format(uncaptured),
        comm)
    seen = _sharded_run(comm)
    eq.assert_all_ranks(bool(seen) and all(s[:2] == (7, False)
                                           for s in seen),
                        'hooks on the thread saw {}'.format(seen), comm)


def _deferred_run(comm):
    model, opt, hook = _setup(comm, wait='forward')
    x, t = _batch()
    try:
        for _ in range(3):
            with chainer.using_config(KEY, 'update'):
                opt.update(model, x, t)
            # The deferred updates run here, under other values.
            with chainer.using_config(KEY, 'evaluation'), \
                    chainer.using_config('train', False):
                model(x, t)
    finally:
        opt.close()
    return hook.seen


def test_deferred_rules_see_the_config_of_update(comm, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(ownership, 'capture_config', lambda: None)
        uncaptured = _deferred_run(comm)
    eq.assert_all_ranks(
        ('evaluation', False, True) in uncaptured,
        'negative control: deferred hooks saw {}'.format(uncaptured), comm)
    seen = _deferred_run(comm)
    eq.assert_all_ranks(bool(seen) and all(s == ('update', True, True)
                                           for s in seen),
                        'deferred hooks saw {}'.format(seen), comm)
