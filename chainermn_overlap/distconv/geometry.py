"""Pure geometry of spatially partitioned tensors (no MPI, no arrays).

Everything here works on half-open integer intervals ``(lo, hi)`` and on
boxes, which are tuples of intervals (one per spatial dimension). The MPI
code in :mod:`chainermn_overlap.distconv.exchange` only moves the bytes that
these functions describe, so all of the arithmetic that decides *what* is
sent can be tested without any process (see ``tests/unit/distconv``).

Conventions:
    * Coordinates are global and refer to the *unpadded* input; an interval
      may reach below 0 or beyond the global size, and those cells are the
      (conceptual) padding of the operation.
    * A tensor of global extent ``n`` distributed over ``p`` processes along
      one dimension uses the balanced block distribution of
      :func:`block_range`: the first ``n % p`` blocks have one more cell.
      Blocks can be empty when ``n < p``.
    * Spatial ranks are the row-major (C order) linearisation of the grid
      coordinates.
"""
from __future__ import annotations

import collections
import functools
import itertools
from typing import List, Sequence, Tuple

__all__ = [
    'Box', 'ExchangePlan', 'Interval', 'Shape',
    'all_grid_coords', 'block_box', 'block_range', 'block_sizes',
    'box_is_empty', 'box_shape', 'box_slices', 'clip',
    'deconv_box_input', 'deconv_box_output', 'deconv_input_interval',
    'deconv_interior', 'deconv_local_output', 'deconv_output_size',
    'deconv_plan', 'dilated_ksize', 'exchange_plan', 'grid_coords',
    'grid_rank', 'grid_size', 'input_interval',
    'interior_interval', 'intersect', 'interval_size', 'needed_plan',
    'output_size',
    'overlap_plan', 'split_box', 'split_interior', 'window_input_box',
    'window_plan',
]

#: A half-open integer interval ``(lo, hi)``.
Interval = Tuple[int, int]
#: One interval per spatial dimension.
Box = Tuple[Interval, ...]
#: A spatial extent or a grid shape: one int per dimension.
Shape = Tuple[int, ...]


def block_range(n: int, p: int, i: int) -> Interval:
    """Returns the interval of block ``i`` of ``n`` cells split ``p`` ways.

    Args:
        n (int): Global number of cells (>= 0).
        p (int): Number of blocks (>= 1).
        i (int): Block index, ``0 <= i < p``.

    Returns:
        tuple: ``(lo, hi)``; ``hi - lo`` is ``n // p`` or ``n // p + 1``.
    """
    if p < 1 or not 0 <= i < p or n < 0:
        raise ValueError('block_range: need n >= 0, p >= 1 and 0 <= i < p, '
                         'got n=%d, p=%d, i=%d' % (n, p, i))
    base, rem = divmod(n, p)
    lo = i * base + min(i, rem)
    return lo, lo + base + (1 if i < rem else 0)


def block_sizes(n: int, p: int) -> List[int]:
    """Returns the sizes of all blocks of :func:`block_range`."""
    return [hi - lo for lo, hi in (block_range(n, p, i) for i in range(p))]


def grid_coords(grid_shape: Sequence[int], spatial_rank: int) -> Shape:
    """Returns the grid coordinates of a spatial rank (row-major order)."""
    coords = []
    for p in reversed(grid_shape):
        spatial_rank, c = divmod(spatial_rank, p)
        coords.append(c)
    return tuple(reversed(coords))


def grid_rank(grid_shape: Sequence[int], coords: Sequence[int]) -> int:
    """Returns the spatial rank of grid coordinates (row-major order)."""
    r = 0
    for p, c in zip(grid_shape, coords):
        r = r * p + c
    return r


def grid_size(grid_shape: Sequence[int]) -> int:
    """Returns the number of processes of a spatial grid."""
    return functools.reduce(lambda a, b: a * b, grid_shape, 1)


