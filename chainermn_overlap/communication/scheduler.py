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

In debug mode every chunk and every control exchange is checked across
ranks before it runs (see :class:`~chainermn_overlap.communication.engine.
Engine`), so a rank that posts a different item, or a round of a different
size, is named instead of reducing unrelated data or hanging.
"""
import threading
import time
from typing import Any, Collection, Mapping, Optional

import numpy

from chainermn_overlap.communication.chunking import DEFAULT_CHUNK_BYTES
from chainermn_overlap.communication.engine import Engine
from chainermn_overlap.communication.engine import Handle

__all__ = ['DEFAULT_CHUNK_BYTES', 'PriorityMpiBackend', 'choose']


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


def choose(unfinished: Collection[int], known_posted: Collection[int],
           priorities: Mapping[int, float]) -> Optional[int]:
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


class PriorityMpiBackend(Engine):
    """Chunked, priority-ordered reductions by a communication thread.

    Args:
        mpi_comm: communicator to duplicate (collective over it).
        chunk_bytes (int): largest chunk reduced in one call; a
            higher-priority item can start at every chunk boundary.
        **options: ``timeout``, ``stall_warning``, ``debug`` and ``comm``,
            as in :class:`~chainermn_overlap.communication.engine.Engine`.
    """

    name = 'mpi_priority'

    def __init__(self, mpi_comm: Any, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 **options: Any) -> None:
        self.chunk_bytes = int(chunk_bytes)
        self._cond = threading.Condition()
        self._rounds = {}
        self._order = []
        # Control exchanges so far; the same count on every rank.
        self.exchanges = 0
        super().__init__(mpi_comm, **options)

    def allreduce(self, array: Any, op: str = 'sum',
                  label: Optional[str] = None, slot: Any = None,
                  priority: float = 0) -> Handle:
        """Posts an in-place allreduce.

        Args:
            slot: ``(round_key, index, n_items)``; items of a round are
                indexed ``0 .. n_items - 1`` and posted in index order on
                every rank.  Without a slot the reduction is a round of its
                own.
            priority: larger runs first among items posted on all ranks.
        """
        return super().allreduce(array, op, label, slot, priority)

    def _enqueue(self, handle, host, op, slot, priority):
        with self._cond:
            if slot is None:
                slot = (('solo', id(handle)), 0, 1)
            key, index, n_items = slot
            rnd = self._rounds.get(key)
            if rnd is None:
                rnd = self._rounds[key] = _Round(key, n_items)
                self._order.append(key)
            item = _Item(index, host, op, priority, handle)
            # A collective of the caller's own (run()) cannot be sliced.
            item.step = (max(1, item.nelems) if callable(op) else
                         max(1, self.chunk_bytes // max(1, host.itemsize)))
            rnd.items[index] = item
            self._cond.notify()

    def _wake(self):
        with self._cond:
            self._cond.notify_all()

    def _serve(self):
        while True:
            with self._cond:
                while not self._order and not self._closed:
                    self._cond.wait()
                if not self._order:
                    return
                rnd = self._rounds[self._order[0]]
            self._serve_round(rnd)
            with self._cond:
                del self._rounds[rnd.key]
                self._order.pop(0)

    def _serve_round(self, rnd):
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
                self._exchange(rnd, posted, flags)
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
                self._complete(item.handle)

    def _exchange(self, rnd, posted, flags):
        """Learns which items every rank has posted (a MIN over flags)."""
        flags[:] = 0
        for i in posted:
            flags[i] = 1
        self.exchanges += 1
        self._reduce(flags, 'min', what='control exchange #{}'.format(
            self.exchanges), label='which of the {} items of a round are '
            'posted'.format(rnd.n_items))
        rnd.known_posted.update(int(i) for i in numpy.nonzero(flags)[0])

    def _run_chunk(self, item):
        h = item.handle
        a, b = item.offset, min(item.offset + item.step, item.nelems)
        # Checked per chunk in debug mode: ranks must agree on the piece.
        label = ('{} [elements {}:{} of {}]'.format(h.label, a, b,
                                                     item.nelems)
                 if self.debug else None)
        attempted = self._attempts()
        t0 = time.perf_counter()
        ok = self._reduce(item.host[a:b], item.op, h, label=label)
        if attempted:
            h.spans.append((t0, time.perf_counter()))
        item.offset = b if ok else item.nelems

