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

Rank 0 computes the cuts with the bucket plan and broadcasts them with it,
so every rank uses the same layout by construction.
"""
from typing import List, Sequence, Tuple

__all__ = ['SHARD_UNITS', 'bounds_from_counts', 'element_counts',
           'owned_range', 'parameter_counts', 'plan_counts']

SHARD_UNITS = ('element', 'parameter')


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


def plan_counts(buckets: Sequence[Sequence[int]], size: int,
                unit: str = 'element') -> List[List[int]]:
    """Piece sizes of every bucket (``buckets``: each one's member sizes)."""
    if unit not in SHARD_UNITS:
        raise ValueError("shard_unit must be 'element' or 'parameter', got "
                         '{!r}'.format(unit))
    loads = [0] * size
    out = []
    for b, sizes in enumerate(buckets):
        if unit == 'element':
            counts = element_counts(sum(sizes), size, rotate=b)
        else:
            counts = parameter_counts(sizes, size, loads)
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
