"""Watchdog, stall diagnosis and collective-sequence checks.

Three guards against the ways a distributed job hangs or silently goes
wrong:

* :class:`Watchdog` bounds every wait of the library: after ``timeout``
  seconds the waiting rank raises :class:`CommunicationTimeout` naming the
  pending communication instead of hanging; past ``stall_warning`` seconds
  it warns (:class:`StallWarning`), repeatedly, while it keeps waiting.
* :class:`StallInspector` answers "which ranks have not posted which
  collective?".  Each rank runs a small side thread on a communicator of
  its own that answers status requests with its posting counters and where
  its main thread is.  It needs no cooperation from a stuck rank's main
  thread or communication thread, so it works exactly when needed: when
  some rank is stuck in Python code, in another collective, or in I/O.
* :meth:`Watchdog.wait_requests` bounds the waits of the collectives the
  main thread runs itself (a gradient norm, a gather of sharded states, a
  barrier, a fetch of parameters) by the same limit as the reductions'
  (:mod:`.requests`, whose :func:`wait_requests` and :func:`abandoned`
  are importable from here too).
* :func:`control_message` / :func:`check_control` piggy-back a fingerprint
  of the bucket layout and the iteration number of every rank on the
  per-iteration control allreduce (an allgather done by ``MAX`` over
  per-rank slots), so that ranks that disagree on the collective sequence
  are found at the next iteration, named, at no extra message.

Everything exchanged is numbers or JSON text: nothing from a peer is ever
unpickled.
"""
import faulthandler
import json
import os
import re
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from typing import Any, Callable, Dict, Optional, Sequence

import numpy

from chainermn_overlap import config
from chainermn_overlap.communication import blocking
from chainermn_overlap.communication.requests import _fmt_s
from chainermn_overlap.communication.requests import abandoned
from chainermn_overlap.communication.requests import wait_requests
from chainermn_overlap.errors import CollectiveMismatchError
from chainermn_overlap.errors import CommunicationTimeout
from chainermn_overlap.errors import StallWarning

__all__ = ['StallInspector', 'Watchdog', 'abandoned', 'check_control',
           'check_same_collective', 'control_message', 'layout_fingerprint',
           'main_thread_location', 'wait_requests']

_INT64_MIN = numpy.iinfo(numpy.int64).min


# ----------------------------------------------------------------------------
# Watchdog

