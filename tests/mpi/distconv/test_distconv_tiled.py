"""Overlapped tiling (distconv.Tiled) equals single-process Chainer.

A stack of convolutions (strided too), batch normalisation, ReLU, max and
average pooling is run as a ``Tiled`` at every depth and compared with the
same layers run serially on the global batch: forward, input gradient,
parameter gradients and running statistics. Tile counts are checked
through ``grid.stats`` (depth None: one exchange for the whole stack), and
the redundant overlap is checked to exist where the test claims to
exercise it.
"""
import functools

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from chainermn_overlap.distconv import tiling
from distconv_mpi_helpers import Checker, collective_raises, comm, grid, \
    sum_over_ranks

# (kind, args): conv (ci, co, k, stride, pad), bn (c), relu, max/avg
# (k, stride, pad).
STACK = [
    ('conv', (3, 4, 3, 1, 1)),
    ('bn', (4,)),
    ('relu', ()),
    ('max', (3, 2, 1)),
    ('conv', (4, 5, 3, 1, 1)),
    ('relu', ()),
    ('avg', (2, 1, 0)),
    ('conv', (5, 3, 3, 2, 1)),
    ('bn', (3,)),
]
N_WINDOWS = 5


def build(g, stack=STACK, seed=30):
    """(layers for Tiled or None, serial ChainList, serial functions)."""
    rng = np.random.RandomState(seed)
    dist_layers, serial_links, serial_fns = [], chainer.ChainList(), []
    for kind, a in stack:
        if kind == 'conv':
            ci, co, k, s, p = a
            W = (rng.randn(co, ci, k, k) * 0.4).astype(np.float32)
            b = rng.randn(co).astype(np.float32)
            sl = L.Convolution2D(ci, co, k, s, p, initialW=W, initial_bias=b)
            serial_links.add_link(sl)
            serial_fns.append(sl)
            if g is not None:
                dist_layers.append(distconv.Convolution2D(
                    g, ci, co, k, s, p, initialW=W, initial_bias=b))
        elif kind == 'bn':
            sl = L.BatchNormalization(a[0])
            serial_links.add_link(sl)
            serial_fns.append(sl)
            if g is not None:
                dist_layers.append(distconv.BatchNormalization(g, a[0]))
        elif kind == 'relu':
            serial_fns.append(F.relu)
            dist_layers.append(F.relu)
        elif kind == 'max':
            k, s, p = a
            serial_fns.append(functools.partial(F.max_pooling_2d, ksize=k,
                                                stride=s, pad=p))
            dist_layers.append(functools.partial(
                distconv.max_pooling_2d, g, ksize=k, stride=s, pad=p))
        elif kind == 'avg':
            k, s, p = a
            serial_fns.append(functools.partial(
                F.average_pooling_2d, ksize=k, stride=s, pad=p))
            dist_layers.append(functools.partial(
                distconv.average_pooling_2d, g, ksize=k, stride=s, pad=p))
    return dist_layers, serial_links, serial_fns


def run_serial(fns, x):
    h = x
    for f in fns:
        h = f(h)
    return h


TILE_GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (4, 1)]


@pytest.mark.parametrize('shape', TILE_GRIDS, ids=str)
@pytest.mark.parametrize('depth', [1, 2, 3, N_WINDOWS, None], ids=str)
def test_tiled_stack_exact(shape, depth):
    g = grid(shape)
    rng = np.random.RandomState(31)
    x = rng.randn(2 * g.n_groups, 3, 13, 11).astype(np.float32)
    layers, serial_links, serial_fns = build(g)
    tiled = distconv.Tiled(g, layers, depth=depth)
    serial_links.cleargrads()
    tiled.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = run_serial(serial_fns, xs)
    gy = rng.randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    g.stats.clear()
    xd = chainer.Variable(g.scatter(x))
    yd = tiled(xd)
    tiles = g.stats['exchange_tiled']
    yd.grad = g.scatter(gy)
    yd.backward()
    chk = Checker()
    chk.close('forward', g.gather(yd), ys.array)
    chk.close('input grad', g.gather(xd.grad), xs.grad)
    sp = dict(serial_links.namedparams())
    for path, p in tiled.namedparams():
        grad = p.grad if p.grad is not None else np.zeros(p.shape, p.dtype)
        chk.close('grad of ' + path, sum_over_ranks(grad), sp[path].grad)
    for i, sl in enumerate(serial_links):
        if isinstance(sl, L.BatchNormalization):
            dl = tiled[i]
            chk.close('running mean %d' % i, dl.avg_mean, sl.avg_mean)
            chk.close('running var %d' % i, dl.avg_var, sl.avg_var)
    want_tiles = 1 if depth is None else -(-N_WINDOWS // depth)
    chk.true('%d exchanges for depth %r, want %d' % (tiles, depth,
                                                     want_tiles),
             tiles == want_tiles)
    if g.spatial_size > 1 and depth != 1:
        # The redundant overlap (and so the owned-cells-only statistics) is
        # really exercised.
        chk.true('redundant cells', tiling.redundancy(
            (13, 11), tiled.windows()[:depth or N_WINDOWS], g.shape) > 1)
    chk.done()


@pytest.mark.parametrize('shape', [(2, 1), (2, 2), (1, 1)], ids=str)
def test_tiled_avg_pool_pad_value_none_and_cover_all(shape):
    g = grid(shape)
    rng = np.random.RandomState(32)
    # One sample: with several sample groups some are empty.
    x = rng.randn(1, 2, 9, 10).astype(np.float32)
    layers = [
        functools.partial(distconv.max_pooling_2d, g, ksize=3, stride=2,
                          pad=1, cover_all=True),
        functools.partial(distconv.average_pooling_nd, g, ksize=3, stride=1,
                          pad=1, pad_value=None),
        F.tanh,
    ]
    serial = [
        functools.partial(F.max_pooling_2d, ksize=3, stride=2, pad=1,
                          cover_all=True),
        functools.partial(F.average_pooling_nd, ksize=3, stride=1, pad=1,
                          pad_value=None),
        F.tanh,
    ]
    xs = chainer.Variable(x.copy())
    ys = run_serial(serial, xs)
    gy = rng.randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = distconv.Tiled(g, layers)(xd)
    yd.grad = g.scatter(gy)
    yd.backward()
    chk = Checker()
    chk.close('forward', g.gather(yd), ys.array)
    chk.close('input grad', g.gather(xd.grad), xs.grad)
    chk.done()


def _channel_grid(shape, channels):
    c = comm()
    if c.size % (int(np.prod(shape)) * channels):
        pytest.skip('does not fit')
    key = ('tiled', shape, channels)
    cache = _channel_grid.__dict__.setdefault('cache', {})
    if key not in cache:
        cache[key] = distconv.SpatialGrid(c, shape, channels=channels)
    return cache[key]


@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2), ((2, 1), 1)],
                         ids=str)
