"""Every blocking MPI call the library makes outside the communication thread.

A collective, a point-to-point wait or a communicator's construction that
another rank never joins would wait forever.  Every such call of the
library goes through this module (a unit test reads the library's source
and refuses a blocking ``mpi4py`` call anywhere else):

* collectives and point-to-point messages are posted non-blocking
  (``Ibcast``, ``Iallreduce``, ``Ibarrier``, ``Isend``/``Irecv`` ...) and
  waited for with the watchdog's limit (:func:`.requests.wait_requests`);
  past it they raise :class:`~chainermn_overlap.CommunicationTimeout`
  naming the operation and the caller's place in the library, and the
  request given up on makes the process call ``MPI_Abort`` at exit;
* ``Dup`` is posted as ``Idup`` and waited for alike;
* ``Split`` has no non-blocking form: the ranks first meet in a bounded
  ``Ibarrier`` (so a rank that never comes raises on every other rank
  within the limit), then split under a timer that ends the job with
  ``MPI_Abort`` and the same message should the split itself not return
  (a rank that died between the two).

The limit is the caller's ``timeout`` (an optimizer's ``timeout=``), else
``CHAINERMN_OVERLAP_TIMEOUT``, else 600 s; 0 disables.  Waits for bytes
(distconv's halo exchanges, ``poll=True``) test without sleeping, as the
blocking calls do; waits for other ranks sleep between tests
(:mod:`.progress`), leaving the core to other threads.
"""
import contextlib
import os
import sys
import threading
from typing import Any, Iterator, Optional, Sequence

from chainermn_overlap import config
from chainermn_overlap.communication import requests as requests_module

__all__ = ['after_meeting', 'agreement', 'allgather', 'allgatherv',
           'allreduce', 'barrier', 'bcast', 'dup', 'object_context',
           'reduce_scatter', 'reduce_scatter_block', 'split', 'wait',
           'wait_any']

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE)


def _mpi():
    from mpi4py import MPI
    return MPI


def caller(depth: int = 2) -> str:
    """``file:line in function`` of the frames that called into this
    module (outside it and the helpers that only pass calls on or wait:
    ``requests``, ``_mpi_json`` and ``distconv/_comm``), innermost
    first."""
    frame = sys._getframe(1)
    skip = (os.path.abspath(__file__),
            os.path.join(_HERE, 'requests.py'),
            os.path.join(_PACKAGE, '_mpi_json.py'),
            os.path.join(_PACKAGE, 'distconv', '_comm.py'))
    out = []
    while frame is not None and len(out) < depth:
        name = os.path.abspath(frame.f_code.co_filename)
        if name not in skip:
            rel = (os.path.relpath(name, _PACKAGE)
                   if name.startswith(_PACKAGE) else os.path.basename(name))
            out.append('{}:{} in {}'.format(rel, frame.f_lineno,
                                            frame.f_code.co_name))
        frame = frame.f_back
    return ' <- '.join(out) or 'unknown'


def limit(timeout: Any = None) -> Optional[float]:
    """The limit in seconds (None: none) for ``timeout`` (None: the
    environment's, else the default)."""
    return config.resolve_timeout(timeout)


def _world_rank():
    try:
        return _mpi().COMM_WORLD.Get_rank()
    except Exception:  # MPI finalized: the rank is only for messages
        return '?'


def _label(what, where):
    # Made only when a message needs it (a timeout, a stall warning): the
    # caller is then found on the stack, which still holds it.
    def label():
        text = what() if callable(what) else what
        return '{} (called from {})'.format(text, where or caller())
    return label


def wait(requests: Sequence[Any], what: str, timeout: Any = None, *,
         poll: bool = False, where: Optional[str] = None,
         detail: Any = None, hint: str = '', on_timeout: Any = None) -> None:
    """Waits for posted requests; raises CommunicationTimeout past the limit.

    Args:
        requests: mpi4py requests (a list, or one).
        what (str or callable): the operation, in messages (a callable
            gives it when a message needs it).
        timeout: seconds (None: the environment's limit; 0: none).
        poll (bool): test without sleeping (a wait for bytes, where a sleep
            would add latency); else sleep between tests.
        where (str): the caller's place (default: found from the stack).
        detail, hint, on_timeout: as :func:`.requests.wait_requests`.
    """
    if not isinstance(requests, (list, tuple)):
        requests = [requests]
    if not requests:
        return
    MPI = _mpi()
    if poll and MPI.Request.Testall(requests):
        return
    requests_module.wait_requests(
        requests, _label(what, where), _world_rank(), limit(timeout),
        detail=detail, hint=hint, on_timeout=on_timeout,
        max_sleep=0 if poll else None)