class Watchdog(object):
    """Bounded waits on a backend's handles.

    Args:
        backend: the backend whose handles are waited for; it provides
            ``rank``, ``describe_progress(handle)``, ``mark_stuck()`` and
            optionally ``inspector``.
        timeout (float or None): seconds before a wait raises.
        stall_warning (float or None): seconds before (and between)
            :class:`StallWarning` reports.
    """

    def __init__(self, backend: Any, timeout: Optional[float],
                 stall_warning: Optional[float]) -> None:
        self.backend = backend
        self.timeout = timeout
        self.stall_warning = stall_warning

    def wait(self, handle: Any, timeout: Optional[float] = None) -> None:
        """Blocks until ``handle`` completed; raises on timeout.

        Args:
            handle: a backend handle.
            timeout (float or None): overrides the watchdog's timeout.
        """
        event = handle._event
        if event.is_set():
            return
        timeout = self.timeout if timeout is None else timeout
        step = self.stall_warning
        if timeout is None and step is None:
            event.wait()
            return
        t0 = time.monotonic()
        next_warning = step
        while True:
            limits = [x for x in (timeout, next_warning) if x is not None]
            remaining = min(limits) - (time.monotonic() - t0)
            if remaining > 0 and event.wait(remaining):
                return
            if event.is_set():
                return
            waited = time.monotonic() - t0
            if timeout is not None and waited >= timeout:
                self.backend.mark_stuck()
                raise CommunicationTimeout(
                    self.timeout_message(handle, waited))
            if next_warning is not None and waited >= next_warning:
                warnings.warn(self.stall_message(handle, waited),
                              StallWarning, stacklevel=4)
                next_warning += step

    def wait_requests(self, requests: Sequence[Any], label: str,
                      timeout: Optional[float] = None,
                      detail: Optional[Callable[[], str]] = None,
                      hint: str = '') -> None:
        """Waits for MPI requests the main thread posted; raises on timeout.

        For the collectives (and fetches) that are not the communication
        thread's: bounded by this watchdog's limit, with its stall
        warnings.  On a timeout the backend is marked stuck (its later
        posts raise at once: the communicator now holds a collective that
        peers may still join) and the process calls MPI_Abort at exit.

        Args:
            requests: mpi4py requests, all posted.
            label (str): what is waited for, in messages.
            timeout (float or None): overrides the watchdog's timeout.
            detail (callable): returns text for the timeout message (e.g.
                which peers have not answered), called then.
            hint (str): what to do about it, in the timeout message.
        """
        def on_timeout():
            mark = getattr(self.backend, 'mark_stuck', None)
            if mark is not None:
                mark(label)
        wait_requests(requests, label, self.backend.rank,
                      self.timeout if timeout is None else timeout,
                      self.stall_warning, detail=detail, hint=hint,
                      on_timeout=on_timeout)

    def _diagnosis(self, handle):
        inspector = getattr(self.backend, 'inspector', None)
        if inspector is None:
            return ('(Which ranks have not posted it is unknown: stall '
                    'diagnosis is off; set {}=<seconds> on every rank.)'
                    .format(config.STALL_WARNING_ENV))
        return inspector.report(handle)

    def stall_message(self, handle: Any, waited: float) -> str:
        """The text of a :class:`StallWarning` about ``handle``."""
        return ('rank {}: has waited {} for {} ({}). {}'.format(
            self.backend.rank, _fmt_s(waited), handle.label,
            self.backend.describe_progress(handle),
            self._diagnosis(handle)))

    def timeout_message(self, handle: Any, waited: float) -> str:
        """The text of a :class:`CommunicationTimeout` about ``handle``."""
        return (
            'rank {rank}: timed out after {waited} waiting for {label} '
            '({nbytes} bytes; {progress}). {diag} Another rank has not '
            'joined this collective: it raised an error or was killed, is '
            'stuck or much slower (e.g. evaluation or a snapshot on one rank '
            'only), ran a different number of iterations, or the network '
            'between ranks failed. The communication thread is still inside '
            'the collective, so this process calls MPI_Abort at exit. '
            'Fixes: call chainermn_overlap.enable_abort_on_exception() on '
            'every rank so that an error on one rank ends the job at once; '
            'set {stall}=<seconds> to report which ranks have not posted '
            'which bucket; if the job is merely slow, raise the limit with '
            'create_overlapped_optimizer(..., timeout=<seconds>) or '
            '{env}=<seconds> (0 disables).'.format(
                rank=self.backend.rank, waited=_fmt_s(waited),
                label=handle.label, nbytes=handle.nbytes,
                progress=self.backend.describe_progress(handle),
                diag=self._diagnosis(handle),
                stall=config.STALL_WARNING_ENV, env=config.TIMEOUT_ENV))


# ----------------------------------------------------------------------------
# Stall inspector

_TAG_ASK = 7301
_TAG_REPLY = 7302
# Replies are small JSON texts in fixed buffers, below MPICH's eager limits,
# so that a reply nobody receives any more never blocks the answering thread.
_REPLY_BYTES = 2048


def main_thread_location(depth: int = 3) -> str:
    """``file:line in function`` of the main thread's innermost frames.

    Read from ``faulthandler``'s dump of every thread, which walks the
    frames in C and creates no Python objects: no collection can start
    inside it, and the collector is left as the program set it.
    (``sys._current_frames()`` creates frame objects while it holds the
    interpreter's thread-list lock, and a collection started there can
    finalise an object that needs the same lock: the process hung when
    another thread polled it every few ms.  Turning the collector off around
    it from this thread could turn it back on behind the main thread.)
    """
    ident = threading.main_thread().ident
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = f.read().decode('utf-8', 'replace')
    return _location_in_dump(text, ident, depth)


