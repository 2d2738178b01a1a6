"""Geometry of distconv, tested without MPI.

The exchange plans are checked by simulating every process of a grid in one
process: each one's needed box is assembled from the other processes' blocks
exactly as the MPI code does, and a single-process Chainer function run
without padding on it must reproduce that process's block of the global
result.
"""
import itertools

import chainer.functions as F
import numpy as np
import pytest
from chainer.utils import conv as chainer_conv
from hypothesis import given, settings, strategies as st

from chainermn_overlap.distconv import geometry as G


# ----------------------------------------------------------------------
# Intervals and blocks
# ----------------------------------------------------------------------
@given(st.integers(0, 40), st.integers(1, 9))
def test_blocks_partition_the_extent(n, p):
    ivs = [G.block_range(n, p, i) for i in range(p)]
    assert ivs[0][0] == 0 and ivs[-1][1] == n
    for (a, b), (c, d) in zip(ivs, ivs[1:]):
        assert b == c  # contiguous, disjoint, in order
    sizes = G.block_sizes(n, p)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_grid_coords_roundtrip(shape, data):
    r = data.draw(st.integers(0, G.grid_size(shape) - 1))
    c = G.grid_coords(shape, r)
    assert all(0 <= ci < p for ci, p in zip(c, shape))
    assert G.grid_rank(shape, c) == r
    assert G.all_grid_coords(shape)[r] == c


def test_bad_block_arguments():
    with pytest.raises(ValueError):
        G.block_range(3, 0, 0)
    with pytest.raises(ValueError):
        G.block_range(3, 2, 2)


@given(st.integers(1, 30), st.integers(1, 7), st.integers(1, 3),
       st.integers(0, 4), st.integers(1, 3), st.booleans())
def test_output_size_matches_chainer(n, k, s, p, d, cover_all):
    assert G.output_size(n, k, s, p, d, cover_all) == \
        chainer_conv.get_conv_outsize(n, k, s, p, cover_all=cover_all, d=d)


@given(st.integers(1, 30), st.integers(1, 7), st.integers(1, 3),
       st.integers(0, 4), st.integers(1, 3), st.booleans(), st.data())
def test_input_interval_is_tight_hull_of_windows(n, k, s, p, d, cover_all,
                                                 data):
    out = G.output_size(n, k, s, p, d, cover_all)
    if out <= 0:
        return
    lo = data.draw(st.integers(0, out))
    hi = data.draw(st.integers(lo, out))
    a, b = G.input_interval((lo, hi), k, s, p, d)
    if hi == lo:
        assert a == b
        return
    cells = {o * s - p + j * d for o in range(lo, hi) for j in range(k)}
    assert min(cells) == a and max(cells) == b - 1


# ----------------------------------------------------------------------
# Exchange plans
# ----------------------------------------------------------------------
def _boxes_cells(boxes):
    cells = []
    for box in boxes:
        cells.extend(itertools.product(*[range(lo, hi) for lo, hi in box]))
    return cells


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.data())
def test_plans_cover_needed_boxes_exactly_once(grid, data):
    ndim = len(grid)
    shape = tuple(data.draw(st.integers(0, 7)) for _ in range(ndim))
    nprocs = G.grid_size(grid)
    needed = []
    for _ in range(nprocs):
        box = []
        for _ in range(ndim):
            lo = data.draw(st.integers(-3, 8))
            box.append((lo, lo + data.draw(st.integers(0, 6))))
        needed.append(tuple(box))
    plans = [G.exchange_plan(shape, grid, needed, r) for r in range(nprocs)]
    for r, plan in enumerate(plans):
        got = _boxes_cells(([plan.local] if plan.local else [])
                           + [b for _, b in plan.recvs])
        assert len(got) == len(set(got))  # disjoint parts
        want = set(_boxes_cells([G.clip(needed[r], shape)])) \
            if not G.box_is_empty(needed[r]) else set()
        assert set(got) == want
        for peer, box in plan.recvs:
            assert (r, box) in plans[peer].sends  # mirrored
        for peer, box in plan.sends:
            assert (r, box) in plans[peer].recvs
            assert set(_boxes_cells([box])) <= set(_boxes_cells([plan.own]))