def block_box(global_shape: Sequence[int], grid_shape: Sequence[int],
              coords: Sequence[int]) -> Box:
    """Returns the box owned by the process at ``coords``.

    Args:
        global_shape (tuple of int): Global spatial extent.
        grid_shape (tuple of int): Processes per spatial dimension.
        coords (tuple of int): Grid coordinates of the process.

    Returns:
        tuple: One ``(lo, hi)`` interval per dimension.
    """
    return tuple(block_range(n, p, c)
                 for n, p, c in zip(global_shape, grid_shape, coords))


def interval_size(iv: Interval) -> int:
    return max(iv[1] - iv[0], 0)


def box_shape(box: Box) -> Shape:
    """Returns the extent of a box per dimension (0 for empty intervals)."""
    return tuple(interval_size(iv) for iv in box)


def box_is_empty(box: Box) -> bool:
    return any(interval_size(iv) == 0 for iv in box)


def intersect(a: Box, b: Box) -> Box:
    """Intersects two boxes; the result may be empty (check box_is_empty)."""
    return tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b))


def clip(box: Box, global_shape: Sequence[int]) -> Box:
    """Clips a box to the unpadded global extent ``[0, n)`` per dimension."""
    return intersect(box, tuple((0, n) for n in global_shape))


def box_slices(box: Box, origin: Sequence[int]) -> Tuple[slice, ...]:
    """Returns slices selecting ``box`` in an array whose cell 0 is ``origin``.

    Args:
        box (tuple): Global box to select (must lie inside the array).
        origin (tuple of int): Global coordinate of the array's first cell
            per dimension.

    Returns:
        tuple of slice: One slice per spatial dimension.
    """
    return tuple(slice(iv[0] - o, iv[1] - o) for iv, o in zip(box, origin))


def dilated_ksize(ksize: int, dilate: int) -> int:
    return dilate * (ksize - 1) + 1


def output_size(n: int, ksize: int, stride: int, pad: int, dilate: int = 1,
                cover_all: bool = False) -> int:
    """Output extent of a window operation, as ``chainer.utils.conv``.

    Args:
        n (int): Input extent.
        ksize (int): Window size.
        stride (int): Step between windows.
        pad (int): Implicit padding on both sides.
        dilate (int): Dilation of the window.
        cover_all (bool): If True, adds windows so that every input cell is
            covered (max pooling's default), as Chainer does.

    Returns:
        int: The output extent; can be <= 0 when the input is too small.
    """
    dk = dilated_ksize(ksize, dilate)
    if cover_all:
        return (n + 2 * pad - dk + stride - 1) // stride + 1
    return (n + 2 * pad - dk) // stride + 1


def input_interval(out_iv: Interval, ksize: int, stride: int, pad: int,
                   dilate: int = 1) -> Interval:
    """Global input interval read by the outputs ``out_iv`` of a window op.

    Output ``o`` reads input cells ``o * stride - pad + j * dilate`` for
    ``j < ksize``. The returned interval is the tight hull of those cells, so
    it can extend into the padding (below 0 or beyond the input size).

    Args:
        out_iv (tuple): Output interval ``(lo, hi)``.
        ksize, stride, pad, dilate (int): Window parameters.

    Returns:
        tuple: ``(lo, hi)``; empty (``lo == hi``) if ``out_iv`` is empty.
    """
    lo, hi = out_iv
    start = lo * stride - pad
    if hi <= lo:
        return start, start
    return start, (hi - 1) * stride - pad + dilated_ksize(ksize, dilate)


def window_input_box(out_box: Box, ksize: Sequence[int],
                     stride: Sequence[int], pad: Sequence[int],
                     dilate: Sequence[int]) -> Box:
    """:func:`input_interval` for every dimension; empty if out_box is."""
    if box_is_empty(out_box):
        return tuple((iv[0] * s - p, iv[0] * s - p)
                     for iv, s, p in zip(out_box, stride, pad))
    return tuple(input_interval(iv, k, s, p, d)
                 for iv, k, s, p, d
                 in zip(out_box, ksize, stride, pad, dilate))


