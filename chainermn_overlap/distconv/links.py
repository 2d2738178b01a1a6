"""Links mirroring ``chainer.links`` with a :class:`SpatialGrid` first.

They subclass the Chainer links, so parameters, initialisers, serialisation
and link hooks are unchanged: a single-process model's parameters can be
copied into a distributed one and back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import chainer
import chainer.links as L

from chainermn_overlap.distconv import functions
from chainermn_overlap.distconv import normalization
from chainermn_overlap.distconv import params as params_mod

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]
    IntOrTuple = Union[int, Sequence[int]]

__all__ = ['BatchNormalization', 'Convolution2D', 'ConvolutionND']


def _layer_name(link, kind):
    return 'distconv.%s %r' % (kind, link.name) if link.name else \
        'distconv.%s' % kind


def _check_split_args(layer, split, in_channels, out_channels, ksize,
                      groups, split_output=False, split_input=False):
    if split not in ('spatial', 'filter', 'channel'):
        raise ValueError("%s: split must be 'spatial', 'filter' or "
                         "'channel', got %r" % (layer, split))
    if split_output and split != 'channel':
        raise ValueError("%s: split_output=True needs split='channel' (got "
                         'split=%r).' % (layer, split))
    if split_input and split != 'filter':
        raise ValueError("%s: split_input=True needs split='filter' (got "
                         "split=%r); a 'channel' layer takes split input "
                         'channels already.' % (layer, split))
    if split != 'spatial':
        if in_channels is None or out_channels is None or ksize is None:
            raise ValueError(
                '%s: split=%r needs in_channels, out_channels and ksize '
                '(the channel blocks are cut from them at construction); '
                'got %r, %r, %r.' % (layer, split, in_channels,
                                     out_channels, ksize))
        if groups != 1:
            raise ValueError(
                "%s: split=%r needs groups=1 (got %r). Use split='spatial' "
                'for grouped convolutions.' % (layer, split, groups))


def _replace_param(link, name, array):
    delattr(link, name)
    with link.init_scope():
        setattr(link, name, chainer.Parameter(array))


def _split_conv_params(link, split, in_channels, out_channels):
    """Keeps only this process's block of W (and b) after construction.

    The whole parameters are initialised first, with the initialisers of
    the single-process link, so a model built with the same random state
    holds exactly the blocks of the single-process model's parameters.
    """
    link.split = split
    link._totals = None
    if split == 'spatial':
        return
    grid = link.grid
    link._totals = (int(in_channels), int(out_channels))
    blocks = _conv_blocks(link)
    W = link.W.array
    b = None if link.b is None else link.b.array
    axis, lo, hi = blocks['W']
    W = W[(slice(None),) * axis + (slice(lo, hi),)].copy()
    if 'b' in blocks:
        _, blo, bhi = blocks['b']
        b = b[blo:bhi].copy()
    # Re-registered in the original order (W, then b).
    _replace_param(link, 'W', W)
    if b is not None:
        _replace_param(link, 'b', b)
    params_mod.mark_split_params(link, grid)


def _attach(link, grid, split, in_channels, out_channels, split_output,
            split_input):
    """Gives a freshly built Chainer convolution link its grid and split."""
    link.grid = grid
    link.split_output = bool(split_output)
    link.split_input = bool(split_input)
    _split_conv_params(link, split, in_channels, out_channels)


def _conv_blocks(link):
    if link.split == 'spatial':
        return {}
    c_in, c_out = link._totals
    if link.split == 'filter':
        lo, hi = link.grid.channel_range(c_out)
        out = {'W': (0, lo, hi)}
        if link.b is not None:
            out['b'] = (0, lo, hi)
        return out
    lo, hi = link.grid.channel_range(c_in)
    return {'W': (1, lo, hi)}


class Convolution2D(L.Convolution2D):
    """Spatially distributed :class:`chainer.links.Convolution2D`.

    Args:
        grid (SpatialGrid): A 2-D process grid.
        in_channels, out_channels, ksize, stride, pad, nobias, initialW,
        initial_bias, dilate, groups: As in Chainer (``in_channels=None``
            initialises lazily; the two-argument form works too).
        split (str): ``'spatial'`` (default: W and b whole on every
            process), ``'filter'`` (the input's channels whole, this
            process holds its block of the output channels of W and b and
            returns that block of the output) or ``'channel'`` (the input's
            channels split, this process holds its block of W's input
            channels and b whole; the partial sums are reduced over the
            grid's channel axis and the whole output is returned). The
            blocks are :meth:`SpatialGrid.channel_range` of the grid's
            channel axis; ``'filter'`` followed by ``'channel'`` needs no
            redistribution. Spatial splitting and halos work the same.
        split_output (bool): With ``split='channel'``: reduce-scatter the
            partial sums and return this process's block of the output
            channels instead of all of them (see
            :func:`~chainermn_overlap.distconv.functions.convolution_nd`);
            the parameters are the same blocks.
        split_input (bool): With ``split='filter'``: take this process's
            block of the input channels (as a ``split_output`` layer
            returns it) and gather the blocks inside the layer, equal to
            :func:`~chainermn_overlap.distconv.gather_channels` followed
            by the layer; the parameters are the same blocks.
    """

    def __init__(self, grid: SpatialGrid, in_channels: Optional[int],
                 out_channels: Optional[int],
                 ksize: Optional[IntOrTuple] = None, stride: IntOrTuple = 1,
                 pad: IntOrTuple = 0, nobias: bool = False, initialW=None,
                 initial_bias=None, dilate: IntOrTuple = 1,
                 groups: int = 1, split: str = 'spatial',
                 split_output: bool = False,
                 split_input: bool = False) -> None:
        if grid.ndim != 2:
            raise ValueError(
                'distconv.Convolution2D needs a 2-D grid, got %r. Use '
                'distconv.ConvolutionND for %d-D data.'
                % (grid.shape, grid.ndim))
        _check_split_args('distconv.Convolution2D', split, in_channels,
                          out_channels, ksize, groups, split_output,
                          split_input)
        super(Convolution2D, self).__init__(
            in_channels, out_channels, ksize, stride, pad, nobias, initialW,
            initial_bias, dilate=dilate, groups=groups)
        _attach(self, grid, split, in_channels, out_channels, split_output,
                split_input)

    def forward(self, x: Input) -> chainer.Variable:
        if self.W.array is None:
            self._initialize_params(x.shape[1])
        return functions.convolution_2d(
            self.grid, x, self.W, self.b, self.stride, self.pad,
            dilate=self.dilate, groups=self.groups,
            _layer=_layer_name(self, 'Convolution2D'), split=self.split,
            _totals=self._totals, split_output=self.split_output,
            split_input=self.split_input)

    def serial_blocks(self) -> dict:
        """Which block of the single-process parameters this link holds.

        Returns:
            dict: ``name -> (axis, lo, hi)`` for each parameter or
            persistent value that holds only part of the single-process one
            (empty with ``split='spatial'``).
        """
        return _conv_blocks(self)

    def reduction_groups(self) -> dict:
        """Parameters not replicated over the whole communicator.

        Returns:
            dict: ``name -> ReductionGroup`` (see
            :mod:`chainermn_overlap.distconv.params`); empty when every
            parameter is replicated everywhere.
        """
        return params_mod.link_reduction_groups(self)


class ConvolutionND(L.ConvolutionND):
    """Spatially distributed :class:`chainer.links.ConvolutionND`.

    Args:
        grid (SpatialGrid): A process grid with ``ndim`` dimensions.
        ndim (int): Number of spatial dimensions.
        in_channels, out_channels, ksize, stride, pad, nobias, initialW,
        initial_bias, cover_all, dilate, groups: As in Chainer.
        split (str): See :class:`Convolution2D`.
        split_output, split_input (bool): See :class:`Convolution2D`.
    """

    def __init__(self, grid: SpatialGrid, ndim: int,
                 in_channels: Optional[int], out_channels: int,
                 ksize: Optional[IntOrTuple] = None, stride: IntOrTuple = 1,
                 pad: IntOrTuple = 0, nobias: bool = False, initialW=None,
                 initial_bias=None, cover_all: bool = False,
                 dilate: IntOrTuple = 1, groups: int = 1,
                 split: str = 'spatial', split_output: bool = False,
                 split_input: bool = False) -> None:
        if grid.ndim != ndim:
            raise ValueError(
                'distconv.ConvolutionND: ndim=%d but the grid %r has %d '
                'dimensions. Use a grid with one entry per spatial '
                'dimension.' % (ndim, grid.shape, grid.ndim))
        _check_split_args('distconv.ConvolutionND', split, in_channels,
                          out_channels, ksize, groups, split_output,
                          split_input)
        super(ConvolutionND, self).__init__(
            ndim, in_channels, out_channels, ksize, stride, pad, nobias,
            initialW, initial_bias, cover_all, dilate, groups)
        _attach(self, grid, split, in_channels, out_channels, split_output,
                split_input)

    def forward(self, x: Input) -> chainer.Variable:
        if self.W.array is None:
            self._initialize_params(x.shape[1])
        return functions.convolution_nd(
            self.grid, x, self.W, self.b, self.stride, self.pad,
            self.cover_all, self.dilate, self.groups,
            _layer=_layer_name(self, 'ConvolutionND'), split=self.split,
            _totals=self._totals, split_output=self.split_output,
            split_input=self.split_input)

    serial_blocks = Convolution2D.serial_blocks
    reduction_groups = Convolution2D.reduction_groups


class BatchNormalization(L.BatchNormalization):
    """Batch normalisation with statistics over the global batch.

    In training mode the mean and variance are taken over every sample of
    every sample group and every cell of the global spatial domain (what
    Chainer computes for the global batch on one process), and the running
    statistics are updated with them. In test mode it is element-wise and
    needs no communication.

    Args:
        grid (SpatialGrid): The process grid.
        size (int or None): Number of channels (None: lazily from input).
        decay, eps, dtype, use_gamma, use_beta, initial_gamma, initial_beta,
        initial_avg_mean, initial_avg_var: As in Chainer.
        axis: Must be None: normalisation is per channel over samples and
            spatial dimensions.
        layout (str): ``'spatial'`` (default) for inputs in spatial layout,
            ``'sample'`` for whole samples per process (after
            :func:`to_sample_layout`); statistics are global either way.
        channel_split (bool): If True, the input holds this process's block
            of the ``size`` channels (the output of a ``split='filter'``
            convolution) and the link holds that block of gamma, beta and
            the running statistics; else all channels. Statistics are per
            channel over the global batch either way (reduced over
            ``grid.mpi_data``, the processes of one channel coordinate).
    """

    def __init__(self, grid: SpatialGrid, size: Optional[int] = None,
                 decay: float = 0.9, eps: float = 2e-5, dtype=None,
                 use_gamma: bool = True, use_beta: bool = True,
                 initial_gamma=None, initial_beta=None, axis=None,
                 initial_avg_mean=None, initial_avg_var=None,
                 layout: str = 'spatial',
                 channel_split: bool = False) -> None:
        if layout not in ('spatial', 'sample'):
            raise ValueError(
                "distconv.BatchNormalization: layout must be 'spatial' or "
                "'sample', got %r" % (layout,))
        if axis is not None:
            raise ValueError(
                'distconv.BatchNormalization: axis=%r is not supported; it '
                'always normalises per channel over samples and all spatial '
                'dimensions (axis=None).' % (axis,))
        # Chainer requires size or axis; the axis given for the lazy case is
        # only used by Chainer's own forward, which this class replaces.
        super(BatchNormalization, self).__init__(
            size, decay, eps, dtype, use_gamma, use_beta, initial_gamma,
            initial_beta, None if size is not None else (0,),
            initial_avg_mean, initial_avg_var)
        self.axis = None
        self.grid = grid
        self.layout = layout
        self.channel_split = bool(channel_split)
        self._size = size
        if self.channel_split:
            if size is None:
                raise ValueError(
                    'distconv.BatchNormalization: channel_split=True needs '
                    'size (the global number of channels), got None.')
            lo, hi = grid.channel_range(size)
            for name in ('gamma', 'beta'):
                p = getattr(self, name, None)
                if p is not None:
                    _replace_param(self, name, p.array[lo:hi].copy())
            self.avg_mean = self.avg_mean[lo:hi].copy()
            self.avg_var = self.avg_var[lo:hi].copy()
            params_mod.mark_split_params(self, grid)

    def serial_blocks(self) -> dict:
        """See :meth:`Convolution2D.serial_blocks`."""
        if not self.channel_split:
            return {}
        lo, hi = self.grid.channel_range(self._size)
        return {name: (0, lo, hi) for name in
                ('gamma', 'beta', 'avg_mean', 'avg_var')
                if getattr(self, name, None) is not None}

    def reduction_groups(self) -> dict:
        """See :meth:`Convolution2D.reduction_groups`."""
        return params_mod.link_reduction_groups(self)

    def forward(self, x: Input, finetune: bool = False) -> chainer.Variable:
        """Normalises ``x``, this process's block ``(N, C, *block)``."""
        if self.avg_mean is None:
            self._initialize_params((x.shape[1],))
        gamma = self.gamma if self.gamma is not None else self._get_gamma()[0]
        beta = self.beta if self.beta is not None else self._get_beta()[0]
        if not chainer.config.train:
            return chainer.functions.fixed_batch_normalization(
                x, gamma, beta, self.avg_mean, self.avg_var, self.eps)
        if finetune:
            self.N += 1
            decay = 1. - 1. / self.N
        else:
            decay = self.decay
        avg_mean, avg_var = self.avg_mean, self.avg_var
        if chainer.config.in_recomputing:
            # Statistics were updated by the first forward pass already.
            if finetune:
                self.N -= 1
            avg_mean = avg_var = None
        return normalization.batch_normalization(
            self.grid, x, gamma, beta, self.eps, avg_mean, avg_var, decay,
            layout=self.layout, _layer=_layer_name(self, 'BatchNormalization'),
            channel_split=self.channel_split)
