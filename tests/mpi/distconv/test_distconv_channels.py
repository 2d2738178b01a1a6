"""Filter and channel parallelism (a channel axis in the grid) vs Chainer.

Grids combine sample groups, the channel axis and spatial splits; channel
counts are chosen not to divide the channel axis (uneven blocks). A
tensor that is not channel split is held whole on every channel
coordinate, and its gradient as per-copy contributions: the tests give the
upstream gradient of a replicated output to channel coordinate 0 only, and
sum the copies of a replicated input's gradient (``reduce_copies``).
Parameter gradients are compared as the sum over all processes of each
process's block placed in a zero array of the whole parameter (every
copy of a block contributes its part, as the training convention says).
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from distconv_mpi_helpers import Checker, collective_raises, comm, \
    sum_over_ranks

_GRIDS = {}

# (spatial grid shape, channels); the rest of the processes form sample
# groups. Skipped where they do not fit.
CHANNEL_GRIDS = [((1, 1), 1), ((1, 1), 2), ((1, 1), 3), ((2, 1), 2),
                 ((1, 2), 2), ((1, 1), 4), ((2, 1), 1)]


def cgrid(shape, channels):
    c = comm()
    p = int(np.prod(shape)) * channels
    if c.size % p:
        pytest.skip('grid %r x %d channels does not fit %d processes'
                    % (shape, channels, c.size))
    key = (tuple(shape), channels)
    if key not in _GRIDS:
        _GRIDS[key] = distconv.SpatialGrid(c, shape, channels=channels)
    return _GRIDS[key]


def _ids(v):
    return '%sx%d' % (v[0], v[1])


def embed(g, full_shape, block, axis, total):
    """This process's block placed in zeros of the whole parameter."""
    out = np.zeros(full_shape, dtype=np.float64)
    if block is None:
        return out
    lo, hi = g.channel_range(total)
    sl = (slice(None),) * axis + (slice(lo, hi),)
    out[sl] = block
    return out


def grad_or_zero(p):
    return np.zeros(p.shape, np.float32) if p.grad is None else p.grad


def upstream(g, gy_full, channel_split):
    """Upstream gradient of an output block: split, or on copy 0 only."""
    if channel_split:
        return g.scatter(gy_full, channel_split=True)
    gy = g.scatter(gy_full)
    return gy if g.channel_rank == 0 else np.zeros_like(gy)


def _data(seed, n, c, h, w):
    rng = np.random.RandomState(seed)
    return rng.randn(n, c, h, w).astype(np.float32)


@pytest.mark.parametrize('gc', CHANNEL_GRIDS, ids=_ids)
@pytest.mark.parametrize('case', [
    # (C_in, C_out, ksize, stride, pad)
    (5, 7, 3, 1, 1), (3, 5, 3, 2, 1), (4, 3, 1, 1, 0)], ids=str)
def test_filter_convolution(gc, case):
    g = cgrid(*gc)
    ci, co, k, s, p = case
    x = _data(1, 4, ci, 7, 6)
    rng = np.random.RandomState(2)
    W = rng.randn(co, ci, k, k).astype(np.float32)
    b = rng.randn(co).astype(np.float32)
    serial = L.Convolution2D(ci, co, k, s, p, initialW=W, initial_bias=b)
    dist = distconv.Convolution2D(g, ci, co, k, s, p, initialW=W,
                                  initial_bias=b, split='filter')
    chk = Checker()
    lo, hi = g.channel_range(co)
    chk.close('W block', dist.W.array, W[lo:hi])
    serial.cleargrads()
    dist.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = serial(xs)
    gy = np.random.RandomState(3).randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = dist(xd)
    yd.grad = upstream(g, gy, True)
    yd.backward()
    chk.close('forward', g.gather(yd, channel_split=True), ys.array)
    chk.close('input grad', g.gather(xd.grad, reduce_copies=True), xs.grad)
    chk.close('W grad', sum_over_ranks(embed(g, W.shape, grad_or_zero(dist.W),
                                             0, co)), serial.W.grad)
    chk.close('b grad', sum_over_ranks(embed(g, b.shape, grad_or_zero(dist.b),
                                             0, co)), serial.b.grad)
    if g.channels > 1 and co >= g.channels:
        # Negative control: one copy's input gradient is not the gradient.
        one = g.gather(xd.grad)
        chk.true('negative control: copy 0 alone differs',
                 not np.allclose(one, xs.grad, rtol=1e-3, atol=1e-4))
    chk.done()


