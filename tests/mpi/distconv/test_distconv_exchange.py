"""Region exchange adjointness, zero-size blocks, layouts and bad input."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from chainermn_overlap.distconv import geometry
from distconv_mpi_helpers import GRIDS_2D, GRIDS_3D, Checker, comm, \
    collective_raises, compare_layer, grid, sum_over_ranks

# (spatial shape, ksize, stride, pad, dilate): wide halos, corners, padding.
ADJOINT_CASES = [
    ((7, 6), 3, 1, 1, 1),
    ((7, 7), 7, 1, 3, 1),
    ((5, 6), 4, 3, 3, 2),
    ((9, 4), 2, 2, 0, 1),
]


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('case', ADJOINT_CASES, ids=str)
def test_exchange_adjoint_dot_product(shape, case):
    """<E x, y> == <x, E^T y> summed over all processes, and backward = E^T.
    """
    g = grid(shape)
    sp, k, s, p, d = case
    nd = len(sp)
    rng = np.random.RandomState(100 + g.rank)  # different data per rank
    x_glob = np.random.RandomState(11).randn(2, 3, *sp)
    x = g.scatter(x_glob)
    plan, _, _ = geometry.window_plan(sp, g.shape, (k,) * nd, (s,) * nd,
                                      (p,) * nd, (d,) * nd, False,
                                      g.spatial_rank)
    xv = chainer.Variable(x)
    ext = distconv.region_exchange(g, xv, plan, fill=0)
    y = rng.randn(*ext.shape)
    ety = distconv.RegionExchangeAdjoint(g, plan, x.shape).apply((y,))[0]
    ext.grad = y.copy()
    ext.backward()
    lhs = sum_over_ranks([np.vdot(ext.array, y)])[0]
    rhs = sum_over_ranks([np.vdot(x, ety.array)])[0]
    chk = Checker(1e-12, 1e-10)
    chk.close('dot product', lhs, rhs)
    chk.close('backward is the adjoint', xv.grad, ety.array)
    # The adjoint's backward is the exchange again (double backprop).
    yv = chainer.Variable(y)
    z = distconv.RegionExchangeAdjoint(g, plan, x.shape).apply((yv,))[0]
    z.grad = x.copy()
    z.backward()
    chk.close('adjoint of adjoint', yv.grad, ext.array)
    chk.done()


def _chain(g=None):
    """conv -> BN -> ReLU -> max-pool -> strided conv, serial or distconv."""
    rng = np.random.RandomState(12)
    w1 = rng.randn(3, 2, 3, 3).astype(np.float32)
    w2 = rng.randn(2, 3, 3, 3).astype(np.float32)
    if g is None:
        c1 = L.Convolution2D(2, 3, 3, pad=1, initialW=w1)
        bn = L.BatchNormalization(3)
        c2 = L.Convolution2D(3, 2, 3, stride=2, pad=1, initialW=w2)
        f = lambda v: c2(F.max_pooling_2d(F.relu(bn(c1(v))), 2, 1))  # NOQA
    else:
        c1 = distconv.Convolution2D(g, 2, 3, 3, pad=1, initialW=w1)
        bn = distconv.BatchNormalization(g, 3)
        c2 = distconv.Convolution2D(g, 3, 2, 3, stride=2, pad=1,
                                    initialW=w2)
        f = lambda v: c2(distconv.max_pooling_2d(  # NOQA
            g, F.relu(bn(c1(v))), 2, 1))
    return f, [('c1.W', c1.W), ('bn.gamma', bn.gamma), ('bn.beta', bn.beta),
               ('c2.W', c2.W), ('c2.b', c2.b)]


@pytest.mark.parametrize('shape', [(4, 1), (1, 4), (2, 2), (3, 1), (2, 1),
                                   (1, 1)], ids=str)
@pytest.mark.parametrize('size', [(3, 2), (2, 3), (2, 2)], ids=str)
@pytest.mark.parametrize('batch', [1, 3])
def test_zero_size_blocks_and_tiny_batches(shape, size, batch):
    """Blocks of zero rows (global size < grid) and groups of no sample."""
    g = grid(shape)
    x = np.random.RandomState(13).randn(batch, 2, *size).astype(np.float32)
    fs, ps = _chain()
    fd, pd = _chain(g)
    compare_layer(g, x, fs, fd, [(n, a, b) for (n, a), (_, b) in zip(ps, pd)],
                  check=None, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('shape', GRIDS_2D + GRIDS_3D[1:], ids=str)
def test_layout_roundtrip(shape):
    g = grid(shape)
    sp = (5, 3) if len(shape) == 2 else (3, 2, 3)
    x = np.random.RandomState(14).randn(5, 2, *sp).astype(np.float32)
    xl = chainer.Variable(g.scatter(x))
    xs = distconv.to_sample_layout(g, xl)
    lo, hi = g.sample_range(5)
    a, b = distconv.sample_share(g, hi - lo)
    chk = Checker(0, 0)
    chk.close('sample layout', xs.array, x[lo + a:lo + b])
    back = distconv.to_spatial_layout(g, xs * 2)
    chk.close('roundtrip', back.array, 2 * xl.array)
    gy = np.random.RandomState(15).randn(*back.shape).astype(np.float32)
    back.grad = gy
    back.backward()
    chk.close('gradient (permutation)', xl.grad, 2 * gy)
    chk.done()


@pytest.mark.parametrize('shape', [(2, 1), (1, 2), (2, 2), (4, 1), (3, 1),
                                   (1, 1, 2)], ids=str)
@pytest.mark.parametrize('sp', ['even', 'empty_blocks'])
def test_layout_uneven_counts_and_empty_pieces(shape, sp):
    """Any number of samples per rank (some none), blocks without cells.

    Sample layout -> spatial layout -> sample layout equals the serial
    slicing of the group's batch exactly, and backward is the inverse
    permutation, also for pieces that are not sent at all.
    """
    g = grid(shape)
    P = g.spatial_size
    # Spatial extent smaller than the grid gives blocks of zero cells.
    size = ((3,) * len(shape) if sp == 'even'
            else tuple(max(1, d - 1) for d in shape))
    # Spatial rank s holds (s * 2) % 3 samples: 0, 2, 1, 0, ...
    counts = [(s * 2) % 3 for s in range(P)]
    x_group = np.random.RandomState(40 + g.group).randn(
        sum(counts), 2, *size).astype(np.float32)
    lo = sum(counts[:g.spatial_rank])
    mine = x_group[lo:lo + counts[g.spatial_rank]]
    xs = chainer.Variable(mine.copy())
    xl = distconv.to_spatial_layout(g, xs)
    box = g.block(size)
    chk = Checker(0, 0)
    chk.close('spatial layout', xl.array,
              x_group[(slice(None), slice(None))
                      + tuple(slice(a, b) for a, b in box)])
    back = distconv.to_sample_layout(g, xl * 3)
    a, b = distconv.sample_share(g, sum(counts))
    chk.close('back to balanced sample layout', back.array,
              3 * x_group[a:b])
    # The gradient of a permutation is the inverse permutation: with the
    # output gradient sliced from one group-wide array, each rank's input
    # gradient is that array's slice of its own samples.
    gy_group = np.random.RandomState(50 + g.group).randn(
        *x_group.shape).astype(np.float32)
    back.grad = gy_group[a:b].copy()
    back.backward()
    chk.close('gradient', xs.grad, 3 * gy_group[lo:lo + len(mine)])
    chk.done()


# ----------------------------------------------------------------------
# Bad input: a clear ValueError on every rank, never a hang.
# ----------------------------------------------------------------------
def _split_grid():
    for shape in [(2, 1), (3, 1), (4, 1)]:
        if comm().size % shape[0] == 0:
            return grid(shape)
    pytest.skip('needs a spatially split grid')


def test_grid_not_dividing_comm_size():
    bad = (comm().size + 1, 1)
    msg = collective_raises(lambda: distconv.SpatialGrid(comm(), bad),
                            'needs a multiple of')
    assert str(comm().size) in msg


def test_bad_grid_shape():
    collective_raises(lambda: distconv.SpatialGrid(comm(), (0, 1)),
                      'positive process counts')


def test_spatial_sizes_disagree():
    g = _split_grid()
    x = g.scatter(np.zeros((2, 2, 8, 4), np.float32))
    if g.spatial_rank == 0:
        x = np.zeros(x.shape[:3] + (5,), np.float32)  # wrong width
    conv = distconv.Convolution2D(g, 2, 2, 3, pad=1)
    conv.name = 'conv1'
    msg = collective_raises(lambda: conv(x), "distconv.Convolution2D 'conv1'")
    assert 'different size' in msg or 'balanced split' in msg


def test_block_layout_not_matching_grid():
    g = _split_grid()
    # Rows split 1 + 7 on two processes instead of the balanced 4 + 4.
    rows = 1 if g.coords[0] == 0 else 7
    x = np.zeros((1, 2, rows, 4), np.float32)
    msg = collective_raises(
        lambda: distconv.max_pooling_2d(g, x, 2), 'balanced split')
    assert 'distconv.max_pooling_2d' in msg and 'grid.scatter' in msg


def test_arguments_differ_between_processes():
    g = _split_grid()
    x = g.scatter(np.zeros((1, 2, 8, 4), np.float32))
    collective_raises(
        lambda: distconv.average_pooling_2d(g, x, 3, 1, g.rank % 2),
        'arguments differ between processes')


def test_wrong_dimensionality_and_channels():
    g = grid((1, 1))
    x = np.zeros((1, 2, 4, 4, 4), np.float32)
    collective_raises(lambda: distconv.max_pooling_nd(g, x, 2),
                      'to match the 2-D grid')
    conv = distconv.Convolution2D(g, 3, 2, 3)
    collective_raises(lambda: conv(np.zeros((1, 2, 5, 5), np.float32)),
                      'input has 2 channels')


def test_input_too_small():
    g = grid((1, 1))
    x = np.zeros((1, 1, 2, 2), np.float32)
    collective_raises(
        lambda: distconv.max_pooling_2d(g, x, 5, cover_all=False),
                      'too small')


def test_unsupported_combinations():
    g = grid((1, 1))
    x = np.zeros((1, 1, 4, 4), np.float32)
    collective_raises(
        lambda: distconv.max_pooling_2d(g, x, 2, return_indices=True),
        'return_indices')
    collective_raises(
        lambda: distconv.average_pooling_nd(g, x, 2, pad_value=1),
        'pad_value')
    collective_raises(
        lambda: distconv.BatchNormalization(g, 3, axis=(0, 2)), 'axis')
    g3 = grid((1, 1, 1))
    collective_raises(lambda: distconv.Convolution2D(g3, 1, 1, 3),
                      'needs a 2-D grid')
    collective_raises(lambda: distconv.ConvolutionND(g, 3, 1, 1, 3),
                      'ndim=3')


def test_empty_global_batch_in_batch_norm():
    g = grid((1, 1))
    bn = distconv.BatchNormalization(g, 2)
    collective_raises(lambda: bn(np.zeros((0, 2, 3, 3), np.float32)),
                      'global batch is empty')


def test_local_batch_normalization_differs():
    """Negative control: plain BN on blocks is not the global BN."""
    g = _split_grid()
    x = np.random.RandomState(16).randn(2, 2, 8, 4).astype(np.float32)
    x[:, :, :4] += 5  # blocks with different statistics
    ys = L.BatchNormalization(2)(x).array
    yl = g.gather(L.BatchNormalization(2)(g.scatter(x)))
    yd = g.gather(distconv.BatchNormalization(g, 2)(g.scatter(x)))
    chk = Checker(1e-4, 1e-4)
    chk.true('local BN differs', np.abs(yl - ys).max() > 0.1)
    chk.close('distconv BN equals', yd, ys)
    chk.done()
