"""The progress-engine base: everything engines share except their policy.

A progress engine runs in-place allreduces that were posted without
blocking the caller.  The optimizer's hooks never talk to MPI themselves;
they post to an engine and wait on its handles, so a different engine (an
NCCL side stream signalling with CUDA events, an emulated network) plugs in
behind the same two calls.

:class:`Engine` holds what every engine needs, so that each engine is its
policy alone:

* the communication thread: started by the constructor, stopped by
  :meth:`Engine.close` (and at exit, before MPI is finalized);
* the failure latch: after an error in the thread, no later collective is
  attempted, and every pending and later handle fails with
  :class:`CommunicationError` naming the rank and the reduction;
* the stuck check: after a wait timed out, posting raises at once;
* tracking of the operation the thread is in, for stall reports
  (:meth:`Engine.status`, :meth:`Engine.describe_progress`);
* the debug check that every rank runs the same collective
  (:func:`~chainermn_overlap.communication.watchdog.check_same_collective`);
* the watchdog and the stall inspector (:meth:`Engine.configure`).

A policy subclass implements ``_enqueue`` (accept a posted reduction),
``_serve`` (the thread's loop: pick what runs next, run it with
``_reduce``, finish handles with ``_complete``; return once closed and
done) and ``_wake`` (make ``_serve`` notice ``close()``).  Its constructor
sets up its own state, then calls ``Engine.__init__``, which starts the
thread.

Engines are looked up by name in a small registry (:func:`get_backend`),
the way communication hooks or array backends are registered elsewhere.
The built-in ones are found through a table and imported at their first
look-up: importing the package registers nothing.

Thread ownership
----------------
Two threads share the optimizer's data: the main (training) thread and the
communication thread this module starts.  Ownership passes with the
handle of each posted operation:

* **Hand-over to the thread**: posting (``allreduce``/``run``, on the main
  thread).  From then on the thread owns the operation's memory: a
  bucket's ``buffer``; for a sharded bucket also ``shard_grad`` (written by
  its reduce-scatter, cleared by its update), the parameters' arrays the
  update writes in place (``param.array[...]``), the update rules' state
  slices and the shard server's pieces (``shard='parameters'``), and a
  compression's state (PowerSGD's factors and error feedback).
* **Hand-back**: the handle completes.  The main thread may touch that
  memory again only once ``handle.wait()`` returned (or ``done()`` is
  true): the reducer's ``wait_bucket`` before it reads a mean, the update
  policy's ``apply`` before a link's forward, ``flush_bucket`` before a
  buffer is packed again.
* **The thread only reads** what the main thread fixed before posting:
  the bucket plan, ``bounds`` and members, the pieces, the update's
  :class:`~chainermn_overlap.optimizers.sharding.rules.Snapshot`
  (hyperparameters and hooks frozen on the main thread) and the main
  thread's ``chainer.config`` values captured at the post
  (:func:`.ownership.capture_config`: ``chainer.config`` is thread-local,
  so the thread applies them around the update rules and hooks it runs;
  a compression's and the float16 ring's arithmetic read no config).
* **The main thread only reads**, while the thread owns a bucket: the
  identity of ``bucket.buffer`` (the sharded throttle counts buffers the
  thread has not released yet) and ``handle.done()``; ``param.grad`` may
  be a view of a bucket in flight (``wait='forward'``, see the reducer's
  ``alias_grad``) and is read only after ``synchronize()`` or the update.
* The thread writes nothing else of the optimizer's.  Of the engine's
  own fields, the main thread writes ``posted``, the thread ``completed``
  and the activity it is in, and a handle's results before the handle is
  marked done; each is one attribute write, which the stall inspector's
  thread only reads.

With ``debug=True`` the main thread's writes are checked: packing a
gradient into a bucket whose collective is still in flight raises
:class:`.ownership.OwnershipError` (:func:`.ownership.check_main_write`).
"""
import importlib
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Optional

from chainermn_overlap import _patches
from chainermn_overlap import abort
from chainermn_overlap import config
from chainermn_overlap._host import stage_to_host
from chainermn_overlap.communication import blocking
from chainermn_overlap.communication import progress
from chainermn_overlap.communication import watchdog as watchdog_module
from chainermn_overlap.communication.handle import FailureLatch
from chainermn_overlap.communication.handle import Handle
from chainermn_overlap.errors import CommunicationError
from chainermn_overlap.errors import StallWarning

__all__ = ['Engine', 'Handle', 'backend_names', 'check_thread_multiple',
           'get_backend', 'register_backend']