ExchangePlan = collections.namedtuple(
    'ExchangePlan', ['own', 'ext', 'local', 'recvs', 'sends'])
ExchangePlan.__doc__ = """What one process sends and receives in an exchange.

Attributes:
    own (tuple): Global box this process owns in the input distribution.
    ext (tuple): Global box (possibly reaching into the padding) that this
        process needs; the exchange output covers exactly this box.
    local (tuple): ``own`` intersected with the unpadded part of ``ext``; it
        is copied without messages.
    recvs (list): ``(spatial_rank, box)`` for every other process that owns
        a non-empty part ``box`` of what this process needs.
    sends (list): ``(spatial_rank, box)`` for every other process that needs
        the non-empty part ``box`` of this process's block.
"""


def exchange_plan(global_shape: Sequence[int], grid_shape: Sequence[int],
                  needed: Sequence[Box], spatial_rank: int) -> ExchangePlan:
    """Plans a general region exchange for one process.

    Every process owns the block :func:`block_box` of a tensor of global
    extent ``global_shape`` and needs an arbitrary box ``needed[r]``. Any
    process may own part of any other's needed box (not only neighbours),
    which covers halos wider than a neighbour's block and corners.

    Args:
        global_shape (tuple of int): Global spatial extent of the input.
        grid_shape (tuple of int): Processes per spatial dimension.
        needed (list of tuple): Needed box of every spatial rank (global,
            unclipped coordinates).
        spatial_rank (int): The process to plan for.

    Returns:
        ExchangePlan: The plan; messages are listed in ascending peer order,
        and ``sends`` of one process mirror ``recvs`` of its peers.
    """
    nprocs = grid_size(grid_shape)
    if len(needed) != nprocs:
        raise ValueError('exchange_plan: %d needed boxes for %d processes'
                         % (len(needed), nprocs))
    owns = [block_box(global_shape, grid_shape, grid_coords(grid_shape, r))
            for r in range(nprocs)]
    me = spatial_rank
    own = owns[me]
    ext = tuple(needed[me])

    def part(owner, needer):
        if box_is_empty(needed[needer]):
            return None
        box = intersect(owns[owner], clip(needed[needer], global_shape))
        return None if box_is_empty(box) else box

    local = part(me, me)
    recvs = [(r, part(r, me)) for r in range(nprocs)
             if r != me and part(r, me) is not None]
    sends = [(r, part(me, r)) for r in range(nprocs)
             if r != me and part(me, r) is not None]
    return ExchangePlan(own, ext, local, recvs, sends)


@functools.lru_cache(maxsize=1024)
def window_plan(in_shape: Shape, grid_shape: Shape, ksize: Shape,
                stride: Shape, pad: Shape, dilate: Shape, cover_all: bool,
                spatial_rank: int) -> Tuple[ExchangePlan, Shape, Box]:
    """Plans the exchange of a window operation (convolution, pooling).

    Each process owns the balanced block of the *output* and needs the input
    box read by it (:func:`window_input_box`).

    Args:
        in_shape (tuple of int): Global input spatial extent.
        grid_shape (tuple of int): Processes per spatial dimension.
        ksize, stride, pad, dilate (tuple of int): Per-dimension window
            parameters.
        cover_all (bool): Chainer's ``cover_all`` output size rule.
        spatial_rank (int): The process to plan for.

    Returns:
        tuple: ``(plan, out_shape, out_box)``: the :class:`ExchangePlan`, the
        global output extent and this process's output box.
    """
    out_shape = tuple(output_size(n, k, s, p, d, cover_all) for n, k, s, p, d
                      in zip(in_shape, ksize, stride, pad, dilate))
    if any(n <= 0 for n in out_shape):
        raise ValueError('window_plan: empty output %r' % (out_shape,))
    needed = []
    for r in range(grid_size(grid_shape)):
        out_box = block_box(out_shape, grid_shape, grid_coords(grid_shape, r))
        needed.append(window_input_box(out_box, ksize, stride, pad, dilate))
    out_box = block_box(out_shape, grid_shape,
                        grid_coords(grid_shape, spatial_rank))
    plan = exchange_plan(in_shape, grid_shape, needed, spatial_rank)
    return plan, out_shape, out_box


