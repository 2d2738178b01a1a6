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

:class:`GatherChannels` (blocks -> whole) and :class:`ChannelBlockOfSum`
(the sum of per-coordinate arrays, this coordinate's block) are each
other's adjoints: one ``Allgatherv`` and one ``Reduce_scatter`` straight
into and out of the result buffers, with no size exchange (the blocks
follow from the global channel count). ``ChannelBlockOfSum`` also reduces
the partial sums of a ``split='channel'`` convolution with
``split_output=True``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import chainer
from chainer import backend
from chainer import function_node
import numpy
from mpi4py import MPI

from chainermn_overlap.communication import blocking
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
    blocking.allreduce(mpi_comm, [send, mpi_type], [out, mpi_type], MPI.SUM,
                       'a distconv channel sum', poll=True)
    return _comm.like(out.astype(arr.dtype, copy=False), arr)


# Element types that move the bytes of an item unchanged (a gather does no
# arithmetic, so any dtype travels as unsigned integers of its width).
_MOVE_TYPES = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T,
               8: MPI.UINT64_T}


def _host_contiguous(arr):
    """A C-contiguous host copy of ``arr`` (``arr`` itself if it is one).

    Chainer's CPU convolutions return channels-last arrays viewed as
    ``(N, C, *spatial)``; numpy copies such a transposed view element by
    element, about half as fast as copying it in slabs of 32 spatial
    cells (each slab a small transpose that stays in the L1 cache).
    """
    if (backend.get_array_module(arr) is not numpy or arr.flags.c_contiguous
            or arr.ndim < 3):
        return _comm.to_host(arr)
    n, c = arr.shape[:2]
    cells = int(numpy.prod(arr.shape[2:]))
    last = numpy.moveaxis(arr, 1, -1)
    if not last.flags.c_contiguous or n * c * cells == 0:
        return numpy.ascontiguousarray(arr)
    src = last.reshape(n, cells, c)
    out = numpy.empty((n, c, cells), dtype=arr.dtype)
    for i in range(n):
        for j in range(0, cells, 32):
            out[i, :, j:j + 32] = src[i, j:j + 32].T
    return out.reshape(arr.shape)


def _block_counts(grid, n, total, cells):
    """Channels, elements and element offsets of each coordinate's block."""
    widths = [hi - lo for lo, hi in
              (grid.channel_range(total, c) for c in range(grid.channels))]
    counts = [n * w * cells for w in widths]
    displs = [0] * len(counts)
    for i in range(1, len(counts)):
        displs[i] = displs[i - 1] + counts[i - 1]
    return widths, counts, displs


def _allgather_blocks(grid, x, total):
    """The channel blocks of every coordinate, joined along axis 1.

    One ``Allgatherv`` straight into the result: the blocks arrive
    block-major (block ``c`` is ``(N, C_c, *block)``), which is the channel
    order of the result itself when ``N == 1``; otherwise one
    concatenation puts each sample's channels together. The blocks'
    shapes are known from ``total`` and the balanced split (the caller has
    checked the layout), so no sizes are exchanged.
    """
    host = _comm.to_host(x)
    n, rest = host.shape[0], host.shape[2:]
    cells = int(numpy.prod(rest))
    widths, counts, displs = _block_counts(grid, n, total, cells)
    flat = numpy.empty(sum(counts), dtype=host.dtype)
    mpi_type = _MOVE_TYPES.get(host.dtype.itemsize)
    if mpi_type is None:  # an unusual width: move bytes
        unit, mpi_type = host.dtype.itemsize, MPI.BYTE
        send = host.reshape(-1).view(numpy.uint8)
        recv = flat.view(numpy.uint8)
    else:
        unit, send, recv = 1, host.reshape(-1), flat
    if len(set(counts)) == 1:
        # Even blocks: the plain allgather (MPICH's is faster than the
        # vector one for the same bytes).
        blocking.wait([grid.mpi_channel.Iallgather(
            [send, mpi_type], [recv, mpi_type])],
            'a distconv channel gather', poll=True)
    else:
        blocking.allgatherv(
            grid.mpi_channel, [send, mpi_type],
            [recv, [c * unit for c in counts], [d * unit for d in displs],
             mpi_type], 'a distconv channel gather', poll=True)
    if n == 1:
        y = flat.reshape((1, total) + rest)
    else:
        y = numpy.concatenate(
            [flat[d:d + c].reshape((n, w) + rest)
             for w, c, d in zip(widths, counts, displs)], axis=1)
    return _comm.like(y, x)


def _reduce_scatter_blocks(grid, g, total):
    """This coordinate's channel block of the sum of ``g`` over the axis.

    One ``Reduce_scatter``: each coordinate receives only its block of the
    sum (half the traffic of an allreduce and no slice copy at two
    coordinates). The send buffer is ``g`` itself when ``N == 1`` (its
    channel blocks are already consecutive); otherwise the blocks are
    packed block-major once. Summed in ``g``'s dtype (float16 in float32,
    which MPI has no type for).
    """
    host = _host_contiguous(g)
    n, rest = host.shape[0], host.shape[2:]
    cells = int(numpy.prod(rest))
    mpi_type = _MPI_TYPES.get(host.dtype)
    if mpi_type is None:
        host, mpi_type = host.astype(numpy.float32), MPI.FLOAT
    _, counts, _ = _block_counts(grid, n, total, cells)
    if n == 1 or grid.channels == 1:
        send = host.reshape(-1)
    else:
        send = numpy.concatenate(
            [host[:, lo:hi].reshape(-1) for lo, hi in
             (grid.channel_range(total, c) for c in range(grid.channels))])
    lo, hi = grid.channel_range(total)
    out = numpy.empty((n, hi - lo) + rest, dtype=host.dtype)
    if len(set(counts)) == 1:
        blocking.reduce_scatter_block(
            grid.mpi_channel, [send, mpi_type], [out, mpi_type], MPI.SUM,
            'a distconv channel reduce-scatter', poll=True)
    else:
        blocking.reduce_scatter(
            grid.mpi_channel, [send, mpi_type], [out, mpi_type], counts,
            MPI.SUM, 'a distconv channel reduce-scatter', poll=True)
    return _comm.like(out.astype(g.dtype, copy=False), g)


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
    exact adjoint sums them and keeps this coordinate's block (one
    reduce-scatter).

    Args:
        grid (SpatialGrid): The process grid.
        total (int): Global number of channels.
    """

    def __init__(self, grid: SpatialGrid, total: int) -> None:
        self.grid = grid
        self.total = total

    def forward(self, inputs):
        x, = inputs
        y = _allgather_blocks(self.grid, x, self.total)
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
        return _reduce_scatter_blocks(self.grid, g, self.total),

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
