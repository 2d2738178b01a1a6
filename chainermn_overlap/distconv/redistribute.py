"""Redistribution between spatial layout, sample layout and replication.

*Spatial layout*: every process of a sample group holds all of the group's
``N_group`` samples, restricted to its spatial block.

*Sample layout*: every process holds whole samples (full spatial extent) for
its share of the group's samples; by default the balanced split
(:func:`geometry.block_range`) of ``N_group`` over the group's processes.
Layers that need whole samples (fully connected, softmax, per-sample losses)
run in sample layout as in plain data parallelism.

Both directions are one all-to-all of contiguous blocks by non-blocking
point-to-point messages inside the sample group; each is the other's
inverse and adjoint (it is a permutation of cells). All receives are posted
first, then the sends; the local piece is copied while the others are in
flight, and each received piece is unpacked as soon as it arrives. Pieces
without cells are not sent. Memory per process stays proportional to its
share of the group's data.

:func:`to_replicated` hands a spatial layout to a grid with a channel axis:
every process of the sample group receives the group's whole samples (an
allgather; its adjoint sums the copies' gradients and keeps the block).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union

import chainer
from chainer import backend
from chainer import function_node
import numpy
from mpi4py import MPI

from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import blocking
from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import _pack
from chainermn_overlap.distconv import geometry

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]

__all__ = ['BlockOfSummedCopies', 'LayoutShuffle', 'ReplicateSamples',
           'sample_share', 'to_replicated', 'to_sample_layout',
           'to_spatial_layout']


class LayoutShuffle(function_node.FunctionNode):
    """Moves a tensor between spatial and sample layout.

    Args:
        grid (SpatialGrid): The process grid.
        spatial_shape (tuple of int): Global spatial extent.
        counts (list of int): Samples of each spatial rank in sample layout.
        to_samples (bool): Direction; spatial -> sample layout if True.
    """

    def __init__(self, grid: SpatialGrid, spatial_shape: Sequence[int],
                 counts: Sequence[int], to_samples: bool) -> None:
        self.grid = grid
        self.spatial_shape = tuple(spatial_shape)
        self.counts = list(counts)
        self.to_samples = to_samples
        self.offsets = [sum(self.counts[:s]) for s in range(len(counts) + 1)]

    def _box(self, s):
        return geometry.block_box(self.spatial_shape, self.grid.shape,
                                  geometry.grid_coords(self.grid.shape, s))

    def _samples(self, s):
        return slice(self.offsets[s], self.offsets[s + 1])

    def _plan(self, c):
        """Messages of one shuffle: ``(sends, recvs, place, local)``.

        ``sends``: ``(peer, selection of the input)``; ``recvs``:
        ``(peer, shape)``; ``place[i]``: where receive ``i`` lands in the
        output; ``local``: ``(selection of the input, selection of the
        output)`` of the piece that stays on this process. Both ends of a
        message derive its shape from the same counts and boxes, so pieces
        with no cell (a rank with no sample, an empty block) are skipped on
        both ends alike.
        """
        me = self.grid.spatial_rank
        P = self.grid.spatial_size
        every = (slice(None), slice(None))
        sp = lambda box: tuple(slice(a, b) for a, b in box)  # NOQA
        my_box = self._box(me)
        my_cells = int(numpy.prod(geometry.box_shape(my_box)))
        # Peers in a shifted order (me+1, me+2, ...; receives from me-1,
        # me-2, ...), so that the first messages of all ranks do not all
        # go to the same rank.
        to = [(me + k) % P for k in range(1, P)]
        frm = [(me - k) % P for k in range(1, P)]
        if self.to_samples:
            # I hold all group samples of my block; rank s gets its samples.
            sends = [(s, self._samples(s)) for s in to
                     if self.counts[s] * c * my_cells]
            recvs = [(s, (self.counts[me], c)
                      + geometry.box_shape(self._box(s))) for s in frm]
            place = [every + sp(self._box(s)) for s, _ in recvs]
            local = (self._samples(me), every + sp(my_box))
        else:
            # I hold whole samples; rank s gets their part in its block.
            n_mine = self.counts[me]
            sends = [(s, every + sp(self._box(s))) for s in to
                     if n_mine * c * int(numpy.prod(
                         geometry.box_shape(self._box(s))))]
            recvs = [(s, (self.counts[s], c) + geometry.box_shape(my_box))
                     for s in frm]
            place = [self._samples(s) for s, _ in recvs]
            local = (every + sp(my_box), self._samples(me))
        keep = [i for i, (_, shape) in enumerate(recvs)
                if int(numpy.prod(shape))]
        return (sends, [recvs[i] for i in keep], [place[i] for i in keep],
                local)

    def forward(self, inputs):
        x, = inputs
        xp = backend.get_array_module(x)
        c = x.shape[1]
        me = self.grid.spatial_rank
        if self.to_samples:
            shape = (self.counts[me], c) + self.spatial_shape
        else:
            shape = (self.offsets[-1], c) + geometry.box_shape(
                self._box(me))
        out = xp.empty(shape, dtype=x.dtype)
        sends, recvs, place, (src, dst) = self._plan(c)
        # Every receive is posted before the first send; each send is
        # packed just before it is posted (a generator), so the first
        # messages travel while the later ones are packed.
        pending = _comm.post_exchange(
            self.grid.mpi_spatial,
            ((peer, _pack.message(xp, x, _pack.region_of(sel, x.shape)))
             for peer, sel in sends), recvs, x)
        # The local piece is copied while the remote ones are in flight.
        out[dst] = x[src]
        # Each piece is unpacked as soon as it has arrived.
        for i, buf in pending.arrivals():
            _pack.unpack(xp, buf, out, [_pack.region_of(place[i],
                                                        out.shape)])
        return out,

    def backward(self, indexes, grad_outputs):
        return LayoutShuffle(self.grid, self.spatial_shape, self.counts,
                             not self.to_samples).apply(grad_outputs)


def to_sample_layout(grid: SpatialGrid, x: Input) -> chainer.Variable:
    """Spatial layout -> sample layout (whole samples per process).

    Args:
        grid (SpatialGrid): The process grid.
        x: This process's block ``(N_group, C, *block)``.

    Returns:
        chainer.Variable: ``(n, C, *global_spatial)`` holding this process's
        balanced share ``sample_share(grid, N_group)`` of the group's samples.
    """
    layer = 'distconv.to_sample_layout'
    x = chainer.as_variable(x)
    layout = grid.check_spatial(x, layer, (layer,))
    n = layout.group_samples[grid.group]
    counts = geometry.block_sizes(n, grid.spatial_size)
    return LayoutShuffle(grid, layout.spatial_shape, counts, True).apply(
        (x,))[0]


def to_spatial_layout(grid: SpatialGrid, x: Input) -> chainer.Variable:
    """Sample layout -> spatial layout (inverse of :func:`to_sample_layout`).

    Any number of whole samples per process is accepted; the group's samples
    are ordered by spatial rank.

    Args:
        grid (SpatialGrid): The process grid.
        x: Whole samples ``(n, C, *global_spatial)`` on this process.

    Returns:
        chainer.Variable: ``(N_group, C, *block)``.
    """
    layer = 'distconv.to_spatial_layout'
    x = chainer.as_variable(x)
    spatial_shape, counts = grid.check_samples(x, layer, (layer,))
    return LayoutShuffle(grid, spatial_shape, counts, False).apply((x,))[0]


def sample_share(grid: SpatialGrid, n_group: int) -> geometry.Interval:
    """Samples ``[lo, hi)`` of a group's ``n_group`` samples that this
    process holds in sample layout."""
    return geometry.block_range(n_group, grid.spatial_size, grid.spatial_rank)


def _box_region(grid, whole, s):
    """The region of spatial rank ``s``'s block in a whole-sample array."""
    box = geometry.block_box(whole.shape[2:], grid.shape,
                             geometry.grid_coords(grid.shape, s))
    return _pack.region_of((Ellipsis,) + tuple(slice(a, b) for a, b in box),
                           whole.shape)


