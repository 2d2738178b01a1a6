"""Spatially distributed convolution and pooling functions.

Each function mirrors its ``chainer.functions`` namesake with the grid
first. It derives the global output extent from the global input extent,
takes the balanced block of the output at this process's grid coordinates,
fetches the global input box that block reads (padding included) with a
:class:`~chainermn_overlap.distconv.exchange.RegionExchange`, and then runs
the single-process Chainer function *without padding* on that box. Because
padding cells are materialised with the value Chainer pads with (0, or -inf
for max pooling), every output cell is computed from exactly the same values,
in the same window order, as on one process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import chainer
from chainer import backend
from chainer import function_node
import chainer.functions as F
import numpy

from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import channel_conv
from chainermn_overlap.distconv import channels as channels_mod
from chainermn_overlap.distconv import geometry
from chainermn_overlap.distconv import window_ops

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]
    IntOrTuple = Union[int, Sequence[int]]

__all__ = [
    'average_pooling_2d', 'average_pooling_nd', 'convolution_2d',
    'convolution_nd', 'global_average_pooling', 'max_pooling_2d',
    'max_pooling_nd',
]


def _ntuple(value, ndim, what, layer, minimum):
    if isinstance(value, (int, numpy.integer)):
        value = (int(value),) * ndim
    try:
        value = tuple(int(v) for v in value)
    except TypeError:
        raise ValueError('%s: %s must be an int or a tuple of %d ints, got %r'
                         % (layer, what, ndim, value))
    if len(value) != ndim:
        raise ValueError('%s: %s must have one entry per spatial dimension '
                         '(%d for grid dims), got %r'
                         % (layer, what, ndim, value))
    if any(v < minimum for v in value):
        raise ValueError('%s: every %s must be >= %d, got %r'
                         % (layer, what, minimum, value))
    return value


def _shape_of(v):
    if v is None:
        return None
    return tuple(v.shape) if v.shape is not None else None


def _check_grid_ndim(grid, ndim, layer):
    if grid.ndim != ndim:
        raise ValueError(
            '%s works on %d spatial dimensions but the grid %r has %d. Use a '
            'grid with %d entries, or the N-dimensional variant.'
            % (layer, ndim, grid.shape, grid.ndim, ndim))


_SPLITS = ('spatial', 'filter', 'channel')


def convolution_nd(grid: SpatialGrid, x: Input, W: Input,
                   b: Optional[Input] = None, stride: IntOrTuple = 1,
                   pad: IntOrTuple = 0, cover_all: bool = False,
                   dilate: IntOrTuple = 1, groups: int = 1,
                   _layer: Optional[str] = None, split: str = 'spatial',
                   _totals: Optional[tuple] = None,
                   split_output: bool = False,
                   split_input: bool = False) -> chainer.Variable:
    """Spatially distributed N-dimensional convolution.

    Mirrors :func:`chainer.functions.convolution_nd` with the grid first.
    Collective over the grid's sample group (and the communicator, for the
    layout check).

    Args:
        grid (SpatialGrid): The process grid; ``grid.ndim`` spatial dims.
        x: This process's block ``(N, C, *block)`` (``C``: this process's
            channel block with ``split='channel'``, all channels otherwise).
        W: Filter ``(C_out, C / groups, *ksize)``, the same on every process
            with ``split='spatial'``; this process's block of the output
            channels (``'filter'``) or of the input channels (``'channel'``)
            otherwise (:meth:`SpatialGrid.channel_range`).
        b: Optional bias ``(C_out,)``: this process's block with
            ``'filter'``, whole otherwise (with ``'channel'`` it is added
            once, after the partial sums are reduced).
        stride, pad, dilate (int or tuple): As in Chainer; any pad >= 0
            (also larger than the kernel radius).
        cover_all (bool): As in Chainer.
        groups (int): Number of channel groups (1 unless ``'spatial'``).
        split (str): ``'spatial'``, ``'filter'`` (input channels whole,
            output channels split over the grid's channel axis) or
            ``'channel'`` (input channels split, output whole: partial sums
            reduced over the channel axis). Spatial blocks and halos work
            the same in all three.
        split_output (bool): Only with ``split='channel'``: reduce-scatter
            the partial sums instead of allreducing them and return this
            process's block of the output channels
            (:meth:`SpatialGrid.channel_range` of ``C_out``), as a
            ``'filter'`` layer would (b, held whole, is added on that
            block). Half the traffic of the allreduce, and whatever follows
            (batch normalisation with ``channel_split=True``, element-wise
            functions) runs on the block instead of on a whole copy per
            channel coordinate; :func:`gather_channels` makes it whole
            again where a ``'filter'`` layer needs it.
        split_input (bool): Only with ``split='filter'``: ``x`` is this
            process's block of the input channels (channels split, as a
            ``split_output`` layer returns them), and the layer gathers the
            blocks itself: W is the same block of output channels over all
            ``C`` input channels. The result equals
            :func:`gather_channels` followed by the ``'filter'`` layer.

    With one process per sample group (``grid.spatial_size == 1``),
    ``split_output`` and ``split_input`` layers overlap their channel
    messages with the products of the other blocks
    (:mod:`~chainermn_overlap.distconv.channel_conv`) unless
    ``grid.channel_overlap`` is False; spatially split grids run the
    convolution and the collective one after the other.

    Returns:
        chainer.Variable: This process's block of the output (its block of
        the output channels with ``'filter'`` or ``split_output``).

    Raises:
        ValueError: On a bad layout or arguments (on every process).
    """
    layer = _layer or 'distconv.convolution_nd'
    split_output, split_input = _check_split(layer, split, split_output,
                                             split_input)
    x = chainer.as_variable(x)
    W = chainer.as_variable(W)
    fuse = (grid.channel_overlap and grid.channels > 1
            and grid.spatial_size == 1 and (split_output or split_input))
    # Whether gradients are needed decides which messages the overlapped
    # nodes exchange in backward, so it must agree along the channel axis.
    needs = (x.requires_grad, W.requires_grad) if fuse else ()
    sig = (layer, split, split_output, split_input) + _param_signature(
        split, W, b, _totals) + (repr(stride), repr(pad), bool(cover_all),
                                 repr(dilate), repr(groups), fuse, needs)
    layout = grid.check_spatial(
        x, layer, sig, channel_split=(split == 'channel' or split_input))
    ksize, stride, pad, dilate = _conv_window(grid, layer, W, stride, pad,
                                              dilate, groups, split)
    c_out, c_in = W.shape[0], W.shape[1] * groups
    if split == 'channel':
        c_in = x.shape[1]
    if split_input:
        if W.shape[1] != layout.channels:
            raise ValueError(
                "%s: split_input=True needs W over all %d input channels "
                "(the input's blocks summed over the channel axis), got W "
                "%r. Give the layer in_channels=%d."
                % (layer, layout.channels, W.shape, layout.channels))
        if fuse:
            grid.stats['exchange_none'] += 1
            grid.stats['channel_overlapped'] += 1
            args = (x, W) if b is None else (x, W, b)
            return channel_conv.GatherConvolution(
                grid, layout.channels, ksize, stride, pad, dilate,
                cover_all).apply(args)[0]
        if grid.channels > 1:
            x = channels_mod.gather_channels(grid, x)
        c_in = x.shape[1]
        layout = layout._replace(channels=c_in)
    _check_conv_channels(grid, layer, split, x, W, c_in, c_out, groups)
    if fuse and split_output:
        grid.stats['exchange_none'] += 1
        grid.stats['channel_overlapped'] += 1
        y = channel_conv.ScatterConvolution(
            grid, c_out, ksize, stride, pad, dilate, cover_all).apply(
                (x, W))[0]
        return _add_bias_block(grid, y, b, c_out)
    return _window_convolution(grid, x, W, b, layer, layout, ksize, stride,
                               pad, dilate, cover_all, groups, split,
                               split_output)


def _check_split(layer, split, split_output, split_input):
    """Validates the split arguments; returns the two flags as bools."""
    if split not in _SPLITS:
        raise ValueError("%s: split must be 'spatial', 'filter' or "
                         "'channel', got %r" % (layer, split))
    split_output = bool(split_output)
    split_input = bool(split_input)
    if split_output and split != 'channel':
        raise ValueError("%s: split_output=True needs split='channel' (got "
                         "split=%r): only partial sums over input channel "
                         "blocks can be reduce-scattered." % (layer, split))
    if split_input and split != 'filter':
        raise ValueError("%s: split_input=True needs split='filter' (got "
                         "split=%r): a 'channel' layer takes split input "
                         "channels already." % (layer, split))
    return split_output, split_input


def _param_signature(split, W, b, totals):
    """What of W and b must agree across processes: ``(wsig, bsig)``."""
    if split == 'spatial':
        return _shape_of(W), _shape_of(b)
    if split == 'filter':
        # The blocks differ between channel coordinates; the totals (from a
        # link) or the shapes they share are what must agree.
        return (totals, _shape_of(W)[1:]), b is None
    return (totals, _shape_of(W)[:1] + _shape_of(W)[2:]), _shape_of(b)


def _conv_window(grid, layer, W, stride, pad, dilate, groups, split):
    """Checks W's rank and the window arguments; returns ``(ksize, stride,
    pad, dilate)`` as tuples of the grid's dimensionality."""
    ndim = grid.ndim
    if W.ndim != 2 + ndim:
        raise ValueError('%s: W must have shape (C_out, C_in/groups, %d '
                         'kernel sizes) for grid %r, got %r'
                         % (layer, ndim, grid.shape, W.shape))
    ksize = tuple(W.shape[2:])
    stride = _ntuple(stride, ndim, 'stride', layer, 1)
    pad = _ntuple(pad, ndim, 'pad', layer, 0)
    dilate = _ntuple(dilate, ndim, 'dilate', layer, 1)
    if not isinstance(groups, (int, numpy.integer)) or groups < 1:
        raise ValueError('%s: groups must be a positive int, got %r'
                         % (layer, groups))
    if split != 'spatial' and groups != 1:
        raise ValueError(
            "%s: split=%r needs groups=1 (got %d): channel blocks would "
            "have to align with the groups. Use split='spatial' for grouped "
            "convolutions." % (layer, split, groups))
    return ksize, stride, pad, dilate


