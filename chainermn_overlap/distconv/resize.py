"""Image resizing on global coordinates, and the concatenation of skips.

:func:`resize_images` mirrors :func:`chainer.functions.resize_images`
(bilinear or nearest, both ``align_corners`` settings, any factor, also
non-integer ones). The source coordinate of every output cell is computed
from the *global* sizes with the same arithmetic as Chainer's
``compute_indices_and_weights`` (written here without ``numpy.float``,
which NumPy 1.24 removed and Chainer 7.8.1 still uses), then each process
fetches the input cells its output block reads through the region exchange
and interpolates them with Chainer's weights, in Chainer's order.

:func:`concat` joins tensors of the same grid along the channels (the skip
connections of a U-Net): blocks of tensors of equal global spatial size
are the same boxes, so the local concatenation is exact; where the sizes
differ (a pooled and upsampled map one cell short), it raises on every
process instead of joining misaligned blocks.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence, Tuple, Union

import chainer
from chainer import backend
from chainer import function_node
import chainer.functions as F
import numpy

from chainermn_overlap.distconv import deconvolution
from chainermn_overlap.distconv import exchange
from chainermn_overlap.distconv import functions as conv_functions
from chainermn_overlap.distconv import geometry

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]

__all__ = ['concat', 'resize_images', 'source_indices']

_MODES = ('bilinear', 'nearest')


def source_indices(n_in: int, n_out: int, mode: str,
                   align_corners: bool) -> Tuple[numpy.ndarray, ...]:
    """Chainer's source cells and weights along one axis (pure, numpy).

    Returns:
        tuple: ``(i0, i1, w)``: for each output cell, the two input cells
        it interpolates and the weight of ``i1`` (float64; 0 for
        ``'nearest'``, where ``i1 == i0``).
    """
    if mode == 'bilinear':
        if align_corners:
            v = numpy.linspace(0, n_in - 1, num=n_out, dtype=numpy.float64)
        else:
            v = (numpy.arange(n_out, dtype=numpy.float64) + 0.5) * (
                n_in / n_out) - 0.5
            v = numpy.maximum(v, 0)
        w, v = numpy.modf(v)
        i0 = v.astype(numpy.intp)
        i1 = numpy.minimum(i0 + 1, n_in - 1)
    else:
        i0 = numpy.minimum(numpy.floor(
            numpy.arange(n_out, dtype=numpy.float64) * (n_in / n_out)),
            n_in - 1).astype(numpy.intp)
        i1 = i0
        w = numpy.zeros(n_out)
    return i0, i1, w


@functools.lru_cache(maxsize=256)
def _resize_plan(in_shape, out_shape, grid_shape, mode, align_corners,
                 spatial_rank):
    """``(plan, out_box, in_box, any_halo, axes)``; ``axes`` holds, per
    dimension, this block's ``(i0, i1, w)`` relative to ``in_box``."""
    idx = [source_indices(n, o, mode, align_corners)
           for n, o in zip(in_shape, out_shape)]
    nprocs = geometry.grid_size(grid_shape)
    needed = []
    for r in range(nprocs):
        ob = geometry.block_box(out_shape, grid_shape,
                                geometry.grid_coords(grid_shape, r))
        if geometry.box_is_empty(ob):
            needed.append(tuple((0, 0) for _ in ob))
            continue
        needed.append(tuple(
            (int(i0[lo:hi].min()), int(i1[lo:hi].max()) + 1)
            for (i0, i1, _), (lo, hi) in zip(idx, ob)))
    plan, any_halo = geometry.needed_plan(in_shape, grid_shape, needed,
                                          spatial_rank)
    out_box = geometry.block_box(out_shape, grid_shape,
                                 geometry.grid_coords(grid_shape,
                                                      spatial_rank))
    in_box = needed[spatial_rank]
    axes = tuple((i0[lo:hi] - ib[0], i1[lo:hi] - ib[0], w[lo:hi])
                 for (i0, i1, w), (lo, hi), ib in zip(idx, out_box, in_box))
    return plan, out_box, in_box, any_halo, axes


def _weights(axes, dtype):
    """Chainer's four corner weights ``(2, 2, h, w)`` in its order."""
    (_, _, vw), (_, _, uw) = axes
    vw = vw.astype(dtype)[:, None]
    uw = uw.astype(dtype)[None, :]
    wcol = numpy.empty((2, 2, vw.shape[0], uw.shape[1]), dtype=dtype)
    wcol[0, 1] = uw
    numpy.subtract(1, wcol[0, 1], out=wcol[0, 0])
    numpy.multiply(wcol[0], vw, out=wcol[1])
    wcol[0] -= wcol[1]
    return wcol


class LocalResize(function_node.FunctionNode):
    """Bilinear interpolation of a box with precomputed local indices.

    Args:
        axes (tuple): Per dimension ``(i0, i1, w)`` into the input box.
    """

    def __init__(self, axes):
        self.axes = axes

    def forward(self, inputs):
        x, = inputs
        self._in_shape = x.shape
        xp = backend.get_array_module(x)
        (v0, v1, _), (u0, u1, _) = self.axes
        wcol = xp.asarray(_weights(self.axes, x.dtype))
        vcol = xp.asarray(numpy.stack([v0, v1]))
        ucol = xp.asarray(numpy.stack([u0, u1]))
        b, c = x.shape[:2]
        h, w = wcol.shape[2:]
        panel = x[:, :, vcol[:, None, :, None], ucol[None, :, None, :]]
        y = xp.einsum('ijk,jk->ik', panel.reshape(b * c, 4, h * w),
                      wcol.reshape(4, h * w))
        return y.reshape(b, c, h, w).astype(x.dtype, copy=False),

    def backward(self, indexes, grad_outputs):
        return LocalResizeGrad(self.axes, self._in_shape).apply(grad_outputs)