_BACKENDS: Dict[str, Callable[..., Any]] = {}
# The built-in engines: name -> (module, attribute), imported when first
# looked up.  register_backend() under the same name replaces one.
_BUILTIN = {
    'mpi_thread': ('backends', 'MpiThreadBackend'),
    'mpi_priority': ('scheduler', 'PriorityMpiBackend'),
    'emulated': ('emulated', 'emulated_backend'),
    'nccl': ('nccl', 'NcclEngine'),
}
DEFAULT_MPI_WAIT = 'poll'

_LIVE = weakref.WeakSet()


def register_backend(name: str, factory: Callable[..., Any]) -> None:
    """Makes an engine available under ``name``.

    Args:
        name (str): the name given as ``backend=`` to the optimizers.
        factory: an :class:`Engine` subclass, or a callable with the same
            signature that returns an engine.
    """
    _BACKENDS[name] = factory


def get_backend(name: str) -> Callable[..., Any]:
    """Returns the engine class (or factory) registered as ``name``."""
    factory = _BACKENDS.get(name)
    if factory is None and name in _BUILTIN:
        module, attribute = _BUILTIN[name]
        factory = getattr(importlib.import_module(
            'chainermn_overlap.communication.' + module), attribute)
    if factory is None:
        raise ValueError('unknown communication backend {!r}; available: {}'
                         .format(name, ', '.join(backend_names())))
    return factory


def backend_names() -> list:
    """The names :func:`get_backend` knows, sorted."""
    return sorted(set(_BACKENDS) | set(_BUILTIN))


def _close_all():
    # At exit (registered with the first engine, after mpi4py initialised
    # MPI, so it runs before MPI is finalized; after the timelines are
    # written): no communication thread is inside MPI at MPI_Finalize.
    stuck = []
    for engine in list(_LIVE):
        engine.close()
        if engine.inspector is not None:
            engine.inspector.close()
        if engine.stuck and engine._thread.is_alive():
            stuck.append(engine)
    if stuck:
        # A communication thread is still inside a collective that will
        # never complete (the watchdog gave up on it): MPI_Finalize would
        # hang, and the other ranks would wait for us forever.
        abort.abort_job('exits while a collective is stuck ({})'.format(
            stuck[0].stuck))


def check_thread_multiple(engine_name: str) -> None:
    """Raises unless MPI runs with ``MPI_THREAD_MULTIPLE``."""
    from mpi4py import MPI
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            'the {} communication backend needs MPI initialised with '
            'MPI_THREAD_MULTIPLE, but the thread level is {}. Do not lower '
            'mpi4py.rc.thread_level before importing mpi4py.MPI.'
            .format(engine_name, provided))


class _Activity(object):
    """What the communication thread is inside, since when."""

    __slots__ = ('handle', 'what', 'since')

    def __init__(self, handle, what):
        self.handle = handle
        self.what = what
        self.since = time.perf_counter()


