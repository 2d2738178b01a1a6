"""Batch normalisation with statistics over the whole distributed batch."""
import chainer
from chainer import backend
from chainer import function_node
import numpy

from chainermn_overlap.distconv import _comm


class DistributedBatchNormalization(function_node.FunctionNode):
    """Batch normalisation over all samples and spatial cells of all ranks.

    The statistics are those Chainer computes on one process for the global
    batch: per channel, over every sample of every sample group and every
    cell of the global spatial domain. Each process contributes sums over
    its block, so uneven (or empty) blocks are weighted by their number of
    cells. The variance uses a second, centred pass (sum of squared
    deviations from the global mean) to avoid the cancellation of
    ``E[x^2] - E[x]^2``. Collective over the whole communicator in forward
    and backward.

    Args:
        grid (SpatialGrid): The process grid.
        eps (float): Added to the variance.
        count (int): Number of values per channel in the global batch.
        running_mean, running_var: Arrays updated in place (or None), as in
            :func:`chainer.functions.batch_normalization`.
        decay (float): Decay of the running statistics.
    """

    def __init__(self, grid, eps, count, running_mean=None, running_var=None,
                 decay=0.9):
        self.grid = grid
        self.eps = eps
        self.count = count
        self.running_mean = running_mean
        self.running_var = running_var
        self.decay = decay

    def forward(self, inputs):
        self.retain_inputs((0, 1))
        x, gamma, beta = inputs
        xp = backend.get_array_module(x)
        interm = numpy.promote_types(x.dtype, gamma.dtype)
        axis = (0,) + tuple(range(2, x.ndim))
        ex = (None, slice(None)) + (None,) * (x.ndim - 2)
        m = self.count
        world = self.grid.mpi_world
        # Two full-size temporaries in all (the deviations and their
        # squares, whose buffer then receives the output): the naive
        # expression allocates one per operator.
        mean = _comm.allreduce_sum(
            world, x.sum(axis=axis, dtype=interm)).astype(interm) / m
        dev = x.astype(interm, copy=False) - mean[ex]
        buf = xp.multiply(dev, dev)
        var = _comm.allreduce_sum(world, buf.sum(axis=axis)) / m
        var = var.astype(interm, copy=False)
        inv_std = 1 / xp.sqrt(var + self.eps, dtype=interm)
        scale = gamma.astype(interm, copy=False) * inv_std
        xp.multiply(dev, scale[ex], out=buf)
        del dev
        buf += beta.astype(interm, copy=False)[ex]
        y = buf.astype(x.dtype, copy=False)
        self._mean, self._inv_std = mean, inv_std
        if self.running_mean is not None:
            adjust = m / max(m - 1., 1.)  # unbiased, as Chainer
            self.running_mean *= self.decay
            self.running_mean += (1 - self.decay) * mean
            self.running_var *= self.decay
            self.running_var += (1 - self.decay) * adjust * var
        return y,

    def backward(self, indexes, grad_outputs):
        if chainer.config.enable_backprop:
            raise NotImplementedError(
                'distconv.BatchNormalization does not support double '
                'backpropagation; call backward() without '
                'enable_double_backprop.')
        x, gamma = self.get_retained_inputs()
        x, gamma = x.array, gamma.array
        xp = backend.get_array_module(x)
        gy = grad_outputs[0]
        # Every process must join the reductions below, even when its
        # output gradient is None (output unused).
        gy = xp.zeros_like(x) if gy is None else gy.array
        interm = numpy.promote_types(x.dtype, gamma.dtype)
        axis = (0,) + tuple(range(2, x.ndim))
        ex = (None, slice(None)) + (None,) * (x.ndim - 2)
        # Two full-size temporaries (x_hat, and one buffer that becomes
        # the input gradient), updated in place.
        xhat = x.astype(interm, copy=False) - self._mean[ex]
        xhat *= self._inv_std[ex]
        gy_i = gy.astype(interm, copy=False)
        gbeta = gy_i.sum(axis=axis)
        buf = xp.multiply(gy_i, xhat)
        ggamma = buf.sum(axis=axis)
        c = gbeta.shape[0]
        tot = _comm.allreduce_sum(self.grid.mpi_world,
                                  xp.concatenate([gbeta, ggamma]))
        tot_gbeta, tot_ggamma = tot[:c], tot[c:]
        m = self.count
        coef = gamma.astype(interm, copy=False) * self._inv_std
        # gx = coef * (gy - (tot_gbeta + xhat * tot_ggamma) / m)
        xp.multiply(xhat, (tot_ggamma / m)[ex], out=buf)
        del xhat
        buf += (tot_gbeta / m)[ex]
        xp.subtract(gy_i, buf, out=buf)
        buf *= coef[ex]
        gx = buf
        # Parameter gradients stay local partial sums: summed over all
        # processes they are the single-process gradient (see loss_scale).
        return (chainer.Variable(gx.astype(x.dtype, copy=False)),
                chainer.Variable(ggamma.astype(gamma.dtype, copy=False)),
                chainer.Variable(gbeta.astype(gamma.dtype, copy=False)))


def batch_normalization(grid, x, gamma, beta, eps=2e-5, running_mean=None,
                        running_var=None, decay=0.9, layout='spatial',
                        _layer=None):
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

    Returns:
        chainer.Variable: The normalised block.
    """
    layer = _layer or 'distconv.batch_normalization'
    x = chainer.as_variable(x)
    gamma = chainer.as_variable(gamma)
    beta = chainer.as_variable(beta)
    sig = (layer, tuple(gamma.shape), tuple(beta.shape))
    if layout == 'spatial':
        lay = grid.check_spatial(x, layer, sig)
        channels = lay.channels
        count = sum(lay.group_samples) * int(numpy.prod(lay.spatial_shape))
    elif layout == 'sample':
        spatial_shape, _ = grid.check_samples(x, layer, sig)
        channels = x.shape[1]
        n_total = int(_comm.allreduce_sum(
            grid.mpi_world, numpy.array([x.shape[0]], numpy.int64))[0])
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
    if grid.size == 1:
        # One process holds the whole batch: the global statistics are the
        # local ones, and Chainer's own function is exactly the serial one
        # (and supports double backpropagation).
        return chainer.functions.batch_normalization(
            x, gamma, beta, eps=eps, running_mean=running_mean,
            running_var=running_var, decay=decay)
    return DistributedBatchNormalization(
        grid, eps, count, running_mean, running_var, decay).apply(
            (x, gamma, beta))[0]