class ReplicateSamples(function_node.FunctionNode):
    """Spatial layout -> the group's whole samples on each of its processes.

    Forward: an allgather of the spatial blocks inside the sample group;
    every process of the group then holds the same ``(N_group, C,
    *spatial)`` (a replicated tensor, e.g. the input of a grid with a
    channel axis whose sample groups are the same processes). Its gradient
    arrives as per-copy contributions; the exact adjoint
    (:class:`BlockOfSummedCopies`) sums them and keeps this process's
    block.

    Args:
        grid (SpatialGrid): The process grid of the spatial layout.
        spatial_shape (tuple of int): Global spatial extent.
    """

    def __init__(self, grid: SpatialGrid,
                 spatial_shape: Sequence[int]) -> None:
        self.grid = grid
        self.spatial_shape = tuple(spatial_shape)

    def forward(self, inputs):
        x, = inputs
        parts = _mpi_json.allgather_arrays(self.grid.mpi_spatial,
                                           _comm.to_host(x))
        out = numpy.empty(x.shape[:2] + self.spatial_shape, dtype=x.dtype)
        for s, part in enumerate(parts):
            _pack.unpack(numpy, part, out, [_box_region(self.grid, out, s)])
        self._meta = (out.shape, out.dtype, backend.get_array_module(x))
        return _comm.like(out, x),

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        if gy is None:  # every process of the group must join
            shape, dtype, xp = self._meta
            gy = chainer.Variable(xp.zeros(shape, dtype=dtype))
        return BlockOfSummedCopies(self.grid, self.spatial_shape).apply(
            (gy,))