@pytest.mark.parametrize('gc', CHANNEL_GRIDS, ids=_ids)
@pytest.mark.parametrize('case', [
    (5, 4, 3, 1, 1), (7, 3, 3, 2, 0), (4, 6, 1, 1, 0)], ids=str)
@pytest.mark.parametrize('split_output', [False, True],
                         ids=['whole', 'split_output'])
def test_channel_convolution(gc, case, split_output):
    g = cgrid(*gc)
    ci, co, k, s, p = case
    x = _data(4, 3, ci, 6, 7)
    rng = np.random.RandomState(5)
    W = rng.randn(co, ci, k, k).astype(np.float32)
    b = rng.randn(co).astype(np.float32)
    serial = L.Convolution2D(ci, co, k, s, p, initialW=W, initial_bias=b)
    dist = distconv.Convolution2D(g, ci, co, k, s, p, initialW=W,
                                  initial_bias=b, split='channel',
                                  split_output=split_output)
    chk = Checker()
    serial.cleargrads()
    dist.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = serial(xs)
    gy = np.random.RandomState(6).randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x, channel_split=True))
    yd = dist(xd)
    if split_output:
        # This coordinate's block of the output channels.
        lo, hi = g.channel_range(co)
        chk.true('output block has %d channels' % (hi - lo),
                 yd.shape[1] == hi - lo)
        chk.close('forward', g.gather(yd, channel_split=True), ys.array)
    else:
        # The output is whole on every channel coordinate (equal copies).
        chk.close('forward (this copy)', g.gather(yd), ys.array)
    yd.grad = upstream(g, gy, split_output)
    yd.backward()
    chk.close('input grad', g.gather(xd.grad, channel_split=True), xs.grad)
    chk.close('W grad', sum_over_ranks(embed(g, W.shape, grad_or_zero(dist.W),
                                             1, ci)), serial.W.grad)
    chk.close('b grad', sum_over_ranks(grad_or_zero(dist.b)), serial.b.grad)
    chk.done()


class BottleneckNet(chainer.Chain):
    """The res4 pairing with a reduce-scattered 3x3 (uneven channels).

    filter 1x1 -> BN (split) -> ReLU -> channel 3x3 with ``split_output``
    -> BN (split) -> ReLU -> gather_channels -> filter 1x1 -> BN (split)
    + the input's channel block -> ReLU -> gather_channels.
    """

    def __init__(self, g=None, c=7, mid=5):
        super(BottleneckNet, self).__init__()
        self.g = g
        rng = np.random.RandomState(21)
        w1 = rng.randn(mid, c, 1, 1).astype(np.float32) * 0.4
        w2 = rng.randn(mid, mid, 3, 3).astype(np.float32) * 0.3
        w3 = rng.randn(c, mid, 1, 1).astype(np.float32) * 0.4
        with self.init_scope():
            if g is None:
                self.c1 = L.Convolution2D(c, mid, 1, initialW=w1)
                self.b1 = L.BatchNormalization(mid)
                self.c2 = L.Convolution2D(mid, mid, 3, 1, 1, initialW=w2,
                                          initial_bias=0.2)
                self.b2 = L.BatchNormalization(mid)
                self.c3 = L.Convolution2D(mid, c, 1, initialW=w3)
                self.b3 = L.BatchNormalization(c)
            else:
                self.c1 = distconv.Convolution2D(g, c, mid, 1, initialW=w1,
                                                 split='filter')
                self.b1 = distconv.BatchNormalization(g, mid,
                                                      channel_split=True)
                self.c2 = distconv.Convolution2D(
                    g, mid, mid, 3, 1, 1, initialW=w2, initial_bias=0.2,
                    split='channel', split_output=True)
                self.b2 = distconv.BatchNormalization(g, mid,
                                                      channel_split=True)
                self.c3 = distconv.Convolution2D(g, mid, c, 1, initialW=w3,
                                                 split='filter')
                self.b3 = distconv.BatchNormalization(g, c,
                                                      channel_split=True)

    def forward(self, x):
        g = self.g
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(self.b2(self.c2(h)))
        if g is not None:
            h = distconv.gather_channels(g, h)
        h = self.b3(self.c3(h))
        s = x if g is None else distconv.channel_block(g, x)
        h = F.relu(h + s)
        return h if g is None else distconv.gather_channels(g, h)


