"""The overlapped halo path: used, exact, equal to the blocking path.

Also the cached layout validation: used on repeated geometries, and bad
input after caching still raises on every rank.
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from distconv_mpi_helpers import Checker, collective_raises, \
    compare_layer, grid, sum_over_ranks

# Grids with 1, 2 and 3 split dimensions (corners); (2, 2, 2) runs at 8.
GRIDS = [(2, 1), (1, 2), (2, 2), (4, 1), (3, 1), (1, 1), (2, 1, 1),
         (1, 2, 2), (2, 2, 2)]
# (ksize, stride, pad, dilate): the common case, stride, wide pad, even
# kernel without padding, dilation.
CASES = [(3, 1, 1, 1), (3, 2, 1, 1), (5, 1, 3, 1), (4, 1, 0, 1),
         (3, 1, 2, 2)]


def _run(g, overlap, x, w, b, case, gy=None):
    ks, s, p, d = case
    old = g.overlap
    g.overlap = overlap
    g.stats.clear()
    try:
        xv = chainer.Variable(g.scatter(x))
        Wv = chainer.Parameter(w.copy())
        bv = chainer.Parameter(b.copy())
        y = distconv.convolution_nd(g, xv, Wv, bv, s, p, dilate=d)
        y.grad = g.scatter(gy)
        y.backward()
        stats = dict(g.stats)
    finally:
        g.overlap = old
    return y.array, xv.grad, Wv.grad, bv.grad, stats


@pytest.mark.parametrize('shape', GRIDS, ids=str)
@pytest.mark.parametrize('case', CASES, ids=str)
def test_overlapped_equals_blocking_and_serial(shape, case):
    g = grid(shape)
    nd = len(shape)
    ks, s, p, d = case
    rng = np.random.RandomState(30)
    # Large enough that every process has an interior to overlap.
    sp = (13, 12) if nd == 2 else (11, 10, 9)
    x = rng.randn(2, 3, *sp).astype(np.float32)
    w = rng.randn(4, 3, *(ks,) * nd).astype(np.float32)
    b = rng.randn(4).astype(np.float32)
    xs = chainer.Variable(x)
    ys = F.convolution_nd(xs, w, b, s, p, dilate=d)
    gy = rng.randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    Ws = chainer.Parameter(w.copy())
    bs = chainer.Parameter(b.copy())
    ys = F.convolution_nd(xs, Ws, bs, s, p, dilate=d)
    ys.grad = gy.copy()
    ys.backward()
    yo, gxo, gWo, gbo, so = _run(g, True, x, w, b, case, gy)
    yb, gxb, gWb, gbb, sb = _run(g, False, x, w, b, case, gy)
    # Summation orders differ (pieces vs one GEMM): float32 round-off only.
    chk = Checker(1e-5, 1e-4)
    if not so.get('exchange_none'):  # (1, 1) without padding: no halo
        chk.true('overlapped path used: %r' % so,
                 so.get('exchange_overlapped'))
        chk.true('blocking path used: %r' % sb, sb.get('exchange_blocking'))
        chk.true('waits timed', 'forward_wait_s' in so and
                 'backward_wait_s' in so)
    chk.close('forward overlap == blocking', yo, yb)
    chk.close('input grad overlap == blocking', gxo, gxb)
    chk.close('W grad overlap == blocking', gWo, gWb, rtol=1e-4, atol=1e-4)
    chk.close('b grad overlap == blocking', gbo, gbb, rtol=1e-4, atol=1e-4)
    chk.close('forward == serial', g.gather(yo), ys.array, 1e-4, 1e-4)
    chk.close('input grad == serial', g.gather(gxo), xs.grad, 1e-4, 1e-4)
    chk.close('W grad == serial', sum_over_ranks(gWo), Ws.grad, 1e-4, 1e-3)
    chk.close('b grad == serial', sum_over_ranks(gbo), bs.grad, 1e-4, 1e-3)
    chk.done()


@pytest.mark.parametrize('shape', [(2, 2), (4, 1), (1, 3), (1, 2, 2)],
                         ids=str)
def test_overlapped_pooling(shape):
    g = grid(shape)
    nd = len(shape)
    sp = (13, 11) if nd == 2 else (9, 10, 9)
    x = np.random.RandomState(31).permutation(2 * 2 * int(np.prod(sp))) \
        .reshape(2, 2, *sp).astype(np.float32)
    g.stats.clear()
    compare_layer(g, x, lambda v: F.max_pooling_nd(v, 3, 1, 1),
                  lambda v: distconv.max_pooling_nd(g, v, 3, 1, 1))
    compare_layer(
        g, x, lambda v: F.average_pooling_nd(v, 3, 2, 1, pad_value=None),
        lambda v: distconv.average_pooling_nd(g, v, 3, 2, 1,
                                              pad_value=None))
    assert g.stats['exchange_overlapped'] == 2


class _Residual(chainer.Chain):
    """Two branches with halos (a 3x3 and a 5x5 conv) joined by a sum: the
    backward interleaves two overlapped exchanges and batch norms."""

    def __init__(self, g=None):
        super(_Residual, self).__init__()
        rng = np.random.RandomState(32)
        w1 = rng.randn(3, 2, 3, 3).astype(np.float32) * 0.3
        w2 = rng.randn(3, 2, 5, 5).astype(np.float32) * 0.3
        with self.init_scope():
            if g is None:
                self.a = L.Convolution2D(2, 3, 3, pad=1, initialW=w1)
                self.b = L.Convolution2D(2, 3, 5, pad=2, initialW=w2)
                self.bn = L.BatchNormalization(3)
            else:
                self.a = distconv.Convolution2D(g, 2, 3, 3, pad=1,
                                                initialW=w1)
                self.b = distconv.Convolution2D(g, 2, 3, 5, pad=2,
                                                initialW=w2)
                self.bn = distconv.BatchNormalization(g, 3)

    def forward(self, x):
        return F.relu(self.bn(self.a(x))) + self.b(x)


@pytest.mark.parametrize('shape', [(2, 2), (1, 4), (3, 1), (2, 1)],
                         ids=str)
def test_branches_with_overlapped_exchanges(shape):
    g = grid(shape)
    x = np.random.RandomState(33).randn(2, 2, 12, 11).astype(np.float32)
    s, d = _Residual(), _Residual(g)
    g.stats.clear()
    compare_layer(g, x, s, d, [('a.W', s.a.W, d.a.W), ('b.W', s.b.W, d.b.W),
                               ('bn.gamma', s.bn.gamma, d.bn.gamma)],
                  rtol=1e-4, atol=1e-4)
    assert g.stats['exchange_overlapped'] == 2


def test_layout_checks_are_cached():
    g = grid((2, 1)) if grid((1, 1)).size % 2 == 0 else grid((1, 1))
    conv = distconv.Convolution2D(g, 2, 2, 3, pad=1)
    x = g.scatter(np.ones((1, 2, 8, 4), np.float32))
    conv(x)
    g.stats.clear()
    for _ in range(3):
        conv(x)
    assert g.stats['validate_full'] == 0
    assert g.stats['validate_cached'] == 3


def test_same_local_block_new_global_layout():
    """A local block seen before can belong to another global layout (8
    rows split 4+4, then 7 split 4+3): the cache must not be trusted on a
    rank whose neighbour sees a new geometry."""
    g = grid((2, 1)) if grid((1, 1)).size % 2 == 0 else grid((1, 1))
    serial = L.Convolution2D(2, 2, 3, pad=1)
    dist = distconv.Convolution2D(g, 2, 2, 3, pad=1)
    dist.copyparams(serial)
    chk = Checker(1e-5, 1e-5)
    for rows in (8, 7, 8):
        x = np.random.RandomState(rows).randn(1, 2, rows, 4).astype(
            np.float32)
        chk.close('rows=%d' % rows, g.gather(dist(g.scatter(x))),
                  serial(x).array)
    chk.done()


def test_bad_input_after_caching_raises_everywhere():
    g = grid((2, 1)) if grid((1, 1)).size % 2 == 0 else None
    if g is None:
        pytest.skip('needs a spatially split grid')
    conv = distconv.Convolution2D(g, 2, 2, 3, pad=1)
    conv.name = 'cached'
    x = g.scatter(np.zeros((1, 2, 8, 4), np.float32))
    conv(x)
    conv(x)  # cached now on every rank
    bad = x
    if g.rank == 1:
        bad = np.zeros(x.shape[:3] + (5,), np.float32)  # wrong width
    msg = collective_raises(lambda: conv(bad), "distconv.Convolution2D "
                            "'cached'")
    assert 'different size' in msg or 'balanced split' in msg


def test_double_backprop_through_overlap_says_what_to_do():
    g = grid((1, 1))
    x = chainer.Variable(np.ones((1, 1, 5, 5), np.float32))
    W = chainer.Parameter(np.ones((1, 1, 3, 3), np.float32))
    y = distconv.convolution_2d(g, x, W, pad=1)
    with pytest.raises(NotImplementedError, match='grid.overlap = False'):
        y.grad = np.ones_like(y.array)
        y.backward(enable_double_backprop=True)
