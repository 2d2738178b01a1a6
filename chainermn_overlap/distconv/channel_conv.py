"""Channel-parallel convolutions with their channel messages overlapped.

A ``split='channel'`` convolution with ``split_output=True`` sums partial
products over the channel axis and keeps this coordinate's block of the
output channels (a reduce-scatter); a ``split='filter'`` convolution with
``split_input=True`` needs every coordinate's block of the input channels
(an allgather). Run as a convolution followed (or preceded) by a
collective, the two form a serial chain: the collective waits for the
slowest coordinate, and nothing else runs while it does.

The nodes here post each message as soon as its data exists and compute
what does not depend on it meanwhile, with an MPI progress call
(``Testall``) between two pieces of work (MPICH moves data only inside MPI
calls):

* :class:`ScatterConvolution`, forward: the partial output of each other
  coordinate's block of output channels first, each sent as soon as it is
  computed, then its own block's; the partials received are summed last.
  Backward: its block of the output gradient is sent first; the weight
  gradient's rows of each block are computed as the blocks arrive (its
  own first), then the input gradient in one product over all output
  channels.
* :class:`GatherConvolution`, forward: its input block is sent first and
  unfolded (``im2col``) while the others travel; then one product over all
  input channels. Backward: the input gradient of every block in one
  product, each other coordinate's part sent as soon as it is folded back
  (``col2im``); the weight gradient is computed while the parts travel;
  the parts received are summed last.

The products are those of a Chainer convolution (``im2col`` and matrix
products), the weight-row blocks of the forward scatter excepted; sums
over coordinates run in a fixed order (coordinate 0 first), so results do
not depend on arrival order. Memory is that of the serial path: the
gathered input blocks are kept for backward, as the gathered input of a
Chainer convolution would be.

These nodes run where every process holds whole samples
(``grid.spatial_size == 1``, the late stages the channel axis is for);
spatially split grids take the general path (halo exchange, convolution,
collective). ``grid.channel_overlap = False`` takes it everywhere. Double
backpropagation is not supported by these nodes (a clear error).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import chainer
from chainer import backend
from chainer import function_node
from chainer.utils import conv as conv_utils
from chainer.utils import conv_nd as conv_nd_utils
import numpy
from mpi4py import MPI

from chainermn_overlap.communication import blocking
from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import _pack
from chainermn_overlap.distconv import geometry

if TYPE_CHECKING:
    from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['GatherConvolution', 'ScatterConvolution']

# Each node's messages have a tag of their own on the grid's private
# channel communicator (_comm.next_exchange): a graph that differs between
# coordinates makes every one of them raise CommunicationTimeout naming the
# exchange, never take another node's message.


class _Window(object):
    """Kernel geometry: im2col / col2im on either backend."""

    def __init__(self, ksize, stride, pad, dilate, cover_all):
        self.ksize = tuple(ksize)
        self.stride = tuple(stride)
        self.pad = tuple(pad)
        self.dilate = tuple(dilate)
        self.cover_all = bool(cover_all)

    def out_shape(self, dims):
        return tuple(geometry.output_size(n, k, s, p, d, self.cover_all)
                     for n, k, s, p, d in zip(dims, self.ksize, self.stride,
                                              self.pad, self.dilate))

    def im2col(self, x):
        """``(N, C, *k, *out)`` as ``(N, C * prod(k), prod(out))``."""
        if len(self.ksize) == 2:
            (kh, kw), (sy, sx), (ph, pw), (dy, dx) = (
                self.ksize, self.stride, self.pad, self.dilate)
            col = conv_utils.im2col(x, kh, kw, sy, sx, ph, pw,
                                    cover_all=self.cover_all, dy=dy, dx=dx)
        else:
            col = conv_nd_utils.im2col_nd(x, self.ksize, self.stride,
                                          self.pad, cover_all=self.cover_all,
                                          dilate=self.dilate)
        n, c = col.shape[:2]
        return col.reshape(n, c * _prod(self.ksize),
                           _prod(col.shape[2 + len(self.ksize):]))

    def col2im(self, gcol, channels, dims):
        """The adjoint of :meth:`im2col` for an input of spatial ``dims``."""
        n = gcol.shape[0]
        col = gcol.reshape((n, channels) + self.ksize + self.out_shape(dims))
        if len(self.ksize) == 2:
            (sy, sx), (ph, pw), (dy, dx) = self.stride, self.pad, self.dilate
            return conv_utils.col2im(col, sy, sx, ph, pw, dims[0], dims[1],
                                     dy, dx)
        return conv_nd_utils.col2im_nd(col, self.stride, self.pad,
                                       tuple(dims), self.dilate)


def _prod(values):
    out = 1
    for v in values:
        out *= int(v)
    return out


def _rows(a):
    """``a`` as a matrix of its first axis by the rest (also when empty)."""
    return a.reshape(a.shape[0], _prod(a.shape[1:]))


def _by_cells(a):
    """``(N, C, *dims)`` as ``(N, C, prod(dims))`` (also when empty)."""
    return a.reshape(a.shape[0], a.shape[1], _prod(a.shape[2:]))


def _acc_dtype(dtype):
    """float16 partial sums are added in float32 (as the collectives do)."""
    return numpy.dtype(numpy.float32) if dtype == numpy.float16 else dtype


class _Messages(object):
    """This node's point-to-point messages on the channel communicator.

    Receives are posted up front into host buffers; each send is posted
    when its block is computed, packed and staged through the host by
    :func:`._pack.message` (no copy for a contiguous host block).
    :meth:`progress` lets MPI move data between two products;
    :meth:`received` waits for one message; :meth:`close` completes every
    send. Every coordinate posts the same messages in the
    same order (the same graph runs everywhere).
    """

    def __init__(self, grid, template):
        self.comm = grid.mpi_channel
        self.template = template
        self.dtype = template.dtype
        self.recv_req = {}
        self.recv_buf = {}
        self.send_req = []
        self.send_buf = []
        self.number, self.tag = _comm.next_exchange(self.comm)

    def label(self):
        return ('the distconv channel exchange number {} (tag {}) of the '
                'channel group'.format(self.number, self.tag))

    def expect(self, peer, shape):
        buf = numpy.empty(shape, dtype=self.dtype)
        self.recv_buf[peer] = buf
        self.recv_req[peer] = self.comm.Irecv([buf, MPI.BYTE], source=peer,
                                              tag=self.tag)

    def send(self, peer, arr):
        buf = _pack.message(backend.get_array_module(arr), arr,
                            dtype=self.dtype)
        self.send_buf.append(buf)  # alive until close()
        self.send_req.append(self.comm.Isend([buf, MPI.BYTE], dest=peer,
                                             tag=self.tag))

    def progress(self):
        reqs = list(self.recv_req.values()) + self.send_req
        if reqs:
            MPI.Request.Testall(reqs)

    def received(self, peer):
        blocking.wait([self.recv_req.pop(peer)], self.label, poll=True,
                      hint=_comm.MISMATCH_HINT)
        return _comm.like(self.recv_buf.pop(peer), self.template)

    def close(self):
        if self.send_req:
            blocking.wait(self.send_req, self.label, poll=True,
                          hint=_comm.MISMATCH_HINT)
        self.send_req, self.send_buf = [], []


def _ring(grid):
    """Peers in the order sends go out (``r+1, r+2, ...``) and receives
    are consumed (``r-1, r-2, ...``): at every step of the ring each
    coordinate sends to one peer and takes from another, so no coordinate
    is the first target of all the others."""
    C, r = grid.channels, grid.channel_rank
    return ([(r + k) % C for k in range(1, C)],
            [(r - k) % C for k in range(1, C)])


def _blocks(grid, total):
    return [tuple(grid.channel_range(total, c)) for c in range(grid.channels)]


def _sum_in_order(parts, dtype):
    """Sum of ``parts`` (coordinate -> array) in coordinate order."""
    acc = _acc_dtype(dtype)
    keys = sorted(parts)
    out = parts[keys[0]].astype(acc, copy=True)
    for k in keys[1:]:
        out += parts[k]
    return out.astype(dtype, copy=False)


def _grad_of_w(gyf, colf, out):
    """Writes the ``(C_o, K)`` weight gradient of ``W @ col`` into ``out``.

    ``gyf`` ``(N, C_o, cells)``, ``colf`` ``(N, K, cells)``: the sum over
    samples of ``gy[n] @ col[n].T``, one product per sample straight into
    ``out`` (no temporary the size of the gradient).
    """
    xp = backend.get_array_module(gyf)
    n = gyf.shape[0]
    if n == 0:
        out[...] = 0
        return
    if out.flags.c_contiguous and out.dtype == gyf.dtype == colf.dtype:
        xp.dot(gyf[0], colf[0].T, out=out)
    else:
        out[...] = xp.dot(gyf[0], colf[0].T)
    for i in range(1, n):
        out += xp.dot(gyf[i], colf[i].T)


class _NoDoubleBackprop(function_node.FunctionNode):

    def backward(self, indexes, grad_outputs):
        raise NotImplementedError(
            'distconv: the overlapped channel convolutions '
            "(split='channel' with split_output=True, split='filter' with "
            'split_input=True) do not support double backpropagation. Set '
            'grid.channel_overlap = False (the same on every process) to '
            'run them as a Chainer convolution and a collective.')


class ScatterConvolution(function_node.FunctionNode):
    """``split='channel'`` convolution, output reduce-scattered.

    Inputs ``x`` ``(N, C_in_block, *dims)`` and ``W`` ``(C_out,
    C_in_block, *k)``; output this coordinate's block of the ``C_out``
    output channels, summed over the channel axis.

    Args:
        grid (SpatialGrid): The process grid (``spatial_size == 1``).
        c_out (int): Global number of output channels.
        ksize, stride, pad, dilate (tuple of int): The window.
        cover_all (bool): As in Chainer.
    """

    def __init__(self, grid: SpatialGrid, c_out: int, ksize: Sequence[int],
                 stride: Sequence[int], pad: Sequence[int],
                 dilate: Sequence[int], cover_all: bool) -> None:
        self.grid = grid
        self.c_out = int(c_out)
        self.window = _Window(ksize, stride, pad, dilate, cover_all)

    def forward(self, inputs):
        self.retain_inputs((0, 1))
        x, W = inputs
        xp = backend.get_array_module(x)
        grid, win = self.grid, self.window
        colf = win.im2col(x)
        W2 = _rows(W)
        blocks = _blocks(grid, self.c_out)
        r = grid.channel_rank
        n, cells = colf.shape[0], colf.shape[2]
        out_dims = win.out_shape(x.shape[2:])
        lo, hi = blocks[r]
        msgs = _Messages(grid, xp.empty((0,), dtype=x.dtype))
        sends, takes = _ring(grid)
        for q in takes:
            msgs.expect(q, (n, hi - lo, cells))
        for d in sends:
            dlo, dhi = blocks[d]
            msgs.send(d, xp.matmul(W2[dlo:dhi], colf).astype(x.dtype,
                                                             copy=False))
            msgs.progress()
        parts = {r: xp.matmul(W2[lo:hi], colf)}
        for q in takes:
            parts[q] = msgs.received(q)
        msgs.close()
        y = _sum_in_order(parts, x.dtype)
        return y.reshape((n, hi - lo) + out_dims),

    def backward(self, indexes, grad_outputs):
        x, W = self.get_retained_inputs()
        gy, = grad_outputs
        if gy is None:  # every coordinate must join the exchange
            gy = chainer.Variable(self._zeros_like_output(x))
        grads = _ScatterConvolutionGrad(
            self, 0 in indexes, 1 in indexes).apply((x, W, gy))
        out = dict(zip([i for i in (0, 1) if i in indexes], grads))
        return tuple(out.get(i) for i in indexes)

    def _zeros_like_output(self, x):
        xp = backend.get_array_module(x)
        lo, hi = self.grid.channel_range(self.c_out)
        shape = (x.shape[0], hi - lo) + self.window.out_shape(x.shape[2:])
        return xp.zeros(shape, dtype=x.dtype)


class _ScatterConvolutionGrad(_NoDoubleBackprop):

    def __init__(self, fwd, need_gx, need_gw):
        self.fwd = fwd
        self.need_gx = need_gx
        self.need_gw = need_gw

    def forward(self, inputs):
        x, W, gy = inputs
        xp = backend.get_array_module(x)
        grid, win = self.fwd.grid, self.fwd.window
        blocks = _blocks(grid, self.fwd.c_out)
        r = grid.channel_rank
        n = gy.shape[0]
        gyf = _by_cells(xp.ascontiguousarray(gy))
        msgs = _Messages(grid, xp.empty((0,), dtype=gy.dtype))
        sends, takes = _ring(grid)
        for q in takes:
            qlo, qhi = blocks[q]
            msgs.expect(q, (n, qhi - qlo, gyf.shape[2]))
        for d in sends:
            msgs.send(d, gyf)
        W2 = _rows(W)
        # The whole output gradient, block by block as it arrives.
        g_all = xp.empty((n, W.shape[0], gyf.shape[2]), dtype=gy.dtype)
        gW2 = xp.empty(W2.shape, dtype=W.dtype) if self.need_gw else None
        colf = win.im2col(x) if self.need_gw else None
        for q in [r] + takes:
            qlo, qhi = blocks[q]
            _pack.unpack(xp, gyf if q == r else msgs.received(q), g_all,
                         [_pack.region_of((slice(None), slice(qlo, qhi)),
                                          g_all.shape)])
            if self.need_gw:
                # The weight rows of block q while the next block travels.
                _grad_of_w(g_all[:, qlo:qhi], colf, gW2[qlo:qhi])
            msgs.progress()
        msgs.close()
        del colf
        out = []
        if self.need_gx:
            # One product over all output channels, as Chainer's own.
            gcol = xp.matmul(W2.T, g_all).astype(x.dtype, copy=False)
            out.append(win.col2im(gcol, x.shape[1], x.shape[2:]))
        if self.need_gw:
            out.append(gW2.reshape(W.shape))
        return tuple(out)


class GatherConvolution(function_node.FunctionNode):
    """``split='filter'`` convolution of a channel-split input.

    Inputs ``x`` ``(N, C_in_block, *dims)`` (this coordinate's block of the
    ``C_in`` input channels), ``W`` ``(C_out_block, C_in, *k)`` and
    optionally ``b`` ``(C_out_block,)``; output this coordinate's block of
    the output channels, the convolution of the whole input.

    Args:
        grid (SpatialGrid): The process grid (``spatial_size == 1``).
        c_in (int): Global number of input channels.
        ksize, stride, pad, dilate (tuple of int): The window.
        cover_all (bool): As in Chainer.
    """

    def __init__(self, grid: SpatialGrid, c_in: int, ksize: Sequence[int],
                 stride: Sequence[int], pad: Sequence[int],
                 dilate: Sequence[int], cover_all: bool) -> None:
        self.grid = grid
        self.c_in = int(c_in)
        self.window = _Window(ksize, stride, pad, dilate, cover_all)
        self._inputs = None

    def _col_rows(self, q):
        """Rows of ``im2col`` of the whole input that block ``q`` fills."""
        lo, hi = self.grid.channel_range(self.c_in, q)
        kk = _prod(self.window.ksize)
        return slice(lo * kk, hi * kk)

    def _whole_col(self, xp, ready):
        """``im2col`` of the whole input, filled block by block as the
        blocks in ``ready`` (coordinate, array) become available."""
        col = None
        for q, xq in ready:
            part = self.window.im2col(xq)
            if col is None:
                col = xp.empty((part.shape[0], self.c_in
                                * _prod(self.window.ksize), part.shape[2]),
                               dtype=part.dtype)
            col[:, self._col_rows(q)] = part
        return col

    def forward(self, inputs):
        self.retain_inputs((1,))
        x, W = inputs[:2]
        b = inputs[2] if len(inputs) == 3 else None
        xp = backend.get_array_module(x)
        grid, win = self.grid, self.window
        blocks = _blocks(grid, self.c_in)
        r = grid.channel_rank
        n, dims = x.shape[0], x.shape[2:]
        msgs = _Messages(grid, xp.empty((0,), dtype=x.dtype))
        sends, takes = _ring(grid)
        for q in takes:
            qlo, qhi = blocks[q]
            msgs.expect(q, (n, qhi - qlo) + tuple(dims))
        for d in sends:
            msgs.send(d, x)
        self._inputs = {r: x}

        def ready():
            # This block's columns while the others travel, then each
            # other block as it arrives.
            yield r, x
            for q in takes:
                msgs.progress()
                self._inputs[q] = msgs.received(q)
                yield q, self._inputs[q]

        col = self._whole_col(xp, ready())
        msgs.close()
        # One product over all input channels, as Chainer's own.
        y = xp.matmul(_rows(W), col).astype(x.dtype,
                                                             copy=False)
        if b is not None:
            y += b[:, None].astype(y.dtype, copy=False)
        return y.reshape((n, W.shape[0]) + win.out_shape(dims)),

    def backward(self, indexes, grad_outputs):
        W, = self.get_retained_inputs()
        gy, = grad_outputs
        if gy is None:
            gy = chainer.Variable(self._zeros_like_output(W))
        grads = _GatherConvolutionGrad(
            self, 0 in indexes, 1 in indexes, 2 in indexes).apply((W, gy))
        out = dict(zip([i for i in (0, 1, 2) if i in indexes], grads))
        return tuple(out.get(i) for i in indexes)

    def _zeros_like_output(self, W):
        x = self._inputs[self.grid.channel_rank]
        xp = backend.get_array_module(x)
        shape = (x.shape[0], W.shape[0]) + self.window.out_shape(x.shape[2:])
        return xp.zeros(shape, dtype=x.dtype)


class _GatherConvolutionGrad(_NoDoubleBackprop):

    def __init__(self, fwd, need_gx, need_gw, need_gb):
        self.fwd = fwd
        self.need_gx = need_gx
        self.need_gw = need_gw
        self.need_gb = need_gb

    def forward(self, inputs):
        W, gy = inputs
        fwd = self.fwd
        grid, win = fwd.grid, fwd.window
        xs = fwd._inputs
        r = grid.channel_rank
        x = xs[r]
        xp = backend.get_array_module(gy)
        gyf = _by_cells(xp.ascontiguousarray(gy))
        W2 = _rows(W)
        blocks = _blocks(grid, fwd.c_in)
        msgs = _Messages(grid, xp.empty((0,), dtype=x.dtype))
        sends, takes = _ring(grid)
        parts = {}
        if self.need_gx:
            for q in takes:
                msgs.expect(q, x.shape)
            # One product over all input channels, then each block's part
            # of the input gradient, the other coordinates' first.
            gcol = xp.matmul(W2.T, gyf).astype(x.dtype, copy=False)
            for q in sends + [r]:
                qlo, qhi = blocks[q]
                part = win.col2im(gcol[:, fwd._col_rows(q)], qhi - qlo,
                                  x.shape[2:])
                if q == r:
                    parts[r] = part
                else:
                    msgs.send(q, part)
                    msgs.progress()
            del gcol
        out = []
        if self.need_gw:
            # The weight gradient while the parts travel.
            col = fwd._whole_col(xp, sorted(xs.items()))
            gW2 = xp.empty(W2.shape, dtype=W.dtype)
            _grad_of_w(gyf, col, gW2)
            del col
            msgs.progress()
        if self.need_gx:
            for q in takes:
                parts[q] = msgs.received(q)
            out.append(_sum_in_order(parts, x.dtype))
        msgs.close()
        if self.need_gw:
            out.append(gW2.reshape(W.shape))
        if self.need_gb:
            out.append(gyf.sum(axis=(0, 2)).astype(W.dtype, copy=False))
        return tuple(out)