def _simulate_ext(x, grid, plans, fill):
    """Assembles every process's needed box as the MPI exchange does."""
    shape = x.shape[2:]
    nprocs = G.grid_size(grid)
    blocks = []
    for r in range(nprocs):
        own = G.block_box(shape, grid, G.grid_coords(grid, r))
        blocks.append(x[(Ellipsis,) + G.box_slices(own, (0,) * len(shape))])
    exts = []
    for r, plan in enumerate(plans):
        o_ext = tuple(iv[0] for iv in plan.ext)
        ext = np.full(x.shape[:2] + G.box_shape(plan.ext), fill, x.dtype)
        parts = ([(r, plan.local)] if plan.local else []) + plan.recvs
        for owner, box in parts:
            o_own = tuple(iv[0] for iv in plans[owner].own)
            ext[(Ellipsis,) + G.box_slices(box, o_ext)] = \
                blocks[owner][(Ellipsis,) + G.box_slices(box, o_own)]
        exts.append(ext)
    return exts


def _check_window_op(grid, x, ksize, stride, pad, dilate, cover_all, fill,
                     local_op, global_op):
    ndim = len(grid)
    shape = x.shape[2:]
    tup = lambda v: (v,) * ndim if isinstance(v, int) else tuple(v)  # NOQA
    args = (tup(ksize), tup(stride), tup(pad), tup(dilate), cover_all)
    if any(G.output_size(n, *a) <= 0 for n, a in
           zip(shape, zip(args[0], args[1], args[2], args[3],
                          (cover_all,) * ndim))):
        return
    results = [G.window_plan(shape, grid, *args, spatial_rank=r)
               for r in range(G.grid_size(grid))]
    plans = [p for p, _, _ in results]
    y = global_op(x)
    for r, ext in enumerate(_simulate_ext(x, grid, plans, fill)):
        _, out_shape, out_box = results[r]
        assert out_shape == y.shape[2:]
        want = y[(Ellipsis,) + G.box_slices(out_box, (0,) * ndim)]
        if G.box_is_empty(out_box):
            continue
        np.testing.assert_allclose(local_op(ext), want, rtol=1e-5, atol=1e-5)


_grids_2d = st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 4),
                             (4, 1), (3, 2)])


@settings(max_examples=80, deadline=None)
@given(_grids_2d, st.integers(1, 9), st.integers(1, 9), st.integers(1, 5),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 2))
def test_simulated_convolution_2d_equals_global(grid, h, w, k, s, p, d):
    rng = np.random.RandomState(0)
    x = rng.randn(1, 2, h, w).astype(np.float32)
    W = rng.randn(3, 2, k, k).astype(np.float32)
    _check_window_op(
        grid, x, k, s, p, d, False, 0,
        lambda e: F.convolution_2d(e, W, stride=s, dilate=d).array,
        lambda g: F.convolution_2d(g, W, stride=s, pad=p, dilate=d).array)


@settings(max_examples=80, deadline=None)
@given(_grids_2d, st.integers(1, 9), st.integers(1, 9), st.integers(1, 7),
       st.integers(1, 3), st.integers(0, 3), st.booleans())
def test_simulated_max_pooling_equals_global(grid, h, w, k, s, p, cover_all):
    rng = np.random.RandomState(1)
    x = rng.randn(1, 2, h, w).astype(np.float32)
    _check_window_op(
        grid, x, k, s, p, 1, cover_all, -np.inf,
        lambda e: F.max_pooling_2d(e, k, s, 0, cover_all=False).array,
        lambda g: F.max_pooling_2d(g, k, s, p, cover_all=cover_all).array)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(2, 1, 1), (1, 2, 2), (2, 2, 2), (1, 1, 3)]),
       st.integers(1, 5), st.integers(1, 5), st.integers(1, 5),
       st.integers(1, 3), st.integers(1, 2), st.integers(0, 2))
def test_simulated_convolution_3d_equals_global(grid, a, b, c, k, s, p):
    rng = np.random.RandomState(2)
    x = rng.randn(1, 1, a, b, c).astype(np.float32)
    W = rng.randn(2, 1, k, k, k).astype(np.float32)
    _check_window_op(
        grid, x, k, s, p, 1, False, 0,
        lambda e: F.convolution_nd(e, W, stride=s).array,
        lambda g: F.convolution_nd(g, W, stride=s, pad=p).array)


def test_wide_halo_reaches_non_adjacent_processes():
    # A 7x7 pooling over a 7x7 map split 4 ways along H: the only output
    # block needs rows owned by all four processes.
    plan, out_shape, _ = G.window_plan((7, 7), (4, 1), (7, 7), (7, 7),
                                       (0, 0), (1, 1), False, 0)
    assert out_shape == (1, 1)
    assert [peer for peer, _ in plan.recvs] == [1, 2, 3]


def test_corners_come_from_diagonal_neighbours():
    plan, _, _ = G.window_plan((4, 4), (2, 2), (3, 3), (1, 1), (1, 1),
                               (1, 1), False, 0)
    assert 3 in [peer for peer, _ in plan.recvs]  # the diagonal process
