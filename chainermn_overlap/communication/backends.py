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
import zlib

import numpy

import chainer

from chainermn_overlap import abort
from chainermn_overlap.communication import watchdog as watchdog_module
from chainermn_overlap.errors import CollectiveMismatchError
from chainermn_overlap.errors import CommunicationError  # NOQA (re-export)
from chainermn_overlap.errors import CommunicationTimeout  # NOQA


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
    stuck = []
    for backend in list(_LIVE):
        backend.close()
        if backend.inspector is not None:
            backend.inspector.close()
        thread = getattr(backend, '_thread', None)
        if backend.stuck and thread is not None and thread.is_alive():
            stuck.append(backend)
    if stuck:
        # A communication thread is still inside a collective that will
        # never complete (the watchdog gave up on it): MPI_Finalize would
        # hang, and the other ranks would wait for us forever.
        abort.abort_job('exits while a collective is stuck ({})'.format(
            stuck[0].stuck))


_DEFAULT_WATCHDOG = []


def _default_watchdog():
    # For handles made without a backend's watchdog: the environment's
    # settings, so that no wait of the library is unbounded by default.
    if not _DEFAULT_WATCHDOG:
        backend = CommunicationBackend()
        backend.configure()
        _DEFAULT_WATCHDOG.append(backend.watchdog)
    return _DEFAULT_WATCHDOG[0]


