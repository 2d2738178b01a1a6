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

from chainermn_overlap.distconv import _comm

if TYPE_CHECKING:
    from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['ChannelAllreduce', 'allreduce_array']

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
