"""Who may touch what, between the main thread and the communication thread.

The rules are written at the top of :mod:`.engine` (the module that starts
the thread).  This module holds what enforces and supports them:

* :func:`check_main_write`: in debug mode (``debug=True``), a main-thread
  write to a bucket whose collective is still in flight raises
  :class:`OwnershipError` instead of corrupting the reduction;
* :func:`capture_config` / :func:`using_config`: ``chainer.config`` is
  thread-local, so work handed to the communication thread (a sharded
  bucket's update rules and optimizer hooks) would see Chainer's defaults;
  the main thread's values are captured when the work is posted and
  applied around it on the thread.
"""
import contextlib
import threading

import chainer

__all__ = ['OwnershipError', 'capture_config', 'check_main_write',
           'using_config']


class OwnershipError(RuntimeError):
    """A thread touched what the other thread owns (a bug; raised only in
    debug mode, where the checks run)."""


def check_main_write(bucket, what):
    """Raises if the main thread is about to write ``bucket``'s memory
    while its collective is in flight (debug mode only calls it).

    Args:
        bucket: a :class:`~.buckets.Bucket`.
        what (str): the write, for the message.
    """
    if bucket.in_flight():
        raise OwnershipError(
            '{} on thread {!r} while the collective of {} is in flight: the '
            'communication thread owns its buffer until its handle '
            'completes (communication/engine.py, "Thread ownership"); '
            'wait for the bucket first. This is a bug of chainermn_overlap.'
            .format(what, threading.current_thread().name, bucket.label()))


def capture_config():
    """The calling thread's own ``chainer.config`` values (those set with
    ``chainer.using_config`` or ``chainer.config.x = ...``: the thread-local
    layer over ``chainer.global_config``)."""
    return dict(chainer.config._local.__dict__)


@contextlib.contextmanager
def using_config(values):
    """Runs the block with ``values`` (from :func:`capture_config`) as the
    calling thread's own ``chainer.config`` values (replacing those it has;
    None: no change), then restores what it had."""
    if values is None:
        yield
        return
    local = chainer.config._local.__dict__
    saved = dict(local)
    local.clear()
    local.update(values)
    try:
        yield
    finally:
        local.clear()
        local.update(saved)