def _check_conv_channels(grid, layer, split, x, W, c_in, c_out, groups):
    if x.shape[1] != c_in or c_out % groups:
        raise ValueError(
            '%s: input has %d channels%s but W %r with groups=%d expects %d '
            '(and C_out divisible by groups). Match in_channels to the '
            'input.' % (layer, x.shape[1],
                        ' here' if split == 'channel' else '', W.shape,
                        groups, W.shape[1] * groups))
    if split == 'channel' and W.shape[1] != x.shape[1]:
        raise ValueError(
            "%s: split='channel' needs W's block of input channels to match "
            'the input block: W %r, input with %d channels on channel '
            'coordinate %d. Hold W[:, grid.channel_range(C_in)].'
            % (layer, W.shape, x.shape[1], grid.channel_rank))


def _chainer_convolution(x: Input, W: Input, b: Optional[Input],
                        stride: Sequence[int], pad: Sequence[int],
                        cover_all: bool, dilate: Sequence[int],
                        groups: int) -> chainer.Variable:
    """Chainer's 2-D or N-D convolution, by the rank of ``W``."""
    if W.ndim == 4:
        return F.convolution_2d(x, W, b, stride, pad, cover_all,
                                dilate=dilate, groups=groups)
    return F.convolution_nd(x, W, b, stride, pad, cover_all, dilate=dilate,
                            groups=groups)


