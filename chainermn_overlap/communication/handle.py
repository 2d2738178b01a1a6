"""Completion handles of posted reductions, and the latch that fails them.

An engine returns a :class:`Handle` for every reduction posted to it; the
optimizer waits on it (bounded by the engine's watchdog) and reads its time
stamps for statistics and timelines.  An engine's :class:`FailureLatch`
fails its handles together once one collective failed.
"""
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from chainermn_overlap import config
from chainermn_overlap.communication import watchdog as watchdog_module
from chainermn_overlap.errors import CollectiveMismatchError
from chainermn_overlap.errors import CommunicationError

__all__ = ['FailureLatch', 'Handle']


class Handle(object):
    """Completion handle of one posted reduction (made by an engine).

    Attributes:
        label (str): what is reduced (bucket, parameters), for messages.
        seq (int): position in the engine's posting order, from 1; the
            same collective has the same ``seq`` on every rank.
        nbytes (int): size of the reduced buffer.
        spans (list): ``(start, end)`` perf_counter stamps of the pieces in
            which an engine that interleaves chunks of several buffers
            reduced this one (so ``finished_at - started_at`` can include
            other buffers' chunks); empty for a first-in-first-out engine,
            whose one piece is ``(started_at, finished_at)``.
    """

    __slots__ = ('label', '_event', 'error', '_finish', 'nbytes',
                 'posted_at', 'started_at', 'finished_at', 'seq', '_watchdog',
                 'spans')

    def __init__(self, label: str,
                 finish: Optional[Callable[[], None]] = None,
                 nbytes: int = 0, seq: int = 0, watchdog: Any = None) -> None:
        self.label = label
        self._event = threading.Event()
        self.error: Optional[BaseException] = None
        self._finish = finish
        self.nbytes = nbytes
        self.seq = seq
        self._watchdog = watchdog
        # time.perf_counter() stamps: posted (caller), started and finished
        # (progress engine).  Used for overlap statistics and timelines.
        self.posted_at = time.perf_counter()
        self.started_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.spans: List[Tuple[float, float]] = []

    def busy_seconds(self) -> float:
        """Time the engine spent reducing this buffer (sum of its spans)."""
        if self.spans:
            return sum(b - a for a, b in self.spans)
        if self.started_at is not None and self.finished_at is not None:
            return self.finished_at - self.started_at
        return 0.0

    def done(self) -> bool:
        """True once the reduction finished (or failed)."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until the reduction finished; re-raises its error.

        Args:
            timeout (float or None): seconds after which
                :class:`CommunicationTimeout` is raised; ``None`` uses the
                engine's watchdog setting (see ``create_overlapped_
                optimizer(timeout=...)``).

        Raises:
            CommunicationTimeout: the reduction did not complete in time;
                the message names it and says what to do.
            CommunicationError: the reduction failed.
        """
        (self._watchdog or _unattached_watchdog()).wait(self, timeout)
        if self.error is not None:
            if isinstance(self.error, CommunicationError):
                raise type(self.error)(str(self.error)) from self.error
            raise CommunicationError(
                'allreduce of {} failed: {}'.format(self.label, self.error)
            ) from self.error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class _Unattached(object):
    """Stands in for the engine of a handle made without one."""

    rank = None
    inspector = None

    def describe_progress(self, handle):
        return 'collective #{}, posted {:.1f} s ago'.format(
            handle.seq, time.perf_counter() - handle.posted_at)

    def mark_stuck(self, what=None):
        pass


_UNATTACHED = []


def _unattached_watchdog():
    # The environment's settings, so that no wait is unbounded by default.
    if not _UNATTACHED:
        _UNATTACHED.append(watchdog_module.Watchdog(
            _Unattached(), config.resolve_timeout(),
            config.resolve_stall_warning()))
    return _UNATTACHED[0]


class FailureLatch(object):
    """An engine's failures: once one collective failed, none is attempted.

    Keeps the first error, and the unfinished handles, so that a
    communication thread that dies fails its waiters instead of leaving
    them to the watchdog.
    """

    def __init__(self, rank: int, engine_name: Optional[str]) -> None:
        self.rank = rank
        self.engine_name = engine_name
        self.error: Optional[BaseException] = None
        # Whether a handle reported ``error`` (a failed control collective
        # has no handle of its own).
        self.reported = True
        self.dead: Optional[BaseException] = None  # the thread's own error
        self._lock = threading.Lock()
        self._pending: Dict[int, Handle] = {}

    def record(self, error: BaseException,
               handle: Optional[Handle]) -> BaseException:
        """A collective failed with ``error``; returns the handle's error."""
        self.error = error
        self.reported = handle is not None
        if isinstance(error, CollectiveMismatchError):
            return error
        return RuntimeError('rank {}: {}'.format(self.rank, error))

    def not_attempted(self) -> BaseException:
        """The error of a handle skipped because of an earlier failure."""
        if (not self.reported
                and isinstance(self.error, CollectiveMismatchError)):
            # A mismatch found by a control collective: the first handle
            # it stops reports it as what it is.
            self.reported = True
            return self.error
        return RuntimeError(
            'not attempted: an earlier reduction on rank {} failed ({})'
            .format(self.rank, self.error))

    def add(self, handle: Handle) -> None:
        """Tracks a new handle; fails it at once if the thread is dead."""
        with self._lock:
            dead = self.dead
            if dead is None:
                self._pending[handle.seq] = handle
        if dead is not None:
            self._fail(handle, dead)

    def discard(self, handle: Handle) -> None:
        """Forgets a finished handle."""
        with self._lock:
            self._pending.pop(handle.seq, None)

    def die(self, error: BaseException) -> None:
        """The communication thread died of ``error``: fail every waiter."""
        with self._lock:
            self.dead = error
            pending, self._pending = list(self._pending.values()), {}
        for handle in pending:
            self._fail(handle, error)

    def _fail(self, handle, error):
        handle.error = RuntimeError(
            'rank {}: the communication thread of the {} backend died ({!r}); '
            'nothing more is reduced by it. This is a defect: please report '
            'it with this message.'.format(self.rank, self.engine_name,
                                           error))
        handle.error.__cause__ = error
        handle.finished_at = time.perf_counter()
        handle._event.set()
