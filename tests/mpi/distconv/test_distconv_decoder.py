"""Exactness of distconv's encoder-decoder layers against single-process
Chainer: transposed convolution and unpooling.

Forward, input gradient and parameter gradients (summed over the ranks)
are compared for uneven blocks on every grid that fits the process count.
"""
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from distconv_mpi_helpers import GRIDS_2D, GRIDS_3D, Checker, \
    collective_raises, compare_layer, grid

# (H, W, C_in, C_out, ksize, stride, pad, outsize, dilate, groups); sizes
# are not divisible by most grids, so blocks are uneven.
DECONV2D_CASES = [
    (5, 4, 2, 3, 3, 2, 1, None, 1, 1),    # the usual up-convolution
    (5, 3, 2, 2, 2, 2, 0, None, 1, 1),    # ksize == stride (uneven here)
    (4, 5, 2, 2, 4, 2, 1, None, 1, 1),    # even kernel, pad
    (3, 4, 2, 2, 1, 3, 0, None, 1, 1),    # ksize < stride: gaps of zeros
    (4, 5, 2, 2, 3, 2, 1, (8, 10), 1, 1),  # outsize one more than default
    (3, 3, 1, 2, 2, 3, 0, (8, 9), 1, 1),  # outsize cells nothing reaches
    (4, 4, 2, 2, 3, 1, 2, None, 2, 1),    # dilation
    (4, 5, 4, 4, 3, 2, 1, None, 1, 2),    # groups
    (4, 4, 1, 2, 7, 1, 3, None, 1, 1),    # kernel wider than a block
    (6, 5, 1, 2, 5, 1, 3, None, 1, 1),    # pad larger than the radius
]


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('case', DECONV2D_CASES, ids=str)
def test_deconvolution_2d(shape, case):
    g = grid(shape)
    h, w, ci, co, k, s, p, outsize, d, groups = case
    rng = np.random.RandomState(11)
    x = rng.randn(2, ci, h, w).astype(np.float32)
    serial = L.Deconvolution2D(ci, co, k, s, p, outsize=outsize,
                               initialW=rng.randn(ci, co // groups, k, k)
                               .astype(np.float32), initial_bias=0.5,
                               dilate=d, groups=groups)
    dist = distconv.Deconvolution2D(g, ci, co, k, s, p, outsize=outsize,
                                    dilate=d, groups=groups)
    dist.copyparams(serial)
    compare_layer(g, x, serial, dist,
                  [('W', serial.W, dist.W), ('b', serial.b, dist.b)])


@pytest.mark.parametrize('shape', [(2, 1), (2, 2), (1, 3)], ids=str)
@pytest.mark.parametrize('case', DECONV2D_CASES[::2], ids=str)
def test_deconvolution_2d_blocking_exchange(shape, case):
    """The same with the blocking exchange (the others overlap: interior
    first, boundary slabs after the halo)."""
    g = grid(shape)
    old, g.overlap = g.overlap, False
    try:
        test_deconvolution_2d(shape, case)
    finally:
        g.overlap = old


DECONV3D_CASES = [
    # (D, H, W, ksize, stride, pad, outsize)
    (3, 4, 3, 3, 2, 1, None),
    (3, 2, 3, 2, 2, 0, None),
    (2, 3, 3, 3, 2, 1, (4, 6, 6)),
]


@pytest.mark.parametrize('shape', GRIDS_3D, ids=str)
@pytest.mark.parametrize('case', DECONV3D_CASES, ids=str)
def test_deconvolution_3d(shape, case):
    g = grid(shape)
    dd, h, w, k, s, p, outsize = case
    rng = np.random.RandomState(12)
    x = rng.randn(2, 2, dd, h, w).astype(np.float32)
    serial = L.DeconvolutionND(3, 2, 3, k, s, p, outsize=outsize)
    dist = distconv.DeconvolutionND(g, 3, 2, 3, k, s, p, outsize=outsize)
    dist.copyparams(serial)
    compare_layer(g, x, serial, dist,
                  [('W', serial.W, dist.W), ('b', serial.b, dist.b)])


@pytest.mark.parametrize('shape', [(2, 1), (1, 2), (2, 2), (4, 1)],
                         ids=str)
def test_deconvolution_without_halo_exchanges_nothing(shape):
    """ksize == stride and pad 0 on sizes the grid divides: each output
    block is reached only by the input block of the same process."""
    g = grid(shape)
    rng = np.random.RandomState(13)
    serial = L.Deconvolution2D(2, 3, 2, 2, 0)
    dist = distconv.Deconvolution2D(g, 2, 3, 2, 2, 0)
    dist.copyparams(serial)
    def exchanges():
        return tuple(g.stats.get('exchange_' + k, 0)
                     for k in ('none', 'blocking', 'overlapped'))

    before = exchanges()
    x = rng.randn(2, 2, 8, 4).astype(np.float32)
    compare_layer(g, x, serial, dist,
                  [('W', serial.W, dist.W), ('b', serial.b, dist.b)])
    chk = Checker()
    after = exchanges()
    chk.true('no exchange: %r -> %r' % (before, after),
             after == (before[0] + 1,) + before[1:])
    # Control: on a size the grid does not divide the same layer needs
    # cells of a neighbour, and the counters see the exchange.
    x = rng.randn(2, 2, 7, 3).astype(np.float32)
    compare_layer(g, x, serial, dist, check=chk)
    last = exchanges()
    chk.true('exchange on uneven blocks: %r -> %r' % (after, last),
             last[0] == after[0] and sum(last[1:]) == sum(after[1:]) + 1)
    chk.done()


def test_deconvolution_bad_outsize_raises_on_every_rank():
    g = grid((2, 1))
    x = g.scatter(np.zeros((1, 2, 4, 4), np.float32))
    W = np.zeros((2, 2, 3, 3), np.float32)
    collective_raises(
        lambda: distconv.deconvolution_2d(g, x, W, stride=2, pad=1,
                                          outsize=(10, 7)),
        'outsize=(10, 7) does not match')


# (H, W, ksize, stride, pad, outsize, cover_all)
UNPOOL_CASES = [
    (3, 4, 2, None, 0, None, True),
    (4, 3, 3, 2, 1, None, True),
    (4, 3, 3, 2, 1, None, False),
    (3, 3, 2, 2, 0, (6, 5), True),
    (3, 4, 3, 1, 1, None, False),     # overlapping windows add
]


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('case', UNPOOL_CASES, ids=str)
def test_unpooling_2d(shape, case):
    g = grid(shape)
    h, w, k, s, p, outsize, cover_all = case
    x = np.random.RandomState(14).randn(2, 2, h, w).astype(np.float32)
    compare_layer(
        g, x,
        lambda v: F.unpooling_2d(v, k, s, p, outsize, cover_all),
        lambda v: distconv.unpooling_2d(g, v, k, s, p, outsize, cover_all))


@pytest.mark.parametrize('shape', GRIDS_3D, ids=str)
def test_unpooling_3d(shape):
    g = grid(shape)
    x = np.random.RandomState(15).randn(1, 2, 3, 2, 3).astype(np.float32)
    compare_layer(
        g, x, lambda v: F.unpooling_nd(v, 2, cover_all=False),
        lambda v: distconv.unpooling_nd(g, v, 2, cover_all=False))
    compare_layer(
        g, x, lambda v: F.unpooling_nd(v, 3, 2, 1),
        lambda v: distconv.unpooling_nd(g, v, 3, 2, 1))


# (N, C, groups, spatial): uneven blocks, one-sample batches, 3-D
GN_CASES = [
    (2, 4, 2, (7, 5)),
    (1, 6, 3, (5, 6)),
    (1, 4, 4, (3, 4, 5)),
]


@pytest.mark.parametrize('case', GN_CASES, ids=str)
def test_group_normalization(case):
    n, c, groups, sp = case
    shapes = GRIDS_2D if len(sp) == 2 else GRIDS_3D
    for shape in shapes:
        # (1, 1) included: at 2+ ranks a one-sample batch leaves a
        # sample group without samples.
        if comm_size() % int(np.prod(shape)) == 0:
            _check_group_norm(grid(shape), n, c, groups, sp)


def comm_size():
    from distconv_mpi_helpers import comm
    return comm().size


def _check_group_norm(g, n, c, groups, sp):
    rng = np.random.RandomState(16)
    x = (rng.randn(n, c, *sp) * 2 + 3).astype(np.float32)
    init_g = rng.rand(c).astype(np.float32) + 0.5
    init_b = rng.randn(c).astype(np.float32)
    serial = L.GroupNormalization(groups, c, initial_gamma=init_g,
                                  initial_beta=init_b)
    dist = distconv.GroupNormalization(g, groups, c, initial_gamma=init_g,
                                       initial_beta=init_b)
    chk = compare_layer(
        g, x, serial, dist,
        [('gamma', serial.gamma, dist.gamma),
         ('beta', serial.beta, dist.beta)], check=Checker(1e-4, 1e-4))
    # Control: statistics of the local block only (Chainer's function on
    # the block) differ from the global ones wherever the block is split.
    # (A sample group left without samples has nothing to compare.)
    xd = g.scatter(x)
    if xd.shape[0] and g.spatial_size > 1:
        local = F.group_normalization(xd, groups, init_g, init_b).array
        want = g.scatter(serial(x).array)
        chk.true('local statistics differ from global ones',
                 not np.allclose(local, want, rtol=1e-3, atol=1e-3))
    chk.done()


def test_group_normalization_bad_groups_raises_on_every_rank():
    g = grid((2, 1))
    x = g.scatter(np.zeros((1, 6, 4, 4), np.float32))
    gamma = np.ones(6, np.float32)
    collective_raises(
        lambda: distconv.group_normalization(g, x, 4, gamma, gamma),
        'groups must be a positive int dividing the 6 channels')