def _location_in_dump(text: str, ident: int, depth: int) -> str:
    """The first ``depth`` frames of thread ``ident`` in a faulthandler
    dump (innermost first), as ``file:line in function <- ...``."""
    frames, inside = [], False
    for line in text.splitlines():
        head = re.match(r'(?:Current thread|Thread) (0x[0-9a-fA-F]+)', line)
        if head:
            if inside:
                break
            inside = int(head.group(1), 16) == ident
            continue
        found = re.match(r'\s+File "(.*)", line (\d+) in (.*)$', line)
        if inside and found and len(frames) < depth:
            frames.append('{}:{} in {}'.format(
                os.path.basename(found.group(1)), found.group(2),
                found.group(3).strip()))
    return ' <- '.join(frames) if frames else 'unknown'


class StallInspector(object):
    """Answers and asks "how far has each rank posted?".

    Each rank runs a daemon thread on a communicator of its own (a ``Dup``
    of the backend's) that polls for status requests every ``poll``
    seconds -- non-blocking, because a blocking receive busy-polls a core
    in MPICH -- and answers with ``status()``.  A waiting rank asks all
    others and reports which ones have not posted the collective it waits
    for.

    Args:
        mpi_comm: communicator to duplicate (collective over it).
        status (callable): returns this rank's status as a JSON-able dict
            with at least ``posted`` (number of collectives posted).
        poll (float): seconds between polls of the answering thread.
    """

    def __init__(self, mpi_comm: Any, status: Callable[[], Dict[str, Any]],
                 poll: float = 0.2, owner: Any = None) -> None:
        self.comm = blocking.dup(mpi_comm, "the stall inspector's "
                                 'communicator')
        # Stops by itself once its backend is closed or garbage collected.
        self._owner = None if owner is None else weakref.ref(owner)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # Through the weak reference when there is an owner, so that the
        # inspector does not keep its backend alive.
        self._status_fn = status if owner is None else None
        self._freed = False
        self.poll = poll
        self._next_request = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name='chainermn_overlap-stall-inspector',
            daemon=True)
        self._thread.start()

    def status(self) -> Dict[str, Any]:
        """This rank's status, as its owner reports it."""
        if self._status_fn is not None:
            return self._status_fn()
        owner = self._owner()
        return owner.status() if owner is not None else {}

    def _free(self):
        if not self._freed:
            self._freed = True
            try:
                self.comm.Free()
            except Exception:  # MPI may be finalized at exit
                pass

    def _owner_closed(self):
        if self._owner is None:
            return False
        owner = self._owner()
        if owner is None or getattr(owner, '_closed', False):
            self._stop.set()
            return True
        return False

    @staticmethod
    def _encode(info):
        # A reply that does not fit is shortened as JSON, never cut as
        # bytes: a cut text would not decode and the rank would read as
        # "no answer", hiding the report that matters most.
        data = json.dumps(info).encode()
        if len(data) > _REPLY_BYTES - 8:
            info = {k: (v[:200] + '...' if isinstance(v, str)
                        and len(v) > 200 else v) for k, v in info.items()}
            data = json.dumps(info).encode()
        if len(data) > _REPLY_BYTES - 8:
            info = {'rank': info.get('rank'), 'posted': info.get('posted'),
                    'comm_thread': '(report too long to send)'}
            data = json.dumps(info).encode()
        out = numpy.zeros(_REPLY_BYTES, dtype=numpy.uint8)
        out[:8] = numpy.frombuffer(
            numpy.int64(len(data)).tobytes(), dtype=numpy.uint8)
        out[8:8 + len(data)] = numpy.frombuffer(data, dtype=numpy.uint8)
        return out

    @staticmethod
    def _decode(buf):
        n = int(numpy.frombuffer(buf[:8].tobytes(), dtype=numpy.int64)[0])
        if not 0 <= n <= len(buf) - 8:
            return None
        try:
            return json.loads(buf[8:8 + n].tobytes().decode())
        except ValueError:
            return None

    def _serve(self):
        from mpi4py import MPI
        ask = numpy.zeros(1, dtype=numpy.int64)
        status = MPI.Status()
        sends = []
        while True:
            req = self.comm.Irecv([ask, MPI.INT64_T], source=MPI.ANY_SOURCE,
                                  tag=_TAG_ASK)
            while not req.Test(status):
                if self._stop.wait(self.poll) or self._owner_closed():
                    req.Cancel()
                    req.Wait()
                    for s, _ in sends:
                        s.Free()
                    self._free()
                    return
            try:
                info = dict(self.status(), request=int(ask[0]))
            except Exception as e:  # report, never kill the answering thread
                info = {'error': repr(e), 'request': int(ask[0])}
            out = self._encode(info)
            # Each buffer is kept with its request until the send completed.
            sends = [(s, b) for s, b in sends if not s.Test()]
            sends.append((self.comm.Isend([out, MPI.BYTE],
                                          dest=status.Get_source(),
                                          tag=_TAG_REPLY), out))

    def ask_all(self, deadline: float = 2.0
                ) -> Dict[int, Optional[Dict[str, Any]]]:
        """Status of every rank: ``{rank: dict or None}`` (None: no answer).

        Args:
            deadline (float): seconds to wait for answers.
        """
        from mpi4py import MPI
        req_id = self._next_request
        self._next_request += 1
        out = {self.rank: self.status()}
        ask = numpy.array([req_id], dtype=numpy.int64)
        pending, sends = {}, []
        for r in range(self.size):
            if r == self.rank:
                continue
            buf = numpy.zeros(_REPLY_BYTES, dtype=numpy.uint8)
            pending[r] = (self.comm.Irecv([buf, MPI.BYTE], source=r,
                                          tag=_TAG_REPLY), buf)
            sends.append(self.comm.Isend([ask, MPI.INT64_T], dest=r,
                                         tag=_TAG_ASK))
        end = time.monotonic() + deadline
        while pending and time.monotonic() < end:
            for r, (req, buf) in list(pending.items()):
                if not req.Test():
                    continue
                info = self._decode(buf)
                if info is not None and info.get('request') == req_id:
                    out[r] = info
                    del pending[r]
                else:
                    # A late answer to an earlier request: receive again.
                    pending[r] = (self.comm.Irecv(
                        [buf, MPI.BYTE], source=r, tag=_TAG_REPLY), buf)
            if pending:
                time.sleep(0.01)
        for r, (req, _) in pending.items():
            req.Cancel()
            req.Wait()
            out[r] = None
        for s in sends:
            if not s.Test():
                s.Free()
        return out

    def report(self, handle: Any, deadline: float = 2.0) -> str:
        """Which ranks have not posted ``handle``'s collective, as text."""
        seq = handle.seq
        statuses = self.ask_all(deadline)
        lagging, silent, lines = [], [], []
        for r in range(self.size):
            info = statuses.get(r)
            if info is None:
                silent.append(r)
                lines.append('rank {}: no answer within {} (dead, hung '
                             'holding the GIL, or on an MPI that cannot '
                             'reach it)'.format(r, _fmt_s(deadline)))
                continue
            posted = info.get('posted', 0)
            where = ('waiting for it (this rank)' if r == self.rank
                     else info.get('main_thread', 'unknown'))
            if posted < seq:
                lagging.append(r)
                lines.append(
                    'rank {}: has NOT posted it (posted {} collectives, the '
                    'last: {}); main thread at {}'.format(
                        r, posted, info.get('last_posted'), where))
            else:
                lines.append(
                    'rank {}: posted it; communication thread {}; main '
                    'thread at {}'.format(r, info.get('comm_thread'), where))
        if lagging:
            head = ('Stall diagnosis for collective #{} ({}): ranks {} have '
                    'not posted it'.format(seq, handle.label, lagging))
        else:
            head = ('Stall diagnosis for collective #{} ({}): every rank that '
                    'answered has posted it (it is in progress, or queued '
                    'behind an earlier one)'.format(seq, handle.label))
        if silent:
            head += ', ranks {} did not answer'.format(silent)
        return head + '. ' + '; '.join(lines) + '.'

    def close(self) -> None:
        """Stops the answering thread (it frees its communicator)."""
        if not self._thread.is_alive():
            return
        self._stop.set()
        self._thread.join(timeout=5 * self.poll + 1)


