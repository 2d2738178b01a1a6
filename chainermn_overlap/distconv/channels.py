"""The channel axis of the process grid: reductions over channel blocks.

A grid with ``channels=C`` splits the channels (or the filters) of a layer
over ``C`` processes that hold the same samples and spatial block (Dryden
et al., IPDPS 2019, "channel and filter parallelism"). Two collectives move
data along that axis:

* :class:`ChannelAllreduce`: the partial sums of a ``split='channel'``
  convolution (each process convolves its block of input channels with its
  block of W's input channels) are summed over the channel axis; every
  channel coordinate then holds the whole output. It is self-adjoint: the
  copies of the output each receive their own gradient (their own loss),
  and the exact adjoint sums them.
* nothing at all for ``split='filter'``: its input is held whole on every
  channel coordinate and each coordinate computes its block of output
  channels. The gradient of that input is held as per-copy contributions
  (each coordinate's partial sum over its filters), like every replicated
  tensor in distconv: summed over the copies they are the gradient, and
  parameters upstream, replicated over the copies, get gradients whose sum
  over all processes is the gradient of the sum of the processes' losses
  (the training convention of :meth:`SpatialGrid.loss_scale`). So the
  reduction Dryden et al. run in backward is left to the optimizer's
  gradient reduction, which runs anyway.

A ``'filter'`` layer's output (split channels) feeds a ``'channel'`` layer
directly, with no redistribution between them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import chainer
from chainer import backend
from chainer import function_node
import numpy
from mpi4py import MPI

from chainermn_overlap import _mpi_json
from chainermn_overlap.distconv import _comm

if TYPE_CHECKING:
    from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['ChannelAllreduce', 'ChannelBlockOfSum', 'GatherChannels',
           'allreduce_array', 'channel_block', 'gather_channels']

_MPI_TYPES = {numpy.dtype(numpy.float16): None,
              numpy.dtype(numpy.float32): MPI.FLOAT,
              numpy.dtype(numpy.float64): MPI.DOUBLE}


def allreduce_array(mpi_comm, arr):
    """Sum-allreduces an activation-sized array in its own dtype.

    Unlike :func:`_comm.allreduce_sum` (tiny statistics, float64), this
    moves whole activations, so it keeps their dtype (float16 is summed in
    float32, which MPI has no type for). Every process must pass the same
    shape and dtype.

    Returns:
        The sum over ``mpi_comm``, a new array on ``arr``'s device.
    """
    if mpi_comm.Get_size() == 1:
        return arr.copy()
    host = _comm.to_host(arr)
    mpi_type = _MPI_TYPES.get(host.dtype)
    if mpi_type is None:
        send, mpi_type = host.astype(numpy.float32), MPI.FLOAT
    else:
        send = host
    out = numpy.empty_like(send)
    mpi_comm.Allreduce([send, mpi_type], [out, mpi_type], op=MPI.SUM)
    return _comm.like(out.astype(arr.dtype, copy=False), arr)


class ChannelAllreduce(function_node.FunctionNode):
    """Sum over the grid's channel axis; self-adjoint (see the module).

    Args:
        grid (SpatialGrid): The process grid.
    """

    def __init__(self, grid: SpatialGrid) -> None:
        self.grid = grid

    def forward(self, inputs):
        x, = inputs
        self._meta = (x.shape, x.dtype, backend.get_array_module(x))
        return allreduce_array(self.grid.mpi_channel, x),

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        if gy is None:
            # Every coordinate must join the reduction, also one whose copy
            # of the output was not used.
            shape, dtype, xp = self._meta
            gy = chainer.Variable(xp.zeros(shape, dtype=dtype))
        return ChannelAllreduce(self.grid).apply((gy,))


class GatherChannels(function_node.FunctionNode):
    """Channel blocks -> all channels on every channel coordinate.

    Forward: an allgather of the blocks over the channel axis. The output
    is replicated, so its gradient arrives as per-copy contributions; the
    exact adjoint sums them (an allreduce) and keeps this coordinate's
    block.

    Args:
        grid (SpatialGrid): The process grid.
        total (int): Global number of channels.
    """

    def __init__(self, grid: SpatialGrid, total: int) -> None:
        self.grid = grid
        self.total = total

    def forward(self, inputs):
        x, = inputs
        parts = _mpi_json.allgather_arrays(self.grid.mpi_channel,
                                           _comm.to_host(x))
        y = _comm.like(numpy.concatenate(parts, axis=1), x)
        self._meta = (y.shape, y.dtype, backend.get_array_module(x))
        return y,

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        if gy is None:  # every coordinate must join the reduction
            shape, dtype, xp = self._meta
            gy = chainer.Variable(xp.zeros(shape, dtype=dtype))
        return ChannelBlockOfSum(self.grid, self.total).apply((gy,))


class ChannelBlockOfSum(function_node.FunctionNode):
    """Sum of the copies over the channel axis, this coordinate's block.

    The adjoint of :class:`GatherChannels` (and vice versa).
    """

    def __init__(self, grid: SpatialGrid, total: int) -> None:
        self.grid = grid
        self.total = total

    def forward(self, inputs):
        g, = inputs
        lo, hi = self.grid.channel_range(self.total)
        summed = allreduce_array(self.grid.mpi_channel, g)
        xp = backend.get_array_module(g)
        return xp.ascontiguousarray(summed[:, lo:hi]),

    def backward(self, indexes, grad_outputs):
        return GatherChannels(self.grid, self.total).apply(grad_outputs)


def gather_channels(grid: SpatialGrid, x) -> chainer.Variable:
    """Channel-split tensor -> all channels on every channel coordinate.

    Collective over the grid's channel axis (and the communicator, for
    the layout check).

    Args:
        grid (SpatialGrid): The process grid.
        x: This process's channel block ``(N, C_block, *block)``.

    Returns:
        chainer.Variable: ``(N, C, *block)``, the same on every channel
        coordinate.
    """
    layer = 'distconv.gather_channels'
    x = chainer.as_variable(x)
    layout = grid.check_spatial(x, layer, (layer,), channel_split=True)
    if grid.channels == 1:
        return x
    return GatherChannels(grid, layout.channels).apply((x,))[0]


def channel_block(grid: SpatialGrid, x) -> chainer.Variable:
    """This coordinate's channel block of a tensor held whole everywhere.

    A slice, no message. Its gradient is held as per-copy contributions
    (zero outside the block), whose sum over the copies is the gradient.

    Args:
        grid (SpatialGrid): The process grid.
        x: ``(N, C, *block)``, the same on every channel coordinate.

    Returns:
        chainer.Variable: ``(N, C_block, *block)``.
    """
    layer = 'distconv.channel_block'
    x = chainer.as_variable(x)
    layout = grid.check_spatial(x, layer, (layer,), channel_split=False)
    lo, hi = grid.channel_range(layout.channels)
    return x[:, lo:hi]
