"""Overlapped tiling: one wide halo exchange for several layers.

Layer by layer, every window operation (convolution, pooling) exchanges its
own halo: one message round per layer. On a link with real latency that
round costs more than the layer's interior computation once blocks are
small. :class:`Tiled` instead exchanges, once, the input region that a
stack of up to ``depth`` window layers needs for this process's output
block, and computes the overlap with its neighbours redundantly (the
classic overlapped / "ghost zone" tiling of stencil codes). The boxes come
from :mod:`.tile_plan` (pure), the layers' steps from :mod:`.tile_steps`,
batch normalisation of a computed box from
:class:`~chainermn_overlap.distconv.normalization.TiledBatchNormalization`.

Exactness: each output cell is computed from the same values, in the same
window order, as layer by layer; batch normalisation takes its statistics
from owned cells only (each cell counted once over the grid) and applies
them to every computed cell; its backward sums the gradients of every
computed cell, redundant ones included, which is the exact adjoint of that
forward. Every backward is an exact adjoint, so input and parameter
gradients (summed over the processes, the distconv convention) equal the
layer-by-layer ones.

Every process builds the same graph (the same FunctionNodes in the same
order, with empty pieces where it has no cells), so collective backward
operations (the exchange's adjoint, batch normalisation, channel
reductions) are entered in the same order everywhere.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import chainer
import chainer.functions as F
import numpy

from chainermn_overlap import _mpi_json
from chainermn_overlap.distconv import exchange
from chainermn_overlap.distconv import geometry
from chainermn_overlap.distconv.normalization import TiledBatchNormalization
from chainermn_overlap.distconv.tile_plan import Window, hull, redundancy
from chainermn_overlap.distconv.tile_plan import segments, tile_boxes
from chainermn_overlap.distconv.tile_steps import describe_layer

if TYPE_CHECKING:
    from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['Tiled', 'TiledBatchNormalization', 'Window', 'describe_layer',
           'hull', 'redundancy', 'segments', 'tile_boxes']


def _slices(box, origin):
    if geometry.box_is_empty(box):
        return (Ellipsis,) + tuple(slice(0, 0) for _ in box)
    return (Ellipsis,) + geometry.box_slices(box, origin)


class Tiled(chainer.ChainList):
    """A stack of layers run with one halo exchange per ``depth`` windows.

    ``Tiled(grid, layers, depth)(x)`` returns exactly what running
    ``layers`` one after the other on ``x`` returns (forward, input and
    parameter gradients, batch-normalisation statistics), with one region
    exchange per tile of up to ``depth`` window layers (convolutions,
    poolings) instead of one per window layer; the overlap of neighbouring
    tiles is computed redundantly (see the module docstring). The stack
    registers the links of ``layers`` as its children (register the
    ``Tiled``, not the layers, in the parent chain) and holds no parameters
    of its own; a serial model mirrors it with a ``chainer.ChainList`` of
    the same links, in the same order.

    Args:
        grid (SpatialGrid): The process grid.
        layers (list): distconv convolution links (any ``split``) and
            ``BatchNormalization`` links, partials of distconv convolution
            or pooling functions, and element-wise callables
            (:func:`describe_layer`).
        depth (int or None): Window layers per exchange (None: all; 1:
            one exchange per window layer, as layer by layer). It can be
            changed between iterations (the same on every process).
    """

    def __init__(self, grid: SpatialGrid, layers: Sequence[Any],
                 depth: Optional[int] = None) -> None:
        super(Tiled, self).__init__()
        if depth is not None and (not isinstance(depth, (int, numpy.integer))
                                  or depth < 1):
            raise ValueError('distconv.Tiled: depth must be a positive int or '
                             'None, got %r' % (depth,))
        self.grid = grid
        self.depth = depth
        self._layers = list(layers)
        for layer in self._layers:
            if isinstance(layer, chainer.Link):
                self.add_link(layer)

    def _steps(self):
        return [describe_layer(self.grid, layer, i)
                for i, layer in enumerate(self._layers)]

    def windows(self) -> List[Window]:
        """The window layers' parameters, in order."""
        return [s.make_window() for s in self._steps() if s.kind == 'window']

    def forward(self, x):
        grid = self.grid
        x = chainer.as_variable(x)
        steps = self._steps()
        layer = 'distconv.Tiled'
        sig = (layer, len(steps), repr(self.depth),
               tuple(s.kind for s in steps),
               tuple(repr(s.make_window()) for s in steps
                     if s.kind == 'window'))
        layout = grid.check_spatial(x, layer, sig)
        error = self._check_channels(steps, x.shape[1])
        # A channel mismatch can hit some channel coordinates only (uneven
        # blocks): agree on it so that every process raises.
        errors = _mpi_json.allgather_json(grid.mpi_world, error)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            raise ValueError('%s: %s (rank %d)' % (layer, bad[0][1],
                                                   bad[0][0]))
        shape = tuple(layout.spatial_shape)
        h = x
        for tile in segments([s.kind for s in steps], self.depth):
            h, shape = self._run_tile(h, shape, [steps[i] for i in tile],
                                      layout)
        return h

    def _check_channels(self, steps, c):
        for s in steps:
            if s.kind == 'window':
                want = s.in_channels()
                if want is not None and want != c:
                    return ('layer %s expects %d input channels here but '
                            'gets %d' % (s.name, want, c))
                c = s.out_channels(c)
            elif s.kind == 'bn':
                size = s.link.avg_mean.shape[0]
                if size != c:
                    return ('batch normalisation %s holds %d channels but '
                            'gets %d' % (s.name, size, c))
        return None

    def _run_tile(self, x, in_shape, steps, layout):
        grid = self.grid
        windows = tuple(s.make_window() for s in steps
                        if s.kind == 'window')
        me = grid.spatial_rank
        levels = tile_boxes(in_shape, windows, grid.shape, me)
        needed = [tile_boxes(in_shape, windows, grid.shape, r)[0]['computed']
                  for r in range(grid.spatial_size)]
        plan = geometry.exchange_plan(in_shape, grid.shape, needed, me)
        grid.stats['exchange_tiled'] += 1
        h = exchange.region_exchange(grid, x, plan, 0)
        n_samples = sum(layout.group_samples)
        level = 0
        for s in steps:
            lv = levels[level]
            if s.kind == 'pointwise':
                h = s.fn(h)
            elif s.kind == 'bn':
                h = self._bn(s.link, h, lv, n_samples)
            else:
                h = self._window(s, h, lv, levels[level + 1])
                level += 1
        return h, levels[-1]['shape']

    def _window(self, step, h, lv, nxt):
        """Pads level ``lv``'s computed box, runs the window on ``read``."""
        comp, ext, read = lv['computed'], lv['extended'], lv['read']
        fill = step.make_window().fill
        widths = ((0, 0), (0, 0)) + tuple(
            (c[0] - e[0], e[1] - c[1]) if not geometry.box_is_empty(comp)
            else (0, 0) for c, e in zip(comp, ext))
        if geometry.box_is_empty(comp):
            # Nothing computed here: an empty array of the extended box's
            # rank (its padding would be read by no output).
            widths = ((0, 0),) * h.ndim
        h = F.pad(h, widths, 'constant', constant_values=fill)
        origin = tuple(e[0] for e in ext) if not geometry.box_is_empty(
            comp) else tuple(c[0] for c in comp)
        x_in = exchange.crop(h, _slices(read, origin))
        out_box = nxt['computed']
        c_out = step.fn_out_channels(h.shape[1])
        shape = (h.shape[0], c_out) + geometry.box_shape(out_box)
        if numpy.prod(shape) == 0 or numpy.prod(x_in.shape) == 0:
            y = exchange.ZeroBlock(shape).apply(
                (x_in,) + step.param_vars())[0]
            for _ in range(step.depth - 1):
                y = F.identity(y)
        else:
            y = step.fn(x_in, read, lv['shape'])
        return step.post(y)

    def _bn(self, link, h, lv, n_samples):
        grid = self.grid
        if link.avg_mean is None:
            link._initialize_params((h.shape[1],))
        gamma = link.gamma if link.gamma is not None else link._get_gamma()[0]
        beta = link.beta if link.beta is not None else link._get_beta()[0]
        if not chainer.config.train:
            return F.fixed_batch_normalization(h, gamma, beta, link.avg_mean,
                                               link.avg_var, link.eps)
        comp = lv['computed']
        owned = _slices(lv['owned'], tuple(c[0] for c in comp)) \
            if not geometry.box_is_empty(lv['owned']) else _slices(
                lv['owned'], None)
        count = n_samples * int(numpy.prod(lv['shape']))
        avg_mean, avg_var = link.avg_mean, link.avg_var
        if chainer.config.in_recomputing:
            avg_mean = avg_var = None
        return TiledBatchNormalization(
            grid, owned, count, link.eps, avg_mean, avg_var,
            link.decay).apply((h, gamma, beta))[0]
