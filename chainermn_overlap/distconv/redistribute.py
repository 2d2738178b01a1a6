"""Redistribution between spatial layout and sample layout.

*Spatial layout*: every process of a sample group holds all of the group's
``N_group`` samples, restricted to its spatial block.

*Sample layout*: every process holds whole samples (full spatial extent) for
its share of the group's samples; by default the balanced split
(:func:`geometry.block_range`) of ``N_group`` over the group's processes.
Layers that need whole samples (fully connected, softmax, per-sample losses)
run in sample layout as in plain data parallelism.

Both directions are one all-to-all of contiguous blocks by non-blocking
point-to-point messages inside the sample group; each is the other's
inverse and adjoint (it is a permutation of cells). Memory per process stays
proportional to its share of the group's data.
"""
import chainer
from chainer import backend
from chainer import function_node

from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import geometry


class LayoutShuffle(function_node.FunctionNode):
    """Moves a tensor between spatial and sample layout.

    Args:
        grid (SpatialGrid): The process grid.
        spatial_shape (tuple of int): Global spatial extent.
        counts (list of int): Samples of each spatial rank in sample layout.
        to_samples (bool): Direction; spatial -> sample layout if True.
    """

    def __init__(self, grid, spatial_shape, counts, to_samples):
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

    def forward(self, inputs):
        x, = inputs
        xp = backend.get_array_module(x)
        me = self.grid.spatial_rank
        P = self.grid.spatial_size
        c = x.shape[1]
        my_box = self._box(me)
        sp = lambda box: tuple(slice(a, b) for a, b in box)  # NOQA
        if self.to_samples:
            # I hold all group samples of my block; rank s gets its samples.
            out = xp.empty((self.counts[me], c) + self.spatial_shape,
                           dtype=x.dtype)
            sends = [(s, xp.ascontiguousarray(x[self._samples(s)]))
                     for s in range(P) if s != me]
            recvs = [(s, (self.counts[me], c)
                      + geometry.box_shape(self._box(s)))
                     for s in range(P) if s != me]
            out[(slice(None), slice(None)) + sp(my_box)] = \
                x[self._samples(me)]
            got = _comm.exchange(self.grid.mpi_spatial, sends, recvs, x)
            for (s, _), buf in zip(recvs, got):
                out[(slice(None), slice(None)) + sp(self._box(s))] = buf
        else:
            # I hold whole samples; rank s gets their part in its block.
            n = self.offsets[-1]
            out = xp.empty((n, c) + geometry.box_shape(my_box),
                           dtype=x.dtype)
            sends = [(s, xp.ascontiguousarray(
                x[(slice(None), slice(None)) + sp(self._box(s))]))
                for s in range(P) if s != me]
            recvs = [(s, (self.counts[s], c) + geometry.box_shape(my_box))
                     for s in range(P) if s != me]
            out[self._samples(me)] = x[(slice(None), slice(None))
                                       + sp(my_box)]
            got = _comm.exchange(self.grid.mpi_spatial, sends, recvs, x)
            for (s, _), buf in zip(recvs, got):
                out[self._samples(s)] = buf
        return out,

    def backward(self, indexes, grad_outputs):
        return LayoutShuffle(self.grid, self.spatial_shape, self.counts,
                             not self.to_samples).apply(grad_outputs)


def to_sample_layout(grid, x):
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


def to_spatial_layout(grid, x):
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


def sample_share(grid, n_group):
    """Samples ``[lo, hi)`` of a group's ``n_group`` samples that this
    process holds in sample layout."""
    return geometry.block_range(n_group, grid.spatial_size, grid.spatial_rank)
