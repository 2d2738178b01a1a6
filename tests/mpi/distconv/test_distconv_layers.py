"""Exactness of distconv layers against single-process Chainer.

Each test runs collectively on every rank; grids that do not fit the
process count are skipped, and when ``comm.size`` is a multiple of the grid
product the quotient forms sample groups.
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from distconv_mpi_helpers import GRIDS_2D, GRIDS_3D, Checker, \
    compare_layer, grid

# (H, W, C_in, C_out, ksize, stride, pad, dilate, groups); sizes are not
# divisible by the grids so blocks are uneven.
CONV2D_CASES = [
    (7, 6, 2, 3, 3, 1, 1, 1, 1),    # the common case
    (7, 5, 2, 2, 1, 1, 0, 1, 1),    # 1x1, no halo
    (8, 7, 2, 2, 2, 1, 0, 1, 1),    # even kernel, no padding
    (9, 6, 2, 2, 4, 2, 3, 1, 1),    # even kernel, stride 2, pad 3
    (7, 7, 1, 2, 3, 1, 3, 1, 1),    # pad larger than the radius
    (9, 8, 2, 2, 5, 3, 2, 1, 1),    # stride 3
    (9, 9, 1, 2, 7, 1, 3, 1, 1),    # 7x7: halo wider than a block
    (8, 7, 2, 2, 3, 1, 2, 2, 1),    # dilation
    (7, 6, 4, 4, 3, 2, 1, 1, 2),    # groups, strided
    (6, 7, 2, 2, 6, 1, 0, 1, 1),    # 6x6 without padding
]


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('case', CONV2D_CASES, ids=str)
def test_convolution_2d(shape, case):
    g = grid(shape)
    h, w, ci, co, k, s, p, d, groups = case
    rng = np.random.RandomState(1)
    x = rng.randn(3, ci, h, w).astype(np.float32)
    serial = L.Convolution2D(ci, co, k, s, p, dilate=d, groups=groups,
                             initialW=rng.randn(co, ci // groups, k, k)
                             .astype(np.float32), initial_bias=0.5)
    dist = distconv.Convolution2D(g, ci, co, k, s, p, dilate=d,
                                  groups=groups)
    dist.copyparams(serial)
    compare_layer(g, x, serial, dist,
                  [('W', serial.W, dist.W), ('b', serial.b, dist.b)])


CONV3D_CASES = [
    # (D, H, W, ksize, stride, pad)
    (5, 4, 5, 3, 1, 1),
    (4, 5, 3, 2, 2, 2),
]


@pytest.mark.parametrize('shape', GRIDS_3D, ids=str)
@pytest.mark.parametrize('case', CONV3D_CASES, ids=str)
def test_convolution_3d(shape, case):
    g = grid(shape)
    dd, h, w, k, s, p = case
    rng = np.random.RandomState(2)
    x = rng.randn(2, 2, dd, h, w).astype(np.float32)
    serial = L.ConvolutionND(3, 2, 2, k, s, p)
    dist = distconv.ConvolutionND(g, 3, 2, 2, k, s, p)
    dist.copyparams(serial)
    compare_layer(g, x, serial, dist,
                  [('W', serial.W, dist.W), ('b', serial.b, dist.b)])


# (H, W, ksize, stride, pad, cover_all)
MAXPOOL_CASES = [
    (7, 6, 2, None, 0, True),
    (7, 7, 3, 2, 1, True),
    (7, 7, 3, 2, 1, False),
    (8, 5, 3, 1, 2, True),          # stride 1, pad > radius
    (7, 7, 7, 1, 0, False),         # ResNet's final 7x7 over a 7x7 map
    (9, 7, 4, 3, 3, True),          # even kernel, stride 3, pad 3
]


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('case', MAXPOOL_CASES, ids=str)
def test_max_pooling_2d(shape, case):
    g = grid(shape)
    h, w, k, s, p, cover_all = case
    # Distinct values: ties would make the argmax, hence the gradient,
    # depend on the summation order of nothing but the data.
    x = np.random.RandomState(3).permutation(2 * 2 * h * w).reshape(
        2, 2, h, w).astype(np.float32)
    compare_layer(
        g, x,
        lambda v: F.max_pooling_2d(v, k, s, p, cover_all=cover_all),
        lambda v: distconv.max_pooling_2d(g, v, k, s, p, cover_all=cover_all))


AVGPOOL_CASES = [
    (7, 6, 2, None, 0),
    (7, 7, 3, 2, 1),
    (8, 5, 4, 1, 3),
    (7, 7, 7, 1, 0),
]


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('case', AVGPOOL_CASES, ids=str)
def test_average_pooling_2d(shape, case):
    g = grid(shape)
    h, w, k, s, p = case
    x = np.random.RandomState(4).randn(2, 2, h, w).astype(np.float32)
    compare_layer(
        g, x, lambda v: F.average_pooling_2d(v, k, s, p),
        lambda v: distconv.average_pooling_2d(g, v, k, s, p))


@pytest.mark.parametrize('shape', [(2, 2), (4, 1), (1, 3)], ids=str)
def test_average_pooling_nd_excluding_padding(shape):
    g = grid(shape)
    x = np.random.RandomState(5).randn(2, 2, 7, 6).astype(np.float32)
    compare_layer(
        g, x, lambda v: F.average_pooling_nd(v, 3, 2, 1, pad_value=None),
        lambda v: distconv.average_pooling_nd(g, v, 3, 2, 1, pad_value=None))


@pytest.mark.parametrize('shape', GRIDS_3D, ids=str)
def test_pooling_3d(shape):
    g = grid(shape)
    x = np.random.RandomState(6).permutation(2 * 5 * 4 * 5).reshape(
        1, 2, 5, 4, 5).astype(np.float32)
    compare_layer(
        g, x, lambda v: F.max_pooling_nd(v, 3, 2, 1),
        lambda v: distconv.max_pooling_nd(g, v, 3, 2, 1))
    compare_layer(
        g, x, lambda v: F.average_pooling_nd(v, 2, 1, 1),
        lambda v: distconv.average_pooling_nd(g, v, 2, 1, 1))


@pytest.mark.parametrize('shape', GRIDS_2D + GRIDS_3D[1:], ids=str)
def test_global_average_pooling(shape):
    g = grid(shape)
    sp = (7, 5) if len(shape) == 2 else (3, 5, 4)
    x = np.random.RandomState(7).randn(3, 2, *sp).astype(np.float32)
    axes = tuple(range(2, x.ndim))
    # The output is replicated on the spatial group and its backward sums
    # the copies' gradients, so each copy gets 1/P of the upstream gradient
    # for the sum over ranks to equal the single-process objective.
    chk = Checker()
    rng = np.random.RandomState(0)
    xs = chainer.Variable(x.copy())
    ys = F.mean(xs, axis=axes)
    gy = rng.randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()  # some Chainer backwards modify it in place
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = distconv.global_average_pooling(g, xd)
    yd.grad = g.scatter_samples(gy) / g.spatial_size
    yd.backward()
    chk.close('forward', yd.array, g.scatter_samples(ys.array))
    chk.close('input grad', g.gather(xd.grad), xs.grad)
    chk.done()


BN_CASES = [
    # (N, C, H, W): uneven spatial blocks, and N=3 over up to 4 groups
    (4, 3, 7, 5),
    (3, 2, 5, 6),
]


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('case', BN_CASES, ids=str)
def test_batch_normalization(shape, case):
    g = grid(shape)
    rng = np.random.RandomState(8)
    x = (rng.randn(*case) * 3 + 1).astype(np.float32)
    c = case[1]
    init_g = rng.rand(c).astype(np.float32) + 0.5
    init_b = rng.randn(c).astype(np.float32)
    serial = L.BatchNormalization(c, initial_gamma=init_g,
                                  initial_beta=init_b)
    dist = distconv.BatchNormalization(g, c, initial_gamma=init_g,
                                       initial_beta=init_b)
    chk = compare_layer(
        g, x, serial, dist,
        [('gamma', serial.gamma, dist.gamma),
         ('beta', serial.beta, dist.beta)], check=Checker(1e-4, 1e-4))
    chk.close('running mean', dist.avg_mean, serial.avg_mean)
    chk.close('running var', dist.avg_var, serial.avg_var)
    # Test mode uses the running statistics, element-wise.
    with chainer.using_config('train', False):
        chk.close('test mode', g.gather(dist(g.scatter(x))),
                  serial(x).array)
    chk.done()


@pytest.mark.parametrize('shape', [(2, 1), (2, 2), (4, 1), (3, 1)], ids=str)
@pytest.mark.parametrize('chunk', [5, 40], ids=lambda c: 'chunk%d' % c)
def test_batch_normalization_blocked_passes(monkeypatch, shape, chunk):
    """The blocked (cache-sized) passes of the distributed batch norm.

    A tiny chunk makes them split each channel into column ranges (5) or
    group whole channels (40); a large common offset would expose a
    variance formula that cancels (E[x^2] - E[x]^2 in float32); uneven and
    (at 4 ranks over 3 rows) empty blocks are weighted by their cells.
    """
    from chainermn_overlap.distconv import normalization
    monkeypatch.setattr(normalization, '_CHUNK', chunk)
    g = grid(shape)
    rng = np.random.RandomState(9)
    x = (rng.randn(3, 4, 3, 7) * 0.5 + 300).astype(np.float32)
    init_g = rng.rand(4).astype(np.float32) + 0.5
    init_b = rng.randn(4).astype(np.float32)
    serial = L.BatchNormalization(4, initial_gamma=init_g,
                                  initial_beta=init_b)
    dist = distconv.BatchNormalization(g, 4, initial_gamma=init_g,
                                       initial_beta=init_b)
    chk = compare_layer(
        g, x, serial, dist,
        [('gamma', serial.gamma, dist.gamma),
         ('beta', serial.beta, dist.beta)], check=Checker(2e-4, 2e-4))
    chk.close('running mean', dist.avg_mean, serial.avg_mean)
    chk.close('running var', dist.avg_var, serial.avg_var)
    chk.done()


def grid_fits(shape):
    from distconv_mpi_helpers import comm
    return comm().size % int(np.prod(shape)) == 0


def test_conv_bn_with_finetune_and_lazy_init():
    g = grid((2, 1)) if grid_fits((2, 1)) else grid((1, 1))
    x = np.random.RandomState(10).randn(2, 3, 5, 4).astype(np.float32)
    serial = L.BatchNormalization(None, axis=(0, 2, 3))
    dist = distconv.BatchNormalization(g)
    chk = Checker(1e-4, 1e-4)
    for _ in range(2):
        ys = serial(x, finetune=True).array
        yd = g.gather(dist(g.scatter(x), finetune=True))
        chk.close('finetune', yd, ys)
    chk.close('running mean', dist.avg_mean, serial.avg_mean)
    chk.close('running var', dist.avg_var, serial.avg_var)
    chk.true('N', dist.N == serial.N == 2)
    conv = distconv.Convolution2D(g, None, 2, 3, pad=1)
    ref = L.Convolution2D(None, 2, 3, pad=1)
    y = conv(g.scatter(x))
    ref(x)
    ref.copyparams(conv)
    chk.close('lazy conv', g.gather(y), ref(x).array)
    chk.done()


@pytest.mark.parametrize('shape', [(2, 2), (4, 1), (3, 1), (1, 2)], ids=str)
def test_convolution_nd_cover_all_on_2d_grid(shape):
    g = grid(shape)
    rng = np.random.RandomState(17)
    x = rng.randn(2, 2, 8, 7).astype(np.float32)
    W = chainer.Parameter(rng.randn(3, 2, 3, 2).astype(np.float32))
    Wd = chainer.Parameter(W.array.copy())
    compare_layer(
        g, x, lambda v: F.convolution_nd(v, W, None, 3, 1, cover_all=True),
        lambda v: distconv.convolution_nd(g, v, Wd, None, 3, 1,
                                          cover_all=True),
        [('W', W, Wd)])