# ----------------------------------------------------------------------------
# Collective-sequence check carried by the control message

def layout_fingerprint(buckets: Sequence[Any]) -> int:
    """A 31-bit fingerprint of the bucket layout (members, sizes, dtypes,
    shard pieces)."""
    text = '|'.join('{}:{}:{}:{}'.format(
        b.plan.dtype.str, b.plan.nelems, ','.join(b.names),
        ','.join(map(str, b.shard_counts))) for b in buckets)
    return zlib.crc32(text.encode()) & 0x7fffffff


def control_message(changed: bool, loaded: bool, rank: int, size: int,
                    fingerprint: int, iteration: int) -> numpy.ndarray:
    """The per-iteration control buffer, reduced with ``MAX``.

    ``[changed, -loaded, fingerprint per rank..., iteration per rank...]``:
    every rank fills only its own slots (the others hold the minimum
    int64), so the ``MAX`` reduction is an allgather of the fingerprints
    and iteration numbers, at the cost of ``2 * size`` integers.
    """
    buf = numpy.full(2 + 2 * size, _INT64_MIN, dtype=numpy.int64)
    buf[0] = int(changed)
    buf[1] = -int(loaded)
    buf[2 + rank] = fingerprint
    buf[2 + size + rank] = iteration
    return buf


