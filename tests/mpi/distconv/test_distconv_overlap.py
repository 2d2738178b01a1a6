"""The overlapped halo path: used, exact, equal to the blocking path.

Also the cached layout validation: used on repeated geometries, and bad
input after caching still raises on every rank.
"""
import collections

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


def _run(g, overlap, x, w, b, case, gy=None, pieces=1):
    ks, s, p, d = case
    old = g.overlap, g.progress_pieces, g.progress_min_cells
    g.overlap = overlap
    # Tiny test inputs: force the split into pieces regardless of size.
    g.progress_pieces, g.progress_min_cells = pieces, 1
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
        g.overlap, g.progress_pieces, g.progress_min_cells = old
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
    # Interior in pieces with progress calls between them (4 pieces: some
    # empty on thin interiors, which must mirror the graph).
    yp, gxp, gWp, gbp, sp_ = _run(g, True, x, w, b, case, gy, pieces=4)
    # Summation orders differ (pieces vs one GEMM): float32 round-off only.
    chk = Checker(1e-5, 1e-4)
    if not so.get('exchange_none'):  # (1, 1) without padding: no halo
        chk.true('overlapped path used: %r' % so,
                 so.get('exchange_overlapped'))
        chk.true('blocking path used: %r' % sb, sb.get('exchange_blocking'))
        chk.true('waits timed', 'forward_wait_s' in so and
                 'backward_wait_s' in so)
    chk.close('forward pieces == blocking', yp, yb)
    chk.close('input grad pieces == blocking', gxp, gxb)
    chk.close('W grad pieces == blocking', gWp, gWb, rtol=1e-4, atol=1e-4)
    chk.close('b grad pieces == blocking', gbp, gbb, rtol=1e-4, atol=1e-4)
    if sp_.get('forward_halos'):
        # A rank with messages drives them between its pieces (also
        # between empty ones: the graph is the same on every rank).
        chk.true('progress driven: %r' % sp_, sp_.get('progress_calls'))
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
    old = g.progress_pieces, g.progress_min_cells
    try:
        for pieces in (1, 3):
            g.progress_pieces, g.progress_min_cells = pieces, 1
            g.stats.clear()
            compare_layer(g, x, lambda v: F.max_pooling_nd(v, 3, 1, 1),
                          lambda v: distconv.max_pooling_nd(g, v, 3, 1, 1))
            compare_layer(
                g, x,
                lambda v: F.average_pooling_nd(v, 3, 2, 1, pad_value=None),
                lambda v: distconv.average_pooling_nd(g, v, 3, 2, 1,
                                                      pad_value=None))
            assert g.stats['exchange_overlapped'] == 2
    finally:
        g.progress_pieces, g.progress_min_cells = old


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
    old = g.progress_pieces, g.progress_min_cells
    try:
        # Two exchanges in flight at once in backward, pieces and progress
        # nodes of both interleaved by Chainer's scheduler.
        g.progress_pieces, g.progress_min_cells = 3, 1
        g.stats.clear()
        compare_layer(g, x, s, d, [('a.W', s.a.W, d.a.W),
                                   ('b.W', s.b.W, d.b.W),
                                   ('bn.gamma', s.bn.gamma, d.bn.gamma)],
                      rtol=1e-4, atol=1e-4)
        assert g.stats['exchange_overlapped'] == 2
    finally:
        g.progress_pieces, g.progress_min_cells = old


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
    g = grid((2, 1)) if grid((1, 1)).size % 2 == 0 else None
    if g is None:
        pytest.skip('needs a spatially split grid (a 1x1 grid runs plain '
                    'Chainer, which supports double backpropagation)')
    x = chainer.Variable(g.scatter(np.ones((1, 1, 6, 5), np.float32)))
    W = chainer.Parameter(np.ones((1, 1, 3, 3), np.float32))
    y = distconv.convolution_2d(g, x, W, pad=1)
    with pytest.raises(NotImplementedError, match='grid.overlap = False'):
        y.grad = np.ones_like(y.array)
        y.backward(enable_double_backprop=True)


