"""Progress engines: how a posted reduction actually moves and completes.

A backend runs in-place allreduces that were posted without blocking the
caller, in exactly the order they were posted.  The optimizer's hooks never
talk to MPI themselves; they post to a backend and wait on its handles, so a
different engine (an NCCL side stream signalling with CUDA events, an
emulated network) plugs in behind the same two calls.

Backends are looked up by name in a small registry (:func:`get_backend`),
the way communication hooks or array backends are registered elsewhere.
"""
import atexit
import queue
import threading
import time
import weakref

import numpy

import chainer


_BACKENDS = {}
_LIVE = weakref.WeakSet()


def register_backend(name, cls):
    """Makes a backend class available under ``name``."""
    _BACKENDS[name] = cls


def get_backend(name):
    """Returns the backend class registered as ``name``."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError('unknown communication backend {!r}; available: {}'
                         .format(name, ', '.join(sorted(_BACKENDS))))


@atexit.register
def _close_all():
    # Runs before mpi4py finalizes MPI (atexit is LIFO and mpi4py registered
    # first), so no communication thread is inside MPI at MPI_Finalize.
    for backend in list(_LIVE):
        backend.close()


class CommunicationError(RuntimeError):
    """A posted reduction failed; raised where it is waited for."""


class Handle(object):
    """Completion handle of one posted reduction."""

    __slots__ = ('label', '_event', 'error', '_finish', 'nbytes',
                 'posted_at', 'started_at', 'finished_at')

    def __init__(self, label, finish=None, nbytes=0):
        self.label = label
        self._event = threading.Event()
        self.error = None
        self._finish = finish
        self.nbytes = nbytes
        # time.perf_counter() stamps: posted (caller), started and finished
        # (progress engine).  Used for overlap statistics and timelines.
        self.posted_at = time.perf_counter()
        self.started_at = None
        self.finished_at = None

    def done(self):
        return self._event.is_set()

    def wait(self):
        """Blocks until the reduction finished; re-raises its error."""
        self._event.wait()
        if self.error is not None:
            raise CommunicationError(
                'allreduce of {} failed: {}'.format(self.label, self.error)
            ) from self.error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class CommunicationBackend(object):
    """Interface of a progress engine.

    Args:
        mpi_comm: the ``mpi4py`` communicator of the ChainerMN communicator.
            Backends duplicate it so their traffic never matches user
            collectives on the original communicator.
    """

    name = None

    def allreduce(self, array, op='sum', label=None, slot=None, priority=0):
        """Posts an in-place allreduce of ``array``; returns a handle.

        Args:
            array: the buffer, reduced in place.
            op (str): ``'sum'``, ``'max'`` or ``'min'``.
            label (str): what it is, for errors and timelines.
            slot: ``(round_key, index, n_items)``: the reduction is item
                ``index`` of a round (an optimizer iteration) whose items
                every rank posts in index order.  Engines that reorder use
                it; first-in-first-out engines ignore it.
            priority: larger may run first (engines that reorder).
        """
        raise NotImplementedError

    def close(self):
        """Finishes posted work and releases resources."""
        raise NotImplementedError


def check_thread_multiple(backend_name):
    """Raises unless MPI runs with ``MPI_THREAD_MULTIPLE``."""
    from mpi4py import MPI
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            'the {} communication backend needs MPI initialised with '
            'MPI_THREAD_MULTIPLE, but the thread level is {}. Do not lower '
            'mpi4py.rc.thread_level before importing mpi4py.MPI.'
            .format(backend_name, provided))


def stage_to_host(array):
    """Host buffer for ``array`` and a callable that copies results back.

    numpy arrays are used in place (no copy, nothing to copy back).  GPU
    arrays are copied out now and back when the reduction is waited for,
    which needs no CUDA-aware MPI.
    """
    xp = chainer.backend.get_array_module(array)
    if xp is numpy:
        return array, None
    host = chainer.backend.CpuDevice().send(array)

    def finish():
        array[...] = xp.asarray(host)
    return host, finish


def _mpi_op(name):
    from mpi4py import MPI
    return {'sum': MPI.SUM, 'max': MPI.MAX, 'min': MPI.MIN}[name]


class MpiThreadBackend(CommunicationBackend):
    """Blocking MPI collectives run by a dedicated communication thread.

    Non-blocking MPI collectives do not progress on their own on CPU without
    asynchronous progress (which costs a core and slows blocking collectives
    several-fold).  A thread doing the blocking collective progresses the
    transfer continuously while the main thread computes: mpi4py releases
    the GIL inside MPI calls.  Requires ``MPI_THREAD_MULTIPLE``.

    Arrays on a GPU are staged through host memory, which needs no
    CUDA-aware MPI (an NCCL backend is the faster path there).
    """

    name = 'mpi_thread'

    def __init__(self, mpi_comm):
        check_thread_multiple(self.name)
        self.rank = mpi_comm.Get_rank()
        self.comm = mpi_comm.Dup()
        self._queue = queue.Queue()
        self._failed = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name='chainermn_overlap-comm', daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def allreduce(self, array, op='sum', label=None, slot=None, priority=0):
        if self._closed:
            raise RuntimeError('the communication backend was closed')
        label = label or 'array of {} elements'.format(array.size)
        host, finish = stage_to_host(array)
        handle = Handle(label, finish, nbytes=array.nbytes)
        self._queue.put((host, op, handle))
        return handle

    def _run(self):
        from mpi4py import MPI
        while True:
            item = self._queue.get()
            if item is None:
                return
            buf, op, handle = item
            handle.started_at = time.perf_counter()
            if self._failed is not None:
                handle.error = RuntimeError(
                    'not attempted: an earlier reduction on rank {} failed '
                    '({})'.format(self.rank, self._failed))
            else:
                try:
                    self.comm.Allreduce(MPI.IN_PLACE, buf, op=_mpi_op(op))
                except Exception as e:  # reported to the waiting thread
                    self._failed = e
                    handle.error = RuntimeError(
                        'rank {}: {}'.format(self.rank, e))
            handle.finished_at = time.perf_counter()
            handle._event.set()

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        try:
            self.comm.Free()
        except Exception:  # MPI may already be finalized at exit
            pass
        _LIVE.discard(self)


register_backend(MpiThreadBackend.name, MpiThreadBackend)