@pytest.mark.parametrize('gc', CHANNEL_GRIDS, ids=_ids)
def test_bottleneck_with_split_output(gc):
    g = cgrid(*gc)
    x = _data(22, 4, 7, 6, 5)
    serial = BottleneckNet()
    dist = BottleneckNet(g)
    serial.cleargrads()
    dist.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = serial(xs)
    gy = np.random.RandomState(23).randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = dist(xd)
    chk = Checker()
    chk.close('forward', g.gather(yd), ys.array)
    yd.grad = upstream(g, gy, False)
    yd.backward()
    chk.close('input grad', g.gather(xd.grad, reduce_copies=True), xs.grad)
    back = BottleneckNet()
    distconv.store_serial_params(g, dist, back)
    for name in ('b1', 'b2', 'b3'):
        chk.close(name + ' running var', getattr(back, name).avg_var,
                  getattr(serial, name).avg_var)
    blocks = {'c1/W': (0, 5), 'c1/b': (0, 5), 'b1/gamma': (0, 5),
              'b1/beta': (0, 5), 'c2/W': (1, 5), 'b2/gamma': (0, 5),
              'b2/beta': (0, 5), 'c3/W': (0, 7), 'c3/b': (0, 7),
              'b3/gamma': (0, 7), 'b3/beta': (0, 7)}
    dparams = dict(dist.namedparams())
    for path, sp in serial.namedparams():
        dp = dparams[path]
        if path.lstrip('/') in blocks:
            axis, total = blocks[path.lstrip('/')]
            got = sum_over_ranks(embed(g, sp.shape, grad_or_zero(dp), axis,
                                       total))
        else:  # c2/b: whole on every process, gradient on its block
            got = sum_over_ranks(grad_or_zero(dp))
        if path.endswith(('c1/b', 'c3/b')):
            # A bias followed by a batch normalisation: its true gradient
            # is zero (BN subtracts the batch mean), so both sides hold
            # only rounding noise of the sum over the batch, about 1e-5
            # here.  It must stay at that noise level, not match noise.
            chk.close('grad of ' + path + ' (noise)', got, sp.grad,
                      rtol=0, atol=5e-5)
            continue
        chk.close('grad of ' + path, got, sp.grad)
    chk.done()


class FilterChannelNet(chainer.Chain):
    """filter conv -> BN (channel split) -> ReLU -> channel conv (strided)."""

    def __init__(self, g=None, ci=5, cm=7, co=4):
        super(FilterChannelNet, self).__init__()
        rng = np.random.RandomState(7)
        w1 = rng.randn(cm, ci, 3, 3).astype(np.float32) * 0.3
        w2 = rng.randn(co, cm, 3, 3).astype(np.float32) * 0.3
        with self.init_scope():
            if g is None:
                self.c1 = L.Convolution2D(ci, cm, 3, 1, 1, initialW=w1,
                                          initial_bias=0.1)
                self.bn = L.BatchNormalization(cm)
                self.c2 = L.Convolution2D(cm, co, 3, 2, 1, initialW=w2,
                                          initial_bias=0.2)
            else:
                self.c1 = distconv.Convolution2D(
                    g, ci, cm, 3, 1, 1, initialW=w1, initial_bias=0.1,
                    split='filter')
                self.bn = distconv.BatchNormalization(g, cm,
                                                      channel_split=True)
                self.c2 = distconv.Convolution2D(
                    g, cm, co, 3, 2, 1, initialW=w2, initial_bias=0.2,
                    split='channel')

    def forward(self, x):
        return self.c2(F.relu(self.bn(self.c1(x))))


