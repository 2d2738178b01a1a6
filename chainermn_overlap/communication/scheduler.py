"""Priority scheduling of reductions, identical on every rank.

With ``wait='forward'`` the next forward needs the first layers' gradients
first, but backward produces them last, so a first-in-first-out engine
delivers them last.  This engine slices each posted reduction into chunks
and, at every chunk boundary, runs the highest-priority chunk that every
rank has posted.

MPI needs every rank to run the same collectives in the same order, and the
moment a rank posts depends on its own timing.  So decisions use only
knowledge all ranks share: a tiny MIN-allreduce of "which items have I
posted" gives every rank the same set of globally posted items, and the
choice among them is a pure function of that set.  The exchange is skipped
when the choice is already determined by what all ranks know (every
unfinished item is known to be posted everywhere), which after
``update()`` is nearly always.  When nothing unfinished is known to be
posted everywhere, the lowest-index unfinished item runs: every rank posts
items in index order, so it will come.

Items are grouped by *round* (one optimizer iteration): a round's items all
finish before the next round's start, so rounds never interleave.
"""
import threading
import time

import numpy

from chainermn_overlap.communication import backends


class _Item(object):
    __slots__ = ('index', 'host', 'op', 'priority', 'handle', 'offset',
                 'nelems', 'step')

    def __init__(self, index, host, op, priority, handle):
        self.index = index
        self.host = host.reshape(-1)
        self.op = op
        self.priority = priority
        self.handle = handle
        self.offset = 0
        self.nelems = self.host.size
        self.step = 1


class _Round(object):
    def __init__(self, key, n_items):
        self.key = key
        self.n_items = n_items
        self.items = {}
        self.done = set()
        self.known_posted = set()


def choose(unfinished, known_posted, priorities):
    """The next item to run, or None if an exchange is needed.

    A pure function of knowledge shared by all ranks.

    Args:
        unfinished: indices of items not finished yet.
        known_posted: indices known to be posted on every rank.
        priorities: dict index -> priority (larger runs first).
    """
    ready = [i for i in unfinished if i in known_posted]
    if not ready:
        return None
    return max(ready, key=lambda i: (priorities[i], -i))


class PriorityMpiBackend(backends.CommunicationBackend):
    """Chunked, priority-ordered reductions by a communication thread.

    Args:
        mpi_comm: communicator to duplicate.
        chunk_bytes (int): largest chunk reduced in one call; a
            higher-priority item can start at every chunk boundary.
    """

    name = 'mpi_priority'

    def __init__(self, mpi_comm, chunk_bytes=4 * 1024 * 1024):
        backends.check_thread_multiple(self.name)
        self.rank = mpi_comm.Get_rank()
        self.comm = mpi_comm.Dup()
        self.chunk_bytes = int(chunk_bytes)
        self._cond = threading.Condition()
        self._rounds = {}
        self._order = []
        self._closed = False
        self._failed = None
        self.exchanges = 0
        self._thread = threading.Thread(
            target=self._run, name='chainermn_overlap-comm', daemon=True)
        self._thread.start()
        backends._LIVE.add(self)

    def allreduce(self, array, op='sum', label=None, slot=None, priority=0):
        """Posts an in-place allreduce.

        Args:
            slot: ``(round_key, index, n_items)``; items of a round are
                indexed ``0 .. n_items - 1`` and posted in index order on
                every rank.  Without a slot the reduction is a round of its
                own.
            priority: larger runs first among items posted on all ranks.
        """
        if self._closed:
            raise RuntimeError('the communication backend was closed')
        label = label or 'array of {} elements'.format(array.size)
        host, finish = backends.stage_to_host(array)
        # Numbered and watched (timeout, stall reports) by the base class.
        handle = self.new_handle(label, finish, nbytes=array.nbytes)
        with self._cond:
            if slot is None:
                slot = (('solo', id(handle)), 0, 1)
            key, index, n_items = slot
            rnd = self._rounds.get(key)
            if rnd is None:
                rnd = self._rounds[key] = _Round(key, n_items)
                self._order.append(key)
            item = _Item(index, host, op, priority, handle)
            item.step = max(1, self.chunk_bytes // max(1, host.itemsize))
            rnd.items[index] = item
            self._cond.notify()
        return handle

    def _run(self):
        while True:
            with self._cond:
                while not self._order and not self._closed:
                    self._cond.wait()
                if not self._order:
                    return
                rnd = self._rounds[self._order[0]]
            self._serve(rnd)
            with self._cond:
                del self._rounds[rnd.key]
                self._order.pop(0)

    def _serve(self, rnd):
        from mpi4py import MPI
        flags = numpy.zeros(rnd.n_items, dtype=numpy.int32)
        while len(rnd.done) < rnd.n_items:
            unfinished = [i for i in range(rnd.n_items) if i not in rnd.done]
            with self._cond:
                posted = dict(rnd.items)
            prio = {i: (posted[i].priority if i in posted else 0)
                    for i in unfinished}
            nxt = choose(unfinished, rnd.known_posted, prio)
            # An exchange can change the choice only while some unfinished
            # item is not known to be posted everywhere.  Decided from shared
            # knowledge only, so every rank exchanges at the same points.
            if nxt is None or any(i not in rnd.known_posted
                                  for i in unfinished):
                # Learn what every rank has posted (a MIN over flags).
                flags[:] = 0
                for i in posted:
                    flags[i] = 1
                if self._failed is None:
                    try:
                        self.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MIN)
                    except Exception as e:  # reported to waiters
                        self._failed = e
                self.exchanges += 1
                rnd.known_posted.update(int(i) for i in numpy.nonzero(flags)[0])
                nxt = choose(unfinished, rnd.known_posted, prio)
                if nxt is None:
                    # Nothing posted everywhere yet: the lowest unfinished
                    # index comes next on every rank; wait until it is here.
                    nxt = unfinished[0]
                    with self._cond:
                        while nxt not in rnd.items and not self._closed:
                            self._cond.wait()
                    rnd.known_posted.add(nxt)
            with self._cond:
                item = rnd.items.get(nxt)
            if item is None:
                return  # closed while waiting
            self._run_chunk(item)
            if item.offset >= item.nelems:
                rnd.done.add(nxt)
                item.handle.finished_at = time.perf_counter()
                item.handle._event.set()

    def _run_chunk(self, item):
        from mpi4py import MPI
        h = item.handle
        if h.started_at is None:
            h.started_at = time.perf_counter()
        a, b = item.offset, min(item.offset + item.step, item.nelems)
        if self._failed is not None:
            h.error = RuntimeError(
                'not attempted: an earlier reduction on rank {} failed ({})'
                .format(self.rank, self._failed))
            item.offset = item.nelems
            return
        t0 = time.perf_counter()
        try:
            self.comm.Allreduce(MPI.IN_PLACE, item.host[a:b],
                                op=backends._mpi_op(item.op))
        except Exception as e:  # reported to the waiting thread
            self._failed = e
            h.error = RuntimeError('rank {}: {}'.format(self.rank, e))
            b = item.nelems
        h.spans.append((t0, time.perf_counter()))
        item.offset = b

    def close(self):
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.close_inspector()
        # After a watchdog timeout the thread may be inside a collective
        # that never completes: do not wait for it (exit then aborts).
        self._thread.join(None if self.stuck is None else 1.0)
        if self._thread.is_alive():
            return
        try:
            self.comm.Free()
        except Exception:  # MPI may already be finalized at exit
            pass
        backends._LIVE.discard(self)


backends.register_backend(PriorityMpiBackend.name, PriorityMpiBackend)
