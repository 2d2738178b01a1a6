"""Debug mode catches a main-thread write to a bucket in flight.

The communication thread owns a bucket's buffer from its post until its
handle completes (``communication/engine.py``, "Thread ownership").  The
reducer's ``before_reuse`` waits before a buffer is packed again; if that
wait were missing (the bug the check is for), the main thread would
overwrite a reduction in progress.  These tests remove it on purpose: the
write really lands in flight without ``debug``, and ``debug=True`` stops
it with an ``OwnershipError``.  No MPI: the engine is a stand-in whose
collective completes when the test says so.
"""
import threading

import numpy as np
import pytest

import chainer

from chainermn_overlap.communication import buckets
from chainermn_overlap.communication import ownership
from chainermn_overlap.communication.timeline import NullTimeline
from chainermn_overlap.optimizers._reducer import BucketReducer
from chainermn_overlap.optimizers._tracker import ParamState


class _Handle(object):
    nbytes = 0
    spans = ()

    def __init__(self, release):
        self._release = release

    def done(self):
        return self._release.is_set()

    def wait(self):
        if not self._release.wait(10):
            raise RuntimeError('the test never completed the collective')

    def busy_seconds(self):
        return 0.0


class _Engine(object):
    """Collectives that complete only once ``release`` is set."""

    def __init__(self, debug):
        self.debug = debug
        self.release = threading.Event()

    def allreduce(self, buffer, op, label, slot, priority):
        return _Handle(self.release)


def _reducer(debug, before_reuse):
    param = chainer.Parameter(np.zeros(4, dtype=np.float32))
    plan, = buckets.plan_buckets([('/W', 4, np.float32)], 1 << 20)
    bucket = buckets.Bucket(0, plan, [param])
    info = ParamState('/W', param, bucket, 0)
    engine = _Engine(debug)
    reducer = BucketReducer(engine, 2, 'forward', NullTimeline(),
                            before_reuse=before_reuse,
                            before_first_post=lambda: None)
    reducer.set_buckets([bucket])
    return reducer, engine, bucket, info


def _post(reducer, info, value):
    reducer.pack(info, np.full(4, value, dtype=np.float32))
    reducer.try_post(0)
    reducer.next_iteration()


def test_without_debug_the_missing_wait_overwrites_a_reduction():
    # Negative control: the fault the check exists for is real.
    reducer, engine, bucket, info = _reducer(False, lambda b: None)
    _post(reducer, info, 1.0)
    assert bucket.in_flight()
    reducer.pack(info, np.full(4, 2.0, dtype=np.float32))
    assert bucket.in_flight()
    assert (bucket.buffer == 2.0).all()   # written under the reduction


def test_debug_stops_a_main_thread_write_in_flight():
    reducer, engine, bucket, info = _reducer(True, lambda b: None)
    _post(reducer, info, 1.0)
    with pytest.raises(ownership.OwnershipError,
                       match='packing the gradient of /W.*in flight'):
        reducer.pack(info, np.full(4, 2.0, dtype=np.float32))
    assert (bucket.buffer == 1.0).all()   # the reduction's data untouched


def test_debug_lets_the_write_through_once_the_bucket_is_waited_for():
    def flush(bucket):
        engine.release.set()
        reducer.wait_bucket(bucket)
        bucket.handle = None

    reducer, engine, bucket, info = _reducer(True, flush)
    _post(reducer, info, 1.0)
    reducer.pack(info, np.full(4, 2.0, dtype=np.float32))
    assert not bucket.in_flight()
    assert (bucket.buffer == 2.0).all()


def test_config_capture_replaces_and_restores_the_threads_values():
    seen = {}
    with chainer.using_config('overlap_test_value', 3), \
            chainer.using_config('train', False):
        values = ownership.capture_config()

    def thread():
        chainer.config.overlap_test_value = 'own'
        with ownership.using_config(values):
            seen['inside'] = (chainer.config.overlap_test_value,
                              chainer.config.train)
        seen['after'] = (chainer.config.overlap_test_value,
                         chainer.config.train)

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert seen == {'inside': (3, False), 'after': ('own', True)}
    assert not hasattr(chainer.config, 'overlap_test_value')