@pytest.mark.parametrize('gc', CHANNEL_GRIDS, ids=_ids)
def test_filter_then_channel(gc):
    g = cgrid(*gc)
    x = _data(8, 4, 5, 7, 6)
    serial = FilterChannelNet()
    dist = FilterChannelNet(g)
    chk = Checker()
    serial.cleargrads()
    dist.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = serial(xs)
    gy = np.random.RandomState(9).randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = dist(xd)
    chk.close('forward', g.gather(yd), ys.array)
    yd.grad = upstream(g, gy, False)
    yd.backward()
    chk.close('input grad', g.gather(xd.grad, reduce_copies=True), xs.grad)
    # Whole parameters on every rank, then compared.
    back = FilterChannelNet()
    distconv.store_serial_params(g, dist, back)
    for name in ('avg_mean', 'avg_var'):
        chk.close('BN ' + name, getattr(back.bn, name),
                  getattr(serial.bn, name))
    blocks = {'c1/W': (0, 7), 'c1/b': (0, 7), 'bn/gamma': (0, 7),
              'bn/beta': (0, 7), 'c2/W': (1, 7)}
    dparams = dict(dist.namedparams())
    for path, sp in serial.namedparams():
        dp = dparams[path]
        if path.lstrip('/') in blocks:
            axis, total = blocks[path.lstrip('/')]
            got = sum_over_ranks(embed(g, sp.shape, grad_or_zero(dp), axis,
                                       total))
        else:
            got = sum_over_ranks(grad_or_zero(dp))
        chk.close('grad of ' + path, got, sp.grad)
    chk.done()


@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2), ((1, 1), 3)],
                         ids=_ids)
def test_batch_normalization_channel_split(gc):
    g = cgrid(*gc)
    x = _data(10, 4, 5, 6, 5) * 2 + 1
    serial = L.BatchNormalization(5)
    dist = distconv.BatchNormalization(g, 5, channel_split=True)
    chk = Checker()
    serial.cleargrads()
    dist.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = serial(xs)
    gy = np.random.RandomState(11).randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x, channel_split=True))
    yd = dist(xd)
    yd.grad = g.scatter(gy, channel_split=True)
    yd.backward()
    chk.close('forward', g.gather(yd, channel_split=True), ys.array)
    chk.close('input grad', g.gather(xd.grad, channel_split=True), xs.grad)
    lo, hi = g.channel_range(5)
    chk.close('running mean', dist.avg_mean, serial.avg_mean[lo:hi])
    chk.close('running var', dist.avg_var, serial.avg_var[lo:hi])
    chk.close('gamma grad', sum_over_ranks(embed(
        g, (5,), grad_or_zero(dist.gamma), 0, 5)), serial.gamma.grad)
    chk.done()


@pytest.mark.parametrize('gc', [((1, 1), 2), ((1, 1), 3), ((2, 1), 2)],
                         ids=_ids)
def test_batch_normalization_replicated_copies(gc):
    # Not channel split on a grid with a channel axis: the copies must not
    # be counted once each (statistics over one channel coordinate).
    g = cgrid(*gc)
    x = _data(12, 4, 3, 5, 6)
    serial = L.BatchNormalization(3)
    dist = distconv.BatchNormalization(g, 3)
    xd = chainer.Variable(g.scatter(x))
    yd = dist(xd)
    ys = serial(chainer.Variable(x.copy()))
    chk = Checker()
    chk.close('forward', g.gather(yd), ys.array)
    chk.close('running var', dist.avg_var, serial.avg_var)
    chk.done()


@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2), ((1, 1), 3),
                                ((1, 1), 1)], ids=_ids)
