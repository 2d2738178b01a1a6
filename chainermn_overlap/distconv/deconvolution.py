"""Spatially distributed transposed convolution and unpooling.

A transposed convolution is the adjoint of a convolution: input cell ``i``
adds ``W[j] * x[i]`` to output ``i * stride - pad + j * dilate``. Each
process owns the balanced block of the *output* and derives, from the
global geometry, the input cells that add to it
(:func:`~chainermn_overlap.distconv.geometry.deconv_input_interval`); the
ones it does not own come from their owners through the region exchange
used by the convolutions (any width, corners, several owners). The
single-process Chainer function then runs *unpadded* on that input box:
its output covers a global interval that contains every contribution to
the block (and partial sums of cells outside it, which are cut off), so
every output cell of the block receives exactly the contributions, in the
same kernel order, that single-process Chainer gives it. ``outsize``
cells that no input reaches are zeros (plus the bias), as in Chainer.
Where no process needs a cell it does not own (``ksize == stride``,
``pad == 0`` on evenly divisible sizes) nothing is exchanged.

Unpooling is the same with a window of ones (Chainer's
:func:`~chainer.functions.unpooling_nd` on the box).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import chainer
from chainer import backend
from chainer import function_node
import chainer.functions as F
import numpy

from chainermn_overlap.distconv import exchange
from chainermn_overlap.distconv import functions as conv_functions
from chainermn_overlap.distconv import geometry
from chainermn_overlap.distconv import window_ops

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]
    IntOrTuple = Union[int, Sequence[int]]

__all__ = ['deconvolution_2d', 'deconvolution_nd', 'unpooling_2d',
           'unpooling_nd']

_ntuple = conv_functions._ntuple


class Reframe(function_node.FunctionNode):
    """Moves an array from one global box to another (crop and zero-fill).

    The output covers ``dst``; cells of ``dst`` inside ``src`` hold the
    input's values, the others zeros. Its adjoint is the reverse move.

    Args:
        src (tuple): Global box of the input's spatial cells.
        dst (tuple): Global box of the output's spatial cells.
    """

    def __init__(self, src, dst):
        self.src = tuple(src)
        self.dst = tuple(dst)

    def forward(self, inputs):
        y, = inputs
        xp = backend.get_array_module(y)
        out = xp.zeros(y.shape[:2] + geometry.box_shape(self.dst),
                       dtype=y.dtype)
        part = geometry.intersect(self.src, self.dst)
        if not geometry.box_is_empty(part):
            out[(Ellipsis,) + geometry.box_slices(
                part, [iv[0] for iv in self.dst])] = y[
                    (Ellipsis,) + geometry.box_slices(
                        part, [iv[0] for iv in self.src])]
        return out,

    def backward(self, indexes, grad_outputs):
        return Reframe(self.dst, self.src).apply(grad_outputs)


def _out_shape(layer, in_shape, ksize, stride, pad, dilate, outsize,
               cover_all):
    """The global output extent, ``outsize`` checked as Chainer does."""
    ndim = len(in_shape)
    if outsize is not None and not isinstance(outsize, (int, numpy.integer)) \
            and all(o is None for o in outsize):
        outsize = None  # Chainer's links store (None, None) for 'none'
    if outsize is None:
        out = tuple(geometry.deconv_output_size(n, k, s, p, d, cover_all)
                    for n, k, s, p, d
                    in zip(in_shape, ksize, stride, pad, dilate))
    else:
        out = _ntuple(outsize, ndim, 'outsize', layer, 1)
        back = tuple(geometry.output_size(o, k, s, p, d, cover_all)
                     for o, k, s, p, d
                     in zip(out, ksize, stride, pad, dilate))
        if back != tuple(in_shape):
            raise ValueError(
                '%s: outsize=%r does not match the global input of spatial '
                'size %r (ksize=%r, stride=%r, pad=%r, dilate=%r give an '
                'input of %r for it). Give the global output size, or '
                'outsize=None.' % (layer, out, tuple(in_shape), ksize,
                                   stride, pad, dilate, back))
    if any(n <= 0 for n in out):
        raise ValueError(
            '%s: the output of spatial size %r is empty for the global '
            'input %r (ksize=%r, stride=%r, pad=%r). Use less padding or a '
            'larger input.' % (layer, out, tuple(in_shape), ksize, stride,
                               pad))
    return out


def transposed_apply(grid: SpatialGrid, x: chainer.Variable, layer: str,
                     layout, out_shape: Sequence[int],
                     ksize: Sequence[int], stride: Sequence[int],
                     pad: Sequence[int], dilate: Sequence[int], op,
                     out_channels: int, params: tuple = ()
                     ) -> chainer.Variable:
    """Runs a transposed window operation on this process's output block.

    Args:
        op (callable): ``op(x_in)`` runs the Chainer function unpadded on
            the input box ``x_in`` (no ``outsize``).
        params (tuple): Other inputs of ``op``, given (zero) gradients
            where the block receives nothing.

    Returns:
        chainer.Variable: This process's output block, without bias. The
        graph has the same depth on every process (the order of the
        exchanges in backward depends on it).
    """
    in_shape = tuple(layout.spatial_shape)
    geo = (tuple(ksize), tuple(stride), tuple(pad), tuple(dilate))
    plan, out_box, in_box, any_halo = geometry.deconv_plan(
        in_shape, tuple(out_shape), grid.shape, *geo, grid.spatial_rank)
    lead = (x.shape[0], out_channels)

    def run(x_in, in_box, box):
        if numpy.prod(lead + geometry.box_shape(box)) == 0 or \
                geometry.box_is_empty(in_box):
            y = exchange.ZeroBlock(lead + geometry.box_shape(box)).apply(
                (x_in,) + tuple(params))[0]
            return F.identity(y)
        src = geometry.deconv_box_output(in_box, *geo)
        return Reframe(src, box).apply((op(x_in),))[0]

    if any_halo and grid.overlap:
        return _overlapped(grid, x, plan, out_box, in_shape, geo, run,
                           out_shape, out_channels)
    return run(fetch_box(grid, x, plan, any_halo), in_box, out_box)


def _overlapped(grid, x, plan, out_box, in_shape, geo, run, out_shape,
                out_channels):
    """Interior first: the output cells reached only by owned input cells
    are computed, in pieces with MPI progress calls between them, while
    the halo travels; then the boundary slabs (as the convolutions'
    :func:`~chainermn_overlap.distconv.window_ops.window_apply`)."""
    interior = geometry.deconv_interior(out_box, plan.own, in_shape, *geo)
    slabs = geometry.split_interior(out_box, interior)
    n_pieces = window_ops.interior_pieces(grid, out_shape, out_channels)
    pieces = geometry.split_box(interior, n_pieces)
    piece_ins = [geometry.deconv_box_input(b, in_shape, *geo)
                 for b in pieces]
    slab_ins = [geometry.deconv_box_input(b, in_shape, *geo) for b in slabs]
    return window_ops.interior_first(grid, x, plan, out_box, pieces,
                                     piece_ins, slabs, slab_ins, 0, run)


def fetch_box(grid: SpatialGrid, x: chainer.Variable,
              plan: geometry.ExchangePlan, any_halo: bool
              ) -> chainer.Variable:
    """The needed box ``plan.ext`` (clipped, no padding) of ``x``: through
    the region exchange if any process needs another's cells, else a crop
    of the block (one node either way, chosen the same everywhere)."""
    if any_halo:
        grid.stats['exchange_blocking'] += 1
        return exchange.region_exchange(grid, x, plan, 0)
    grid.stats['exchange_none'] += 1
    box = plan.ext
    sel = geometry.box_slices(box, [iv[0] for iv in plan.own]) \
        if not geometry.box_is_empty(box) else tuple(slice(0, 0)
                                                     for _ in box)
    return exchange.crop(x, (Ellipsis,) + sel)


def deconvolution_nd(grid: SpatialGrid, x: Input, W: Input,
                     b: Optional[Input] = None, stride: IntOrTuple = 1,
                     pad: IntOrTuple = 0,
                     outsize: Optional[IntOrTuple] = None,
                     dilate: IntOrTuple = 1, groups: int = 1,
                     _layer: Optional[str] = None) -> chainer.Variable:
    """Spatially distributed N-dimensional transposed convolution.

    Mirrors :func:`chainer.functions.deconvolution_nd` with the grid first;
    exact for every kernel, stride, pad, ``outsize``, dilation and group
    count Chainer accepts. Collective over the grid's sample group.

    Args:
        grid (SpatialGrid): The process grid; ``grid.ndim`` spatial dims.
        x: This process's block ``(N, C_in, *block)``.
        W: Filter ``(C_in, C_out / groups, *ksize)``, the same everywhere.
        b: Optional bias ``(C_out,)``.
        stride, pad, dilate (int or tuple): As in Chainer.
        outsize (int or tuple or None): The *global* output size, as in
            Chainer (None: ``stride * (n - 1) + dilated ksize - 2 * pad``).
        groups (int): Number of channel groups.

    Returns:
        chainer.Variable: This process's block of the output (the balanced
        block of the global output extent).

    Raises:
        ValueError: On a bad layout or arguments (on every process).
    """
    layer = _layer or 'distconv.deconvolution_nd'
    x = chainer.as_variable(x)
    W = chainer.as_variable(W)
    sig = (layer, conv_functions._shape_of(W), conv_functions._shape_of(b),
           repr(stride), repr(pad), repr(outsize), repr(dilate),
           repr(groups))
    layout = grid.check_spatial(x, layer, sig, channel_split=False)
    ndim = grid.ndim
    if W.ndim != 2 + ndim:
        raise ValueError('%s: W must have shape (C_in, C_out/groups, %d '
                         'kernel sizes) for grid %r, got %r'
                         % (layer, ndim, grid.shape, W.shape))
    if not isinstance(groups, (int, numpy.integer)) or groups < 1:
        raise ValueError('%s: groups must be a positive int, got %r'
                         % (layer, groups))
    if x.shape[1] != W.shape[0] or W.shape[0] % groups:
        raise ValueError(
            '%s: input has %d channels but W %r expects %d (W is (C_in, '
            'C_out/groups, ...) for a transposed convolution, C_in '
            'divisible by groups=%d). Match in_channels to the input.'
            % (layer, x.shape[1], W.shape, W.shape[0], groups))
    ksize = tuple(W.shape[2:])
    stride = _ntuple(stride, ndim, 'stride', layer, 1)
    pad = _ntuple(pad, ndim, 'pad', layer, 0)
    dilate = _ntuple(dilate, ndim, 'dilate', layer, 1)
    out_shape = _out_shape(layer, layout.spatial_shape, ksize, stride, pad,
                           dilate, outsize, False)
    c_out = W.shape[1] * groups
    if grid.spatial_size == 1:
        grid.stats['exchange_none'] += 1
        if x.shape[0] == 0:
            shape = (0, c_out) + out_shape
            inputs = (x, W) + (() if b is None else (b,))
            return exchange.ZeroBlock(shape).apply(inputs)[0]
        return _chainer_deconvolution(x, W, b, stride, pad, out_shape,
                                      dilate, groups)

    def op(x_in):
        return _chainer_deconvolution(x_in, W, None, stride, 0, None,
                                      dilate, groups)

    y = transposed_apply(grid, x, layer, layout, out_shape, ksize, stride,
                         pad, dilate, op, c_out, (W,))
    if b is not None:
        y = F.bias(y, b, axis=1)
    return y


def _chainer_deconvolution(x, W, b, stride, pad, outsize, dilate, groups):
    if W.ndim == 4:
        return F.deconvolution_2d(x, W, b, stride, pad, outsize,
                                  dilate=dilate, groups=groups)
    return F.deconvolution_nd(x, W, b, stride, pad, outsize, dilate=dilate,
                              groups=groups)


def deconvolution_2d(grid: SpatialGrid, x: Input, W: Input,
                     b: Optional[Input] = None, stride: IntOrTuple = 1,
                     pad: IntOrTuple = 0,
                     outsize: Optional[IntOrTuple] = None,
                     dilate: IntOrTuple = 1, groups: int = 1,
                     _layer: Optional[str] = None) -> chainer.Variable:
    """Spatially distributed 2-D transposed convolution (see
    :func:`deconvolution_nd`)."""
    layer = _layer or 'distconv.deconvolution_2d'
    conv_functions._check_grid_ndim(grid, 2, layer)
    return deconvolution_nd(grid, x, W, b, stride, pad, outsize, dilate,
                            groups, _layer=layer)


def unpooling_nd(grid: SpatialGrid, x: Input, ksize: IntOrTuple,
                 stride: Optional[IntOrTuple] = None, pad: IntOrTuple = 0,
                 outsize: Optional[IntOrTuple] = None,
                 cover_all: bool = True,
                 _layer: Optional[str] = None) -> chainer.Variable:
    """Spatially distributed N-dimensional unpooling.

    Mirrors :func:`chainer.functions.unpooling_nd` (every input cell is
    copied to its window, overlapping windows add); ``outsize`` is the
    global output size. Collective over the grid's sample group.

    Args:
        grid (SpatialGrid): The process grid.
        x: This process's block ``(N, C, *block)``.
        ksize, stride, pad, outsize, cover_all: As in Chainer
            (``stride=None`` means ksize).

    Returns:
        chainer.Variable: This process's block of the output.
    """
    layer = _layer or 'distconv.unpooling_nd'
    x = chainer.as_variable(x)
    sig = (layer, repr(ksize), repr(stride), repr(pad), repr(outsize),
           bool(cover_all))
    layout = grid.check_spatial(x, layer, sig)
    ksize, stride, pad = conv_functions._pool_args(grid, layer, ksize,
                                                   stride, pad)
    ones = (1,) * grid.ndim
    out_shape = _out_shape(layer, layout.spatial_shape, ksize, stride, pad,
                           ones, outsize, cover_all)
    if grid.spatial_size == 1:
        grid.stats['exchange_none'] += 1
        if x.shape[0] == 0:
            return exchange.ZeroBlock(
                (0, x.shape[1]) + out_shape).apply((x,))[0]
        return F.unpooling_nd(x, ksize, stride, pad, out_shape,
                              cover_all=cover_all)

    def op(x_in):
        return F.unpooling_nd(x_in, ksize, stride, 0, cover_all=False)

    return transposed_apply(grid, x, layer, layout, out_shape, ksize,
                            stride, pad, ones, op, x.shape[1])


def unpooling_2d(grid: SpatialGrid, x: Input, ksize: IntOrTuple,
                 stride: Optional[IntOrTuple] = None, pad: IntOrTuple = 0,
                 outsize: Optional[IntOrTuple] = None,
                 cover_all: bool = True) -> chainer.Variable:
    """Spatially distributed 2-D unpooling (see :func:`unpooling_nd`)."""
    layer = 'distconv.unpooling_2d'
    conv_functions._check_grid_ndim(grid, 2, layer)
    return unpooling_nd(grid, x, ksize, stride, pad, outsize, cover_all,
                        _layer=layer)
