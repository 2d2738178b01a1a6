"""Batch normalisation with statistics over the whole distributed batch.

:class:`DistributedBatchNormalization` normalises blocks of the spatial
(or sample) layout; :class:`TiledBatchNormalization` a box computed by a
tiled stack, with statistics from its owned cells only. Both reduce the
same three per-channel sums over ``grid.mpi_data`` and derive the
statistics and running averages in one place (:class:`_GlobalStatistics`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import chainer
from chainer import backend
from chainer import function_node
import numpy

from chainermn_overlap.distconv import _comm

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

    Input = Union[chainer.Variable, NdArray]

__all__ = ['DistributedBatchNormalization', 'TiledBatchNormalization',
           'batch_normalization']

# Values per chunk of the blocked passes on the CPU: a chunk of the input,
# of the output gradient and one temporary fit in a core's L2 cache, so the
# temporary costs no memory traffic and no fresh full-size allocation (each
# fresh one page-faults: about 1.4 ms per 8 MB here).
_CHUNK = 1 << 15


def _chunks(shape, xp):
    """Slices ``(channels, columns)`` of an ``(N, C, M)`` array.

    Each chunk holds about ``_CHUNK`` values: whole channels when a channel
    is small, else column ranges of one channel. On a GPU the whole array
    is one chunk (one kernel per operation).
    """
    n, c, m = shape
    if xp is not numpy or n * c * m <= _CHUNK:
        return [(slice(0, c), slice(0, m))]
    per_channel = n * m
    if per_channel >= _CHUNK:
        w = max(1, _CHUNK // n)
        return [(slice(ch, ch + 1), slice(j, min(j + w, m)))
                for ch in range(c) for j in range(0, m, w)]
    k = max(1, _CHUNK // max(per_channel, 1))
    return [(slice(ch, min(ch + k, c)), slice(0, m))
            for ch in range(0, c, k)]


def _flat(a):
    """``(N, C, *spatial)`` -> ``(N, C, M)`` (a view when contiguous)."""
    # No -1: numpy cannot infer it for an empty array (an empty block).
    return a.reshape(a.shape[:2] + (int(numpy.prod(a.shape[2:])),))



def backward_inputs(node: function_node.FunctionNode, grad_outputs: tuple,
                    name: str) -> tuple:
    """``(x, gamma, gy, xp, interm)`` for the backward of a normalization
    node that retained ``(x, gamma)``: arrays, ``gy`` zeros where the
    output is unused (every process must still join the backward's
    reduction), ``interm`` the computation's dtype.  Double
    backpropagation is refused, naming ``name``."""
    if chainer.config.enable_backprop:
        raise NotImplementedError(
            '{} does not support double backpropagation; call backward() '
            'without enable_double_backprop.'.format(name))
    x, gamma = node.get_retained_inputs()
    x, gamma = x.array, gamma.array
    xp = backend.get_array_module(x)
    gy = grad_outputs[0]
    gy = xp.zeros_like(x) if gy is None else gy.array
    return x, gamma, gy, xp, numpy.promote_types(x.dtype, gamma.dtype)

class _GlobalStatistics(function_node.FunctionNode):
    """Statistics over the global batch from allreduced per-channel sums.

    Args:
        grid (SpatialGrid): The grid (reductions over ``grid.mpi_data``).
        eps (float): Added to the variance.
        count (int): Number of values per channel in the global batch.
        running_mean, running_var: Arrays updated in place (or None).
        decay (float): Decay of the running statistics.
    """

    def __init__(self, grid: SpatialGrid, eps: float, count: int,
                 running_mean: Optional[NdArray] = None,
                 running_var: Optional[NdArray] = None,
                 decay: float = 0.9) -> None:
        self.grid = grid
        self.eps = eps
        self.count = count
        self.running_mean = running_mean
        self.running_var = running_var
        self.decay = decay

    def _statistics(self, xp, tot, c, interm):
        """``(mean, var, inv_std)`` in ``interm`` from the allreduced
        float64 ``[sum, M2, sum^2 / n]`` of ``c`` channels; updates the
        running statistics."""
        m = self.count
        mean64 = tot[:c] / m
        var64 = xp.maximum(tot[c:2 * c] + (tot[2 * c:] - tot[:c] * mean64),
                           0) / m
        mean = mean64.astype(interm)
        var = var64.astype(interm)
        inv_std = 1 / xp.sqrt(var + self.eps, dtype=interm)
        if self.running_mean is not None:
            adjust = m / max(m - 1., 1.)  # unbiased, as Chainer
            self.running_mean *= self.decay
            self.running_mean += (1 - self.decay) * mean
            self.running_var *= self.decay
            self.running_var += (1 - self.decay) * adjust * var
        return mean, var, inv_std


class DistributedBatchNormalization(_GlobalStatistics):
    """Batch normalisation over all samples and spatial cells of all ranks.

    The statistics are those Chainer computes on one process for the global
    batch: per channel, over every sample of every sample group and every
    cell of the global spatial domain. Each process contributes sums over
    its block, so uneven (or empty) blocks are weighted by their number of
    cells.

    Forward needs one allreduce (of ``3 C`` float64 values): each process
    sends its per-channel sum, the sum of squared deviations from its
    *local* mean and ``sum^2 / n``; the global sum of squared deviations is
    then ``sum_i M2_i + (sum_i s_i^2 / n_i - S^2 / N)`` (Chan et al.'s
    parallel variance), with one message round instead of the two of a
    two-pass (centred) formula. It avoids the cancellation of
    ``E[x^2] - E[x]^2``: what cancels is a difference of block means, in
    float64, exact to float32 precision unless the mean exceeds about
    ``10^4`` standard deviations. Backward needs one allreduce (of
    ``2 C`` values). On the CPU both run in blocked passes (:data:`_CHUNK`
    values at a time) whose temporaries stay in cache: the only full-size
    array allocated is the result (``y``, ``gx``). Collective over the whole
    communicator in forward and backward.

    Args:
        grid (SpatialGrid): The process grid.
        eps (float): Added to the variance.
        count (int): Number of values per channel in the global batch.
        running_mean, running_var: Arrays updated in place (or None), as in
            :func:`chainer.functions.batch_normalization`.
        decay (float): Decay of the running statistics.
    """

    def forward(self, inputs):
        self.retain_inputs((0, 1))
        x, gamma, beta = inputs
        xp = backend.get_array_module(x)
        interm = numpy.promote_types(x.dtype, gamma.dtype)
        c = x.shape[1]
        x3 = _flat(x)
        n_local = x3.shape[0] * x3.shape[2]
        chunks = _chunks(x3.shape, xp)
        # Local sums and squared deviations from the local mean, in one
        # read of x; the deviations live in a chunk-sized temporary.
        s = xp.empty(c, dtype=numpy.float64)
        q = xp.empty(c, dtype=numpy.float64)
        tmp = None
        for cs, js in chunks:
            xc = x3[:, cs, js].astype(interm, copy=False)
            part = xc.sum(axis=(0, 2), dtype=interm)
            if js.start == 0:
                s[cs] = part
            else:
                s[cs] += part
        local_mean = (s / max(n_local, 1)).astype(interm)
        for cs, js in chunks:
            xc = x3[:, cs, js]
            if tmp is None or tmp.size < xc.size:
                tmp = xp.empty(xc.size, dtype=interm)
            dev = tmp[:xc.size].reshape(xc.shape)
            xp.subtract(xc, local_mean[None, cs, None], out=dev)
            xp.multiply(dev, dev, out=dev)
            part = dev.sum(axis=(0, 2))
            if js.start == 0:
                q[cs] = part
            else:
                q[cs] += part
        del tmp
        # One allreduce: sum, local M2, and sum^2/n for the mean shift.
        shift = s * s / n_local if n_local else xp.zeros_like(s)
        tot = _comm.allreduce_sum(self.grid.mpi_data,
                                  xp.concatenate([s, q, shift]))
        mean, var, inv_std = self._statistics(xp, tot, c, interm)
        scale = gamma.astype(interm, copy=False) * inv_std
        beta_i = beta.astype(interm, copy=False)
        # y = (x - mean) * scale + beta, chunk by chunk in place.
        y3 = xp.empty(x3.shape, dtype=interm)
        for cs, js in chunks:
            yc = y3[:, cs, js]
            xp.subtract(x3[:, cs, js], mean[None, cs, None], out=yc)
            yc *= scale[None, cs, None]
            yc += beta_i[None, cs, None]
        y = y3.reshape(x.shape).astype(x.dtype, copy=False)
        self._mean, self._inv_std = mean, inv_std
        return y,

    def backward(self, indexes, grad_outputs):
        x, gamma, gy, xp, interm = backward_inputs(
            self, grad_outputs, 'distconv.BatchNormalization')
        c = x.shape[1]
        x3, gy3 = _flat(x), _flat(gy)
        chunks = _chunks(x3.shape, xp)
        mean = self._mean[None, :, None]
        inv_std = self._inv_std[None, :, None]
        # Local sums of gy and gy * x_hat, one chunk-sized temporary; the
        # chunks' partial sums are accumulated in float64.
        sums = xp.empty(2 * c, dtype=numpy.float64)
        gbeta, ggamma = sums[:c], sums[c:]
        tmp = None
        for cs, js in chunks:
            xc = x3[:, cs, js]
            gyc = gy3[:, cs, js].astype(interm, copy=False)
            if tmp is None or tmp.size < xc.size:
                tmp = xp.empty(xc.size, dtype=interm)
            xhat = tmp[:xc.size].reshape(xc.shape)
            xp.subtract(xc, mean[:, cs], out=xhat)
            xhat *= inv_std[:, cs]
            xhat *= gyc
            gb, gg = gyc.sum(axis=(0, 2)), xhat.sum(axis=(0, 2))
            if js.start == 0:
                gbeta[cs], ggamma[cs] = gb, gg
            else:
                gbeta[cs] += gb
                ggamma[cs] += gg
        del tmp
        tot = _comm.allreduce_sum(self.grid.mpi_data, sums)
        m = self.count
        coef = (gamma.astype(interm, copy=False) * self._inv_std)[None, :,
                                                                  None]
        # In the compute dtype: a float64 operand would make every
        # element-wise operation below run in float64.
        a = (tot[c:] / m).astype(interm)[None, :, None]
        b = (tot[:c] / m).astype(interm)[None, :, None]
        # gx = coef * (gy - (x_hat * tot_ggamma + tot_gbeta) / m), chunk
        # by chunk into the one full-size result.
        gx3 = xp.empty(x3.shape, dtype=interm)
        for cs, js in chunks:
            g = gx3[:, cs, js]
            xp.subtract(x3[:, cs, js], mean[:, cs], out=g)
            g *= inv_std[:, cs]
            g *= a[:, cs]
            g += b[:, cs]
            xp.subtract(gy3[:, cs, js], g, out=g)
            g *= coef[:, cs]
        gx = gx3.reshape(x.shape)
        # Parameter gradients stay local partial sums: summed over all
        # processes they are the single-process gradient (see loss_scale).
        return (chainer.Variable(gx.astype(x.dtype, copy=False)),
                chainer.Variable(ggamma.astype(gamma.dtype, copy=False)),
                chainer.Variable(gbeta.astype(gamma.dtype, copy=False)))


class TiledBatchNormalization(_GlobalStatistics):
    """Batch normalisation of a computed box, statistics from owned cells.

    Forward: per channel, the mean and variance over the owned cells of
    every process (reduced over ``grid.mpi_data``); every cell of the box
    (owned or computed redundantly) is normalised with them, and the
    running statistics are updated as Chainer does. Backward is the exact
    adjoint: the direct term for every cell, and the statistics' term,
    whose sums run over every computed cell of every process, for the
    owned cells only.

    Args:
        grid (SpatialGrid): The grid.
        owned (tuple): Selection of the owned cells in the box.
        count (int): Owned values per channel over all processes.
        eps, running_mean, running_var, decay: As in Chainer.
    """

    def __init__(self, grid, owned, count, eps, running_mean=None,
                 running_var=None, decay=0.9):
        super(TiledBatchNormalization, self).__init__(
            grid, eps, count, running_mean, running_var, decay)
        self.owned = owned

    def forward(self, inputs):
        self.retain_inputs((0, 1))
        x, gamma, beta = inputs
        xp = backend.get_array_module(x)
        c = x.shape[1]
        xo = x[self.owned]
        axes = (0,) + tuple(range(2, x.ndim))
        n_local = int(numpy.prod([xo.shape[a] for a in axes]))
        xo64 = xo.astype(numpy.float64)
        s = xo64.sum(axis=axes)
        local_mean = s / max(n_local, 1)
        shape = (1, c) + (1,) * (x.ndim - 2)
        q = ((xo64 - local_mean.reshape(shape)) ** 2).sum(axis=axes)
        shift = s * s / n_local if n_local else xp.zeros_like(s)
        tot = _comm.allreduce_sum(self.grid.mpi_data,
                                  xp.concatenate([s, q, shift]))
        interm = numpy.promote_types(x.dtype, gamma.dtype)
        mean, _, inv_std = self._statistics(xp, tot, c, interm)
        self._mean, self._inv_std = mean, inv_std
        xhat = (x - mean.reshape(shape)) * inv_std.reshape(shape)
        y = xhat * gamma.reshape(shape) + beta.reshape(shape)
        return y.astype(x.dtype, copy=False),

    def backward(self, indexes, grad_outputs):
        if chainer.config.enable_backprop:
            raise NotImplementedError(
                'distconv.Tiled: batch normalisation does not support '
                'double backpropagation.')
        x, gamma = self.get_retained_inputs()
        x, gamma = x.array, gamma.array
        xp = backend.get_array_module(x)
        gy = grad_outputs[0]
        gy = xp.zeros_like(x) if gy is None else gy.array
        c = x.shape[1]
        shape = (1, c) + (1,) * (x.ndim - 2)
        axes = (0,) + tuple(range(2, x.ndim))
        mean = self._mean.reshape(shape)
        inv_std = self._inv_std.reshape(shape)
        xhat = (x - mean) * inv_std
        gbeta = gy.astype(numpy.float64).sum(axis=axes)
        ggamma = (gy * xhat).astype(numpy.float64).sum(axis=axes)
        tot = _comm.allreduce_sum(self.grid.mpi_data,
                                  xp.concatenate([gbeta, ggamma]))
        m = self.count
        coef = (gamma * self._inv_std).reshape(shape)
        a = (tot[c:] / m).astype(xhat.dtype).reshape(shape)
        b = (tot[:c] / m).astype(xhat.dtype).reshape(shape)
        gx = coef * gy
        corr = coef * (xhat[self.owned] * a + b)
        gx[self.owned] -= corr
        return (chainer.Variable(gx.astype(x.dtype, copy=False)),
                chainer.Variable(ggamma.astype(gamma.dtype)),
                chainer.Variable(gbeta.astype(gamma.dtype)))


def batch_normalization(grid: SpatialGrid, x: Input, gamma: Input,
                        beta: Input, eps: float = 2e-5,
                        running_mean: Optional[NdArray] = None,
                        running_var: Optional[NdArray] = None,
                        decay: float = 0.9, layout: str = 'spatial',
                        _layer: Optional[str] = None,
                        channel_split: bool = False) -> chainer.Variable:
    """Batch normalisation with global statistics (see the FunctionNode).

    Args:
        grid (SpatialGrid): The process grid.
        x: This process's block ``(N, C, *block)`` (spatial layout), or its
            whole samples ``(n, C, *spatial)`` (sample layout).
        gamma, beta: Scale and shift ``(C,)``.
        eps (float): Added to the variance.
        running_mean, running_var: Updated in place if given.
        decay (float): Decay of the running statistics.
        layout (str): ``'spatial'`` or ``'sample'`` (the layout of ``x``;
            the statistics are over the global batch either way).
        channel_split (bool): Whether ``x`` holds this process's block of
            the channels of a grid with a channel axis (gamma and beta are
            then that block too). Statistics are reduced over the processes
            of this channel coordinate (``grid.mpi_data``) either way, so a
            tensor held whole on every channel coordinate is not counted
            once per copy.

    Returns:
        chainer.Variable: The normalised block.
    """
    layer = _layer or 'distconv.batch_normalization'
    x = chainer.as_variable(x)
    gamma = chainer.as_variable(gamma)
    beta = chainer.as_variable(beta)
    # Channel blocks differ between channel coordinates; their agreement
    # with the input is checked below on each process.
    sig = (layer, bool(channel_split)) + (
        () if channel_split else (tuple(gamma.shape), tuple(beta.shape)))
    if layout == 'spatial':
        lay = grid.check_spatial(x, layer, sig,
                                 channel_split=bool(channel_split))
        channels = x.shape[1]
        count = sum(lay.group_samples) * int(numpy.prod(lay.spatial_shape))
    elif layout == 'sample':
        spatial_shape, _ = grid.check_samples(x, layer, sig)
        channels = x.shape[1]
        n_total = int(_comm.allreduce_sum(
            grid.mpi_data, numpy.array([x.shape[0]], numpy.int64))[0])
        count = n_total * int(numpy.prod(spatial_shape))
    else:
        raise ValueError("%s: layout must be 'spatial' or 'sample', got %r"
                         % (layer, layout))
    if tuple(gamma.shape) != (channels,) or tuple(beta.shape) != (channels,):
        raise ValueError(
            '%s: gamma %r and beta %r must have shape (%d,) for an input '
            'with %d channels. Set size to the number of channels.'
            % (layer, gamma.shape, beta.shape, channels, channels))
    if count == 0:
        raise ValueError(
            '%s: the global batch is empty (no samples or no spatial cells '
            'on any process); batch statistics are undefined. Skip empty '
            'batches.' % layer)
    if grid.mpi_data.Get_size() == 1:
        # One process holds the whole batch: the global statistics are the
        # local ones, and Chainer's own function is exactly the serial one
        # (and supports double backpropagation).
        return chainer.functions.batch_normalization(
            x, gamma, beta, eps=eps, running_mean=running_mean,
            running_var=running_var, decay=decay)
    return DistributedBatchNormalization(
        grid, eps, count, running_mean, running_var, decay).apply(
            (x, gamma, beta))[0]
