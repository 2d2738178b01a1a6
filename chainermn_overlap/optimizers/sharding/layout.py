"""Which elements of each bucket a rank owns: pure functions of the plan.

A bucket's flat buffer (its parameters one after the other, see
:mod:`chainermn_overlap.communication.buckets`) is cut into one contiguous
piece per rank, in rank order, so that one ``Reduce_scatter`` hands each
rank the mean of its piece and one ``Allgatherv`` rebuilds the whole.  Two
ways to cut:

* ``'element'``: every bucket is split evenly (pieces differ by at most one
  element; which ranks get the extra element rotates with the bucket, so
  over a model the ranks hold the same number of elements within one
  element per bucket).  A piece may end inside a parameter: the update rule
  then runs on that parameter's slice, which gives the same bits as on the
  whole array only for element-wise rules (:mod:`.rules` checks).
* ``'parameter'``: cuts fall on parameter boundaries (each parameter has
  one owner), balanced greedily over the whole model, so any update rule
  works; ranks then differ by up to one parameter.
* ``'auto'``: as ``'element'``, except that a cut falling inside a
  parameter that must stay whole (its rule or a hook of its rule is not
  known to be element-wise, :func:`.rules.whole_reason`) moves to that
  parameter's nearer end: it has one owner, which updates it whole, and
  the other parameters are cut as with ``'element'``.

Rank 0 computes the cuts with the bucket plan and broadcasts them with it,
so every rank uses the same layout by construction.
"""
from typing import List, Optional, Sequence, Tuple

import numpy

from chainermn_overlap.communication import buckets as buckets_module

__all__ = ['SHARD_UNITS', 'ShardedBucket', 'bounds_from_counts', 'element_counts',
           'keep_whole', 'owned_range', 'parameter_counts', 'plan_counts']

SHARD_UNITS = ('auto', 'element', 'parameter')


def element_counts(nelems: int, size: int, rotate: int = 0) -> List[int]:
    """Even piece sizes of a bucket of ``nelems`` over ``size`` ranks.

    The ``nelems % size`` extra elements go to ranks ``rotate``,
    ``rotate + 1``, ... (modulo ``size``).
    """
    base, extra = divmod(int(nelems), size)
    return [base + (1 if (r - rotate) % size < extra else 0)
            for r in range(size)]


def parameter_counts(sizes: Sequence[int], size: int,
                     loads: Sequence[int]) -> List[int]:
    """Piece sizes of a bucket cut on parameter boundaries.

    Args:
        sizes: element counts of the bucket's parameters, in bucket order.
        size (int): number of ranks.
        loads: elements each rank already owns in earlier buckets; the cut
            evens out the running totals.

    Returns:
        list: elements of the bucket owned by each rank (whole parameters,
        contiguous in rank order).
    """
    counts = [0] * size
    r = 0
    for n in sizes:
        # The least loaded rank from the current one on (pieces stay in
        # rank order; ranks skipped own nothing of this bucket).
        r = min(range(r, size), key=lambda q: (loads[q] + counts[q], q))
        counts[r] += n
    return counts


def keep_whole(counts: Sequence[int], sizes: Sequence[int],
               whole: Sequence[bool]) -> List[int]:
    """Piece sizes with no cut inside a parameter marked ``whole``.

    Each cut of ``counts`` that falls strictly inside such a parameter
    moves to its nearer end (its start on a tie).  Moving cuts this way
    keeps them in order, so pieces stay contiguous in rank order; a piece
    may become empty.

    Args:
        counts: piece sizes of the bucket, one per rank.
        sizes: element counts of the bucket's parameters, in bucket order.
        whole: for each parameter, whether it must have one owner.
    """
    spans, off = [], 0
    for n, w in zip(sizes, whole):
        if w:
            spans.append((off, off + n))
        off += n
    cuts, even = [], 0
    for c in counts[:-1]:
        even += c
        at = even
        for start, stop in spans:
            if start < at < stop:
                at = start if at - start <= stop - at else stop
                break
        cuts.append(at)
    ends = cuts + [sum(counts)]
    return [b - a for a, b in zip([0] + cuts, ends)]


def plan_counts(buckets: Sequence[Sequence[int]], size: int,
                unit: str = 'element',
                whole: Optional[Sequence[Sequence[bool]]] = None
                ) -> List[List[int]]:
    """Piece sizes of every bucket.

    Args:
        buckets: each bucket's member sizes.
        size (int): number of ranks.
        unit (str): one of :data:`SHARD_UNITS`.
        whole: with ``'auto'``, for each bucket, whether each member must
            have one owner (None: none must).
    """
    if unit not in SHARD_UNITS:
        raise ValueError("shard_unit must be 'auto', 'element' or "
                         "'parameter', got {!r}".format(unit))
    loads = [0] * size
    out = []
    for b, sizes in enumerate(buckets):
        if unit == 'parameter':
            counts = parameter_counts(sizes, size, loads)
        else:
            counts = element_counts(sum(sizes), size, rotate=b)
            if unit == 'auto' and whole is not None and any(whole[b]):
                counts = keep_whole(counts, sizes, whole[b])
        loads = [a + c for a, c in zip(loads, counts)]
        out.append(counts)
    return out


def bounds_from_counts(counts: Sequence[int]) -> List[Tuple[int, int]]:
    """``(start, stop)`` of each rank's piece in the bucket."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def owned_range(offset: int, size: int, start: int, stop: int
                ) -> Tuple[int, int, int]:
    """The part of a parameter a rank owns.

    Args:
        offset, size: the parameter's place in its bucket.
        start, stop: the rank's piece of the bucket.

    Returns:
        ``(lo, hi, at)``: elements ``lo:hi`` of the flattened parameter,
        found at ``at`` in the rank's piece; ``lo == hi`` when it owns
        none of it.
    """
    a = max(offset, start)
    b = min(offset + size, stop)
    if b <= a:
        return 0, 0, 0
    return a - offset, b - offset, a - start


class ShardedBucket(buckets_module.Bucket):
    """A bucket cut between ranks: each rank owns one piece of it.

    Args:
        index, plan, params: as :class:`~.buckets.Bucket`.
        counts: elements of the bucket each rank owns, in rank order
            (rank 0's plan, broadcast).
        param_dtype: the dtype of every parameter of the bucket (the
            update runs in it; the wire may be another).

    Besides the bucket's own state, two fields the communication thread
    writes (``communication/engine.py`` says when): ``shard_grad``, this
    rank's piece of the mean once the bucket's reduce-scatter ran, and
    ``update_handle``, the handle of the bucket's update and gather.
    """

    def __init__(self, index, plan, params, counts, param_dtype):
        super().__init__(index, plan, params)
        self.shard_counts = tuple(int(c) for c in counts)
        self.bounds = bounds_from_counts(self.shard_counts)
        self.param_dtype = numpy.dtype(param_dtype)
        self.shard_grad = None
        self.update_handle = None

    def in_flight(self):
        h = self.update_handle
        return super().in_flight() or (h is not None and not h.done())
