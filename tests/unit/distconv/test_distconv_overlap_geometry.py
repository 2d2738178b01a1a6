"""Geometry of the overlapped path (interior and boundary slabs), no MPI.

For every process of a grid (1 to 3 split dimensions), the interior output
box must only read cells the process owns, and the interior plus the
``2 * ndim`` slabs must tile the output block exactly (corner cells in
exactly one slab). Every slab's input box must lie inside the needed box
of the exchange plan, so the halo received is all the boundary needs.
"""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from chainermn_overlap.distconv import geometry as G


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3), st.data())
def test_interior_and_slabs_tile_the_output(ndim, data):
    grid = tuple(data.draw(st.lists(st.integers(1, 3), min_size=ndim,
                                    max_size=ndim)))
    ksize = tuple(data.draw(st.lists(st.integers(1, 5), min_size=ndim,
                                     max_size=ndim)))
    stride = tuple(data.draw(st.lists(st.integers(1, 3), min_size=ndim,
                                      max_size=ndim)))
    pad = tuple(data.draw(st.lists(st.integers(0, 3), min_size=ndim,
                                   max_size=ndim)))
    dilate = tuple(data.draw(st.lists(st.integers(1, 2), min_size=ndim,
                                      max_size=ndim)))
    shape = tuple(data.draw(st.integers(G.dilated_ksize(k, d), 14))
                  for k, d in zip(ksize, dilate))
    cover_all = data.draw(st.booleans())
    for r in range(G.grid_size(grid)):
        (plan, _, out_box, interior, slabs, interior_in, slab_ins,
         _) = G.overlap_plan(shape, grid, ksize, stride, pad, dilate,
                             cover_all, r)
        assert len(slabs) == 2 * ndim
        count = np.zeros(G.box_shape(out_box), dtype=int)
        o0 = tuple(iv[0] for iv in out_box)
        for box in [interior] + list(slabs):
            if G.box_is_empty(box):
                continue
            assert G.intersect(box, out_box) == box
            count[G.box_slices(box, o0)] += 1
        assert (count == 1).all()
        if not G.box_is_empty(interior):
            assert G.intersect(interior_in, plan.own) == interior_in
        for box, sin in zip(slabs, slab_ins):
            if not G.box_is_empty(box):
                assert G.intersect(sin, plan.ext) == tuple(sin)


def test_interior_of_a_3x3_convolution_on_a_2x2x2_grid():
    """All three dimensions split: the interior excludes one cell per cut
    side and the slabs include every corner."""
    shape, grid = (8, 8, 8), (2, 2, 2)
    k = (3, 3, 3)
    one = (1, 1, 1)
    for r in range(8):
        c = G.grid_coords(grid, r)
        (_, _, out_box, interior, slabs, _, _, any_halo) = G.overlap_plan(
            shape, grid, k, one, one, one, False, r)
        assert any_halo
        for d in range(3):
            # Cut side: one row of halo; global border: padding, also halo.
            assert interior[d] == (out_box[d][0] + 1, out_box[d][1] - 1)
        corner = tuple(iv[1] - 1 if ci == 0 else iv[0]
                       for iv, ci in zip(out_box, c))
        hits = [s for s in slabs if all(lo <= x < hi for x, (lo, hi)
                                        in zip(corner, s))]
        assert len(hits) == 1


def test_no_halo_when_windows_stay_inside_blocks():
    for grid in [(2, 1), (2, 2)]:
        for r in range(G.grid_size(grid)):
            any_halo = G.overlap_plan((8, 8), grid, (1, 1), (1, 1), (0, 0),
                                      (1, 1), False, r)[-1]
            assert not any_halo
            any_halo = G.overlap_plan((8, 8), grid, (2, 2), (2, 2), (0, 0),
                                      (1, 1), False, r)[-1]
            assert not any_halo
    assert G.overlap_plan((8, 8), (2, 1), (3, 3), (1, 1), (0, 0), (1, 1),
                          False, 0)[-1]


def test_interior_interval_matches_brute_force():
    for n_own_lo, n_own_hi, k, s, p, d in itertools.product(
            range(0, 6), range(6, 12), range(1, 5), range(1, 4), range(0, 3),
            range(1, 3)):
        out_iv = (0, 12)
        lo, hi = G.interior_interval(out_iv, (n_own_lo, n_own_hi), k, s, p,
                                     d)
        dk = G.dilated_ksize(k, d)
        want = [o for o in range(*out_iv)
                if o * s - p >= n_own_lo and o * s - p + dk <= n_own_hi]
        got = list(range(lo, hi))
        assert got == want


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.data())
def test_split_box_tiles_the_box(ndim, pieces, data):
    """The interior pieces tile the interior exactly, always ``pieces`` of
    them (the graph must be the same on every process), empty boxes
    included when the box is thin or empty."""
    lo = data.draw(st.lists(st.integers(-3, 5), min_size=ndim,
                            max_size=ndim))
    size = data.draw(st.lists(st.integers(0, 9), min_size=ndim,
                              max_size=ndim))
    box = tuple((a, a + n) for a, n in zip(lo, size))
    parts = G.split_box(box, pieces)
    assert len(parts) == pieces
    if G.box_is_empty(box):
        assert all(G.box_is_empty(p) for p in parts)
        return
    count = np.zeros(G.box_shape(box), dtype=int)
    o0 = tuple(iv[0] for iv in box)
    for p in parts:
        if G.box_is_empty(p):
            continue
        assert G.intersect(p, box) == p
        count[G.box_slices(p, o0)] += 1
    assert (count == 1).all()
    # Balanced along the split (longest) dimension.
    d = G.box_shape(box).index(max(G.box_shape(box)))
    split = sorted(G.box_shape(p)[d] for p in parts)
    assert split[-1] - split[0] <= 1, parts


def test_split_box_rejects_no_pieces():
    with pytest.raises(ValueError, match='pieces must be >= 1'):
        G.split_box(((0, 4),), 0)