class Handle(object):
    """Completion handle of one posted reduction.

    Attributes:
        label (str): what is reduced (bucket, parameters), for messages.
        seq (int): position in this backend's posting order, from 1; the
            same collective has the same ``seq`` on every rank.
        nbytes (int): size of the reduced buffer.
        spans (list): ``(start, end)`` perf_counter stamps of the pieces in
            which the engine actually reduced this buffer (one for a FIFO
            engine; one per chunk for an engine that interleaves chunks of
            several buffers, so ``finished_at - started_at`` can include
            other buffers' chunks).
    """

    __slots__ = ('label', '_event', 'error', '_finish', 'nbytes',
                 'posted_at', 'started_at', 'finished_at', 'seq', '_watchdog',
                 'spans')

    def __init__(self, label, finish=None, nbytes=0, seq=0, watchdog=None):
        self.label = label
        self._event = threading.Event()
        self.error = None
        self._finish = finish
        self.nbytes = nbytes
        self.seq = seq
        self._watchdog = watchdog
        # time.perf_counter() stamps: posted (caller), started and finished
        # (progress engine).  Used for overlap statistics and timelines.
        self.posted_at = time.perf_counter()
        self.started_at = None
        self.finished_at = None
        self.spans = []

    def busy_seconds(self):
        """Time the engine spent reducing this buffer (sum of its spans)."""
        if self.spans:
            return sum(b - a for a, b in self.spans)
        if self.started_at is not None and self.finished_at is not None:
            return self.finished_at - self.started_at
        return 0.0

    def done(self):
        return self._event.is_set()

    def wait(self, timeout=None):
        """Blocks until the reduction finished; re-raises its error.

        Args:
            timeout (float or None): seconds after which
                :class:`CommunicationTimeout` is raised; ``None`` uses the
                backend's watchdog setting (see ``create_overlapped_
                optimizer(timeout=...)``).

        Raises:
            CommunicationTimeout: the reduction did not complete in time;
                the message names it and says what to do.
            CommunicationError: the reduction failed.
        """
        (self._watchdog or _default_watchdog()).wait(self, timeout)
        if self.error is not None:
            if isinstance(self.error, CommunicationError):
                raise type(self.error)(str(self.error)) from self.error
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
    # Watchdog of this backend's handles (see configure()); None: defaults.
    watchdog = None
    # Set (to a description) when a wait timed out: a thread of the backend
    # may then be stuck in a collective, and MPI cannot be finalized.
    stuck = None
    # Answers "how far has each rank posted?" (MpiThreadBackend only).
    inspector = None
    rank = None
    debug = False
    posted = 0
    last_posted = None

    def configure(self, timeout=None, stall_warning=None, debug=None,
                  mpi_comm=None):
        """Sets the watchdog and debug checks of this backend's waits.

        Args:
            timeout: seconds before a wait raises
                :class:`~chainermn_overlap.CommunicationTimeout`; ``None``:
                ``CHAINERMN_OVERLAP_TIMEOUT`` or 600 s; 0 or ``'none'``:
                never.
            stall_warning: seconds of waiting before each
                :class:`~chainermn_overlap.StallWarning`; ``None``:
                ``CHAINERMN_OVERLAP_STALL_WARNING`` or off.
            debug: check before each collective that all ranks post the
                same one; ``None``: ``CHAINERMN_OVERLAP_DEBUG`` or off.
            mpi_comm: if given and stall reports are on, start this rank's
                stall inspector on a duplicate of it (collective: the
                setting must be the same on every rank, as an environment
                variable passed by mpiexec is).  Off by default: its thread
                polls five times a second, which adds up over many
                optimizers left open.
        """
        self.watchdog = watchdog_module.Watchdog(
            self, watchdog_module.resolve_timeout(timeout),
            watchdog_module.resolve_stall_warning(stall_warning))
        self.debug = watchdog_module.resolve_debug(debug)
        if (mpi_comm is not None and self.inspector is None
                and self.watchdog.stall_warning is not None):
            self.inspector = watchdog_module.StallInspector(
                mpi_comm, self.status, owner=self)

    def close_inspector(self):
        """Stops the stall inspector, if any (part of ``close()``)."""
        if self.inspector is not None:
            self.inspector.close()

    def status(self):
        """This rank's progress, as a JSON-able dict (called by any thread).

        ``posted``: collectives posted so far; since every rank posts the
        same sequence, a rank with fewer has not reached a collective yet.
        """
        cur = getattr(self, '_current', False)
        if cur:
            comm_thread = 'in collective #{} ({}) for {:.1f} s'.format(
                cur.seq, cur.label,
                time.perf_counter() - (cur.started_at or cur.posted_at))
        elif cur is None:
            comm_thread = 'not inside a collective'
        else:
            comm_thread = 'not tracked by the {} backend'.format(self.name)
        return {'rank': self.rank, 'posted': self.posted,
                'last_posted': self.last_posted, 'comm_thread': comm_thread,
                'main_thread': watchdog_module.main_thread_location()}

    def new_handle(self, label, finish=None, nbytes=0):
        """A handle for the next posted collective (numbered, watched)."""
        self.posted += 1
        self.last_posted = label
        return Handle(label, finish, nbytes=nbytes, seq=self.posted,
                      watchdog=self.watchdog)

    def describe_progress(self, handle):
        """Where ``handle`` stands on this rank, for messages."""
        return 'collective #{} of rank {}, posted {:.1f} s ago'.format(
            handle.seq, self.rank, time.perf_counter() - handle.posted_at)

    def mark_stuck(self):
        """A wait on this backend timed out."""
        self.stuck = 'rank {}: a wait timed out'.format(self.rank)

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

    Args:
        mpi_comm: the communicator to duplicate (collective over it).
        timeout (float or None): watchdog timeout of every wait, seconds.
        stall_warning (float or None): seconds of waiting before a
            :class:`~chainermn_overlap.StallWarning` says which ranks have
            not posted the awaited collective.
        debug (bool): before each collective, check that every rank posts
            the same one (label, size, dtype); costs one small allreduce per
            collective.
    """

    name = 'mpi_thread'

    def __init__(self, mpi_comm, timeout=None, stall_warning=None,
                 debug=None):
        check_thread_multiple(self.name)
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.comm = mpi_comm.Dup()
        self.configure(timeout, stall_warning, debug)
        self._queue = queue.Queue()
        self._failed = None
        self._closed = False
        # Progress counters, read by the stall inspector's thread.
        self.posted = 0
        self.completed = 0
        self.last_posted = None
        self._current = None
        self._thread = threading.Thread(
            target=self._run, name='chainermn_overlap-comm', daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def allreduce(self, array, op='sum', label=None, slot=None, priority=0):
        if self._closed:
            raise RuntimeError('the communication backend was closed')
        if self.stuck is not None:
            raise CommunicationError(
                'rank {}: cannot post {}: an earlier collective is stuck '
                '({})'.format(self.rank, label, self.stuck))
        label = label or 'array of {} elements'.format(array.size)
        host, finish = stage_to_host(array)
        handle = self.new_handle(label, finish, nbytes=array.nbytes)
        self._queue.put((host, op, handle))
        return handle

    # -- state for messages and the stall inspector --------------------

    def describe_progress(self, handle):
        """Where ``handle`` stands on this rank, for messages."""
        now = time.perf_counter()
        text = 'collective #{} of rank {}, posted {:.1f} s ago'.format(
            handle.seq, self.rank, now - handle.posted_at)
        cur = self._current
        if handle.started_at is not None and cur is handle:
            text += '; the communication thread is inside it'
        elif cur is not None:
            text += ('; queued behind collective #{} ({}), in progress for '
                     '{:.1f} s'.format(cur.seq, cur.label,
                                       now - (cur.started_at or now)))
        return text

    def mark_stuck(self):
        cur = self._current
        self.stuck = ('rank {}: collective #{} ({}) never completed'.format(
            self.rank, cur.seq, cur.label) if cur is not None else
            'rank {}: a wait timed out'.format(self.rank))

    # -- the communication thread ----------------------------------------

    def _run(self):
        from mpi4py import MPI
        while True:
            item = self._queue.get()
            if item is None:
                return
            buf, op, handle = item
            handle.started_at = time.perf_counter()
            self._current = handle
            if self._failed is not None:
                handle.error = RuntimeError(
                    'not attempted: an earlier reduction on rank {} failed '
                    '({})'.format(self.rank, self._failed))
            else:
                try:
                    if self.debug:
                        self._verify(handle, buf, op)
                    self.comm.Allreduce(MPI.IN_PLACE, buf, op=_mpi_op(op))
                except CollectiveMismatchError as e:
                    self._failed = e
                    handle.error = e
                except Exception as e:  # reported to the waiting thread
                    self._failed = e
                    handle.error = RuntimeError(
                        'rank {}: {}'.format(self.rank, e))
            handle.finished_at = time.perf_counter()
            self._current = None
            self.completed += 1
            handle._event.set()

    def _verify(self, handle, buf, op):
        """Debug mode: checks that every rank posts this same collective.

        An allgather (as ``MAX`` over per-rank slots) of a fingerprint of
        label, dtype, size and operation; on disagreement the labels are
        exchanged too, so the error names each rank's collective.
        """
        from mpi4py import MPI
        text = '{}|{}|{}|{}'.format(handle.label, buf.dtype.str, buf.size,
                                    op)
        fp = zlib.crc32(text.encode()) & 0x7fffffff
        vec = numpy.full(2 * self.size, numpy.iinfo(numpy.int64).min,
                         dtype=numpy.int64)
        vec[self.rank] = fp
        vec[self.size + self.rank] = buf.nbytes
        self.comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MAX)
        if (vec[:self.size] == fp).all():
            return
        width = 200
        mine = numpy.zeros(width, dtype=numpy.uint8)
        enc = handle.label.encode()[:width]
        mine[:len(enc)] = numpy.frombuffer(enc, dtype=numpy.uint8)
        labels = numpy.empty(width * self.size, dtype=numpy.uint8)
        self.comm.Allgather([mine, MPI.BYTE], [labels, MPI.BYTE])
        desc = '; '.join(
            'rank {}: {!r} ({} bytes)'.format(
                r, labels[r * width:(r + 1) * width].tobytes()
                .rstrip(b'\0').decode(errors='replace'),
                int(vec[self.size + r]))
            for r in range(self.size))
        raise CollectiveMismatchError(
            'rank {}: collective #{} differs between ranks ({}). Every rank '
            'must post the same collectives in the same order: build the '
            'same model and call update() the same number of times on '
            'every rank.'.format(self.rank, handle.seq, desc))

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.close_inspector()
        self._queue.put(None)
        if self.stuck is not None:
            # The thread is inside a collective that will not complete.
            self._thread.join(timeout=1.0)
        else:
            self._thread.join()
        if self._thread.is_alive():
            return
        try:
            self.comm.Free()
        except Exception:  # MPI may already be finalized at exit
            pass
        _LIVE.discard(self)


register_backend(MpiThreadBackend.name, MpiThreadBackend)