class BlockOfSummedCopies(function_node.FunctionNode):
    """Sum of the group's copies, this process's spatial block.

    The adjoint of :class:`ReplicateSamples` (and vice versa).
    """

    def __init__(self, grid: SpatialGrid,
                 spatial_shape: Sequence[int]) -> None:
        self.grid = grid
        self.spatial_shape = tuple(spatial_shape)

    def forward(self, inputs):
        g, = inputs
        host = _comm.to_host(g)
        summed = numpy.empty_like(host)
        blocking.allreduce(self.grid.mpi_spatial, host, summed, MPI.SUM,
                           'a distconv sum over samples', poll=True)
        region = _box_region(self.grid, summed, self.grid.spatial_rank)
        return _comm.like(_pack.message(numpy, summed, region), g),

    def backward(self, indexes, grad_outputs):
        return ReplicateSamples(self.grid, self.spatial_shape).apply(
            grad_outputs)


def to_replicated(grid: SpatialGrid, x: Input) -> chainer.Variable:
    """Spatial layout -> the group's whole samples on each of its processes.

    For handing a spatially split stage over to a grid whose sample groups
    are the same processes and whose spatial grid is ``(1, ..., 1)``, e.g.
    ``SpatialGrid(comm, (1, 1), channels=prod(grid.shape))`` for
    filter/channel-parallel late stages: its layers take whole channels
    held the same on every channel coordinate, which is what this returns.
    Collective over the sample group.

    Args:
        grid (SpatialGrid): The grid of the spatial layout.
        x: This process's block ``(N_group, C, *block)``.

    Returns:
        chainer.Variable: ``(N_group, C, *spatial)``, the same on every
        process of the group.
    """
    layer = 'distconv.to_replicated'
    x = chainer.as_variable(x)
    layout = grid.check_spatial(x, layer, (layer,))
    return ReplicateSamples(grid, layout.spatial_shape).apply((x,))[0]