def test_load_store_serial_params_roundtrip(gc):
    g = cgrid(*gc)
    serial = FilterChannelNet()
    serial.bn.avg_mean[...] = np.arange(7, dtype=np.float32)
    np.random.seed(99)  # the distributed model starts elsewhere
    dist = FilterChannelNet(g)
    for _, p in dist.namedparams():
        p.array[...] = -1
    distconv.load_serial_params(g, dist, serial)
    chk = Checker(rtol=0, atol=0)
    lo, hi = g.channel_range(7)
    chk.close('c1/W block', dist.c1.W.array, serial.c1.W.array[lo:hi])
    chk.close('c2/W block', dist.c2.W.array, serial.c2.W.array[:, lo:hi])
    chk.close('c2/b whole', dist.c2.b.array, serial.c2.b.array)
    chk.close('bn mean block', dist.bn.avg_mean, serial.bn.avg_mean[lo:hi])
    back = FilterChannelNet()
    for _, p in back.namedparams():
        p.array[...] = 0
    distconv.store_serial_params(g, dist, back)
    sp = dict(serial.namedparams())
    for path, p in back.namedparams():
        chk.close('roundtrip ' + path, p.array, sp[path].array)
    chk.close('roundtrip avg_mean', back.bn.avg_mean, serial.bn.avg_mean)
    chk.done()


@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2), ((1, 1), 3)],
                         ids=_ids)
def test_reduction_groups_descriptor(gc):
    g = cgrid(*gc)
    dist = FilterChannelNet(g)
    groups = distconv.reduction_groups(dist)
    chk = Checker()
    chk.true('split parameters listed: %r' % sorted(groups),
             sorted(groups) == ['/bn/beta', '/bn/gamma', '/c1/W', '/c1/b',
                                '/c2/W'])
    rg = groups['/c1/W']
    chk.true('same object on the parameter', dist.c1.W.reduction_group is rg)
    chk.true('c2/b replicated', getattr(dist.c2.b, 'reduction_group',
                                        None) is None)
    chk.true('size', rg.size == comm().size // g.channels)
    chk.true('communicator size', rg.mpi_comm.Get_size() == rg.size)
    chk.true('scale', abs(rg.sum_scale - 1.0 / comm().size) < 1e-12)
    chk.true('mean scale', abs(rg.mean_scale - 1.0 / g.channels) < 1e-12)
    chk.true('this rank is a member', comm().rank in rg.members)
    # Key identical on members, different across channel coordinates.
    keys = comm().mpi_comm.allgather((rg.key, g.channel_rank))
    for k, c in keys:
        chk.true('key per coordinate', (k == rg.key) == (c == g.channel_rank))
    # The group sums exactly the members' values.
    got = rg.mpi_comm.allreduce(comm().rank)
    chk.true('members sum', got == sum(rg.members))
    chk.done()
    collective_raises(lambda: distconv.check_replicated(dist),
                      'live on part of the processes')


def test_no_groups_without_channel_axis():
    g = cgrid((1, 1), 1)
    dist = FilterChannelNet(g)
    assert distconv.reduction_groups(dist) == {}
    distconv.check_replicated(dist)


@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2)], ids=_ids)
def test_channel_split_errors(gc):
    g = cgrid(*gc)
    x = _data(13, 2, 4, 5, 5)
    conv = distconv.Convolution2D(g, 4, 3, 3, 1, 1, split='channel')
    # Whole channels into a layer that takes split ones (and the reverse):
    # an error on every rank, not a hang or a silent wrong result.
    collective_raises(lambda: conv(g.scatter(x)), 'channel')
    filt = distconv.Convolution2D(g, 4, 3, 3, 1, 1, split='filter')
    collective_raises(lambda: filt(g.scatter(x, channel_split=True)),
                      'expects 4')
    with pytest.raises(ValueError, match='in_channels'):
        distconv.Convolution2D(g, None, 3, 3, split='filter')
    with pytest.raises(ValueError, match='split must be'):
        distconv.Convolution2D(g, 4, 3, 3, split='rows')
    with pytest.raises(ValueError, match='split_output'):
        distconv.Convolution2D(g, 4, 3, 3, split='filter', split_output=True)
    with pytest.raises(ValueError, match='split_output'):
        distconv.convolution_2d(g, g.scatter(x), conv.W, split='spatial',
                                split_output=True)


