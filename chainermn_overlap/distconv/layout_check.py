"""The collective layout check, its cache, and the fingerprint agreement.

The first time a layer sees an input geometry, the processes allgather
their local shapes (a few integers) and :mod:`.layout` derives the global
layout from them, so wrong inputs raise the same :class:`ValueError` on
every rank instead of hanging. The result is cached per local geometry;
later calls only agree on a 64-bit fingerprint of the cached layout with
one tiny allreduce, and fall back to the full check on every rank as soon
as any rank misses its cache or disagrees (so the guarantee holds, at a
fraction of the cost).
"""
from __future__ import annotations

import collections
import hashlib
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, Union

import chainer
import numpy
from mpi4py import MPI

from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import blocking
from chainermn_overlap.distconv import layout as layout_mod

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.topology import GridTopology

    Input = Union[chainer.Variable, NdArray]

__all__ = ['CHECK_MODES', 'LayoutCheck', 'check_mode', 'fingerprint']

CHECK_MODES = ('cached', 'always')
# Bounds the cache for workloads with ever new geometries.
_CACHE_SIZE = 4096


def check_mode(check: str) -> str:
    """``check`` if it is a valid mode, else a ValueError naming them."""
    if check not in CHECK_MODES:
        raise ValueError(
            "distconv.SpatialGrid: check must be 'cached' or 'always', "
            'got %r' % (check,))
    return check


def fingerprint(kind: Any, summary: Any, dtype: str, signature: Any) -> int:
    """62-bit fingerprint of a global layout (the negated value fits in
    int64, which the agreement needs)."""
    digest = hashlib.blake2b(repr((kind, summary, dtype, signature)).encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, 'little') >> 2


def _array(x):
    return x.array if isinstance(x, chainer.Variable) else x


class LayoutCheck(object):
    """Layout checks of one grid: full (allgather) or cached (allreduce).

    Args:
        topology (GridTopology): The grid's topology.
        mpi_comm: The grid's private world communicator.
        stats (collections.Counter): Counts ``validate_full`` and
            ``validate_cached`` (shared with the grid's other counters).
        mode (str): ``'cached'`` or ``'always'`` (see
            :class:`~chainermn_overlap.distconv.grid.SpatialGrid`).
    """

    def __init__(self, topology: GridTopology, mpi_comm: Any,
                 stats: collections.Counter, mode: str = 'cached') -> None:
        self.topology = topology
        self.mpi_comm = mpi_comm
        self.stats = stats
        self.mode = check_mode(mode)
        self._cache = {}

    def gather_info(self, x: Input, signature: tuple) -> List[tuple]:
        """Every rank's ``(shape, dtype, signature)`` (collective)."""
        arr = _array(x)
        info = (tuple(int(s) for s in arr.shape), str(arr.dtype), signature)
        return _mpi_json.allgather_json(self.mpi_comm, info, tuples=True)

    def spatial(self, x: Input, layer: str, signature: tuple = (),
                channel_split: Optional[bool] = None
                ) -> layout_mod.Layout:
        """See :meth:`SpatialGrid.check_spatial`."""
        def full(x, layer, sig):
            return layout_mod.spatial_layout(
                self.topology, self.gather_info(x, sig), layer,
                channel_split)
        return self.cached(('spatial', channel_split), x, layer, signature,
                           full)

    def samples(self, x: Input, layer: str, signature: tuple = ()
                ) -> Tuple[Tuple[int, ...], List[int]]:
        """See :meth:`SpatialGrid.check_samples`."""
        def full(x, layer, sig):
            return layout_mod.samples_layout(
                self.topology, self.gather_info(x, sig), layer)
        return self.cached('samples', x, layer, signature, full)

    def cached(self, kind: Any, x: Input, layer: str, signature: tuple,
               full: Callable) -> Any:
        """Runs ``full`` unless every rank has this geometry validated.

        The decision is collective: one allreduce (MAX) of ``[miss,
        fingerprint, -fingerprint]`` tells every rank whether all ranks hit
        their cache with the same fingerprint; otherwise all of them run the
        full check (which raises the same error everywhere on bad input).
        ``full(x, layer, signature)`` returns ``(result, summary)``, where
        ``summary`` describes the global layout identically on every rank
        (it is fingerprinted). A local cache hit alone is not enough: the
        same local block can belong to different global layouts, and a rank
        that skipped the check while another ran it would hang in the
        allgather.
        """
        arr = _array(x)
        key = (kind, tuple(arr.shape), arr.dtype.str, signature)
        if self.mode == 'cached':
            try:
                hit = self._cache.get(key)
            except TypeError:  # an unhashable signature: never cached
                hit, key = None, None
            vote = numpy.array([0, 0, 0], dtype=numpy.int64)
            if hit is None:
                vote[0] = 1
            else:
                vote[1], vote[2] = hit[1], -hit[1]
            agreed = numpy.empty_like(vote)
            blocking.allreduce(self.mpi_comm, [vote, MPI.INT64_T],
                               [agreed, MPI.INT64_T], MPI.MAX,
                               'the vote of a distconv layout check')
            if agreed[0] == 0 and agreed[1] == -agreed[2]:
                self.stats['validate_cached'] += 1
                return hit[0]
        self.stats['validate_full'] += 1
        result, summary = full(x, layer, signature)
        if self.mode == 'cached' and key is not None:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = (result, fingerprint(
                kind, summary, arr.dtype.str, signature))
        return result