def _window_convolution(grid, x, W, b, layer, layout, ksize, stride, pad,
                        dilate, cover_all, groups, split, split_output):
    """The convolution through the halo paths of :func:`window_apply`,
    with the partial sums of a ``'channel'`` layer reduced after it."""
    reduce_channels = split == 'channel' and grid.channels > 1
    b_in = None if reduce_channels else b

    def op(x_in, in_box):
        # in_box None: whole samples, the layer's own padding (1 process
        # per sample group); otherwise a box that already holds the padding.
        p, ca = (pad, cover_all) if in_box is None else (0, False)
        return _chainer_convolution(x_in, W, b_in, stride, p, ca, dilate,
                                   groups)

    params = (W,) + ((b_in,) if b_in is not None else ())
    y = window_ops.window_apply(grid, x, layer, layout, ksize, stride, pad,
                                dilate, cover_all, 0, op, W.shape[0], params)
    if reduce_channels:
        y = _reduce_partial_sums(grid, y, b, W.shape[0], split_output)
    return y


def _reduce_partial_sums(grid, y, b, c_out, split_output):
    """Sums a ``split='channel'`` layer's partial sums over the channel axis.

    The whole output everywhere (allreduce) or, with ``split_output``, this
    coordinate's block of its channels (reduce-scatter, the adjoint of
    :func:`gather_channels`); the bias, held whole, is added once after
    the reduction (on the block with ``split_output``).
    """
    if split_output:
        y = channels_mod.ChannelBlockOfSum(grid, c_out).apply((y,))[0]
        return _add_bias_block(grid, y, b, c_out)
    y = channels_mod.ChannelAllreduce(grid).apply((y,))[0]
    if b is not None:
        y = F.bias(y, b, axis=1)
    return y


