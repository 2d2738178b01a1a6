"""Every distconv message is packed by distconv/_pack.py.

The halo exchange (blocking and overlapped, forward and adjoint), the
layout shuffle and the overlapped channel convolutions are run with spies
on the packing core of ``_pack`` and on ``_pack.alloc`` (the buffers they
return), on ``_comm.post_exchange`` and on the channel nodes' sends (what
is handed to MPI): every array sent must share memory with such a buffer,
and every received buffer must be read by ``_pack`` (its unpacking core,
or ``copy_box`` for parts of received boxes) to be placed into a larger
array (the channel nodes also use received blocks as they are). So the
packing a GPU runs (the same functions, on cupy) is the packing these CPU
tests run. Results are compared with single-process Chainer as well.
"""
import chainer
import chainer.functions as F
import numpy as np
import pytest

from chainermn_overlap import distconv
from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import _pack
from chainermn_overlap.distconv import channel_conv
from distconv_mpi_helpers import Checker, comm, compare_layer, grid


class Spy(object):
    """Records packed buffers, sent arrays, received buffers and what
    _pack read received data from."""

    def __init__(self, monkeypatch):
        self.packed = []
        self.sent = []
        self.received = []
        self.read = []
        # Every packing and unpacking of _pack runs these two functions;
        # copy_box places parts of received boxes.
        pack, alloc = _pack._pack, _pack.alloc
        unpack, post = _pack._unpack, _comm.post_exchange
        copy_box = _pack.copy_box
        send = channel_conv._Messages.send

        def recorder(fn):
            def spy(*args, **kwargs):
                buf, pieces = fn(*args, **kwargs)
                self.packed.append(buf)
                return buf, pieces
            return spy

        def spy_unpack(xp, buffer, *args, **kwargs):
            self.read.append(buffer)
            return unpack(xp, buffer, *args, **kwargs)

        def spy_copy_box(dst, dst_origin, src, *args, **kwargs):
            self.read.append(src)
            return copy_box(dst, dst_origin, src, *args, **kwargs)

        def spy_post(mpi_comm, sends, recvs, template):
            def each():
                for peer, arr in sends:
                    self.sent.append(arr)
                    yield peer, arr
            pending = post(mpi_comm, each(), recvs, template)
            if pending.host_flat.size:
                self.received.append(pending.host_flat)
            return pending

        def spy_send(messages, peer, arr):
            send(messages, peer, arr)
            self.sent.append(messages.send_buf[-1])

        monkeypatch.setattr(_pack, '_pack', recorder(pack))
        monkeypatch.setattr(_pack, 'alloc', recorder(alloc))
        monkeypatch.setattr(_pack, '_unpack', spy_unpack)
        monkeypatch.setattr(_pack, 'copy_box', spy_copy_box)
        monkeypatch.setattr(_comm, 'post_exchange', spy_post)
        monkeypatch.setattr(channel_conv._Messages, 'send', spy_send)

    def check(self, unpacked=True):
        chk = Checker()
        chk.true('messages were sent', self.sent)
        if unpacked:
            chk.true('messages were unpacked', self.read)
        for i, buf in enumerate(self.received):
            chk.true('received buffer %d (%d values) is not read by _pack'
                     % (i, buf.size), any(np.shares_memory(buf, b)
                                          for b in self.read))
        for i, arr in enumerate(self.sent):
            chk.true('message %d (shape %r) is not from _pack'
                     % (i, arr.shape), any(np.shares_memory(arr, b)
                                           for b in self.packed))
        chk.done()


def _split_grid():
    if comm().size < 2:
        pytest.skip('no messages on one process')
    return grid((comm().size, 1))


@pytest.mark.parametrize('overlap', [False, True],
                         ids=['blocking', 'overlapped'])
def test_halo_messages_are_packed(monkeypatch, overlap):
    g = _split_grid()
    old = g.overlap, g.progress_min_cells
    g.overlap, g.progress_min_cells = overlap, 1
    spy = Spy(monkeypatch)
    try:
        x = np.random.RandomState(0).randn(2, 3, 4 * g.size, 5).astype(
            np.float32)
        W = np.random.RandomState(1).randn(4, 3, 5, 3).astype(np.float32)
        Ws, Wd = chainer.Parameter(W.copy()), chainer.Parameter(W.copy())
        compare_layer(g, x, lambda v: F.convolution_2d(v, Ws, pad=(2, 1)),
                      lambda v: distconv.convolution_2d(g, v, Wd,
                                                        pad=(2, 1)),
                      [('W', Ws, Wd)])
    finally:
        g.overlap, g.progress_min_cells = old
    spy.check()


def test_layout_shuffle_messages_are_packed(monkeypatch):
    g = _split_grid()
    spy = Spy(monkeypatch)
    x = np.random.RandomState(2).randn(5, 2, 3 * g.size, 4).astype(
        np.float32)
    compare_layer(g, x, lambda v: v * v, lambda v: distconv.to_spatial_layout(
        g, distconv.to_sample_layout(g, v) ** 2))
    spy.check()


@pytest.mark.parametrize('split', ['channel', 'filter'])
def test_channel_messages_are_packed(monkeypatch, split):
    c = comm()
    if c.size < 2:
        pytest.skip('no channel messages on one process')
    g = distconv.SpatialGrid(c, (1, 1), channels=c.size)
    spy = Spy(monkeypatch)
    rng = np.random.RandomState(3)
    x = rng.randn(2, 5, 6, 5).astype(np.float32)
    W = rng.randn(7, 5, 3, 3).astype(np.float32)
    lo, hi = g.channel_range(5 if split == 'channel' else 7)
    Wd = chainer.Parameter(W[:, lo:hi].copy() if split == 'channel'
                           else W[lo:hi].copy())
    xd = chainer.Variable(g.scatter(x, channel_split=True))
    flags = {'split_output': True} if split == 'channel' else \
        {'split_input': True}
    y = distconv.convolution_2d(g, xd, Wd, pad=1, split=split, **flags)
    y.grad = np.ones_like(y.array)
    y.backward()
    ys = F.convolution_2d(x, W, pad=1).array
    chk = Checker()
    chk.close('forward', g.gather(y, channel_split=True), ys)
    chk.true('the overlapped channel nodes ran',
             g.stats['channel_overlapped'] == 1)
    chk.done()
    # The gather convolution uses the blocks it receives as they are.
    spy.check(unpacked=split == 'channel')
