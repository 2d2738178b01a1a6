"""Fetching whole parameters from their owners, without a collective.

With ``shard='parameters'`` a rank keeps only its piece of each bucket's
parameters; a link's forward (and the backward of a function that retained
a parameter) needs the whole.  A collective gather would force every rank
to gather the same buckets in the same order, which networks whose
branches differ between ranks, a snapshot written by rank 0 alone or an
evaluation on one rank do not do.  So each rank runs a small server: a
thread that answers requests for its pieces, and any rank fetches a bucket
when it needs it by sending one request to each owner and receiving the
pieces straight into place (point to point, on a communicator of its own).

Versions keep fetches exact: a request names the number of updates the
requester expects the bucket to have had; an owner that has not applied
that update yet answers once it has (:meth:`ShardServer.updated`), and an
owner does not start the next update of a bucket before its answers of the
previous version are sent (:meth:`ShardServer.before_update`).  Every rank
finishes its own fetches before it closes an iteration, and the updates of
a closed iteration start only once every rank closed it (a collective of
the round), so no request can ask for a version an owner has already left.

Each fetch receives its answers under a tag of its own, which its request
names: an answer can only land in the fetch that asked for it, whatever
order the owners answer in (an answer deferred for its version may be sent
after a later request's).

One thread per process listens for the requests of every server of the
process (:class:`_Listener`): a process that made many optimizers, most of
them dropped and not yet collected, still has one thread waking, not one
per optimizer contending for the interpreter lock.  It waits by testing
between short sleeps (10-250 us), as the engines' sleeping waits do, and
tests a server that has been idle less often, so an idle server costs
almost no CPU.

That thread needs the interpreter lock to answer, so a rank answers only
while no thread of its holds the lock in a wait on another rank.  mpi4py's
calls release the lock while they wait, but one does not: its first
reduction of objects on a communicator (``allreduce``, ``reduce``,
``scan``, ``exscan``: ChainerMN's ``allreduce_obj`` and its multi-node
evaluator) creates mpi4py's context for that communicator, an
``MPI_Comm_dup`` (collective) called with the lock held.  A rank that
entered it first would wait there for a peer that is itself waiting for
this rank's answer, and never answer.  So a server creates that context
at its own construction, a collective point (:func:`_prepare_contexts`).
"""
import logging
import threading
import time

import numpy

from chainermn_overlap.communication import blocking
from chainermn_overlap.communication import watchdog as watchdog_module

__all__ = ['Fetch', 'ShardServer']

_REQUEST = 1
_DATA = 2   # + the fetch's sequence number, modulo the span below
# Tags of answers cycle through this many values (at most; MPI guarantees
# tags up to 32767).  A rank has a few fetches in flight at a time, all
# finished before its iteration closes, so a tag is long free when reused.
_TAG_SPAN = 1 << 20
_MIN_SLEEP = 10e-6
_MAX_SLEEP = 250e-6
# An idle server is tested less often: every 1 ms at most after 20 ms
# without a request, 20 ms after 1 s, 100 ms after 10 s (a server of an
# optimizer that is no longer used then costs next to nothing until it is
# collected; the first request after such a pause waits that much longer).
_IDLE_STEPS = ((10.0, 100e-3), (1.0, 20e-3), (0.02, 1e-3))
# A request deferred this long (its version not reached) is logged once:
# the requester is then usually stuck too, and its timeout says less.
_DEFERRED_WARNING_S = 30.0

_log = logging.getLogger(__name__)


def _mpi():
    from mpi4py import MPI
    return MPI


