"""Bounded waits for MPI requests the main thread posted itself.

The collectives that are not the communication thread's (a gradient norm,
a gather of sharded states, a barrier, a fetch of parameters) are posted
non-blocking and polled here (which is also what makes them progress),
between short sleeps (:mod:`.progress`: 10 us doubling to 250 us) that
leave the core to other threads.  After the limit the wait raises
:class:`~chainermn_overlap.CommunicationTimeout` naming what it waited
for.  A request given up on stays pending, and MPICH's MPI_Finalize would
then hang: an exit handler calls MPI_Abort instead while one is
(:func:`abandoned`).  :meth:`.watchdog.Watchdog.wait_requests` applies an
optimizer's limit and marks its engine stuck.
"""
import os
import time
import warnings
from typing import Any, Callable, Optional, Sequence

from chainermn_overlap import _patches
from chainermn_overlap import abort
from chainermn_overlap import config
from chainermn_overlap.communication import progress
from chainermn_overlap.errors import CommunicationTimeout
from chainermn_overlap.errors import StallWarning

__all__ = ['abandoned', 'wait_requests', 'wait_until']


def _fmt_s(seconds):
    return '{:.1f} s'.format(seconds)


# Main-thread requests given up on by a timeout: (label, requests).
_ABANDONED = []


def abandoned() -> list:
    """Labels of the requests given up on that are still pending.

    The engines' exit handler calls MPI_Abort while there is one: MPICH's
    MPI_Finalize waits for such a request (measured: a rank that gave up
    on an Iallreduce never ended).
    """
    if not _ABANDONED:
        return []
    from mpi4py import MPI
    out = []
    for label, requests in _ABANDONED:
        try:
            if not MPI.Request.Testall(requests):
                out.append(label)
        except MPI.Exception:   # a broken request: treat it as pending
            out.append(label)
    return out


def _abort_if_abandoned():
    # At exit, after the engines closed (chainermn_overlap._patches): as
    # for a stuck communication thread, MPI_Finalize would hang.
    pending = abandoned()
    if pending:
        abort.abort_job('exits while {} is pending (its wait timed out)'
                        .format(pending[0]))


def wait_requests(requests: Sequence[Any], label: str, rank: Any,
                  timeout: Optional[float],
                  stall_warning: Optional[float] = None,
                  detail: Optional[Callable[[], str]] = None,
                  hint: str = '',
                  on_timeout: Optional[Callable[[], None]] = None,
                  max_sleep: Optional[float] = None) -> None:
    """Polls ``requests`` between short sleeps until all completed.

    Raises :class:`CommunicationTimeout` after ``timeout`` seconds (None or
    0: no limit), naming ``label`` and the rank; warns with
    :class:`StallWarning` every ``stall_warning`` seconds meanwhile.  The
    sleeps (:mod:`.progress`: 10 us doubling to ``max_sleep``, 250 us by
    default; 0: none) leave the core to other threads; each test drives
    MPI's progress.
    """
    from mpi4py import MPI
    requests = list(requests)
    if not requests:
        return
    wait_until(lambda: MPI.Request.Testall(requests), label, rank, timeout,
               stall_warning, detail, hint, on_timeout, requests, max_sleep)


def wait_until(test: Callable[[], bool], label: str, rank: Any,
               timeout: Optional[float],
               stall_warning: Optional[float] = None,
               detail: Optional[Callable[[], str]] = None,
               hint: str = '',
               on_timeout: Optional[Callable[[], None]] = None,
               pending: Sequence[Any] = (),
               max_sleep: Optional[float] = None) -> None:
    """:func:`wait_requests` for any ``test()`` of MPI requests
    (``pending``: those given up on at a timeout).  ``label`` may be a
    callable that gives the text when a message needs it."""
    text = label if callable(label) else (lambda: label)
    timeout = timeout or None
    max_sleep = progress.MAX_SLEEP if max_sleep is None else max_sleep
    t0 = time.monotonic()
    next_warning = stall_warning
    delay = min(progress.MIN_SLEEP, max_sleep)
    while not test():
        waited = time.monotonic() - t0
        if timeout is not None and waited >= timeout:
            name = text()
            _ABANDONED.append((name, list(pending)))
            _patches.at_exit(_abort_if_abandoned, order=2)
            if on_timeout is not None:
                on_timeout()
            raise CommunicationTimeout(_requests_timeout_message(
                rank, name, waited, detail() if detail else '', hint))
        if next_warning is not None and waited >= next_warning:
            warnings.warn('rank {}: has waited {} for {}.{}'.format(
                rank, _fmt_s(waited), text(),
                ' ' + detail() if detail else ''), StallWarning,
                stacklevel=3)
            next_warning += stall_warning
        if delay:
            time.sleep(delay)
            delay = min(2 * delay, max_sleep)
        else:
            # A wait for bytes polls, as MPI's blocking calls do, but gives
            # the core to a runnable process or thread between polls (MPICH
            # yields after a number of polls too): a peer sharing the core
            # may be the one that sends.
            os.sched_yield()


def _requests_timeout_message(rank, label, waited, detail, hint):
    return (
        'rank {rank}: timed out after {waited} waiting for {label}.{detail}'
        '{hint} A rank it needs has not taken part: it raised an error or '
        'was killed, is stuck or much slower, called it at another point (or '
        'not at all), or the network between ranks failed. The request stays '
        'pending, so this process calls MPI_Abort at exit. Fixes: call '
        'chainermn_overlap.enable_abort_on_exception() on every rank so '
        'that an error on one rank ends the job at once; if the job is '
        'merely slow, raise the limit with create_overlapped_optimizer(..., '
        'timeout=<seconds>) or {env}=<seconds> (0 disables).'.format(
            rank=rank, waited=_fmt_s(waited), label=label,
            detail=' ' + detail if detail else '',
            hint=' ' + hint if hint else '', env=config.TIMEOUT_ENV))
