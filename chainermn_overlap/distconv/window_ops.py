"""The four paths of a window operation (convolution, pooling) on a grid.

:func:`window_apply` runs a Chainer window function on this process's
output block: directly on whole samples, on a view of the block when no
halo is needed, overlapped with its halo messages (interior pieces with
MPI progress calls in between, then the boundary slabs), or after a
blocking :class:`~chainermn_overlap.distconv.exchange.RegionExchange`. The
path and the number of pieces depend on global sizes only, so every
process builds the same graph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import chainer
import chainer.functions as F
import numpy

from chainermn_overlap.distconv import exchange
from chainermn_overlap.distconv import geometry

if TYPE_CHECKING:
    from chainermn_overlap.distconv.grid import SpatialGrid
    from chainermn_overlap.distconv.layout import Layout

__all__ = ['interior_pieces', 'window_apply']


def window_apply(grid: SpatialGrid, x: chainer.Variable, layer: str,
                 layout: Layout, ksize: Sequence[int], stride: Sequence[int],
                 pad: Sequence[int], dilate: Sequence[int], cover_all: bool,
                 fill: float, op: Callable, out_channels: int,
                 extra: tuple = (), depth: int = 1) -> chainer.Variable:
    """Runs a window operation on this process's output block.

    Four paths, chosen from global information only (so every process
    builds the same graph, which keeps the order of collective operations
    in backward the same everywhere):

    * one process per sample group (``grid.spatial_size == 1``): each
      process holds whole samples, so ``op`` runs directly on the block
      with the layer's padding, exactly the single-process Chainer call,
      without any distconv machinery;
    * no process needs cells it does not own (1x1 kernels, aligned
      pooling): ``op`` runs on a view of the block, without messages;
    * ``grid.overlap``: the halo messages are posted, the interior of the
      output (windows inside the owned block) is computed on views of the
      block while they are in flight, in ``grid.progress_pieces`` pieces
      with an MPI progress call between two pieces (MPI moves data only
      inside MPI calls), then the boundary slabs are computed from small
      boxes built from the block, the halos and the padding. In backward
      the adjoint messages are posted before the interior's gradients
      (input and parameters) are computed, piece by piece with progress
      calls in between. No copy of the whole block is made;
    * otherwise the blocking :class:`RegionExchange` builds the whole
      needed box (block, halos and padding) and ``op`` runs on it.

    Args:
        op (callable): ``op(x_in, in_box)`` runs the Chainer function
            without padding on the input box ``x_in`` (global box
            ``in_box``) and returns a Variable; ``op(x, None)`` runs it
            with the layer's own padding and ``cover_all`` on whole samples.
        out_channels (int): Channels of the output.
        extra (tuple): Other inputs of ``op`` (parameters), given gradients
            (zeros) where a piece is empty.
        depth (int): Number of FunctionNodes ``op`` chains, mirrored on
            empty pieces so that every process's graph has the same depth.

    Returns:
        chainer.Variable: This process's output block.
    """
    in_shape = layout.spatial_shape
    out_shape = tuple(geometry.output_size(n, k, s, p, d, cover_all)
                      for n, k, s, p, d
                      in zip(in_shape, ksize, stride, pad, dilate))
    if any(n <= 0 for n in out_shape):
        raise ValueError(
            '%s: the global input of spatial size %r is too small for '
            'ksize=%r, stride=%r, pad=%r, dilate=%r (output size %r). Use '
            'a larger input, more padding or a smaller kernel.'
            % (layer, in_shape, ksize, stride, pad, dilate, out_shape))
    lead = (x.shape[0], out_channels)

    def run(x_in, in_box, box, depth=depth):
        shape = lead + geometry.box_shape(box)
        if numpy.prod(shape) == 0:
            y = exchange.ZeroBlock(shape).apply((x_in,) + tuple(extra))[0]
            for _ in range(depth - 1):
                y = F.identity(y)
            return y
        return op(x_in, in_box)

    if grid.spatial_size == 1:
        # Whole samples: nothing to exchange, nothing to split. The direct
        # Chainer call is one FunctionNode on every process (op's direct
        # form), so empty sample groups mirror depth 1.
        grid.stats['exchange_none'] += 1
        if x.shape[0] == 0:
            return run(x, None, tuple((0, n) for n in out_shape), depth=1)
        return op(x, None)
    (plan, _, out_box, interior, slabs, interior_in, slab_ins,
     any_halo) = geometry.overlap_plan(
        in_shape, grid.shape, ksize, stride, pad, dilate, bool(cover_all),
        grid.spatial_rank)

    own0 = tuple(iv[0] for iv in plan.own)
    if not any_halo:
        grid.stats['exchange_none'] += 1
        box = plan.ext if not geometry.box_is_empty(out_box) else tuple(
            (lo, lo) for lo in own0)
        return run(x[(Ellipsis,) + geometry.box_slices(box, own0)], box,
                   out_box)
    if not grid.overlap:
        grid.stats['exchange_blocking'] += 1
        x_ext = exchange.region_exchange(grid, x, plan, fill)
        return run(x_ext, plan.ext, out_box)
    n_pieces = interior_pieces(grid, out_shape, out_channels)
    pieces = geometry.split_box(interior, n_pieces)
    piece_ins = [geometry.window_input_box(b, ksize, stride, pad, dilate)
                 for b in pieces]
    return interior_first(grid, x, plan, out_box, pieces, piece_ins, slabs,
                          slab_ins, fill, run)


def interior_first(grid: SpatialGrid, x: chainer.Variable,
                   plan: geometry.ExchangePlan, out_box: Sequence,
                   pieces: Sequence, piece_ins: Sequence, slabs: Sequence,
                   slab_ins: Sequence, fill: float,
                   run: Callable) -> chainer.Variable:
    """The output block ``out_box`` computed interior first: ``run`` on
    each interior piece (output box ``pieces[i]``, from input box
    ``piece_ins[i]``, all owned) while the halo travels, with MPI progress
    calls between the pieces, then on each boundary slab once the halo is
    in, the results assembled into one block.  Used by every windowed
    operation (convolutions, pooling, transposed convolution, unpooling):
    only the geometry of the pieces differs between them."""
    grid.stats['exchange_overlapped'] += 1
    state = exchange.HaloState(grid, plan)
    outs = exchange.HaloStart(state, piece_ins).apply((x,))
    token, views = outs[0], outs[1:]
    ys = []
    for view, in_box, box in zip(views, piece_ins, pieces):
        if ys:
            # Orders this piece after the previous one (in backward: its
            # gradient before the previous one's), with a progress call in
            # between. Without a gradient for the block there are no
            # adjoint messages to drive, so the order only matters in
            # forward: a plain array keeps the piece out of backward's
            # input-gradient computation.
            after = ys[-1] if x.requires_grad else ys[-1].array
            view = exchange.HaloProgress(state).apply((view, after))[0]
        ys.append(run(view, in_box, box))
    x_slabs = exchange.HaloFinish(state, slab_ins, fill).apply(
        (x, token, ys[-1]))
    ys += [run(xs, box, slab)
           for xs, box, slab in zip(x_slabs, slab_ins, slabs)]
    return exchange.Assemble(out_box, pieces + list(slabs)).apply(ys)[0]


def interior_pieces(grid: SpatialGrid, out_shape: Sequence[int],
                    out_channels: int) -> int:
    """Number of interior pieces, the same on every process.

    Depends on global sizes only (the graph, and so the order of collective
    operations in backward, must be the same everywhere). Pieces below
    ``grid.progress_min_cells`` output values per sample are not worth
    their per-call overhead (a few Chainer calls each).
    """
    pieces = max(1, int(grid.progress_pieces))
    if pieces == 1:
        return 1
    per_process = int(numpy.prod(out_shape)) * out_channels \
        // grid.spatial_size
    affordable = per_process // max(1, int(grid.progress_min_cells))
    return max(1, min(pieces, affordable))