def _add_bias_block(grid, y, b, c_out):
    """Adds this coordinate's block of a whole bias ``b`` (if any)."""
    if b is None:
        return y
    lo, hi = grid.channel_range(c_out)
    return F.bias(y, b[lo:hi], axis=1)


def convolution_2d(grid: SpatialGrid, x: Input, W: Input,
                   b: Optional[Input] = None, stride: IntOrTuple = 1,
                   pad: IntOrTuple = 0, cover_all: bool = False,
                   dilate: IntOrTuple = 1, groups: int = 1,
                   _layer: Optional[str] = None, split: str = 'spatial',
                   _totals: Optional[tuple] = None,
                   split_output: bool = False,
                   split_input: bool = False) -> chainer.Variable:
    """Spatially distributed 2-D convolution (see :func:`convolution_nd`)."""
    layer = _layer or 'distconv.convolution_2d'
    _check_grid_ndim(grid, 2, layer)
    return convolution_nd(grid, x, W, b, stride, pad, cover_all, dilate,
                          groups, _layer=layer, split=split, _totals=_totals,
                          split_output=split_output, split_input=split_input)


def _pool_args(grid, layer, ksize, stride, pad):
    ndim = grid.ndim
    ksize = _ntuple(ksize, ndim, 'ksize', layer, 1)
    stride = ksize if stride is None else _ntuple(stride, ndim, 'stride',
                                                  layer, 1)
    pad = _ntuple(pad, ndim, 'pad', layer, 0)
    return ksize, stride, pad


def max_pooling_nd(grid: SpatialGrid, x: Input, ksize: IntOrTuple,
                   stride: Optional[IntOrTuple] = None, pad: IntOrTuple = 0,
                   cover_all: bool = True,
                   return_indices: bool = False) -> chainer.Variable:
    """Spatially distributed N-dimensional max pooling.

    Mirrors :func:`chainer.functions.max_pooling_nd`; padding cells are
    -inf as in Chainer, so windows that reach into other processes' blocks
    or far into the padding give the single-process result.

    Args:
        grid (SpatialGrid): The process grid.
        x: This process's block ``(N, C, *block)``.
        ksize, stride, pad: As in Chainer (``stride=None`` means ksize).
        cover_all (bool): As in Chainer.
        return_indices (bool): Not supported (indices would be local to
            the exchanged box); must be False.

    Returns:
        chainer.Variable: This process's block of the output.
    """
    return _max_pooling(grid, x, ksize, stride, pad, cover_all,
                        return_indices, 'distconv.max_pooling_nd')


def max_pooling_2d(grid: SpatialGrid, x: Input, ksize: IntOrTuple,
                   stride: Optional[IntOrTuple] = None, pad: IntOrTuple = 0,
                   cover_all: bool = True,
                   return_indices: bool = False) -> chainer.Variable:
    """Spatially distributed 2-D max pooling (see :func:`max_pooling_nd`)."""
    layer = 'distconv.max_pooling_2d'
    _check_grid_ndim(grid, 2, layer)
    return _max_pooling(grid, x, ksize, stride, pad, cover_all,
                        return_indices, layer)


def _max_pooling(grid, x, ksize, stride, pad, cover_all, return_indices,
                 layer):
    x = chainer.as_variable(x)
    sig = (layer, repr(ksize), repr(stride), repr(pad), bool(cover_all),
           bool(return_indices))
    layout = grid.check_spatial(x, layer, sig)
    if return_indices:
        raise ValueError(
            '%s: return_indices=True is not supported, because the indices '
            'would refer to the exchanged halo box, not to the input block. '
            'Call it with return_indices=False.' % layer)
    ksize, stride, pad = _pool_args(grid, layer, ksize, stride, pad)

    def op(x_in, in_box):
        if in_box is None:  # whole samples (see convolution_nd)
            return F.max_pooling_nd(x_in, ksize, stride, pad,
                                    cover_all=cover_all)
        return F.max_pooling_nd(x_in, ksize, stride, 0, cover_all=False)

    return window_ops.window_apply(grid, x, layer, layout, ksize, stride,
                                   pad, (1,) * grid.ndim, cover_all,
                                   -numpy.inf, op, layout.channels)


