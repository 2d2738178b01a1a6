"""Halo packing (distconv/_pack.py) against the exchange's own packing.

The packed layout must be byte-for-byte what
:mod:`chainermn_overlap.distconv.exchange` sends today (the concatenation of
``ascontiguousarray(x[..., box])`` over the plan's boxes), and unpacking
must do what the exchange does with received buffers (write for the
forward, add for the adjoint).  Both methods are checked on numpy: the
strided copies (the default on every backend), and the one-kernel
gather/scatter over an index map.  General regions (sample slices, channel
blocks) are what redistribution and the channel convolutions pack.
Exchange plans come from the real planner for uneven blocks, halos wider
than a block, corners, and 1-D to 3-D grids.
"""
import itertools

import numpy as np
import pytest

from chainermn_overlap.distconv import _pack
from chainermn_overlap.distconv import exchange
from chainermn_overlap.distconv import geometry

METHODS = ['slice', 'index']
# (global spatial shape, grid shape, halo radius per dimension)
CASES = [
    ((7,), (3,), (1,)),
    ((9, 7), (2, 2), (1, 1)),
    ((9, 7), (3, 2), (2, 3)),      # halos wider than a block
    ((5, 6), (1, 4), (0, 2)),      # a block of one column or less
    ((4, 5, 6), (2, 1, 2), (1, 1, 2)),
    ((3, 3), (4, 1), (1, 1)),      # empty blocks
]


def plans(global_shape, grid_shape, radius):
    n = geometry.grid_size(grid_shape)
    owns = [geometry.block_box(global_shape, grid_shape,
                               geometry.grid_coords(grid_shape, r))
            for r in range(n)]
    needed = [tuple((lo - h, hi + h) if hi > lo else (lo, hi)
                    for (lo, hi), h in zip(own, radius)) for own in owns]
    return [geometry.exchange_plan(global_shape, grid_shape, needed, r)
            for r in range(n)]


def block(plan, seed, lead=(2, 3), dtype=np.float32):
    rng = np.random.RandomState(seed)
    return rng.randn(*(lead + geometry.box_shape(plan.own))).astype(dtype)


def origin(box):
    return tuple(iv[0] for iv in box)


def all_plans():
    for case in CASES:
        for rank, plan in enumerate(plans(*case)):
            yield case, rank, plan


PLANS = list(all_plans())
IDS = ['{}-{}-r{}'.format(c[0], c[1], r) for c, r, _ in PLANS]


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('case, rank, plan', PLANS, ids=IDS)
def test_pack_equals_the_exchange_sends_bytes(case, rank, plan, method):
    x = block(plan, rank)
    own0 = origin(plan.own)
    boxes = [box for _, box in plan.sends]
    want = [np.ascontiguousarray(x[exchange._sel(box, own0)])
            for box in boxes]
    buf, pieces = _pack.pack_regions(np, x, boxes, own0, method=method)
    assert buf.flags.c_contiguous and buf.ndim == 1
    flat = (np.concatenate([w.ravel() for w in want]) if want
            else np.zeros(0, np.float32))
    assert buf.tobytes() == flat.tobytes()
    for w, p in zip(want, pieces):
        assert p.shape == w.shape and np.array_equal(p, w)
        assert np.shares_memory(p, buf) or p.size == 0


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('case, rank, plan', PLANS, ids=IDS)
def test_unpack_equals_the_exchange_receive(case, rank, plan, method):
    # RegionExchange.forward writes each received box into the needed box.
    lead = (2, 3)
    ext0 = origin(plan.ext)
    rng = np.random.RandomState(7 + rank)
    got_msgs = [rng.randn(*(lead + geometry.box_shape(box)))
                .astype(np.float32) for _, box in plan.recvs]
    want = np.full(lead + geometry.box_shape(plan.ext), -1.0, np.float32)
    for (_, box), m in zip(plan.recvs, got_msgs):
        want[exchange._sel(box, ext0)] = m
    got = np.full_like(want, -1.0)
    packed = (np.concatenate([m.ravel() for m in got_msgs]) if got_msgs
              else np.zeros(0, np.float32))
    _pack.unpack_regions(np, packed, got, [b for _, b in plan.recvs], ext0,
                         method=method)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('case, rank, plan', PLANS, ids=IDS)