def _prepare_contexts(mpi_comm):
    """Creates mpi4py's context for the reductions of objects on
    ``mpi_comm`` and, when ``mpi_comm`` spans every process, on
    ``COMM_WORLD`` (collective over ``mpi_comm``).

    Later reductions of objects on them then release the interpreter lock
    while they wait, as every other MPI call does, and this rank's server
    answers meanwhile (see the module's docstring).  A communicator made
    after the server is not covered: reduce objects on it once on every
    rank before a rank may enter such a reduction while another still
    fetches parameters.
    """
    MPI = _mpi()
    comms = [mpi_comm]
    if mpi_comm != MPI.COMM_WORLD and MPI.Comm.Compare(
            mpi_comm, MPI.COMM_WORLD) in (MPI.CONGRUENT, MPI.SIMILAR):
        comms.append(MPI.COMM_WORLD)
    for comm in comms:
        # The first reduction of an object creates the context (once per
        # communicator, cached); here every rank makes it at once.
        blocking.object_context(comm)


class Fetch(object):
    """A bucket being fetched: ``wait()`` returns the whole flat array."""

    def __init__(self, bucket, full, requests, own, version=None,
                 owners=(), tag=None, rank=None):
        self.bucket = bucket
        self.rank = rank   # the fetching rank, for messages
        self.tag = tag   # the tag its answers come under
        self.full = full
        self.requests = requests
        self._own = own   # callable filling this rank's piece, or None
        self.version = version
        self.owners = list(owners)   # the rank of each (receive, request)

    def label(self):
        return ('the fetch of the parameters of bucket {} (version {}, tag '
                '{}) from rank(s) {}'.format(self.bucket.index, self.version,
                                             self.tag, self.owners))

    def _unanswered(self):
        # requests: (answer receive, request send) per owner.
        pairs = list(zip(self.owners, self.requests[0::2],
                         self.requests[1::2]))
        missing = [r for r, recv, _ in pairs if not recv.Test()]
        unsent = [r for r, _, send in pairs if not send.Test()]
        return ('No answer from rank(s) {}{}: a rank stopped answering (it '
                'died, hangs, or its link is down).'.format(
                    missing, ' (the request to rank(s) {} not even sent)'
                    .format(unsent) if unsent else ''))

    def wait(self, timeout=None, watchdog=None):
        """Blocks until every piece arrived.

        Args:
            timeout (float or None): seconds before
                :class:`~chainermn_overlap.CommunicationTimeout` (naming the
                ranks that have not answered); None: the watchdog's (0 or
                None without one: no limit).
            watchdog: the optimizer's engine's
                :class:`~chainermn_overlap.communication.watchdog.Watchdog`
                (its limit and stall warnings; a timeout marks its engine
                stuck).
        """
        if self._own is not None:
            self._own(self.full)
            self._own = None
        if watchdog is not None:
            watchdog.wait_requests(self.requests, self.label(), timeout,
                                   detail=self._unanswered)
        else:
            watchdog_module.wait_requests(self.requests, self.label(),
                                          self.rank, timeout,
                                          detail=self._unanswered)
        self.requests = []
        return self.full


class _Listener(object):
    """The thread that receives the requests of every server of this
    process; it runs while one server listens."""

    def __init__(self):
        self._lock = threading.Lock()
        self._servers = []
        self._thread = None
        self._wake = threading.Event()

    def add(self, server):
        with self._lock:
            self._servers.append(server)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True,
                    name='chainermn_overlap-shards')
                self._thread.start()
        self._wake.set()

    def wake(self):
        self._wake.set()

    def _run(self):
        while True:
            with self._lock:
                servers = list(self._servers)
                if not servers:
                    self._thread = None
                    return
            now = time.perf_counter()
            next_at = now + 1.0
            for server in servers:
                if server._closed:
                    server._stop_listening()
                    with self._lock:
                        self._servers.remove(server)
                    continue
                if now >= server._next_poll:
                    server._poll(now)
                next_at = min(next_at, server._next_poll)
            delay = next_at - time.perf_counter()
            if delay > 0 and self._wake.wait(delay):
                self._wake.clear()


_LISTENER = _Listener()