def all_grid_coords(grid_shape: Sequence[int]) -> List[Shape]:
    """All coordinates of a grid in spatial-rank order."""
    return list(itertools.product(*[range(p) for p in grid_shape]))


def interior_interval(out_iv: Interval, own_iv: Interval, ksize: int,
                      stride: int, pad: int, dilate: int = 1) -> Interval:
    """Outputs of ``out_iv`` whose windows lie inside ``own_iv``.

    These outputs read only cells this process owns (no halo, no padding),
    so they can be computed while the halo is still in flight.

    Args:
        out_iv (tuple): This process's output interval ``(lo, hi)``.
        own_iv (tuple): The input interval this process owns.
        ksize, stride, pad, dilate (int): Window parameters.

    Returns:
        tuple: ``(lo, hi)`` inside ``out_iv``; empty (``lo >= hi``) if no
        output qualifies.
    """
    dk = dilated_ksize(ksize, dilate)
    # Window of output o: [o * stride - pad, o * stride - pad + dk).
    lo = max(out_iv[0], -((-own_iv[0] - pad) // stride))  # ceil division
    hi = min(out_iv[1], (own_iv[1] - dk + pad) // stride + 1)
    return (lo, hi) if hi > lo else (out_iv[0], out_iv[0])


def split_interior(out_box: Box, interior: Box) -> List[Box]:
    """Splits ``out_box`` into the interior box and ``2 * ndim`` slabs.

    Slab ``2k`` (``2k + 1``) holds the outputs below (above) the interior
    along dimension ``k``, restricted to the interior along dimensions
    before ``k`` and spanning ``out_box`` along dimensions after it, so the
    interior and the slabs tile ``out_box`` exactly (diagonal corner cells
    belong to the slab of the first dimension). The number of slabs does
    not depend on the process, which keeps the computational graph (and so
    the order of collective operations in backward) the same on every
    process; slabs may be empty.

    Args:
        out_box (tuple): The output box.
        interior (tuple): A box inside ``out_box``; if it is empty in any
            dimension, the whole output goes to the first slabs.

    Returns:
        list: ``2 * ndim`` boxes (possibly empty).
    """
    ndim = len(out_box)
    if box_is_empty(interior):
        # No interior: the whole box is "below" the (empty) interior along
        # the first dimension; every other slab is empty.
        empty = tuple((iv[0], iv[0]) for iv in out_box)
        return [tuple(out_box)] + [empty] * (2 * ndim - 1)
    slabs = []
    for k in range(ndim):
        before = tuple(interior[:k])
        after = tuple(out_box[k + 1:])
        slabs.append(before + ((out_box[k][0], interior[k][0]),) + after)
        slabs.append(before + ((interior[k][1], out_box[k][1]),) + after)
    return slabs


@functools.lru_cache(maxsize=1024)
def overlap_plan(in_shape: Shape, grid_shape: Shape, ksize: Shape,
                 stride: Shape, pad: Shape, dilate: Shape, cover_all: bool,
                 spatial_rank: int) -> tuple:
    """Plans an overlapped window operation for one process.

    Returns:
        tuple: ``(plan, out_shape, out_box, interior, slabs, interior_in,
        slab_ins, any_halo)``: :func:`window_plan`'s plan, output extent
        and box; the interior output box and its input box (inside the
        owned block); the ``2 * ndim`` boundary slabs and their input boxes
        (which may reach into halos and padding); and ``any_halo``, True if
        any process of the grid needs cells it does not own (halo or
        padding), the same on every process.
    """
    plan, out_shape, out_box = window_plan(
        in_shape, grid_shape, ksize, stride, pad, dilate, cover_all,
        spatial_rank)
    interior = tuple(
        interior_interval(o, w, k, s, p, d) for o, w, k, s, p, d
        in zip(out_box, plan.own, ksize, stride, pad, dilate))
    slabs = split_interior(out_box, interior)
    interior_in = window_input_box(interior, ksize, stride, pad, dilate)
    slab_ins = [window_input_box(b, ksize, stride, pad, dilate)
                for b in slabs]
    any_halo = False
    for r in range(grid_size(grid_shape)):
        p_r, _, ob_r = window_plan(in_shape, grid_shape, ksize, stride, pad,
                                   dilate, cover_all, r)
        if not box_is_empty(ob_r) and (
                intersect(p_r.ext, p_r.own) != tuple(p_r.ext)):
            any_halo = True
            break
    return (plan, out_shape, out_box, interior, slabs, interior_in,
            slab_ins, any_halo)


def split_box(box: Box, pieces: int) -> List[Box]:
    """Splits a box into ``pieces`` balanced boxes along its longest side.

    The overlapped path computes the interior in pieces and drives MPI
    progress between them; the number of pieces must be the same on every
    process (it shapes the computational graph), so some pieces may be
    empty when a box is thin or empty.

    Args:
        box (tuple): The box to split.
        pieces (int): Number of pieces (>= 1).

    Returns:
        list: ``pieces`` boxes tiling ``box`` in ascending order along the
        longest dimension (the first one of equal lengths); empty boxes
        where there is nothing left to split.
    """
    if pieces < 1:
        raise ValueError('split_box: pieces must be >= 1, got %d' % pieces)
    if pieces == 1:
        return [tuple(box)]
    sizes = box_shape(box)
    if box_is_empty(box):
        empty = tuple((iv[0], iv[0]) for iv in box)
        return [empty] * pieces
    d = sizes.index(max(sizes))
    lo = box[d][0]
    out = []
    for i in range(pieces):
        a, b = block_range(sizes[d], pieces, i)
        out.append(tuple(box[:d]) + ((lo + a, lo + b),) + tuple(box[d + 1:]))
    return out


def deconv_output_size(n: int, ksize: int, stride: int, pad: int,
                       dilate: int = 1, cover_all: bool = False) -> int:
    """Output extent of a transposed convolution (or unpooling) without
    ``outsize``, as ``chainer.utils.conv.get_deconv_outsize``."""
    dk = dilated_ksize(ksize, dilate)
    if cover_all:
        return stride * (n - 1) + dk - stride + 1 - 2 * pad
    return stride * (n - 1) + dk - 2 * pad


def deconv_input_interval(out_iv: Interval, n_in: int, ksize: int,
                          stride: int, pad: int, dilate: int = 1) -> Interval:
    """Input cells of a transposed convolution that reach ``out_iv``.

    Input ``i`` adds to the outputs ``i * stride - pad + j * dilate`` for
    ``j < ksize`` (the adjoint of :func:`input_interval`). The result
    (clipped to ``[0, n_in)``) holds every input cell that adds to an
    output of ``out_iv``; those outside it add nothing there. It is tight
    for ``dilate == 1``; with gaps in the window, a cell inside it may
    step over a short ``out_iv`` and add nothing to it, which costs a
    transferred cell, not exactness.

    Returns:
        tuple: ``(lo, hi)``, empty (``lo == hi``) if no input window
        reaches ``out_iv`` (an empty block, or outputs that only
        ``outsize`` adds).
    """
    lo, hi = out_iv
    if hi <= lo:
        return 0, 0
    reach = dilate * (ksize - 1)
    first = max(0, -((reach - lo - pad) // stride))  # ceil division
    last = min(n_in, (hi - 1 + pad) // stride + 1)
    return (first, last) if last > first else (0, 0)


def deconv_local_output(in_iv: Interval, ksize: int, stride: int, pad: int,
                        dilate: int = 1) -> Interval:
    """Global outputs computed by an unpadded transposed convolution of the
    input cells ``in_iv`` (non-empty): where its local output lies."""
    start = in_iv[0] * stride - pad
    return start, (in_iv[1] - 1) * stride - pad + dilated_ksize(ksize,
                                                                dilate)


def needed_plan(in_shape: Shape, grid_shape: Shape, needed: Sequence[Box],
                spatial_rank: int) -> Tuple[ExchangePlan, bool]:
    """:func:`exchange_plan` of clipped needed boxes, and ``any_halo``.

    Returns:
        tuple: ``(plan, any_halo)``; ``any_halo`` is True if some process
        needs cells it does not own (the same on every process).
    """
    plan = exchange_plan(in_shape, grid_shape, needed, spatial_rank)
    for r in range(grid_size(grid_shape)):
        own = block_box(in_shape, grid_shape, grid_coords(grid_shape, r))
        if not box_is_empty(needed[r]) and (
                intersect(needed[r], own) != tuple(needed[r])):
            return plan, True
    return plan, False


@functools.lru_cache(maxsize=1024)
def deconv_plan(in_shape: Shape, out_shape: Shape, grid_shape: Shape,
                ksize: Shape, stride: Shape, pad: Shape, dilate: Shape,
                spatial_rank: int) -> Tuple[ExchangePlan, Box, Box, bool]:
    """Plans the exchange of a transposed convolution for one process.

    Each process owns the balanced block of the *output* and needs the
    input cells that add to it (:func:`deconv_input_interval`), which may
    be owned by any process.

    Returns:
        tuple: ``(plan, out_box, in_box, any_halo)``: the
        :class:`ExchangePlan` (``plan.ext`` is ``in_box``), this process's
        output box, the input box it reads (empty if no input cell reaches
        its block) and ``any_halo`` (see :func:`needed_plan`).
    """
    needed, out_boxes = [], []
    for r in range(grid_size(grid_shape)):
        ob = block_box(out_shape, grid_shape, grid_coords(grid_shape, r))
        out_boxes.append(ob)
        needed.append(deconv_box_input(ob, in_shape, ksize, stride, pad,
                                       dilate))
    plan, any_halo = needed_plan(in_shape, grid_shape, needed, spatial_rank)
    return plan, out_boxes[spatial_rank], needed[spatial_rank], any_halo


def deconv_box_input(out_box: Box, in_shape: Shape, ksize: Shape,
                     stride: Shape, pad: Shape, dilate: Shape) -> Box:
    """:func:`deconv_input_interval` per dimension; all ``(0, 0)`` if the
    box is reached by nothing (or empty)."""
    box = tuple(deconv_input_interval(o, n, k, s, p, d) for o, n, k, s, p, d
                in zip(out_box, in_shape, ksize, stride, pad, dilate))
    return tuple((0, 0) for _ in box) if box_is_empty(box) else box


def deconv_box_output(in_box: Box, ksize: Shape, stride: Shape, pad: Shape,
                      dilate: Shape) -> Box:
    """:func:`deconv_local_output` per dimension (``in_box`` non-empty)."""
    return tuple(deconv_local_output(iv, k, s, p, d)
                 for iv, k, s, p, d in zip(in_box, ksize, stride, pad, dilate))


def deconv_interior(out_box: Box, own: Box, in_shape: Shape, ksize: Shape,
                    stride: Shape, pad: Shape, dilate: Shape) -> Box:
    """Outputs of ``out_box`` reached only by input cells of ``own``.

    Along each dimension the first and the last input cell reaching an
    output never decrease with the output, so these outputs form one
    interval per dimension: after the last output reached from below
    ``own`` and before the first reached from above it.

    Returns:
        tuple: A box inside ``out_box`` (empty along some dimension if no
        output qualifies).
    """
    out = []
    for (lo, hi), (olo, ohi), n, k, s, p, d in zip(
            out_box, own, in_shape, ksize, stride, pad, dilate):
        a, b = lo, hi
        for o in range(lo, hi):
            first, last = deconv_input_interval((o, o + 1), n, k, s, p, d)
            if last <= first:
                continue
            if first < olo:
                a = o + 1
            if last > ohi and b == hi:
                b = o
        out.append((a, b) if b > a else (lo, lo))
    return tuple(out)
