"""Replication primitives: to_replicated, gather_channels, channel_block.

Dot-product (adjoint) tests with rank-dependent random data, exactness of
the forward against the global tensor, and a spatial -> channel-parallel
hand-over (the ResNet example's stage boundary) against Chainer.
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from chainermn_overlap.distconv import channels as dc_channels
from chainermn_overlap.distconv import redistribute
from distconv_mpi_helpers import Checker, comm, grid, sum_over_ranks

_GRIDS = {}


def cgrid(shape, channels):
    c = comm()
    if c.size % (int(np.prod(shape)) * channels):
        pytest.skip('does not fit %d processes' % c.size)
    key = (tuple(shape), channels)
    if key not in _GRIDS:
        _GRIDS[key] = distconv.SpatialGrid(c, shape, channels=channels)
    return _GRIDS[key]


def _dot(a, b):
    return sum_over_ranks([np.vdot(a, b)])[0]


@pytest.mark.parametrize('shape', [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)],
                         ids=str)
def test_to_replicated_adjoint_and_forward(shape):
    g = grid(shape)
    rng = np.random.RandomState(7 + comm().rank)
    full = np.random.RandomState(5).randn(2 * g.n_groups, 3, 7, 5)
    x = g.scatter(full)
    y = rng.randn(x.shape[0], 3, 7, 5)
    node = redistribute.ReplicateSamples(g, (7, 5))
    ax = node.apply((x,))[0].array
    aty = redistribute.BlockOfSummedCopies(g, (7, 5)).apply((y,))[0].array
    chk = Checker()
    lo, hi = g.sample_range(full.shape[0])
    chk.close('forward is the whole samples', ax, full[lo:hi])
    np.testing.assert_allclose(_dot(ax, y), _dot(x, aty), rtol=1e-12)
    chk.done()


@pytest.mark.parametrize('gc', [((1, 1), 1), ((1, 1), 2), ((2, 1), 2),
                                ((1, 1), 3)], ids=str)
def test_gather_channels_adjoint_and_forward(gc):
    g = cgrid(*gc)
    full = np.random.RandomState(6).randn(2 * g.n_groups, 5, 4, 3)
    x = g.scatter(full, channel_split=True)
    y = np.random.RandomState(9 + comm().rank).randn(*g.scatter(full).shape)
    ax = dc_channels.GatherChannels(g, 5).apply((x,))[0].array
    aty = dc_channels.ChannelBlockOfSum(g, 5).apply((y,))[0].array
    chk = Checker()
    chk.close('forward', ax, g.scatter(full))
    np.testing.assert_allclose(_dot(ax, y), _dot(x, aty), rtol=1e-12)
    # channel_block is the slice (its adjoint: zeros outside the block).
    blk = distconv.channel_block(g, g.scatter(full)).array
    chk.close('channel_block', blk, x)
    chk.done()


@pytest.mark.parametrize('shape', [(1, 1), (2, 1), (1, 2), (4, 1), (3, 1)],
                         ids=str)
def test_spatial_then_channel_parallel_stage(shape):
    """A spatial conv, to_replicated, then filter/channel convolutions on a
    grid whose channel axis is the spatial grid's processes."""
    gs = grid(shape)
    gc = cgrid((1, 1), gs.spatial_size)
    rng = np.random.RandomState(12)
    x = rng.randn(2 * gs.n_groups, 3, 9, 8).astype(np.float32)
    w0 = rng.randn(4, 3, 3, 3).astype(np.float32)
    w1 = rng.randn(6, 4, 1, 1).astype(np.float32)
    w2 = rng.randn(5, 6, 3, 3).astype(np.float32)
    s0 = L.Convolution2D(3, 4, 3, 1, 1, initialW=w0)
    s1 = L.Convolution2D(4, 6, 1, initialW=w1)
    s2 = L.Convolution2D(6, 5, 3, 2, 1, initialW=w2)
    d0 = distconv.Convolution2D(gs, 3, 4, 3, 1, 1, initialW=w0)
    d1 = distconv.Convolution2D(gc, 4, 6, 1, initialW=w1, split='filter')
    d2 = distconv.Convolution2D(gc, 6, 5, 3, 2, 1, initialW=w2,
                                split='channel')
    for link in (s0, s1, s2, d0, d1, d2):
        link.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = F.sum(s2(F.relu(s1(s0(xs)))) ** 2)
    ys.backward()
    xd = chainer.Variable(gs.scatter(x))
    h = distconv.to_replicated(gs, d0(xd))
    h = d2(F.relu(d1(h)))
    # Every channel coordinate holds the same output; copy 0's loss.
    loss = F.sum(h ** 2) * (1.0 if gc.channel_rank == 0 else 0.0)
    loss.backward()
    chk = Checker()
    chk.close('loss', sum_over_ranks([loss.array])[0], ys.array, rtol=1e-4)
    chk.close('input grad', gs.gather(xd.grad), xs.grad, rtol=1e-3,
              atol=1e-3)
    chk.close('d0 W grad', sum_over_ranks(d0.W.grad), s0.W.grad, rtol=1e-3,
              atol=1e-3)
    lo, hi = gc.channel_range(6)
    full = np.zeros(w2.shape)
    full[:, lo:hi] = d2.W.grad
    chk.close('d2 W grad', sum_over_ranks(full), s2.W.grad, rtol=1e-3,
              atol=1e-3)
    chk.done()