class LocalResizeGrad(function_node.FunctionNode):
    """Adjoint of :class:`LocalResize`: scatter-adds into the input box."""

    def __init__(self, axes, in_shape):
        self.axes = axes
        self.in_shape = in_shape

    def forward(self, inputs):
        gy, = inputs
        xp = backend.get_array_module(gy)
        (v0, v1, _), (u0, u1, _) = self.axes
        b, c, hin, win = self.in_shape
        h, w = gy.shape[2:]
        wcol = _weights(self.axes, gy.dtype)
        gycol = gy.reshape(b * c, 1, 1, h, w) * xp.asarray(wcol)
        vcol = numpy.stack([v0, v1])[:, :, None]
        ucol = numpy.stack([u0, u1])[:, None, :]
        cells = (vcol[:, None] * win + ucol[None, :])  # (2, 2, h, w)
        offsets = numpy.arange(0, b * c * hin * win, hin * win)
        flat = xp.asarray((offsets[:, None] + cells.ravel()).ravel())
        if xp is numpy:
            gx = numpy.bincount(flat, weights=gycol.ravel(),
                                minlength=b * c * hin * win)
        else:
            import cupyx  # only with a GPU array
            gx = xp.zeros(b * c * hin * win, dtype=gy.dtype)
            cupyx.scatter_add(gx, flat, gycol.ravel())
        return gx.astype(gy.dtype, copy=False).reshape(self.in_shape),

    def backward(self, indexes, grad_outputs):
        return LocalResize(self.axes).apply(grad_outputs)


def resize_images(grid: SpatialGrid, x: Input, output_shape: Sequence[int],
                  mode: str = 'bilinear',
                  align_corners: bool = True) -> chainer.Variable:
    """Spatially distributed :func:`chainer.functions.resize_images`.

    Args:
        grid (SpatialGrid): A 2-D process grid.
        x: This process's block ``(N, C, h, w)`` (float32, as Chainer).
        output_shape (tuple of int): The *global* ``(h_O, w_O)``.
        mode (str): ``'bilinear'`` or ``'nearest'``.
        align_corners (bool): As in Chainer (``'nearest'`` ignores it).

    Returns:
        chainer.Variable: This process's block of the resized images.
    """
    layer = 'distconv.resize_images'
    conv_functions._check_grid_ndim(grid, 2, layer)
    x = chainer.as_variable(x)
    sig = (layer, repr(output_shape), repr(mode), bool(align_corners))
    layout = grid.check_spatial(x, layer, sig)
    if mode not in _MODES:
        raise ValueError("%s: mode must be 'bilinear' or 'nearest', got %r"
                         % (layer, mode))
    out_shape = conv_functions._ntuple(output_shape, 2, 'output_shape',
                                       layer, 1)
    in_shape = tuple(layout.spatial_shape)
    if min(in_shape) < 1:
        raise ValueError('%s: the global input %r is empty; there is '
                         'nothing to interpolate.' % (layer, in_shape))
    plan, out_box, in_box, any_halo, axes = _resize_plan(
        in_shape, out_shape, grid.shape, mode, bool(align_corners),
        grid.spatial_rank)
    if grid.spatial_size == 1:
        grid.stats['exchange_none'] += 1
        x_in = x
    else:
        x_in = deconvolution.fetch_box(grid, x, plan, any_halo)
    shape = x.shape[:2] + geometry.box_shape(out_box)
    if numpy.prod(shape) == 0:
        return exchange.ZeroBlock(shape).apply((x_in,))[0]
    return LocalResize(axes).apply((x_in,))[0]


def concat(grid: SpatialGrid, xs: Sequence[Input],
           axis: int = 1) -> chainer.Variable:
    """Concatenates tensors of the grid along the channel axis.

    The skip connection of a U-Net: ``xs`` are this process's blocks of
    tensors with the same global spatial size, hence the same boxes, and
    their local concatenation is this process's block of the global one.
    Collective (each input's layout is checked).

    Args:
        grid (SpatialGrid): The process grid.
        xs (list): This process's blocks ``(N, C_i, *block)``.
        axis (int): Must be 1 (channels): the spatial axes are distributed.

    Returns:
        chainer.Variable: ``(N, sum C_i, *block)``.

    Raises:
        ValueError: On every process, if the global spatial sizes (or the
            samples) differ between the inputs, naming them and the fix.
    """
    layer = 'distconv.concat'
    xs = list(xs)
    if not xs:
        raise ValueError('%s: needs at least one input.' % layer)
    layouts = [grid.check_spatial(x, '%s (input %d)' % (layer, i),
                                  (layer, len(xs), repr(axis)))
               for i, x in enumerate(xs)]
    if axis != 1:
        raise ValueError(
            '%s: axis must be 1 (channels), got %r: the spatial axes are '
            'split over the grid. Concatenate along the channels, or gather '
            'the tensors first.' % (layer, axis))
    first = layouts[0]
    for i, lay in enumerate(layouts[1:], 1):
        if tuple(lay.spatial_shape) != tuple(first.spatial_shape) or \
                list(lay.group_samples) != list(first.group_samples):
            raise ValueError(
                '%s: input %d has global spatial size %r (samples per group '
                '%r) but input 0 has %r (%r), so their blocks are different '
                'boxes and joining them would misalign cells. Make the '
                'decoder tensor the size of the encoder tensor it joins, '
                'e.g. outsize= of the up-convolution or output_shape= of '
                'resize_images.'
                % (layer, i, tuple(lay.spatial_shape), lay.group_samples,
                   tuple(first.spatial_shape), first.group_samples))
    return F.concat(xs, axis=1)