@pytest.mark.parametrize('depth', [1, None], ids=str)
@pytest.mark.parametrize('split_output', [False, True],
                         ids=['whole', 'split_output'])
def test_tiled_filter_channel(gc, depth, split_output):
    g = _channel_grid(*gc)
    rng = np.random.RandomState(33)
    x = rng.randn(2 * g.n_groups, 3, 9, 8).astype(np.float32)
    W1 = (rng.randn(5, 3, 3, 3) * 0.4).astype(np.float32)
    W2 = (rng.randn(4, 5, 3, 3) * 0.4).astype(np.float32)
    c1 = distconv.Convolution2D(g, 3, 5, 3, 1, 1, initialW=W1,
                                initial_bias=0.3, split='filter')
    bn = distconv.BatchNormalization(g, 5, channel_split=True)
    c2 = distconv.Convolution2D(g, 5, 4, 3, 2, 1, initialW=W2,
                                initial_bias=0.2, split='channel',
                                split_output=split_output)
    tiled = distconv.Tiled(g, [c1, bn, F.relu, c2], depth=depth)
    serial = chainer.ChainList(
        L.Convolution2D(3, 5, 3, 1, 1, initialW=W1, initial_bias=0.3),
        L.BatchNormalization(5),
        L.Convolution2D(5, 4, 3, 2, 1, initialW=W2, initial_bias=0.2))
    serial.cleargrads()
    tiled.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = serial[2](F.relu(serial[1](serial[0](xs))))
    gy = rng.randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = tiled(xd)
    if split_output:  # this coordinate's block of the output channels
        yd.grad = g.scatter(gy, channel_split=True)
    else:
        gyd = g.scatter(gy)
        yd.grad = gyd if g.channel_rank == 0 else np.zeros_like(gyd)
    yd.backward()
    chk = Checker()
    chk.close('forward', g.gather(yd, channel_split=split_output), ys.array)
    chk.close('input grad', g.gather(xd.grad, reduce_copies=True), xs.grad)
    back = chainer.ChainList(L.Convolution2D(3, 5, 3, 1, 1),
                             L.BatchNormalization(5),
                             L.Convolution2D(5, 4, 3, 2, 1))
    distconv.store_serial_params(g, tiled, back)
    chk.close('running var', back[1].avg_var, serial[1].avg_var)
    # Gradients as blocks: gathered over the channel axis like values.
    split = {path.split('/')[-2:][0] + '/' + path.split('/')[-1]
             for path in distconv.reduction_groups(tiled)}
    for p in tiled.params():
        p.array[...] = 0 if p.grad is None else p.grad
    distconv.store_serial_params(g, tiled, back)
    sp = dict(serial.namedparams())
    for path, p in back.namedparams():
        got = sum_over_ranks(p.array)
        if path.lstrip('/') in split:
            # Every process of a channel position holds the gathered
            # whole: the sum over ranks counts it once per coordinate.
            got = got / g.channels
        chk.close('grad of ' + path, got, sp[path].grad)
    chk.done()


def test_tiled_rejects_plain_window_link():
    g = grid((1, 1))
    collective_raises(lambda: distconv.Tiled(
        g, [L.Convolution2D(3, 3, 3)])(np.zeros((1, 3, 5, 5), np.float32)),
        'not supported')
    with pytest.raises(ValueError, match='depth'):
        distconv.Tiled(g, [], depth=0)


def test_tiled_channel_mismatch_raises_everywhere():
    g = grid((1, 1))
    conv = distconv.Convolution2D(g, 4, 3, 3, 1, 1)
    collective_raises(lambda: distconv.Tiled(g, [conv])(
        np.zeros((1, 2, 5, 5), np.float32)), 'expects 4 input channels')