def wait_any(requests: Sequence[Any], what: str, timeout: Any = None, *,
             where: Optional[str] = None) -> int:
    """Index of a completed request (``MPI.UNDEFINED`` if all are null),
    testing without sleeping; raises CommunicationTimeout past the limit.
    ``what`` may be a callable giving the text (made only when needed)."""
    MPI = _mpi()
    i, done = MPI.Request.Testany(requests)
    if done:
        return i
    box = []

    def test():
        j, ok = MPI.Request.Testany(requests)
        if ok:
            box.append(j)
        return ok
    requests_module.wait_until(
        test, _label(what, where), _world_rank(), limit(timeout),
        pending=requests, max_sleep=0)
    return box[0]


def _post_and_wait(post, what, timeout, where, poll=False):
    wait([post()], what, timeout, poll=poll, where=where)


def bcast(comm: Any, buf: Any, root: int = 0, what: str = 'a broadcast',
          timeout: Any = None, where: Optional[str] = None) -> None:
    """``comm.Bcast(buf, root)``, bounded."""
    _post_and_wait(lambda: comm.Ibcast(buf, root=root), what, timeout, where)


def allreduce(comm: Any, sendbuf: Any, recvbuf: Any, op: Any = None,
              what: str = 'an allreduce', timeout: Any = None,
              where: Optional[str] = None, poll: bool = False) -> None:
    """``comm.Allreduce(sendbuf, recvbuf, op)`` (``sendbuf`` may be
    ``MPI.IN_PLACE``), bounded."""
    op = _mpi().SUM if op is None else op
    _post_and_wait(lambda: comm.Iallreduce(sendbuf, recvbuf, op=op), what,
                   timeout, where, poll)


def allgather(comm: Any, sendbuf: Any, recvbuf: Any,
              what: str = 'an allgather', timeout: Any = None,
              where: Optional[str] = None) -> None:
    """``comm.Allgather(sendbuf, recvbuf)``, bounded."""
    _post_and_wait(lambda: comm.Iallgather(sendbuf, recvbuf), what, timeout,
                   where)


def allgatherv(comm: Any, sendbuf: Any, recvbuf: Any,
               what: str = 'an allgatherv', timeout: Any = None,
               where: Optional[str] = None, poll: bool = False) -> None:
    """``comm.Allgatherv(sendbuf, recvbuf)``, bounded."""
    _post_and_wait(lambda: comm.Iallgatherv(sendbuf, recvbuf), what,
                   timeout, where, poll)


def reduce_scatter(comm: Any, sendbuf: Any, recvbuf: Any, counts: Any,
                   op: Any = None, what: str = 'a reduce-scatter',
                   timeout: Any = None, where: Optional[str] = None,
                   poll: bool = False) -> None:
    """``comm.Reduce_scatter(sendbuf, recvbuf, counts, op)``, bounded."""
    op = _mpi().SUM if op is None else op
    _post_and_wait(lambda: comm.Ireduce_scatter(sendbuf, recvbuf, counts,
                                                op=op),
                   what, timeout, where, poll)


def reduce_scatter_block(comm: Any, sendbuf: Any, recvbuf: Any,
                         op: Any = None, what: str = 'a reduce-scatter',
                         timeout: Any = None, where: Optional[str] = None,
                         poll: bool = False) -> None:
    """``comm.Reduce_scatter_block(sendbuf, recvbuf, op)``, bounded."""
    op = _mpi().SUM if op is None else op
    _post_and_wait(lambda: comm.Ireduce_scatter_block(sendbuf, recvbuf,
                                                      op=op),
                   what, timeout, where, poll)


def barrier(comm: Any, what: str = 'a barrier', timeout: Any = None,
            where: Optional[str] = None) -> None:
    """``comm.Barrier()``, bounded."""
    _post_and_wait(comm.Ibarrier, what, timeout, where)


def dup(comm: Any, what: str = 'a communicator duplicate',
        timeout: Any = None, where: Optional[str] = None) -> Any:
    """``comm.Dup()``, bounded (``Idup``)."""
    new, request = comm.Idup()
    wait([request], what, timeout, where=where or caller(2))
    return new