def test_accumulate_equals_the_exchange_adjoint(case, rank, plan, method):
    # RegionExchangeAdjoint.forward adds each message into the owner's box.
    lead = (2, 3)
    own0 = origin(plan.own)
    rng = np.random.RandomState(11 + rank)
    base = rng.randn(*(lead + geometry.box_shape(plan.own)))
    msgs = [rng.randn(*(lead + geometry.box_shape(box)))
            for _, box in plan.sends]
    want = base.copy()
    for (_, box), m in zip(plan.sends, msgs):
        want[exchange._sel(box, own0)] += m
    got = base.copy()
    packed = (np.concatenate([m.ravel() for m in msgs]) if msgs
              else np.zeros(0))
    _pack.unpack_regions(np, packed, got, [b for _, b in plan.sends], own0,
                         accumulate=True, method=method)
    # The same additions in the same order for each cell: bit-identical.
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize('method', METHODS)
def test_pack_and_accumulate_are_adjoint_with_overlapping_boxes(method):
    # Boxes sent to different peers overlap (a cell needed by several):
    # <pack(x), b> == <x, unpack(b, accumulate=True)>.
    rng = np.random.RandomState(3)
    x = rng.randn(2, 2, 6, 5)
    o = (10, -2)
    boxes = [((10, 13), (-2, 1)), ((11, 16), (0, 3)), ((10, 16), (-2, 3)),
             ((12, 12), (0, 3))]
    packed, _ = _pack.pack_regions(np, x, boxes, o, method=method)
    b = rng.randn(packed.size)
    back = _pack.unpack_regions(np, b, np.zeros_like(x), boxes, o,
                                accumulate=True, method=method)
    np.testing.assert_allclose(np.dot(packed, b), np.sum(x * back),
                               rtol=1e-12)
    # Negative control: overwriting is not the adjoint when boxes overlap.
    over = _pack.unpack_regions(np, b, np.zeros_like(x), boxes, o,
                                method='slice')
    assert abs(np.dot(packed, b) - np.sum(x * over)) > 1e-6


def test_methods_agree_for_every_dtype():
    rng = np.random.RandomState(5)
    boxes = [((0, 2), (1, 4)), ((3, 5), (0, 2))]
    for dtype in (np.float16, np.float32, np.float64, np.int32):
        x = (rng.randn(1, 3, 5, 4) * 10).astype(dtype)
        a, _ = _pack.pack_regions(np, x, boxes, (0, 0), method='slice')
        b, _ = _pack.pack_regions(np, x, boxes, (0, 0), method='index')
        assert a.dtype == dtype and a.tobytes() == b.tobytes()


def test_out_buffer_is_filled_in_place_and_reused():
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    boxes = [((0, 1), (0, 4)), ((1, 4), (3, 4))]
    n = _pack.packed_size(x.shape[:2], boxes)
    assert n == 2 * (4 + 3)
    out = np.empty(n, np.float32)
    for method in METHODS:
        out[...] = 0
        buf, _ = _pack.pack_regions(np, x, boxes, (0, 0), out=out,
                                    method=method)
        assert buf is out
        np.testing.assert_array_equal(
            out, np.concatenate([x[..., 0:1, 0:4].ravel(),
                                 x[..., 1:4, 3:4].ravel()]))