def test_single_block_grid_is_plain_chainer():
    """With one process per sample group every window operation is the
    single-process Chainer call: bitwise equal, no exchange machinery, and
    double backpropagation works."""
    g = grid((1, 1))
    rng = np.random.RandomState(40)
    x = rng.randn(3, 2, 9, 8).astype(np.float32)
    w = rng.randn(4, 2, 3, 3).astype(np.float32)
    b = rng.randn(4).astype(np.float32)
    x_local = g.scatter(x)
    g.stats.clear()
    cases = [
        (lambda v: F.convolution_2d(v, w, b, 2, 1, cover_all=True),
         lambda v: distconv.convolution_2d(g, v, w, b, 2, 1,
                                           cover_all=True)),
        (lambda v: F.max_pooling_2d(v, 3, 2, 1),
         lambda v: distconv.max_pooling_2d(g, v, 3, 2, 1)),
        (lambda v: F.average_pooling_nd(v, 3, 2, 1, pad_value=None),
         lambda v: distconv.average_pooling_nd(g, v, 3, 2, 1,
                                               pad_value=None)),
    ]
    chk = Checker(0, 0)
    for i, (serial, dist) in enumerate(cases):
        xd = chainer.Variable(x_local.copy())
        yd = dist(xd)  # collective (layout check), also without samples
        yd.grad = np.ones_like(yd.array)
        yd.backward(enable_double_backprop=True)
        if not len(x_local):
            # An empty sample group (3 samples, 4 processes): Chainer
            # rejects empty inputs, distconv mirrors an empty block.
            chk.true('case %d empty block' % i, yd.size == 0
                     and xd.grad.shape == x_local.shape)
            continue
        xs = chainer.Variable(x_local.copy())
        ys = serial(xs)
        chk.close('case %d forward bitwise' % i, yd.array, ys.array)
        ys.grad = np.ones_like(ys.array)
        ys.backward(enable_double_backprop=True)
        chk.close('case %d backward bitwise' % i, xd.grad, xs.grad)
    chk.true('no exchange: %r' % dict(g.stats),
             g.stats['exchange_none'] == 3
             and not g.stats['exchange_overlapped']
             and not g.stats['exchange_blocking'])
    chk.done()


def test_progress_completes_halos_before_the_wait():
    """The mechanism that hides the halo: with progress calls between the
    interior pieces, the messages of an exchange complete before its
    boundary wait (forward and backward), which cannot happen without them
    (MPICH moves data only inside MPI calls). Timing-free: it counts
    exchanges found complete when their wait began. A descheduled peer on a
    loaded machine can delay one exchange, so it asks for one of several
    repetitions; the time saved is measured by ``make bench-spatial``."""
    g = grid((2, 1)) if grid((1, 1)).size % 2 == 0 else None
    if g is None:
        pytest.skip('needs a spatially split grid')
    rng = np.random.RandomState(41)
    # Big enough that the interior takes milliseconds per piece.
    x = g.scatter(rng.randn(2, 16, 128, 96).astype(np.float32))
    conv = distconv.Convolution2D(g, 16, 16, 3, pad=1)
    old = g.progress_pieces, g.progress_min_cells
    ready = {}
    try:
        for pieces in (1, 8):
            g.progress_pieces, g.progress_min_cells = pieces, 1
            g.stats.clear()
            for _ in range(5):
                xv = chainer.Variable(x)
                g.mpi_world.Barrier()
                y = conv(xv)
                y.grad = np.ones_like(y.array)
                y.backward()
            ready[pieces] = collections.Counter(g.stats)
    finally:
        g.progress_pieces, g.progress_min_cells = old
    chk = Checker()
    no, yes = ready[1], ready[8]
    chk.true('without progress calls nothing is ready early: %r' % no,
             no['forward_halos'] == 5 and no['backward_halos'] == 5
             and not no['forward_halos_ready']
             and not no['backward_halos_ready'])
    chk.true('with progress calls, forward halos complete before the wait '
             '(%r)' % yes, yes['forward_halos_ready'] >= 1)
    chk.true('with progress calls, backward halos complete before the '
             'wait (%r)' % yes, yes['backward_halos_ready'] >= 1)
    chk.done()