def check_control(buf: numpy.ndarray, rank: int, size: int) -> None:
    """Raises CollectiveMismatchError if ranks disagree, naming them."""
    if len(buf) < 2 + 2 * size:
        return
    fps = buf[2:2 + size]
    its = buf[2 + size:2 + 2 * size]
    problems = []
    for what, values in (('iteration', its), ('bucket layout', fps)):
        if (values == values[0]).all():
            continue
        groups = {}
        for r, v in enumerate(values.tolist()):
            groups.setdefault(v, []).append(r)
        desc = '; '.join('ranks {}: {} {}'.format(rs, what, v)
                         for v, rs in sorted(groups.items(),
                                             key=lambda kv: kv[1][0]))
        problems.append(desc)
    if problems:
        raise CollectiveMismatchError(
            'rank {}: ranks disagree on the sequence of collectives ({}). '
            'Each rank must call update() the same number of times on the '
            'same model: a rank that skips update() (e.g. for an empty '
            'batch; give it a zero-sample batch instead) or runs an extra '
            'one reduces unrelated gradients together or hangs.'.format(
                rank, ' | '.join(problems)))


# Labels exchanged when ranks disagree, truncated to this many bytes each.
_LABEL_BYTES = 200


def check_same_collective(comm: Any, rank: int, size: int, what: str,
                          label: str, buf: numpy.ndarray, op: str) -> None:
    """Debug mode: checks that every rank is about to run this collective.

    An allgather (as ``MAX`` over per-rank slots, on ``comm``) of a
    fingerprint of label, dtype, size and operation; on disagreement the
    labels are exchanged too, so that the error names each rank's
    collective.  Collective: every rank of ``comm`` calls it.

    Args:
        comm: the ``mpi4py`` communicator the collective runs on.
        rank, size: this rank and the number of ranks of ``comm``.
        what (str): the collective, for the message (``'collective #3'``).
        label (str): what each rank means to reduce, compared and shown.
        buf: the buffer about to be reduced.
        op (str): the reduction (``'sum'``, ``'max'``, ``'min'``).

    Raises:
        CollectiveMismatchError: on every rank, if any rank differs.
    """
    from mpi4py import MPI
    text = '{}|{}|{}|{}'.format(label, buf.dtype.str, buf.size, op)
    fp = zlib.crc32(text.encode()) & 0x7fffffff
    vec = numpy.full(2 * size, _INT64_MIN, dtype=numpy.int64)
    vec[rank] = fp
    vec[size + rank] = buf.nbytes
    comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MAX)
    if (vec[:size] == fp).all():
        return
    width = _LABEL_BYTES
    mine = numpy.zeros(width, dtype=numpy.uint8)
    enc = label.encode()[:width]
    mine[:len(enc)] = numpy.frombuffer(enc, dtype=numpy.uint8)
    labels = numpy.empty(width * size, dtype=numpy.uint8)
    comm.Allgather([mine, MPI.BYTE], [labels, MPI.BYTE])
    desc = '; '.join(
        'rank {}: {!r} ({} bytes)'.format(
            r, labels[r * width:(r + 1) * width].tobytes()
            .rstrip(b'\0').decode(errors='replace'),
            int(vec[size + r]))
        for r in range(size))
    raise CollectiveMismatchError(
        'rank {}: {} differs between ranks ({}). Every rank must post the '
        'same collectives in the same order: build the same model and call '
        'update() the same number of times on every rank.'.format(
            rank, what, desc))