def average_pooling_nd(grid: SpatialGrid, x: Input, ksize: IntOrTuple,
                       stride: Optional[IntOrTuple] = None,
                       pad: IntOrTuple = 0,
                       pad_value: Optional[int] = 0) -> chainer.Variable:
    """Spatially distributed N-dimensional average pooling.

    Mirrors :func:`chainer.functions.average_pooling_nd`.

    Args:
        grid (SpatialGrid): The process grid.
        x: This process's block ``(N, C, *block)``.
        ksize, stride, pad: As in Chainer (``stride=None`` means ksize).
        pad_value (0 or None): 0 averages over the whole window with padding
            counted as zeros; None averages over the cells inside the input
            only, as in Chainer.

    Returns:
        chainer.Variable: This process's block of the output.
    """
    return _average_pooling(grid, x, ksize, stride, pad, pad_value,
                            'distconv.average_pooling_nd')


def average_pooling_2d(grid: SpatialGrid, x: Input, ksize: IntOrTuple,
                       stride: Optional[IntOrTuple] = None,
                       pad: IntOrTuple = 0) -> chainer.Variable:
    """Spatially distributed 2-D average pooling.

    Mirrors :func:`chainer.functions.average_pooling_2d` (padding counts as
    zeros in the window average).
    """
    layer = 'distconv.average_pooling_2d'
    _check_grid_ndim(grid, 2, layer)
    return _average_pooling(grid, x, ksize, stride, pad, 0, layer)


def _average_pooling(grid, x, ksize, stride, pad, pad_value, layer):
    x = chainer.as_variable(x)
    sig = (layer, repr(ksize), repr(stride), repr(pad), repr(pad_value))
    layout = grid.check_spatial(x, layer, sig)
    if pad_value is not None and pad_value != 0:
        raise ValueError(
            '%s: pad_value must be 0 or None (as in Chainer), got %r'
            % (layer, pad_value))
    ksize, stride, pad = _pool_args(grid, layer, ksize, stride, pad)

    def op(x_in, in_box):
        if in_box is None:  # whole samples (see convolution_nd)
            return F.average_pooling_nd(x_in, ksize, stride, pad,
                                        pad_value=pad_value)
        y = F.average_pooling_nd(x_in, ksize, stride, 0)
        if pad_value is None:
            # Chainer divides by the number of non-padding cells per
            # window; the input box knows where the global border is, so a
            # mask of in-bounds cells pooled the same way gives that
            # count's fraction.
            y = y * _inside_fraction_inverse(x_in, in_box, layout, ksize,
                                             stride)
        return y

    return window_ops.window_apply(grid, x, layer, layout, ksize, stride,
                                   pad, (1,) * grid.ndim, False, 0, op,
                                   layout.channels,
                                   depth=2 if pad_value is None else 1)


def _inside_fraction_inverse(x_in, in_box, layout, ksize, stride):
    xp = backend.get_array_module(x_in.array)
    mask = xp.zeros((1, 1) + geometry.box_shape(in_box), dtype=x_in.dtype)
    inside = geometry.clip(in_box, layout.spatial_shape)
    if not geometry.box_is_empty(inside):
        origin = tuple(iv[0] for iv in in_box)
        mask[(Ellipsis,) + geometry.box_slices(inside, origin)] = 1
    frac = F.average_pooling_nd(mask, ksize, stride, 0).array
    with numpy.errstate(divide='ignore'):
        return xp.broadcast_to(1 / frac, x_in.shape[:2] + frac.shape[2:])


class SpatialAllreduce(function_node.FunctionNode):
    """Sum over the processes of a sample group; self-adjoint.

    The output is replicated on the group's processes and each uses its copy
    in its own loss, so the exact adjoint sums the copies' gradients.
    """

    def __init__(self, grid):
        self.grid = grid

    def forward(self, inputs):
        x, = inputs
        return _comm.allreduce_sum(self.grid.mpi_spatial, x),

    def backward(self, indexes, grad_outputs):
        return SpatialAllreduce(self.grid).apply(grad_outputs)


def global_average_pooling(grid: SpatialGrid,
                           x: Input) -> chainer.Variable:
    """Mean over the whole (distributed) spatial domain of each sample.

    Args:
        grid (SpatialGrid): The process grid.
        x: This process's block ``(N, C, *block)``.

    Returns:
        chainer.Variable: ``(N, C)``, identical on the processes of the
        sample group. Its backward sums the gradients of all copies (the
        exact adjoint), see :meth:`SpatialGrid.loss_scale`.
    """
    layer = 'distconv.global_average_pooling'
    x = chainer.as_variable(x)
    layout = grid.check_spatial(x, layer, (layer,))
    count = int(numpy.prod(layout.spatial_shape))
    local = F.sum(x, axis=tuple(range(2, x.ndim)))
    total = SpatialAllreduce(grid).apply((local,))[0]
    return total * (1.0 / count)