def test_bad_arguments_say_what_and_how_to_fix():
    x = np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match='does not lie inside the array'):
        _pack.pack_regions(np, x, [((0, 5), (0, 1))], (0, 0))
    with pytest.raises(ValueError, match='out must be a flat float32 buffer '
                       'of 4 elements'):
        _pack.pack_regions(np, x, [((0, 4), (0, 1))], (0, 0),
                           out=np.empty(5, np.float32))
    with pytest.raises(ValueError, match="method must be 'slice' or 'index'"):
        _pack.pack_regions(np, x, [], (0, 0), method='rows')
    with pytest.raises(ValueError, match='must be C-contiguous'):
        _pack.unpack_regions(np, np.zeros(2, np.float32),
                             np.zeros((1, 1, 4, 8), np.float32)[..., ::2],
                             [((0, 2), (0, 1))], (0, 0), method='index')


def test_pinned_staging_on_numpy_copies_nothing():
    st = _pack.PinnedStaging()
    buf = np.arange(5, dtype=np.float32)
    assert st.to_host(buf) is buf
    out = np.zeros(5, np.float32)
    assert st.to_device(buf, out) is out
    np.testing.assert_array_equal(out, buf)
    h = st.host_buffer('recv', 7, np.float64)
    assert h.shape == (7,) and st.host_buffer('recv', 7, np.float64) is h


def test_index_maps_are_cached():
    boxes = [((0, 1), (0, 2))]
    a = _pack.index_map((1, 2, 3, 3), boxes, (0, 0))
    assert _pack.index_map((1, 2, 3, 3), boxes, (0, 0)) is a
    assert list(a) == [0, 1, 9, 10]
    assert list(itertools.islice(a, 2)) == [0, 1]


# ----------------------------------------------------------------------
# General regions: what redistribution and channel messages pack
# ----------------------------------------------------------------------
REGION_CASES = [
    # (array shape, selections): sample slices, channel blocks, spatial
    # boxes with all samples, the whole array, an empty one.
    ((5, 3, 4, 6), [(slice(1, 3),), (slice(3, 5),), (slice(0, 0),)]),
    ((2, 7, 9), [(slice(None), slice(0, 3)), (slice(None), slice(3, 7))]),
    ((3, 2, 5, 4), [(Ellipsis, slice(0, 2), slice(1, 4)),
                    (Ellipsis, slice(2, 5), slice(0, 4))]),
    ((2, 3, 4), [(Ellipsis,)]),
]


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('shape, sels', REGION_CASES)
def test_regions_pack_what_the_selections_select(shape, sels, method):
    x = np.random.RandomState(1).randn(*shape).astype(np.float32)
    regions = [_pack.region_of(s, shape) for s in sels]
    buf, pieces = _pack.pack(np, x, regions, method=method)
    want = [np.ascontiguousarray(x[s]) for s in sels]
    assert buf.tobytes() == b''.join(w.tobytes() for w in want)
    for w, p in zip(want, pieces):
        assert p.shape == w.shape
    # unpack is the inverse (disjoint regions) and accumulate its adjoint.
    back = np.full_like(x, 7)
    _pack.unpack(np, buf, back, regions, method=method)
    want_back = np.full_like(x, 7)
    for s in sels:
        want_back[s] = x[s]
    assert back.tobytes() == want_back.tobytes()
    acc = np.ones_like(x)
    _pack.unpack(np, buf, acc, regions, accumulate=True, method=method)
    want_acc = np.ones_like(x)
    for s in sels:
        want_acc[s] += x[s]
    assert acc.tobytes() == want_acc.tobytes()


def test_region_of_follows_numpy_slicing():
    shape = (4, 5, 6)
    for sel in [(slice(1, 3),), slice(2, 9), (Ellipsis, slice(-2, None)),
                (slice(None), slice(3, 1)), (slice(1, 2), Ellipsis,
                                             slice(0, 6))]:
        region = _pack.region_of(sel, shape)
        x = np.zeros(shape)
        assert x[sel].shape == tuple(hi - lo for lo, hi in region), sel
    with pytest.raises(ValueError, match='slices of step 1'):
        _pack.region_of((slice(None, None, 2),), shape)
    with pytest.raises(ValueError, match='does not lie inside an array of '
                       r'shape \(4, 5, 6\)'):
        _pack.pack(np, np.zeros(shape), [((0, 5), (0, 5), (0, 6))])