def split(comm: Any, color: int, key: int = 0,
          what: str = 'a communicator split', timeout: Any = None,
          where: Optional[str] = None) -> Any:
    """``comm.Split(color, key)``, bounded.

    MPI has no non-blocking split: the ranks first meet in a bounded
    barrier, then split under a timer that ends the job (``MPI_Abort``)
    with the timeout's message should the split not return.
    """
    return after_meeting(comm, lambda: comm.Split(color, key), what,
                         timeout, where or caller(2))


def object_context(comm: Any, what: str = "mpi4py's object context",
                   timeout: Any = None, where: Optional[str] = None) -> None:
    """Makes mpi4py create ``comm``'s context for reductions of objects
    (an ``MPI_Comm_dup`` it runs holding the interpreter lock, at the first
    such reduction): a tiny ``allreduce`` of an object, bounded as
    :func:`split` is."""
    after_meeting(comm, lambda: comm.allreduce(0), what, timeout,
                  where or caller(2))


def after_meeting(comm: Any, fn: Any, what: str, timeout: Any = None,
                  where: Optional[str] = None) -> Any:
    """``fn()``, a collective over ``comm`` with no non-blocking form.

    The ranks first meet in a bounded barrier (a rank that never comes
    makes the others raise CommunicationTimeout), then ``fn`` runs under a
    timer that ends the job (``MPI_Abort``) with a message naming ``what``
    should it not return within the limit (a rank that left in between).
    """
    where = where or caller(2)
    barrier(comm, 'the ranks meeting for ' + what, timeout, where)
    seconds = limit(timeout)
    if seconds is None:
        return fn()
    return _guarded(fn, what, seconds, where)


def _guarded(fn, what, seconds, where):
    """``fn()``; if it has not returned after ``seconds``, the job ends
    with a message naming ``what`` (a call that cannot be interrupted)."""
    done = threading.Event()

    def expire():
        if not done.wait(seconds):
            from chainermn_overlap import abort
            abort.abort_job(
                'timed out after {:.1f} s in {} (called from {}), which '
                'cannot be interrupted: another rank left after the ranks '
                'met for it'.format(seconds, what, where))
    timer = threading.Thread(target=expire, daemon=True,
                             name='chainermn_overlap-guard')
    timer.start()
    try:
        return fn()
    finally:
        done.set()


@contextlib.contextmanager
def agreement(comm: Any, what: str, timeout: Any = None) -> Iterator[None]:
    """Runs the ``with`` body, then lets every rank know whether it failed
    on any rank: an error raised on one rank between two collectives is
    then raised on every rank (the others would wait in the next one).

    One bounded allreduce of a flag; when some rank failed, a bounded
    allgather of the errors' texts.  The failing rank raises its own error;
    the others raise one naming the failing ranks and their errors, of the
    same type when it is ``ValueError``, ``TypeError`` or ``RuntimeError``
    (else ``RuntimeError``).  Only ``Exception`` is caught: a
    ``KeyboardInterrupt`` ends this rank, the others' waits are bounded.

    Args:
        comm: the mpi4py communicator every rank of which runs the body.
        what (str): what the body does, in messages.
        timeout: the limit of the agreement's waits (None: the
            environment's).
    """
    import numpy
    MPI = _mpi()
    error = None
    try:
        yield
    except Exception as e:  # told to every rank below, then raised
        error = e
    where = caller(2)
    flag = numpy.array([error is not None], dtype=numpy.int32)
    allreduce(comm, MPI.IN_PLACE, flag, MPI.MAX,
              'the agreement on ' + what, timeout, where)
    if not flag[0]:
        return
    from chainermn_overlap import _mpi_json
    mine = None if error is None else [type(error).__name__, str(error)]
    everyone = _mpi_json.allgather_json(
        comm, mine, what='the errors of ' + what, timeout=timeout)
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
    kinds = {e[0] for _, e in failed}
    kind = {'ValueError': ValueError, 'TypeError': TypeError}.get(
        kinds.pop() if len(kinds) == 1 else '', RuntimeError)
    raise kind('rank {}: {} failed on rank {}: {}'.format(
        comm.Get_rank(), what, ', '.join(str(r) for r, _ in failed),
        '; '.join('rank {}: {}: {}'.format(r, e[0], e[1])
                  for r, e in failed)))
