"""Geometry of overlapped tiling (distconv.tiling), no MPI.

For random stacks of window layers and grids, every process's boxes must
chain exactly (each window run without padding on the ``read`` box yields
the next level's ``computed`` box), hold the owned block at every level,
and differ from their padded extension only by cells outside the global
extent. A 1-D numerical simulation then checks the whole scheme: compute
each level on the computed box, pad with zeros, read, window, and compare
with the global computation (with a non-linearity between layers, so that
padding values that were computed instead of zero would show).
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from chainermn_overlap.distconv import geometry as G
from chainermn_overlap.distconv import tiling as T


def windows_strategy(ndim, max_layers=4):
    one = st.tuples(
        st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim),
        st.lists(st.integers(1, 2), min_size=ndim, max_size=ndim),
        st.lists(st.integers(0, 2), min_size=ndim, max_size=ndim),
        st.lists(st.integers(1, 2), min_size=ndim, max_size=ndim),
        st.booleans())
    return st.lists(one, min_size=1, max_size=max_layers)


def _make(ws):
    return tuple(T.Window(k, s, p, d, ca) for k, s, p, d, ca in ws)


def _fits(shape, windows):
    for w in windows:
        shape = w.out_shape(shape)
        if any(n <= 0 for n in shape):
            return False
    return True


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2), st.data())
def test_tile_boxes_chain_and_hold_the_owned_block(ndim, data):
    grid = tuple(data.draw(st.lists(st.integers(1, 4), min_size=ndim,
                                    max_size=ndim)))
    windows = _make(data.draw(windows_strategy(ndim)))
    shape = tuple(data.draw(st.lists(st.integers(6, 20), min_size=ndim,
                                     max_size=ndim)))
    if not _fits(shape, windows):
        return
    owners = None
    for r in range(G.grid_size(grid)):
        levels = T.tile_boxes(shape, windows, grid, r)
        assert len(levels) == len(windows) + 1
        assert levels[-1]['computed'] == levels[-1]['owned']
        for i, w in enumerate(windows):
            lv, nxt = levels[i], levels[i + 1]
            comp, ext, read = lv['computed'], lv['extended'], lv['read']
            # Owned cells are computed (batch norm finds them).
            if not G.box_is_empty(lv['owned']):
                assert G.intersect(lv['owned'], comp) == lv['owned']
            # The computed box is the extension's part inside the extent.
            assert comp == G.clip(ext, lv['shape'])
            if not G.box_is_empty(read):
                assert G.intersect(read, ext) == read
            # The window on `read` without padding gives `nxt.computed`.
            if not G.box_is_empty(nxt['computed']):
                for d in range(ndim):
                    n_in = read[d][1] - read[d][0]
                    dk = G.dilated_ksize(w.ksize[d], w.dilate[d])
                    assert (n_in - dk) // w.stride[d] + 1 == \
                        nxt['computed'][d][1] - nxt['computed'][d][0]
                    assert read[d][0] == nxt['computed'][d][0] * \
                        w.stride[d] - w.pad[d]
        if owners is None:
            owners = [np.zeros(lv['shape'], int) for lv in levels]
        for cnt, lv in zip(owners, levels):
            if not G.box_is_empty(lv['owned']):
                cnt[G.box_slices(lv['owned'], (0,) * ndim)] += 1
    for cnt in owners:
        assert (cnt == 1).all()


def _window_1d(x, w):
    """Sum over each window, no padding (a stand-in for a convolution)."""
    k, s, d = w.ksize[0], w.stride[0], w.dilate[0]
    dk = G.dilated_ksize(k, d)
    n_out = (len(x) - dk) // s + 1
    return np.array([sum(x[o * s + j * d] * (j + 1) for j in range(k))
                     for o in range(n_out)])


def _global_1d(x, windows):
    levels = [x]
    for w in windows:
        p = w.pad[0]
        n_out = w.out_shape((len(levels[-1]),))[0]
        dk = G.dilated_ksize(w.ksize[0], w.dilate[0])
        # cover_all may read past the right padding: pad enough.
        right = max(p, (n_out - 1) * w.stride[0] + dk - len(levels[-1]) - p)
        padded = np.concatenate([np.zeros(p), levels[-1], np.zeros(right)])
        y = _window_1d(padded, w)[:n_out]
        levels.append(np.abs(y - 1.0))
    return levels


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(8, 30), st.data())
def test_tiled_1d_simulation_matches_global(p, n, data):
    windows = _make(data.draw(windows_strategy(1)))
    if not _fits((n,), windows):
        return
    x = np.random.RandomState(n).randn(n)
    want = _global_1d(x, windows)
    for r in range(p):
        levels = T.tile_boxes((n,), windows, (p,), r)
        (lo, hi), = levels[0]['computed']
        h = x[lo:hi]  # what the exchange delivers
        for i, w in enumerate(windows):
            lv, nxt = levels[i], levels[i + 1]
            (clo, chi), = lv['computed']
            (elo, ehi), = lv['extended']
            (rlo, rhi), = lv['read']
            if nxt['computed'][0][1] <= nxt['computed'][0][0]:
                h = np.zeros(0)
                continue
            ext = np.concatenate([np.zeros(clo - elo), h,
                                  np.zeros(ehi - chi)])
            y = _window_1d(ext[rlo - elo:rhi - elo], w)
            h = np.abs(y - 1.0)
            (nlo, nhi), = nxt['computed']
            np.testing.assert_allclose(h, want[i + 1][nlo:nhi])
        (olo, ohi), = levels[-1]['owned']
        if ohi > olo:
            np.testing.assert_allclose(h, want[-1][olo:ohi])


def test_redundancy():
    w = T.Window((3, 3), (1, 1), (1, 1))
    assert T.redundancy((8, 8), [w, w], (1, 1)) == 1.0
    r2 = T.redundancy((8, 8), [w, w], (2, 1))
    r3 = T.redundancy((8, 8), [w, w, w], (2, 1))
    assert 1.0 < r2 < r3
    # A 1x1 window needs no overlap.
    one = T.Window((1, 1), (1, 1), (0, 0))
    assert T.redundancy((8, 8), [one, one], (2, 2)) == 1.0


def test_depth_one_reads_what_the_layer_by_layer_exchange_reads():
    w = T.Window((3, 3), (2, 2), (1, 1))
    for r in range(4):
        levels = T.tile_boxes((9, 7), (w,), (2, 2), r)
        plan, _, out_box = G.window_plan((9, 7), (2, 2), (3, 3), (2, 2),
                                         (1, 1), (1, 1), False, r)
        assert levels[1]['computed'] == out_box
        assert levels[0]['read'] == plan.ext


@pytest.mark.parametrize('depth, want', [
    (None, [[0, 1, 2, 3, 4, 5]]),
    (1, [[0, 1, 2], [3], [4, 5]]),
    (2, [[0, 1, 2, 3], [4, 5]]),
    (3, [[0, 1, 2, 3, 4, 5]]),
])
def test_segments(depth, want):
    kinds = ['pointwise', 'window', 'bn', 'window', 'window', 'pointwise']
    assert T.segments(kinds, depth) == want


def test_segments_without_windows():
    assert T.segments(['bn', 'pointwise'], 1) == [[0, 1]]
    assert T.segments([], None) == []


def test_hull():
    a = ((0, 3), (2, 4))
    b = ((-1, 1), (3, 6))
    assert T.hull(a, b) == ((-1, 3), (2, 6))
    empty = ((5, 5), (0, 0))
    assert T.hull(a, empty) == a
    assert T.hull(empty, b) == b