def test_grid_channel_axis_layout():
    c = comm()
    for shape, ch in CHANNEL_GRIDS:
        if c.size % (int(np.prod(shape)) * ch):
            continue
        g = cgrid(shape, ch)
        P = g.spatial_size
        assert g.rank == g.world_rank(g.group, g.channel_rank,
                                      g.spatial_rank)
        assert g.n_groups * ch * P == c.size
        assert g.mpi_channel.Get_size() == ch
        assert g.mpi_channel.Get_rank() == g.channel_rank
        assert g.mpi_spatial.Get_size() == P
        assert g.mpi_data.Get_size() == c.size // ch
    with pytest.raises(ValueError, match='channels'):
        distconv.SpatialGrid(c, (1, 1), channels=0)
    if c.size > 1:
        collective_raises(lambda: distconv.SpatialGrid(
            c, (1, 1), channels=c.size + 1), 'channels=')


@pytest.mark.parametrize('gc', [((1, 1, 1), 2), ((2, 1, 1), 2),
                                ((1, 1, 1), 3)], ids=_ids)
def test_convolution_nd_filter_then_channel_3d(gc):
    g = cgrid(*gc)
    rng = np.random.RandomState(14)
    x = rng.randn(2, 3, 5, 4, 5).astype(np.float32)
    w1 = rng.randn(5, 3, 3, 3, 3).astype(np.float32)
    w2 = rng.randn(2, 5, 1, 3, 3).astype(np.float32)
    s1 = L.ConvolutionND(3, 3, 5, 3, 1, 1, initialW=w1, initial_bias=0.2)
    s2 = L.ConvolutionND(3, 5, 2, (1, 3, 3), 2, (0, 1, 1), initialW=w2,
                         initial_bias=0.1)
    d1 = distconv.ConvolutionND(g, 3, 3, 5, 3, 1, 1, initialW=w1,
                                initial_bias=0.2, split='filter')
    d2 = distconv.ConvolutionND(g, 3, 5, 2, (1, 3, 3), 2, (0, 1, 1),
                                initialW=w2, initial_bias=0.1,
                                split='channel')
    for link in (s1, s2, d1, d2):
        link.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = s2(F.relu(s1(xs)))
    gy = rng.randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = d2(F.relu(d1(xd)))
    yd.grad = upstream(g, gy, False)
    yd.backward()
    chk = Checker()
    chk.close('forward', g.gather(yd), ys.array)
    chk.close('input grad', g.gather(xd.grad, reduce_copies=True), xs.grad)
    chk.close('W1 grad', sum_over_ranks(embed(g, w1.shape, d1.W.grad, 0, 5)),
              s1.W.grad)
    chk.close('W2 grad', sum_over_ranks(embed(g, w2.shape, d2.W.grad, 1, 5)),
              s2.W.grad)
    chk.done()


@pytest.mark.parametrize('shape', [(1, 14, 14, 256), (3, 5, 7, 6),
                                   (2, 40, 3, 9), (0, 4, 4, 3),
                                   (2, 3, 4, 5, 6)], ids=str)
def test_host_contiguous_copies_channels_last_views_exactly(shape):
    from chainermn_overlap.distconv import channels as dc_channels
    rng = np.random.RandomState(31)
    last = rng.randn(*shape).astype(np.float32)
    view = np.moveaxis(last, -1, 1)  # what Chainer's CPU convolution returns
    got = dc_channels._host_contiguous(view)
    assert got.flags.c_contiguous
    assert got.shape == view.shape
    np.testing.assert_array_equal(got, view)
    whole = np.ascontiguousarray(view)
    assert dc_channels._host_contiguous(whole) is whole
    strided = whole[:, ::2]
    np.testing.assert_array_equal(dc_channels._host_contiguous(strided),
                                  strided)
