"""Links of encoder-decoder models mirroring ``chainer.links``.

:class:`Deconvolution2D`, :class:`DeconvolutionND` and
:class:`GroupNormalization` subclass the Chainer links (parameters,
initialisers, serialisation and hooks unchanged, so a single-process
model's parameters copy in and out) and call the distributed functions
of :mod:`.deconvolution` and :mod:`.group_norm`. Their parameters are
replicated on every process; their gradients are partial sums, as for
:class:`~chainermn_overlap.distconv.Convolution2D`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import chainer
import chainer.links as L

from chainermn_overlap.distconv import deconvolution
from chainermn_overlap.distconv import group_norm

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]
    IntOrTuple = Union[int, Sequence[int]]

__all__ = ['Deconvolution2D', 'DeconvolutionND', 'GroupNormalization']


def _layer_name(link, kind):
    return 'distconv.%s %r' % (kind, link.name) if link.name else \
        'distconv.%s' % kind


def _check_ndim(grid, ndim, kind):
    if grid.ndim != ndim:
        raise ValueError(
            'distconv.%s works on %d spatial dimensions but the grid %r has '
            '%d. Use a grid with one entry per spatial dimension%s.'
            % (kind, ndim, grid.shape, grid.ndim,
               ' (distconv.DeconvolutionND for other than 2-D data)'
               if kind == 'Deconvolution2D' else ''))


class Deconvolution2D(L.Deconvolution2D):
    """Spatially distributed :class:`chainer.links.Deconvolution2D`.

    Args:
        grid (SpatialGrid): A 2-D process grid.
        in_channels, out_channels, ksize, stride, pad, nobias, outsize,
        initialW, initial_bias, dilate, groups: As in Chainer;
            ``outsize`` is the global output size.
    """

    def __init__(self, grid: SpatialGrid, in_channels: Optional[int],
                 out_channels: Optional[int],
                 ksize: Optional[IntOrTuple] = None, stride: IntOrTuple = 1,
                 pad: IntOrTuple = 0, nobias: bool = False,
                 outsize: Optional[IntOrTuple] = None, initialW=None,
                 initial_bias=None, dilate: IntOrTuple = 1,
                 groups: int = 1) -> None:
        _check_ndim(grid, 2, 'Deconvolution2D')
        super(Deconvolution2D, self).__init__(
            in_channels, out_channels, ksize, stride, pad, nobias, outsize,
            initialW, initial_bias, dilate=dilate, groups=groups)
        self.grid = grid

    def forward(self, x: Input) -> chainer.Variable:
        if self.W.array is None:
            self._initialize_params(x.shape[1])
        return deconvolution.deconvolution_2d(
            self.grid, x, self.W, self.b, self.stride, self.pad,
            self.outsize, self.dilate, self.groups,
            _layer=_layer_name(self, 'Deconvolution2D'))


class DeconvolutionND(L.DeconvolutionND):
    """Spatially distributed :class:`chainer.links.DeconvolutionND`.

    Args:
        grid (SpatialGrid): A process grid with ``ndim`` dimensions.
        ndim (int): Number of spatial dimensions.
        in_channels, out_channels, ksize, stride, pad, nobias, outsize,
        initialW, initial_bias, dilate, groups: As in Chainer;
            ``outsize`` is the global output size.
    """

    def __init__(self, grid: SpatialGrid, ndim: int,
                 in_channels: Optional[int], out_channels: int,
                 ksize: Optional[IntOrTuple] = None, stride: IntOrTuple = 1,
                 pad: IntOrTuple = 0, nobias: bool = False,
                 outsize: Optional[IntOrTuple] = None, initialW=None,
                 initial_bias=None, dilate: IntOrTuple = 1,
                 groups: int = 1) -> None:
        _check_ndim(grid, ndim, 'DeconvolutionND')
        super(DeconvolutionND, self).__init__(
            ndim, in_channels, out_channels, ksize, stride, pad, nobias,
            outsize, initialW, initial_bias, dilate, groups)
        self.grid = grid

    def forward(self, x: Input) -> chainer.Variable:
        if self.W.array is None:
            self._initialize_params(x.shape[1])
        return deconvolution.deconvolution_nd(
            self.grid, x, self.W, self.b, self.stride, self.pad,
            self.outsize, self.dilate, self.groups,
            _layer=_layer_name(self, 'DeconvolutionND'))


class GroupNormalization(L.GroupNormalization):
    """Group normalisation with statistics over the global spatial extent.

    Per sample and group, the mean and variance are those of every cell of
    the global spatial domain (not of this process's block), as Chainer
    computes them on one process; one small allreduce over the processes
    of the sample group in forward, one in backward. No running
    statistics: training and test mode are the same, so a batch of one
    sample trains as on one process.

    Args:
        grid (SpatialGrid): The process grid.
        groups, size, eps, initial_gamma, initial_beta: As in Chainer.
    """

    def __init__(self, grid: SpatialGrid, groups: int,
                 size: Optional[int] = None, eps: float = 1e-5,
                 initial_gamma=None, initial_beta=None) -> None:
        super(GroupNormalization, self).__init__(
            groups, size, eps, initial_gamma, initial_beta)
        self.grid = grid

    def forward(self, x: Input) -> chainer.Variable:
        """Normalises ``x``, this process's block ``(N, C, *block)``."""
        if self.gamma.array is None:
            self._initialize_params(x.shape[1])
        return group_norm.group_normalization(
            self.grid, x, self.groups, self.gamma, self.beta, self.eps,
            _layer=_layer_name(self, 'GroupNormalization'))
