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

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]
    IntOrTuple = Union[int, Sequence[int]]

__all__ = ['BatchNormalization', 'Convolution2D', 'ConvolutionND']


def _layer_name(link, kind):
    return 'distconv.%s %r' % (kind, link.name) if link.name else \
        'distconv.%s' % kind


class Convolution2D(L.Convolution2D):
    """Spatially distributed :class:`chainer.links.Convolution2D`.

    Args:
        grid (SpatialGrid): A 2-D process grid.
        in_channels, out_channels, ksize, stride, pad, nobias, initialW,
        initial_bias, dilate, groups: As in Chainer (``in_channels=None``
            initialises lazily; the two-argument form works too).
    """

    def __init__(self, grid: SpatialGrid, in_channels: Optional[int],
                 out_channels: Optional[int],
                 ksize: Optional[IntOrTuple] = None, stride: IntOrTuple = 1,
                 pad: IntOrTuple = 0, nobias: bool = False, initialW=None,
                 initial_bias=None, dilate: IntOrTuple = 1,
                 groups: int = 1) -> None:
        if grid.ndim != 2:
            raise ValueError(
                'distconv.Convolution2D needs a 2-D grid, got %r. Use '
                'distconv.ConvolutionND for %d-D data.'
                % (grid.shape, grid.ndim))
        super(Convolution2D, self).__init__(
            in_channels, out_channels, ksize, stride, pad, nobias, initialW,
            initial_bias, dilate=dilate, groups=groups)
        self.grid = grid

    def forward(self, x: Input) -> chainer.Variable:
        if self.W.array is None:
            self._initialize_params(x.shape[1])
        return functions.convolution_2d(
            self.grid, x, self.W, self.b, self.stride, self.pad,
            dilate=self.dilate, groups=self.groups,
            _layer=_layer_name(self, 'Convolution2D'))


class ConvolutionND(L.ConvolutionND):
    """Spatially distributed :class:`chainer.links.ConvolutionND`.

    Args:
        grid (SpatialGrid): A process grid with ``ndim`` dimensions.
        ndim (int): Number of spatial dimensions.
        in_channels, out_channels, ksize, stride, pad, nobias, initialW,
        initial_bias, cover_all, dilate, groups: As in Chainer.
    """

    def __init__(self, grid: SpatialGrid, ndim: int,
                 in_channels: Optional[int], out_channels: int,
                 ksize: Optional[IntOrTuple] = None, stride: IntOrTuple = 1,
                 pad: IntOrTuple = 0, nobias: bool = False, initialW=None,
                 initial_bias=None, cover_all: bool = False,
                 dilate: IntOrTuple = 1, groups: int = 1) -> None:
        if grid.ndim != ndim:
            raise ValueError(
                'distconv.ConvolutionND: ndim=%d but the grid %r has %d '
                'dimensions. Use a grid with one entry per spatial '
                'dimension.' % (ndim, grid.shape, grid.ndim))
        super(ConvolutionND, self).__init__(
            ndim, in_channels, out_channels, ksize, stride, pad, nobias,
            initialW, initial_bias, cover_all, dilate, groups)
        self.grid = grid

    def forward(self, x: Input) -> chainer.Variable:
        if self.W.array is None:
            self._initialize_params(x.shape[1])
        return functions.convolution_nd(
            self.grid, x, self.W, self.b, self.stride, self.pad,
            self.cover_all, self.dilate, self.groups,
            _layer=_layer_name(self, 'ConvolutionND'))


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
    """

    def __init__(self, grid: SpatialGrid, size: Optional[int] = None,
                 decay: float = 0.9, eps: float = 2e-5, dtype=None,
                 use_gamma: bool = True, use_beta: bool = True,
                 initial_gamma=None, initial_beta=None, axis=None,
                 initial_avg_mean=None, initial_avg_var=None,
                 layout: str = 'spatial') -> None:
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
            layout=self.layout, _layer=_layer_name(self, 'BatchNormalization'))
