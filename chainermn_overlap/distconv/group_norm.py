"""Group normalisation with statistics over the global spatial extent.

Chainer's :func:`~chainer.functions.group_normalization` normalises each
sample's channel groups over all their cells. On a spatial grid those
cells are spread over the processes of the sample group, so each process
contributes per ``(sample, group)`` sums over its block and one allreduce
over ``grid.mpi_spatial`` (of ``3 N G`` float64 values) gives the global
statistics, the same combination of block sums (Chan et al.'s parallel
variance) as :class:`~.normalization.DistributedBatchNormalization`.
Backward needs one allreduce of ``2 N G`` values. No statistic crosses
samples, so sample groups never communicate here, and a batch of one
sample trains exactly as on one process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import chainer
from chainer import backend
from chainer import function_node
import chainer.functions as F
import numpy

from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import normalization

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]

__all__ = ['DistributedGroupNormalization', 'group_normalization']


def _channel_vector(v, groups, per_group):
    """A per-channel vector as ``(1, G, C / G, 1)`` to scale row views."""
    return v.reshape(1, groups, per_group, 1)


class DistributedGroupNormalization(function_node.FunctionNode):
    """Group normalisation of spatial blocks with global statistics.

    Args:
        grid (SpatialGrid): The grid (reductions over ``grid.mpi_spatial``).
        groups (int): Number of channel groups.
        eps (float): Added to the variance.
        count (int): Values per ``(sample, group)`` in the global domain.
    """

    def __init__(self, grid: SpatialGrid, groups: int, eps: float,
                 count: int) -> None:
        self.grid = grid
        self.groups = groups
        self.eps = eps
        self.count = count

    def _cells(self, x):
        """``x`` as ``(N, G, C / G, cells)``."""
        n, c = x.shape[:2]
        return x.reshape(n, self.groups, c // self.groups,
                         int(numpy.prod(x.shape[2:])))

    def forward(self, inputs):
        self.retain_inputs((0, 1))
        x, gamma, beta = inputs
        xp = backend.get_array_module(x)
        interm = numpy.promote_types(x.dtype, gamma.dtype)
        x4 = self._cells(x).astype(interm, copy=False)
        n, g, per = x4.shape[:3]
        n_local = per * x4.shape[3]
        s = x4.sum(axis=(2, 3), dtype=numpy.float64)
        local_mean = (s / max(n_local, 1)).astype(interm)
        dev = x4 - local_mean[:, :, None, None]
        q = (dev * dev).sum(axis=(2, 3), dtype=numpy.float64)
        del dev
        shift = s * s / n_local if n_local else xp.zeros_like(s)
        tot = _comm.allreduce_sum(
            self.grid.mpi_spatial,
            xp.concatenate([s.ravel(), q.ravel(), shift.ravel()]))
        m = self.count
        k = n * g
        mean64 = tot[:k] / m
        var64 = xp.maximum(tot[k:2 * k] + (tot[2 * k:] - tot[:k] * mean64),
                           0) / m
        mean = mean64.astype(interm).reshape(n, g, 1, 1)
        inv_std = (1 / xp.sqrt(var64 + self.eps)).astype(interm).reshape(
            n, g, 1, 1)
        xhat = (x4 - mean) * inv_std
        y = xhat * _channel_vector(gamma.astype(interm, copy=False), g, per) \
            + _channel_vector(beta.astype(interm, copy=False), g, per)
        self._mean, self._inv_std = mean, inv_std
        return y.reshape(x.shape).astype(x.dtype, copy=False),

    def backward(self, indexes, grad_outputs):
        x, gamma, gy, xp, interm = normalization.backward_inputs(
            self, grad_outputs, 'distconv.group_normalization')
        x4 = self._cells(x).astype(interm, copy=False)
        gy4 = self._cells(gy).astype(interm, copy=False)
        n, g, per = x4.shape[:3]
        xhat = (x4 - self._mean) * self._inv_std
        gxhat = gy4 * _channel_vector(gamma.astype(interm, copy=False), g,
                                      per)
        sums = xp.concatenate([
            gxhat.sum(axis=(2, 3), dtype=numpy.float64).ravel(),
            (gxhat * xhat).sum(axis=(2, 3), dtype=numpy.float64).ravel()])
        tot = _comm.allreduce_sum(self.grid.mpi_spatial, sums)
        k = n * g
        m = self.count
        mean_g = (tot[:k] / m).astype(interm).reshape(n, g, 1, 1)
        mean_gx = (tot[k:] / m).astype(interm).reshape(n, g, 1, 1)
        gx = self._inv_std * (gxhat - mean_g - xhat * mean_gx)
        # Parameter gradients stay local partial sums: summed over all
        # processes they are the single-process gradient (see loss_scale).
        ggamma = (gy4 * xhat).sum(axis=(0, 3)).reshape(-1)
        gbeta = gy4.sum(axis=(0, 3)).reshape(-1)
        return (chainer.Variable(gx.reshape(x.shape).astype(x.dtype,
                                                            copy=False)),
                chainer.Variable(ggamma.astype(gamma.dtype, copy=False)),
                chainer.Variable(gbeta.astype(gamma.dtype, copy=False)))


def group_normalization(grid: SpatialGrid, x: Input, groups: int,
                        gamma: Input, beta: Input, eps: float = 1e-5,
                        _layer: Optional[str] = None) -> chainer.Variable:
    """Group normalisation with global statistics (see the FunctionNode).

    Mirrors :func:`chainer.functions.group_normalization` with the grid
    first. Collective over the grid's sample group.

    Args:
        grid (SpatialGrid): The process grid.
        x: This process's block ``(N, C, *block)``, all channels.
        groups (int): Number of channel groups (divides ``C``).
        gamma, beta: Scale and shift ``(C,)``, the same everywhere.
        eps (float): Added to the variance.

    Returns:
        chainer.Variable: The normalised block.

    Raises:
        ValueError: On a bad layout or arguments (on every process).
    """
    layer = _layer or 'distconv.group_normalization'
    x = chainer.as_variable(x)
    gamma = chainer.as_variable(gamma)
    beta = chainer.as_variable(beta)
    sig = (layer, repr(groups), tuple(gamma.shape), tuple(beta.shape),
           float(eps))
    lay = grid.check_spatial(x, layer, sig, channel_split=False)
    c = x.shape[1]
    if not isinstance(groups, (int, numpy.integer)) or groups < 1 \
            or c % groups:
        raise ValueError(
            '%s: groups must be a positive int dividing the %d channels, '
            'got %r. Choose a number of groups that divides the channels.'
            % (layer, c, groups))
    if tuple(gamma.shape) != (c,) or tuple(beta.shape) != (c,):
        raise ValueError(
            '%s: gamma %r and beta %r must have shape (%d,) for an input '
            'with %d channels. Set size to the number of channels.'
            % (layer, gamma.shape, beta.shape, c, c))
    count = (c // groups) * int(numpy.prod(lay.spatial_shape))
    if count == 0:
        raise ValueError(
            '%s: the global spatial domain is empty; group statistics are '
            'undefined.' % layer)
    if grid.spatial_size == 1 and x.shape[0]:
        # Whole samples: Chainer's own function is the serial one (which
        # cannot take an empty batch, a sample group without samples).
        return F.group_normalization(x, int(groups), gamma, beta, eps)
    return DistributedGroupNormalization(grid, int(groups), eps,
                                         count).apply((x, gamma, beta))[0]