class Engine(object):
    """Base of the progress engines: a communication thread and its checks.

    Args:
        mpi_comm: the ``mpi4py`` communicator of the ChainerMN communicator.
            The engine reduces on a duplicate of it, so that its traffic
            never matches user collectives (collective over ``mpi_comm``).
        timeout (float or str): watchdog: seconds before a wait raises
            :class:`~chainermn_overlap.CommunicationTimeout`; ``None``:
            ``CHAINERMN_OVERLAP_TIMEOUT`` or 600 s; 0 or ``'none'``: never.
        stall_warning (float or str): seconds of waiting before each
            :class:`~chainermn_overlap.StallWarning`, which says which ranks
            have not posted the awaited collective; ``None``:
            ``CHAINERMN_OVERLAP_STALL_WARNING`` or off.  When on, the
            stall inspector starts (a collective over ``mpi_comm``: the
            setting must agree between ranks).
        debug (bool): before each collective, check that every rank runs
            the same one (costs one small allreduce each); ``None``:
            ``CHAINERMN_OVERLAP_DEBUG`` or off.
        comm: the communicator to reduce on instead of a duplicate of
            ``mpi_comm``, such as the emulated engine's modelled one; the
            engine owns it (frees it when closed).
        mpi_wait (str): how the thread waits for an allreduce: ``'sleep'``
            (post ``Iallreduce``, test it between short sleeps:
            :mod:`.progress`) or ``'poll'`` (MPI's blocking call, which
            polls the core).  Collectives of ``run`` (the float16 ring,
            PowerSGD) always sleep.

    Subclasses take the same arguments, plus keyword options of their
    policy (``chunk_bytes`` of ``'mpi_priority'``; ``base`` and the link of
    ``'emulated'``).
    """

    name: Optional[str] = None

    def __init__(self, mpi_comm: Any, *, timeout: Any = None,
                 stall_warning: Any = None, debug: Optional[bool] = None,
                 comm: Any = None, mpi_wait: str = DEFAULT_MPI_WAIT) -> None:
        if mpi_wait not in ('sleep', 'poll'):
            raise ValueError("mpi_wait must be 'sleep' or 'poll', got {!r}"
                             .format(mpi_wait))
        self.mpi_wait = mpi_wait
        check_thread_multiple(self.name)
        from mpi4py import MPI
        self._in_place = MPI.IN_PLACE
        self._ops = {'sum': MPI.SUM, 'max': MPI.MAX, 'min': MPI.MIN}
        # Validated first: a bad value fails alike on every rank, no Dup left.
        _resolve(timeout, stall_warning, debug)
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.comm = (blocking.dup(mpi_comm, "the engine's communicator",
                                  timeout) if comm is None else comm)
        self.posted = 0   # progress counters (see "Thread ownership")
        self.completed = 0
        self.last_posted: Optional[str] = None
        # What timed out: the thread may be stuck, MPI cannot be finalized.
        self.stuck: Optional[str] = None
        self.inspector = None
        self.watchdog = None
        self.debug = False
        self._closed = False
        self._current = None  # the _Activity the thread is inside
        self._latch = FailureLatch(self.rank, self.name)
        try:
            self.configure(timeout, stall_warning, debug, mpi_comm=mpi_comm)
        except ValueError:   # the same on every rank (an agreement failed)
            if comm is None:
                self.comm.Free()
            raise
        self._thread = threading.Thread(
            target=self._thread_main, name='chainermn_overlap-comm',
            daemon=True)
        self._thread.start()
        _LIVE.add(self)
        _patches.at_exit(_close_all, order=1)

    # -- configuration ---------------------------------------------------

    def configure(self, timeout: Any = None, stall_warning: Any = None,
                  debug: Optional[bool] = None,
                  mpi_comm: Any = None) -> None:
        """Sets the watchdog and debug checks of this engine's waits.

        The constructor calls it with its own arguments; call it again to
        change the settings before posting.

        Args:
            timeout, stall_warning, debug: as in the constructor.
            mpi_comm: if given, start this rank's stall inspector on a
                duplicate of it when stall reports are on (and stop it when
                they are off); collective over it.  Without it the
                inspector is left as it is.
        """
        timeout, stall_warning, debug = _resolve(timeout, stall_warning,
                                                 debug)
        self.watchdog = watchdog_module.Watchdog(self, timeout, stall_warning)
        self.debug = debug
        if mpi_comm is None:
            return
        _agree_on_settings(mpi_comm, self.rank, timeout,
                           stall_warning is not None, debug)
        if stall_warning is not None and self.inspector is None:
            self.inspector = watchdog_module.StallInspector(
                mpi_comm, self.status, owner=self)
        elif stall_warning is None and self.inspector is not None:
            self.inspector.close()
            self.inspector = None

    # -- posting ---------------------------------------------------------

    def allreduce(self, array: Any, op: str = 'sum',
                  label: Optional[str] = None, slot: Any = None,
                  priority: float = 0) -> Handle:
        """Posts an in-place allreduce of ``array``; returns a handle.

        Args:
            array: the buffer (numpy or cupy), reduced in place.
            op (str): ``'sum'``, ``'max'`` or ``'min'``.
            label (str): what it is, for errors and timelines.
            slot: ``(round_key, index, n_items)``: the reduction is item
                ``index`` of a round (an optimizer iteration) whose items
                every rank posts in index order.  Engines that reorder use
                it; first-in-first-out engines ignore it.
            priority: larger may run first (engines that reorder).
        """
        label = label or 'array of {} elements'.format(array.size)
        if op not in self._ops:
            raise ValueError("op must be 'sum', 'max' or 'min', got {!r} "
                             '(for {})'.format(op, label))
        return self._post(op, array, label, slot, priority, True, None)

    def run(self, fn: Callable[[Any, Any], Any], array: Any, *,
            label: Optional[str] = None, slot: Any = None,
            priority: float = 0, stage: bool = True,
            nbytes: Optional[int] = None) -> Handle:
        """Posts ``fn(comm, buf)``, a collective of its own; returns a handle.

        For reductions that are not one ``MPI_Allreduce`` (a ring with
        float32 arithmetic for a float16 wire, a compression).  It runs in
        the communication thread, in this engine's order, with the same
        latch, tracking, watchdog and debug check as ``allreduce``; an
        engine that chunks runs it whole.  An emulated engine times only
        ``Allreduce`` calls, so traffic of other kinds is not modelled.

        Args:
            fn: called as ``fn(comm, buf)`` with the engine's communicator;
                collective over it, the same on every rank.  It leaves its
                result in ``buf``.
            array: the buffer ``fn`` works on.
            label, slot, priority: as in :meth:`allreduce`.
            stage (bool): give ``fn`` a host copy of a device ``array``
                (copied back when the handle is waited for); False: give
                ``fn`` ``array`` itself.
            nbytes (int): bytes the handle reports (statistics); default
                ``array.nbytes``.
        """
        label = label or '{} of {} elements'.format(
            getattr(fn, '__name__', 'collective'), array.size)
        return self._post(fn, array, label, slot, priority, stage, nbytes)

    def _check_can_post(self, label):
        """Raises if this engine takes no more posts (closed or stuck)."""
        if self._closed:
            raise RuntimeError(
                'rank {}: cannot post {}: the {} communication backend was '
                'closed; post to a new one'.format(self.rank, label,
                                                   self.name))
        if self.stuck is not None:
            raise CommunicationError(
                'rank {}: cannot post {}: an earlier collective is stuck '
                '({})'.format(self.rank, label, self.stuck))

    def _post(self, op, array, label, slot, priority, stage, nbytes):
        self._check_can_post(label)
        host, finish = stage_to_host(array) if stage else (array, None)
        handle = self.new_handle(
            label, finish, nbytes=array.nbytes if nbytes is None else nbytes)
        self._enqueue(handle, host, op, slot, priority)
        return handle

    def new_handle(self, label: str, finish: Optional[Callable[[], None]],
                   nbytes: int = 0) -> Handle:
        """A handle for the next posted collective (numbered, watched)."""
        self.posted += 1
        self.last_posted = label
        handle = Handle(label, finish, nbytes, self.posted, self.watchdog)
        self._latch.add(handle)
        return handle

    # -- state for messages and the stall inspector ----------------------

    def status(self) -> Dict[str, Any]:
        """This rank's progress, as a JSON-able dict (called by any thread).

        ``posted``: collectives posted so far; since every rank posts the
        same sequence, a rank with fewer has not reached a collective yet.
        """
        cur = self._current
        if cur is not None:
            comm_thread = 'in {} for {:.1f} s'.format(
                cur.what, time.perf_counter() - cur.since)
        elif self._latch.dead is not None:
            comm_thread = 'dead ({!r})'.format(self._latch.dead)
        else:
            comm_thread = 'not inside a collective'
        return {'rank': self.rank, 'posted': self.posted,
                'last_posted': self.last_posted, 'comm_thread': comm_thread,
                'main_thread': watchdog_module.main_thread_location()}

    def describe_progress(self, handle: Handle) -> str:
        """Where ``handle`` stands on this rank, for messages."""
        now = time.perf_counter()
        text = 'collective #{} of rank {}, posted {:.1f} s ago'.format(
            handle.seq, self.rank, now - handle.posted_at)
        if handle.spans:
            text += '; {} chunk(s) of it reduced'.format(len(handle.spans))
        cur = self._current
        if cur is not None and cur.handle is handle:
            text += '; the communication thread is inside it'
        elif cur is not None:
            text += '; queued behind {}, in progress for {:.1f} s'.format(
                cur.what, now - cur.since)
        return text

    def mark_stuck(self, what: Optional[str] = None) -> None:
        """A wait on this engine timed out: later posts raise at once.

        Args:
            what (str): the collective that never completed, when it is not
                the one the thread is inside (one the main thread ran).
        """
        cur = self._current
        if what is None and cur is not None:
            what = cur.what
        self.stuck = ('rank {}: {} never completed'.format(self.rank, what)
                      if what is not None else
                      'rank {}: a wait timed out'.format(self.rank))

    # -- for the policy: running collectives, completing handles ---------

    def _reduce(self, buf: Any, op: str, handle: Optional[Handle] = None,
                what: Optional[str] = None,
                label: Optional[str] = None) -> bool:
        """Runs one in-place allreduce of ``buf`` on the engine's comm.

        Tracked as the thread's current operation; in debug mode checked
        across ranks first; latched: once one failed, none is attempted.

        Args:
            buf: host buffer, reduced in place.
            op: ``'sum'``, ``'max'`` or ``'min'``, or a callable run as
                ``op(comm, buf)`` instead of the allreduce (see :meth:`run`).
            handle: the reduction it is (a part of), whose ``error`` is set
                on failure; None for an engine's own control collective.
            what (str): the collective in messages; default
                ``'collective #<seq>'``.
            label (str): what ranks must agree on in debug mode; default
                the handle's label.

        Returns:
            bool: True if it ran; False if it failed or was not attempted
            (the handle's ``error`` is then set).
        """
        if handle is not None:
            if handle.started_at is None:
                handle.started_at = time.perf_counter()
            what = what or 'collective #{}'.format(handle.seq)
            label = label or handle.label
        if self._latch.error is not None:
            if handle is not None:
                handle.error = self._latch.not_attempted()
            return False
        self._current = _Activity(handle, '{} ({})'.format(
            what, handle.label if handle is not None else label))
        try:
            custom = callable(op)
            if self.debug:
                watchdog_module.check_same_collective(
                    self.comm, self.rank, self.size, what, label, buf,
                    getattr(op, '__qualname__', 'run') if custom else op)
            if custom:
                op(self.comm, buf)
            else:
                if self.mpi_wait == 'sleep':
                    progress.allreduce(self.comm, buf, self._ops[op])
                else:
                    self.comm.Allreduce(self._in_place, buf,
                                        op=self._ops[op])
            return True
        except Exception as e:  # reported to the waiting thread
            error = self._latch.record(e, handle)
            if handle is not None:
                handle.error = error
            return False
        finally:
            self._current = None

    def _attempts(self) -> bool:
        """Whether the next collective will be attempted (no failure yet)."""
        return self._latch.error is None

    def _complete(self, handle: Handle) -> None:
        """Marks ``handle`` finished (its error, if any, is set)."""
        handle.finished_at = time.perf_counter()
        self.completed += 1
        self._latch.discard(handle)
        handle._event.set()

    # -- the thread ------------------------------------------------------

    def _thread_main(self):
        try:
            self._serve()
        except Exception as e:  # fail the waiters instead of hanging them
            self._latch.die(e)

    def _enqueue(self, handle, host, op, slot, priority):
        raise NotImplementedError

    def _serve(self):
        raise NotImplementedError

    def _wake(self):
        raise NotImplementedError

    def close(self) -> None:
        """Finishes posted work, stops the thread, frees the communicator."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self.inspector is not None:
            self.inspector.close()
        # After a watchdog timeout the thread may be inside a collective that
        # never completes (exit then aborts); else it finishes the posted
        # work, which needs every peer: wait at most the watchdog's timeout.
        limit = 1.0 if self.stuck is not None else self.watchdog.timeout
        self._thread.join(limit)
        if self._thread.is_alive():
            if self.stuck is None:
                self.mark_stuck()
                warnings.warn(_CLOSE_LEFT.format(self.stuck, limit),
                              StallWarning, stacklevel=2)
            return
        try:
            self.comm.Free()
        except Exception:  # MPI may already be finalized at exit
            pass
        _LIVE.discard(self)


_CLOSE_LEFT = ('{}: close() waited {:.1f} s for the communication thread to '
               'finish its posted collectives; left behind (a peer never '
               'joined them). Exit will end the job with MPI_Abort; call '
               'close() on every rank at the same point.')


def _agree_on_settings(mpi_comm: Any, rank: int, timeout: Optional[float],
                       stall: bool, debug: bool) -> None:
    """Raises on every rank unless all ranks turn stall reports on, or all
    off, and likewise the debug check: the inspector's ``Dup`` is a
    collective, and the debug check adds a collective before each one, so
    an environment variable set on some ranks only would leave the others
    waiting (or pair different collectives).  One tiny allreduce (bounded
    by the watchdog's timeout)."""
    import numpy
    from mpi4py import MPI
    flags = numpy.array([stall, not stall, debug, not debug],
                        dtype=numpy.int32)
    request = mpi_comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    watchdog_module.wait_requests([request], 'the agreement on stall '
                                  'reports and the debug check', rank,
                                  timeout)
    for i, (what, env, option, mine) in enumerate((
            ('stall reports are', config.STALL_WARNING_ENV,
             'stall_warning=', stall),
            ('the debug check is', config.DEBUG_ENV, 'debug=', debug))):
        if flags[2 * i] and flags[2 * i + 1]:
            raise ValueError(
                'rank {}: {} on for some ranks and off for others ({} '
                'or {} differ between ranks; here: {}): give every rank the '
                'same value (mpiexec -genv {} ...)'.format(
                    rank, what, env, option, 'on' if mine else 'off', env))


def _resolve(timeout, stall_warning, debug):
    return (config.resolve_timeout(timeout),
            config.resolve_stall_warning(stall_warning),
            config.resolve_debug(debug))
