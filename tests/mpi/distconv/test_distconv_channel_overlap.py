"""Overlapped channel convolutions (``distconv.channel_conv``) vs Chainer.

``split='channel', split_output=True`` (reduce-scattered partial sums) and
``split='filter', split_input=True`` (gathered input blocks) on grids of
whole samples run the overlapped nodes unless ``grid.channel_overlap`` is
False; both paths are compared with single-process Chainer (forward, input
gradient, W and b gradients) and with each other, and the stats show
which path ran. Channel counts do not divide the channel axis (uneven
blocks).
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from distconv_mpi_helpers import Checker, collective_raises, comm, \
    sum_over_ranks
from test_distconv_channels import CHANNEL_GRIDS, _ids, cgrid, embed, \
    grad_or_zero


def _fused_expected(g, overlap):
    return overlap and g.channels > 1 and g.spatial_size == 1


def _run(g, overlap, fn):
    """Runs ``fn()`` with ``grid.channel_overlap = overlap``; returns its
    result and how many layers took the overlapped nodes."""
    g.channel_overlap = overlap
    before = g.stats['channel_overlapped']
    try:
        out = fn()
    finally:
        g.channel_overlap = True
    return out, g.stats['channel_overlapped'] - before


# (C_in, C_out, ksize, stride, pad, dilate, cover_all)
CASES = [(5, 7, 3, 1, 1, 1, False), (7, 3, 3, 2, 1, 1, False),
         (4, 6, 1, 1, 0, 1, False), (6, 5, 3, 1, 2, 2, False),
         (5, 4, 3, 2, 0, 1, True)]


def _case_id(c):
    return 'ci%d-co%d-k%d-s%d-p%d-d%d%s' % (c[:6] + (
        '-cover_all' if c[6] else '',))


def _serial(x, W, b, case):
    ci, co, k, s, p, d, ca = case
    xs = chainer.Variable(x.copy())
    Ws = chainer.Variable(W.copy())
    bs = chainer.Variable(b.copy())
    ys = F.convolution_2d(xs, Ws, bs, s, p, ca, dilate=d)
    gy = np.random.RandomState(6).randn(*ys.shape).astype(x.dtype)
    ys.grad = gy.copy()
    ys.backward()
    return xs, Ws, bs, ys, gy


def _weights(case, dtype=np.float32):
    ci, co, k = case[:3]
    rng = np.random.RandomState(5)
    return (rng.randn(co, ci, k, k).astype(dtype),
            rng.randn(co).astype(dtype))


def _check_one_layer(gc, case, overlap, split, w_axis):
    """One layer with channel-split input and output against Chainer.

    ``w_axis`` is W's split axis (0: output channels with b split too, for
    ``'filter'``; 1: input channels with b whole, for ``'channel'``)."""
    g = cgrid(*gc)
    ci, co, k, s, p, d, ca = case
    x = np.random.RandomState(4).randn(3, ci, 6, 7).astype(np.float32)
    W, b = _weights(case)
    xs, Ws, bs, ys, gy = _serial(x, W, b, case)
    total = co if w_axis == 0 else ci
    lo, hi = g.channel_range(total)
    Wd = chainer.Parameter(W[(slice(None),) * w_axis
                             + (slice(lo, hi),)].copy())
    bd = chainer.Parameter((b[lo:hi] if w_axis == 0 else b).copy())
    xd = chainer.Variable(g.scatter(x, channel_split=True))
    flags = dict(split_input=True) if split == 'filter' else \
        dict(split_output=True)

    def run():
        y = distconv.convolution_2d(g, xd, Wd, bd, s, p, ca, dilate=d,
                                    split=split, **flags)
        y.grad = g.scatter(gy, channel_split=True)
        y.backward()
        return y

    yd, fused = _run(g, overlap, run)
    chk = Checker()
    chk.true('overlapped nodes ran %d times' % fused,
             fused == (1 if _fused_expected(g, overlap) else 0))
    chk.close('forward', g.gather(yd, channel_split=True), ys.array)
    chk.close('input grad', g.gather(xd.grad, channel_split=True), xs.grad)
    chk.close('W grad', sum_over_ranks(embed(g, W.shape, grad_or_zero(Wd),
                                             w_axis, total)), Ws.grad)
    if w_axis == 0:
        gb = sum_over_ranks(embed(g, b.shape, grad_or_zero(bd), 0, co))
    else:
        gb = sum_over_ranks(grad_or_zero(bd))
    chk.close('b grad', gb, bs.grad)
    chk.done()


@pytest.mark.parametrize('gc', CHANNEL_GRIDS, ids=_ids)
@pytest.mark.parametrize('case', CASES, ids=_case_id)
@pytest.mark.parametrize('overlap', [True, False],
                         ids=['overlapped', 'serial'])
def test_split_input(gc, case, overlap):
    """'filter' layer fed channel blocks = gather_channels + 'filter'."""
    _check_one_layer(gc, case, overlap, 'filter', 0)


@pytest.mark.parametrize('gc', CHANNEL_GRIDS, ids=_ids)
@pytest.mark.parametrize('case', CASES, ids=_case_id)
@pytest.mark.parametrize('overlap', [True, False],
                         ids=['overlapped', 'serial'])
def test_split_output(gc, case, overlap):
    """'channel' layer with its partial sums reduce-scattered."""
    _check_one_layer(gc, case, overlap, 'channel', 1)


@pytest.mark.parametrize('gc', [((1, 1), 2), ((1, 1), 3), ((1, 1), 4)],
                         ids=_ids)
def test_pair_in_float64_and_frozen_input(gc):
    """split_output -> split_input in float64 (tight tolerance), the first
    layer fed a plain array (no input gradient: only the weight gradient
    is computed and exchanged) and both paths equal."""
    g = cgrid(*gc)
    rng = np.random.RandomState(8)
    x = rng.randn(2, 7, 5, 5)
    W1 = rng.randn(5, 7, 3, 3)
    W2 = rng.randn(6, 5, 1, 1)
    xs = chainer.Variable(x.copy(), requires_grad=False)
    W1s, W2s = chainer.Variable(W1.copy()), chainer.Variable(W2.copy())
    ys = F.convolution_2d(F.relu(F.convolution_2d(xs, W1s, pad=1)), W2s)
    gy = rng.randn(*ys.shape)
    ys.grad = gy.copy()
    ys.backward()
    got = {}
    for overlap in (True, False):
        W1d = chainer.Parameter(W1[:, slice(*g.channel_range(7))].copy())
        W2d = chainer.Parameter(W2[slice(*g.channel_range(6))].copy())
        xd = g.scatter(x, channel_split=True)  # an array: no input grad

        def run():
            h = distconv.convolution_2d(g, xd, W1d, pad=1, split='channel',
                                        split_output=True)
            y = distconv.convolution_2d(g, F.relu(h), W2d, split='filter',
                                        split_input=True)
            y.grad = g.scatter(gy, channel_split=True)
            y.backward()
            return y

        yd, fused = _run(g, overlap, run)
        got[overlap] = (g.gather(yd, channel_split=True),
                        sum_over_ranks(embed(g, W1.shape, W1d.grad, 1, 7)),
                        sum_over_ranks(embed(g, W2.shape, W2d.grad, 0, 6)),
                        fused)
    chk = Checker(rtol=1e-10, atol=1e-12)
    for overlap, (y, gW1, gW2, fused) in got.items():
        tag = ' (%s)' % ('overlapped' if overlap else 'serial')
        chk.true('overlapped nodes ran %d times%s' % (fused, tag),
                 fused == (2 if overlap else 0))
        chk.close('forward' + tag, y, ys.array)
        chk.close('W1 grad' + tag, gW1, W1s.grad)
        chk.close('W2 grad' + tag, gW2, W2s.grad)
    chk.done()


@pytest.mark.parametrize('gc', [((1, 1, 1), 2), ((1, 1, 1), 3)], ids=_ids)
def test_3d(gc):
    g = cgrid(*gc)
    rng = np.random.RandomState(9)
    x = rng.randn(2, 5, 4, 5, 3).astype(np.float32)
    s1 = L.ConvolutionND(3, 5, 4, 3, 1, 1, initialW=rng.randn(4, 5, 3, 3, 3)
                         .astype(np.float32) * 0.3, initial_bias=0.1)
    s2 = L.ConvolutionND(3, 4, 7, (1, 3, 3), 2, (0, 1, 1),
                         initialW=rng.randn(7, 4, 1, 3, 3).astype(np.float32)
                         * 0.3, initial_bias=0.2)
    d1 = distconv.ConvolutionND(g, 3, 5, 4, 3, 1, 1, initialW=s1.W.array,
                                initial_bias=0.1, split='channel',
                                split_output=True)
    d2 = distconv.ConvolutionND(g, 3, 4, 7, (1, 3, 3), 2, (0, 1, 1),
                                initialW=s2.W.array, initial_bias=0.2,
                                split='filter', split_input=True)
    for link in (s1, s2, d1, d2):
        link.cleargrads()  # Chainer links start with NaN gradients
    xs = chainer.Variable(x.copy())
    ys = s2(F.relu(s1(xs)))
    gy = rng.randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x, channel_split=True))
    before = g.stats['channel_overlapped']
    yd = d2(F.relu(d1(xd)))
    yd.grad = g.scatter(gy, channel_split=True)
    yd.backward()
    chk = Checker()
    chk.true('overlapped nodes ran', g.stats['channel_overlapped']
             - before == 2)
    chk.close('forward', g.gather(yd, channel_split=True), ys.array)
    chk.close('input grad', g.gather(xd.grad, channel_split=True), xs.grad)
    chk.close('W1 grad', sum_over_ranks(embed(g, s1.W.shape, d1.W.grad, 1,
                                              5)), s1.W.grad)
    chk.close('W2 grad', sum_over_ranks(embed(g, s2.W.shape, d2.W.grad, 0,
                                              7)), s2.W.grad)
    chk.close('b2 grad', sum_over_ranks(embed(g, s2.b.shape, d2.b.grad, 0,
                                              7)), s2.b.grad)
    chk.done()


def test_zero_gradient_on_one_coordinate():
    """One coordinate's loss ignores its output block (a zero gradient):
    the exchange in backward still gives every block its gradient."""
    g = cgrid((1, 1), 2)
    rng = np.random.RandomState(10)
    x = rng.randn(1, 4, 3, 3).astype(np.float32)
    W = rng.randn(3, 4, 3, 3).astype(np.float32)
    lo, hi = g.channel_range(4)
    Wd = chainer.Parameter(W[:, lo:hi].copy())
    xd = chainer.Variable(g.scatter(x, channel_split=True))
    y = distconv.convolution_2d(g, xd, Wd, pad=1, split='channel',
                                split_output=True)
    # Coordinate 0's output feeds the loss, coordinate 1's does not: the
    # loss is the sum of coordinate 0's block only.
    loss = F.sum(y) if g.channel_rank == 0 else F.sum(y) * 0
    loss.backward()
    xs = chainer.Variable(x.copy())
    Ws = chainer.Variable(W.copy())
    ys = F.convolution_2d(xs, Ws, pad=1)
    lo0, hi0 = g.channel_range(3, 0)
    F.sum(ys[:, lo0:hi0]).backward()
    chk = Checker()
    chk.close('input grad', g.gather(xd.grad, channel_split=True), xs.grad)
    chk.close('W grad', sum_over_ranks(embed(g, W.shape, Wd.grad, 1, 4)),
              Ws.grad)
    chk.done()


def test_double_backprop_is_refused_on_every_rank():
    g = cgrid((1, 1), 2)
    rng = np.random.RandomState(11)
    x = g.scatter(rng.randn(g.n_groups, 4, 3, 3).astype(np.float32),
                  channel_split=True)
    Wd = chainer.Parameter(rng.randn(3, x.shape[1], 3, 3).astype(np.float32))
    xd = chainer.Variable(x)
    y = distconv.convolution_2d(g, xd, Wd, pad=1, split='channel',
                                split_output=True)
    gx, = chainer.grad([F.sum(y * y)], [xd], enable_double_backprop=True)
    try:
        F.sum(gx * gx).backward()
    except NotImplementedError as e:
        msg = str(e)
    else:
        msg = None
    msgs = comm().mpi_comm.allgather(msg)
    assert all(m is not None and 'channel_overlap = False' in m
               for m in msgs), msgs
    # The serial path supports it (and is what the message recommends).
    g.channel_overlap = False
    try:
        y = distconv.convolution_2d(g, xd, Wd, pad=1, split='channel',
                                    split_output=True)
        gx, = chainer.grad([F.sum(y * y)], [xd],
                           enable_double_backprop=True)
        F.sum(gx * gx).backward()
    finally:
        g.channel_overlap = True
    assert all(comm().mpi_comm.allgather(Wd.grad is not None))


def test_gradient_need_must_agree():
    """One coordinate passes a Variable, another a plain array: their
    backward would exchange different messages, so the layer refuses on
    every rank."""
    g = cgrid((1, 1), 2)
    x = g.scatter(np.ones((1, 4, 3, 3), np.float32), channel_split=True)
    Wd = chainer.Parameter(np.ones((3, x.shape[1], 1, 1), np.float32))
    xin = chainer.Variable(x) if g.channel_rank == 0 else x
    collective_raises(
        lambda: distconv.convolution_2d(g, xin, Wd, split='channel',
                                        split_output=True),
        'arguments differ between processes')


def test_split_input_errors():
    g = cgrid((1, 1), 2)
    x = np.ones((1, 5, 4, 4), np.float32)
    with pytest.raises(ValueError, match='split_input'):
        distconv.Convolution2D(g, 5, 3, 3, split='channel', split_input=True)
    conv = distconv.Convolution2D(g, 5, 3, 3, split='filter',
                                  split_input=True)
    # Whole channels into a layer that takes blocks: an error everywhere.
    collective_raises(lambda: conv(x), 'channel')
    stack = distconv.Tiled(g, [conv])
    with pytest.raises(ValueError, match='split_input'):
        stack(g.scatter(x, channel_split=True))