def test_messages_copy_only_when_needed():
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    # A contiguous region (whole samples) is sent as a view: no copy, as
    # ascontiguousarray did before.
    m = _pack.message(np, x, _pack.region_of((slice(1, 2),), x.shape))
    assert np.shares_memory(m, x) and m.flags.c_contiguous
    assert m.tobytes() == x[1:2].tobytes()
    # A strided one is packed; a dtype conversion is a copy too.
    m = _pack.message(np, x, _pack.region_of((slice(None), slice(1, 2)),
                                             x.shape))
    assert not np.shares_memory(m, x) and m.tobytes() == \
        np.ascontiguousarray(x[:, 1:2]).tobytes()
    m = _pack.message(np, x, dtype=np.float64)
    assert m.dtype == np.float64 and np.array_equal(m, x)
    # pack(copy=True), the default, always fills a new buffer.
    buf, _ = _pack.pack(np, x, [_pack.region_of((Ellipsis,), x.shape)])
    assert not np.shares_memory(buf, x)


def test_alloc_pieces_and_staging_on_numpy():
    buf, pieces = _pack.alloc(np, [(2, 3), (0, 4), (5,)], np.float32,
                              zero=True)
    assert buf.shape == (11,) and not buf.any()
    assert [p.shape for p in pieces] == [(2, 3), (0, 4), (5,)]
    pieces[2][...] = 1
    assert buf[6:].tolist() == [1] * 5  # views, not copies
    assert _pack.staged(buf, pieces) == pieces  # the pieces themselves


def test_copy_box_between_global_coordinates():
    src = np.arange(2 * 1 * 4 * 4, dtype=np.float64).reshape(2, 1, 4, 4)
    dst = np.zeros((2, 1, 3, 3))
    box = ((11, 13), (21, 23))
    _pack.copy_box(dst, (10, 20), src, (11, 20), box)
    np.testing.assert_array_equal(dst[..., 1:3, 1:3], src[..., 0:2, 1:3])
    _pack.copy_box(dst, (10, 20), src, (11, 20), box, accumulate=True)
    np.testing.assert_array_equal(dst[..., 1:3, 1:3],
                                  2 * src[..., 0:2, 1:3])
    _pack.copy_box(dst, (10, 20), src, (11, 20), ((11, 11), (0, 99)))
    assert dst[..., 0, :].sum() == 0  # an empty box copies nothing


def test_the_default_method_is_the_same_on_every_backend():
    # The CPU tests must run the code a GPU runs: no default by backend.
    assert _pack._method(None) == 'slice'


def test_layouts_are_cached_and_unhashable_boxes_still_work():
    x = np.arange(2 * 2 * 5 * 4, dtype=np.float32).reshape(2, 2, 5, 4)
    boxes = [((0, 2), (1, 3)), ((3, 5), (0, 4))]
    a, _ = _pack.pack_regions(np, x, boxes, (0, 0))
    hits = _pack._cached_box_layout.cache_info().hits
    b, _ = _pack.pack_regions(np, x, boxes, (0, 0))
    assert _pack._cached_box_layout.cache_info().hits == hits + 1
    c, _ = _pack.pack_regions(np, x, [[list(iv) for iv in bx]
                                      for bx in boxes], [0, 0])
    assert a.tobytes() == b.tobytes() == c.tobytes()
    # A bad box raises every time (errors are not cached).
    for _ in range(2):
        with pytest.raises(ValueError, match='does not lie inside'):
            _pack.pack_regions(np, x, [((0, 6), (0, 1))], (0, 0))
