"""Ending the whole MPI job when one rank fails.

An uncaught exception on one rank leaves the others waiting forever in
their next collective: with MPICH the raising rank itself then hangs in
``MPI_Finalize`` at exit, so not even the launcher notices (measured: the
job never ends).  :func:`enable_abort_on_exception` makes such an exception
call ``MPI_Abort`` after printing it, which the launcher turns into the end
of every rank within a second.

Compared with ``chainermn.global_except_hook.add_hook()`` it also

* covers uncaught exceptions in threads other than the main thread (a
  dead data-loading or communication thread otherwise hangs the job);
* writes which rank failed *before* the traceback and flushes stdout and
  stderr first, so the original error is readable in interleaved output;
* ends the process with ``os._exit`` if ``MPI_Abort`` itself does not
  return within a grace period (a broken MPI must not turn into a hang);
* is idempotent and can be undone (:func:`disable_abort_on_exception`).

Setting the environment variable ``CHAINERMN_OVERLAP_ABORT_ON_EXCEPTION=1``
(pass it to every rank, e.g. ``mpiexec -genv``) installs it when
``chainermn_overlap`` is imported.
"""
import fcntl
import math
import os
import signal
import stat
import struct
import sys
import termios
import threading
import time
import traceback
from typing import NoReturn

from chainermn_overlap import config

__all__ = ['ABORT_CODE', 'abort_job', 'abort_on_exception_enabled',
           'disable_abort_on_exception', 'enable_abort_on_exception']

# Exit status given to MPI_Abort, and grace period for MPI_Abort itself.
ABORT_CODE = 1
_ABORT_GRACE_SECONDS = 5.0
# How long abort_job waits for the reader of a piped stdout/stderr (the
# process manager's proxy) to take what was written before MPI_Abort.
_DRAIN_SECONDS = 1.0

_installed = None   # (previous sys.excepthook, previous threading hook)
_aborting = threading.Lock()


def _world_rank():
    # MPI is normally initialised by now; if it is not (an exception at
    # start-up), importing mpi4py.MPI initialises it so Abort still works.
    try:
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_rank(), MPI
    except Exception:  # an unusable MPI: fall back to os._exit below
        return None, None


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop abort
            pass