class ShardServer(object):
    """Serves this rank's pieces of each bucket; fetches the others'.

    Args:
        mpi_comm: the communicator to duplicate (collective over it).
        rank (int): this rank.
        timeout (float or None): the limit of the owner's waits for its
            answers to be sent (:meth:`before_update`, :meth:`reset`): the
            optimizer's ``timeout=``; None: the environment's; 0: none.
    """

    def __init__(self, mpi_comm, rank, timeout=None):
        self.comm = blocking.dup(mpi_comm, "the parameter server's "
                                 'communicator')
        # Every rank has reached the Dup above (it agrees on a context id), so
        # this collective, which holds the interpreter lock, waits for no
        # one long.
        _prepare_contexts(mpi_comm)
        self.rank = rank
        self._timeout = timeout
        self._cond = threading.Condition()
        self._pieces = {}      # bucket index -> this rank's piece
        self._version = {}     # bucket index -> updates applied to it
        self._pending = {}     # index -> [(source, version, tag, since)]
        self._sends = {}       # bucket index -> [request]
        self._closed = False
        self._seq = 0          # fetches started by this rank
        tag_ub = self.comm.Get_attr(_mpi().TAG_UB) or 32767
        self._tag_span = max(1, min(_TAG_SPAN, tag_ub - _DATA))
        self._debug = _log.isEnabledFor(logging.DEBUG)
        # The listening side, driven by the process's listener thread.
        # One receive per other rank, not one from MPI_ANY_SOURCE: with
        # MPICH 5 (ch4, UCX, MPIR_CVAR_NOLOCAL=1) an any-source receive
        # posted again and again stopped matching requests that had
        # arrived, a few iterations into a ResNet-50 job (5 runs of 5);
        # receives from named sources did not (3 runs of 3).
        peers = [r for r in range(self.comm.Get_size()) if r != rank]
        self._bufs = [numpy.empty(3, dtype=numpy.int64) for _ in peers]
        self._peers = peers
        self._reqs = [self._listen(i) for i in range(len(peers))]
        self._delay = _MIN_SLEEP
        self._last = self._next_poll = time.perf_counter()
        self._stopped = threading.Event()
        self._freed = False
        _LISTENER.add(self)

    # -- the owner's side ------------------------------------------------

    def publish(self, index, piece, version=0):
        """Makes ``piece`` (host memory) the answer for bucket ``index``."""
        with self._cond:
            self._pieces[index] = piece
            self._version[index] = version
            self._sends.setdefault(index, [])
            # Requests that came before the piece did.
            waiting, self._pending[index] = self._pending.get(index, []), []
            for source, v, tag, _ in waiting:
                self._answer(index, source, v, tag)

    def reset(self):
        """Forgets every piece (a new layout publishes its own)."""
        with self._cond:
            for sends in self._sends.values():
                blocking.wait(sends, 'the answers to fetches of parameters',
                              self._timeout)
            self._pieces, self._version, self._sends = {}, {}, {}

    def before_update(self, index):
        """Waits until no answer of bucket ``index`` is being sent."""
        with self._cond:
            sends = list(self._sends.get(index, ()))
        blocking.wait(sends, 'the answers to fetches of the parameters of '
                      'bucket {}'.format(index), self._timeout)
        with self._cond:
            self._sends[index] = [r for r in self._sends[index]
                                  if r not in sends]

    def updated(self, index):
        """Bucket ``index`` had one more update: answer who waited for it."""
        with self._cond:
            self._version[index] += 1
            waiting, self._pending[index] = self._pending[index], []
            for source, version, tag, _ in waiting:
                self._answer(index, source, version, tag)

    def _answer(self, index, source, version, tag):
        # Called with the lock held.  A bucket not published yet (this
        # rank is behind the requester) or not updated yet: answer later.
        have = self._version.get(index, -1)
        if have < version:
            if self._debug:
                _log.debug('rank %d: defers rank %d\'s request for bucket %d '
                           'version %d (tag %d): has version %d', self.rank,
                           source, index, version, tag, have)
            self._pending.setdefault(index, []).append(
                (source, version, tag, time.perf_counter()))
            return
        if self._debug:
            _log.debug('rank %d: answers rank %d: bucket %d version %d '
                       '(asked %d, tag %d)', self.rank, source, index, have,
                       version, tag)
        self._sends[index].append(self.comm.Isend(
            self._pieces[index], dest=source, tag=tag))

    def _poll(self, now):
        """Answers the requests that arrived (the listener's thread)."""
        MPI = _mpi()
        while self._reqs:
            done = MPI.Request.Testsome(self._reqs)
            if not done:
                break
            for i in done:
                buf = self._bufs[i]
                with self._cond:
                    self._answer(int(buf[0]), self._peers[i], int(buf[1]),
                                 int(buf[2]))
                self._reqs[i] = self._listen(i)
            self._delay, self._last = _MIN_SLEEP, now
        self._warn_deferred()
        idle = now - self._last
        cap = next((c for after, c in _IDLE_STEPS if idle > after),
                   _MAX_SLEEP)
        self._delay = min(2 * self._delay, cap)
        self._next_poll = now + self._delay

    def _listen(self, i):
        return self.comm.Irecv(self._bufs[i], source=self._peers[i],
                               tag=_REQUEST)

    def _stop_listening(self):
        for req in self._reqs:
            req.Cancel()
        _mpi().Request.Waitall(self._reqs)
        self._stopped.set()

    def _warn_deferred(self):
        now = time.perf_counter()
        with self._cond:
            for index, waiting in self._pending.items():
                for i, (source, version, tag, since) in enumerate(waiting):
                    if since is not None and now - since > \
                            _DEFERRED_WARNING_S:
                        _log.warning(
                            'rank %d: rank %d asked for bucket %d at version '
                            '%d %.0f s ago; this rank has applied %s updates '
                            'to it', self.rank, source, index, version,
                            now - since, self._version.get(index))
                        waiting[i] = (source, version, tag, None)

    # -- the requester's side --------------------------------------------

    def fetch(self, bucket, version, own):
        """Starts fetching bucket ``bucket``'s parameters at ``version``.

        Args:
            bucket: with ``bounds`` (every rank's piece), ``plan`` and
                ``param_dtype``.
            version (int): the updates the bucket must have had.
            own (callable): ``own(full)`` copies this rank's piece in (run
                at ``wait()``, once this rank's own update is applied).

        Returns:
            Fetch
        """
        full = numpy.empty(bucket.plan.nelems, dtype=bucket.param_dtype)
        requests, owners = [], []
        tag = _DATA + self._seq % self._tag_span
        self._seq += 1
        msg = numpy.array([bucket.index, version, tag], dtype=numpy.int64)
        for r, (a, b) in enumerate(bucket.bounds):
            if r == self.rank or a == b:
                continue
            owners.append(r)
            requests.append(self.comm.Irecv(full[a:b], source=r, tag=tag))
            requests.append(self.comm.Isend(msg, dest=r, tag=_REQUEST))
        if self._debug:
            _log.debug('rank %d: fetches bucket %d version %d from %s '
                       '(tag %d)', self.rank, bucket.index, version, owners,
                       tag)
        return Fetch(bucket, full, requests, own, version, owners, tag,
                     self.rank)

    def stop(self):
        """Stops listening, without waiting (an optimizer that was dropped
        without ``close()``)."""
        self._closed = True
        _LISTENER.wake()

    def close(self):
        """Stops listening and frees the communicator."""
        if self._freed:
            return
        self._freed = True
        self.stop()
        self._stopped.wait(5.0)
        for sends in self._sends.values():
            blocking.wait(sends, 'the answers to fetches of parameters')
        try:
            self.comm.Free()
        except Exception:  # MPI may already be finalized at exit
            pass