def _unread(fd):
    """Bytes written to pipe ``fd`` not yet read by its reader; 0 when
    ``fd`` is not a pipe (a file or terminal keeps what it was given)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        buf = fcntl.ioctl(fd, termios.FIONREAD, struct.pack('i', 0))
        return struct.unpack('i', buf)[0]
    except OSError:
        return 0


def _wait_until_read(fds=(1, 2), limit=_DRAIN_SECONDS):
    """Waits (at most ``limit`` s) until the pipes ``fds`` are read empty.

    MPICH's proxy forwards a rank's output from a pipe, and handles the
    rank's ``MPI_Abort`` on another socket: when the abort overtakes the
    output, the proxy ends with the output's tail unforwarded (measured:
    1 time in 5 after 200 kB of traceback-sized output), and the abort line
    that tells the launcher why the job ended is lost with it.
    """
    deadline = time.monotonic() + limit
    while any(_unread(fd) for fd in fds) and time.monotonic() < deadline:
        time.sleep(0.005)


def _end_later(code):
    """Ends this process in ``_ABORT_GRACE_SECONDS`` unless it ended before.

    A timer thread exits with ``code``.  Python 3.12 and later start no
    thread at interpreter shutdown, which is when the atexit handlers that
    abort a job with a stuck collective run (RuntimeError: can't create new
    thread at interpreter shutdown); then the kernel's alarm ends the
    process instead (killed by SIGALRM), which no hung C call can delay.
    """
    try:
        timer = threading.Timer(_ABORT_GRACE_SECONDS, os._exit, (code,))
        timer.daemon = True
        timer.start()
        return
    except RuntimeError:
        pass
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(math.ceil(_ABORT_GRACE_SECONDS)))
    except ValueError:  # not the main thread: MPI_Abort or os._exit it is
        pass


def abort_job(reason: str, code: int = ABORT_CODE) -> NoReturn:
    """Writes ``reason`` to stderr and ends every rank of the MPI job.

    Calls ``MPI_Abort`` on ``COMM_WORLD``; if that has not ended this
    process within a few seconds, exits it with ``os._exit``.  Never
    returns.

    Args:
        reason (str): what happened, shown with the rank.
        code (int): exit status requested from ``MPI_Abort``.
    """
    # Only one thread aborts; a second failing thread waits for the end.
    _aborting.acquire()
    rank, MPI = _world_rank()
    try:
        sys.stderr.write(
            '\nchainermn_overlap: rank {} {}; calling MPI_Abort to end every '
            'rank of the job.\n'.format('?' if rank is None else rank,
                                        reason))
    except Exception:  # stderr may be gone at interpreter shutdown
        pass
    _flush()
    _wait_until_read()
    # If MPI_Abort hangs (seen with broken networks in some MPIs), still
    # end this process; the launcher then ends the others.
    _end_later(code)
    if MPI is not None:
        try:
            MPI.COMM_WORLD.Abort(code)
        except Exception:  # fall through to os._exit
            pass
    os._exit(code)


def _message(value, limit=200):
    """' (first line of the message)' or '': for the abort line.

    The traceback's own last line may reach the launcher interleaved with
    other ranks' output (each rank writes it in pieces); the abort line is
    one write, so its copy of the message arrives whole.
    """
    try:
        text = str(value).strip().splitlines()
    except Exception:  # a broken __str__ must not stop the abort
        return ''
    if not text:
        return ''
    first = text[0].strip()
    if len(first) > limit:
        first = first[:limit - 3] + '...'
    return ' ({})'.format(first)


def _excepthook(exctype, value, tb):
    previous = _installed[0] if _installed else sys.__excepthook__
    rank, _ = _world_rank()
    try:
        sys.stderr.write('\nchainermn_overlap: uncaught exception on rank '
                         '{}:\n'.format('?' if rank is None else rank))
        previous(exctype, value, tb)
    finally:
        abort_job('raised an uncaught {}{}'.format(exctype.__name__,
                                                   _message(value)))


def _thread_excepthook(args):
    if args.exc_type is SystemExit:
        # threading ignores SystemExit in threads; so do we.
        return
    rank, _ = _world_rank()
    try:
        sys.stderr.write(
            '\nchainermn_overlap: uncaught exception on rank {} in thread '
            '{!r}:\n'.format('?' if rank is None else rank,
                             getattr(args.thread, 'name', None)))
        traceback.print_exception(args.exc_type, args.exc_value,
                                  args.exc_traceback)
    finally:
        abort_job('raised an uncaught {}{} in a thread'.format(
            args.exc_type.__name__, _message(args.exc_value)))


def enable_abort_on_exception(threads: bool = True) -> None:
    """Makes an uncaught exception on any rank end the whole MPI job.

    Call it at the start of a training script, on every rank.  The
    exception is printed as usual (preceded by the rank), then
    ``MPI_Abort`` ends all ranks with a non-zero exit status instead of
    leaving the others waiting in a collective forever.

    It replaces ``chainermn.global_except_hook.add_hook()`` (see the module
    docstring for the differences); calling both is harmless.  Note that
    ``sys.exit(n)`` is not an exception to Python's hooks: on one rank only,
    it still leaves the others waiting; raise an exception instead.

    Args:
        threads (bool): also abort on uncaught exceptions in threads other
            than the main thread.
    """
    global _installed
    if _installed is not None:
        return
    previous = sys.excepthook
    # chainermn's hook aborts too, without the extras: chain to what it
    # wrapped instead, so that the traceback is printed once.
    try:
        from chainermn import global_except_hook as cmn_hook
        if previous is cmn_hook._global_except_hook:
            previous = cmn_hook._orig_except_hook or sys.__excepthook__
    except ImportError:
        pass
    _installed = (previous, threading.excepthook)
    sys.excepthook = _excepthook
    if threads:
        threading.excepthook = _thread_excepthook


def disable_abort_on_exception() -> None:
    """Restores the exception hooks replaced by enable_abort_on_exception."""
    global _installed
    if _installed is None:
        return
    if sys.excepthook is _excepthook:
        sys.excepthook = _installed[0]
    if threading.excepthook is _thread_excepthook:
        threading.excepthook = _installed[1]
    _installed = None


def abort_on_exception_enabled() -> bool:
    """True when :func:`enable_abort_on_exception` is in effect."""
    return _installed is not None


def _enable_from_environment():
    if config.resolve_abort_on_exception():
        enable_abort_on_exception()
