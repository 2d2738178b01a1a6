"""Overlapped tiling: one wide halo exchange for several layers.

Layer by layer, every window operation (convolution, pooling) exchanges its
own halo: one message round per layer. On a link with real latency that
round costs more than the layer's interior computation once blocks are
small. :class:`Tiled` instead exchanges, once, the input region that a
stack of up to ``depth`` window layers needs for this process's output
block, and computes the overlap with its neighbours redundantly (the
classic overlapped / "ghost zone" tiling of stencil codes).

Geometry (pure, :func:`tile_boxes`): going backwards from the owned output
block ``B_k`` of the last layer, each window layer ``i`` needs the input box
``R_{i-1} = window_input_box(B_i)`` (which may reach into padding); the
process computes level ``i-1`` on ``B_{i-1} = clip(hull(R_{i-1}, O_{i-1}))``
where ``O_{i-1}`` is its owned block of that level in the layer-by-layer
layout (so batch normalisation finds its owned cells), and pads it to
``E_{i-1} = hull(R_{i-1}, O_{i-1})`` with the next layer's padding value.
Every cell of ``E \\ B`` lies outside the global extent (padding), so the
padded array holds exactly the values the layer-by-layer run reads.

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

import functools
import inspect
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import chainer
from chainer import backend
from chainer import function_node
import chainer.functions as F
import numpy

from chainermn_overlap import _mpi_json
from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import exchange
from chainermn_overlap.distconv import functions
from chainermn_overlap.distconv import geometry
from chainermn_overlap.distconv import links

if TYPE_CHECKING:
    from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['Tiled', 'Window', 'describe_layer', 'hull', 'redundancy',
           'segments', 'tile_boxes']


def hull(a: geometry.Box, b: geometry.Box) -> geometry.Box:
    """Smallest box containing two boxes; an empty box is ignored."""
    if geometry.box_is_empty(a):
        return tuple(b)
    if geometry.box_is_empty(b):
        return tuple(a)
    return tuple((min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(a, b))


class Window(object):
    """Window parameters of one layer (hashable, for the plan cache).

    Args:
        ksize, stride, pad, dilate (tuple of int): Per dimension.
        cover_all (bool): Chainer's output size rule.
        fill (float): Value of padding cells (0, or -inf for max pooling).
    """

    def __init__(self, ksize, stride, pad, dilate=None, cover_all=False,
                 fill=0.0):
        self.ksize = tuple(ksize)
        self.stride = tuple(stride)
        self.pad = tuple(pad)
        self.dilate = tuple(dilate) if dilate is not None else \
            (1,) * len(self.ksize)
        self.cover_all = bool(cover_all)
        self.fill = float(fill)

    def _key(self):
        return (self.ksize, self.stride, self.pad, self.dilate,
                self.cover_all, self.fill)

    def __eq__(self, other):
        return isinstance(other, Window) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return 'Window(ksize=%r, stride=%r, pad=%r, dilate=%r%s)' % (
            self.ksize, self.stride, self.pad, self.dilate,
            ', cover_all=True' if self.cover_all else '')

    def out_shape(self, in_shape):
        return tuple(geometry.output_size(n, k, s, p, d, self.cover_all)
                     for n, k, s, p, d in zip(in_shape, self.ksize,
                                              self.stride, self.pad,
                                              self.dilate))

    def input_box(self, out_box):
        return geometry.window_input_box(out_box, self.ksize, self.stride,
                                         self.pad, self.dilate)


@functools.lru_cache(maxsize=1024)
def tile_boxes(in_shape: geometry.Shape, windows: tuple,
               grid_shape: geometry.Shape, spatial_rank: int) -> list:
    """Boxes of one tile of window layers for one process (pure).

    Args:
        in_shape (tuple of int): Global spatial extent of the input.
        windows (tuple of Window): The window layers, in order.
        grid_shape (tuple of int): Processes per spatial dimension.
        spatial_rank (int): The process.

    Returns:
        list: One dict per level ``0..k`` (level ``i`` is the output of
        window ``i``, level 0 the input) with ``shape`` (global extent),
        ``owned`` (this process's block in the layer-by-layer layout),
        ``computed`` (the box computed here, ``B``), and for levels below
        ``k`` ``extended`` (``E``: ``B`` plus padding) and ``read`` (the
        input box of the next window, inside ``E``). Level 0's
        ``computed`` box is what the exchange must deliver.

    Raises:
        ValueError: If a window leaves no output.
    """
    coords = geometry.grid_coords(grid_shape, spatial_rank)
    shapes = [tuple(in_shape)]
    for w in windows:
        out = w.out_shape(shapes[-1])
        if any(n <= 0 for n in out):
            raise ValueError(
                'distconv.Tiled: the input of spatial size %r is too small '
                'for %r (output size %r). Use a larger input or more '
                'padding.' % (shapes[-1], w, out))
        shapes.append(out)
    levels = [None] * len(shapes)
    owned = geometry.block_box(shapes[-1], grid_shape, coords)
    levels[-1] = {'shape': shapes[-1], 'owned': owned, 'computed': owned}
    for i in range(len(windows) - 1, -1, -1):
        read = windows[i].input_box(levels[i + 1]['computed'])
        owned = geometry.block_box(shapes[i], grid_shape, coords)
        ext = hull(read, owned)
        levels[i] = {'shape': shapes[i], 'owned': owned,
                     'computed': geometry.clip(ext, shapes[i]),
                     'extended': ext, 'read': read}
    return levels


def redundancy(in_shape: Sequence[int], windows: Sequence[Window],
               grid_shape: Sequence[int]) -> float:
    """Cells computed over cells owned, summed over levels 1..k and ranks.

    1.0 means no redundant computation (layer by layer); the excess is the
    price of tiling (pure; for the tuner and the benchmark).
    """
    computed = owned = 0
    for r in range(geometry.grid_size(grid_shape)):
        levels = tile_boxes(tuple(in_shape), tuple(windows),
                            tuple(grid_shape), r)
        for lv in levels[1:]:
            computed += int(numpy.prod(geometry.box_shape(lv['computed'])))
            owned += int(numpy.prod(geometry.box_shape(lv['owned'])))
    return computed / float(max(owned, 1))


def segments(kinds: Sequence[str], depth: Optional[int]) -> List[List[int]]:
    """Splits a layer sequence into tiles of at most ``depth`` windows.

    Args:
        kinds (list of str): ``'window'``, ``'bn'`` or ``'pointwise'`` per
            layer.
        depth (int or None): Window layers per tile (None: all).

    Returns:
        list of list of int: Layer indices per tile; layers after a tile's
        last window (before the next window) stay in that tile.
    """
    out = [[]]
    n_windows = 0
    for i, kind in enumerate(kinds):
        if kind == 'window':
            if depth is not None and n_windows == depth:
                out.append([])
                n_windows = 0
            n_windows += 1
        out[-1].append(i)
    return [s for s in out if s]


def _slices(box, origin):
    if geometry.box_is_empty(box):
        return (Ellipsis,) + tuple(slice(0, 0) for _ in box)
    return (Ellipsis,) + geometry.box_slices(box, origin)


class _Step(object):
    """One layer of a tile: its kind, window and computation."""

    def __init__(self, kind, fn, window=None, params=(), depth=1,
                 link=None, channel_split=None, name=''):
        self.kind = kind
        self.fn = fn
        self.window = window
        self.params = params
        self.depth = depth
        self.link = link
        self.channel_split = channel_split
        self.name = name


def _no_split_input(split_input, name):
    if split_input:
        raise ValueError(
            'distconv.Tiled: layer %s has split_input=True; a tile runs on '
            'one channel layout. Put distconv.gather_channels before the '
            'stack and use split_input=False.' % name)


def _conv_step(grid, W, b, stride, pad, dilate, cover_all, groups, split,
               name, split_output=False):
    nd = grid.ndim
    layer = 'distconv.Tiled (%s)' % name
    stride = functions._ntuple(stride, nd, 'stride', layer, 1)
    pad = functions._ntuple(pad, nd, 'pad', layer, 0)
    dilate = functions._ntuple(dilate, nd, 'dilate', layer, 1)
    reduce_channels = split == 'channel' and grid.channels > 1

    def params():
        Wv = W() if callable(W) else W
        bv = b() if callable(b) else b
        return Wv, bv

    def fn(x_in, in_box, level_shape):
        Wv, bv = params()
        b_in = None if reduce_channels else bv
        if nd == 2:
            y = F.convolution_2d(x_in, Wv, b_in, stride, 0, False,
                                 dilate=dilate, groups=groups)
        else:
            y = F.convolution_nd(x_in, Wv, b_in, stride, 0, False,
                                 dilate=dilate, groups=groups)
        return y

    def post(y):
        if reduce_channels:
            y = functions._reduce_partial_sums(
                grid, y, params()[1], params()[0].shape[0], split_output)
        return y

    def make_window(Wv):
        return Window(tuple(Wv.shape[2:]), stride, pad, dilate, cover_all, 0)

    def out_channels(c_in):
        Wv, _ = params()
        if split_output:
            lo, hi = grid.channel_range(Wv.shape[0])
            return hi - lo
        return Wv.shape[0]

    def param_vars():
        Wv, bv = params()
        return tuple(v for v in (Wv, bv if not reduce_channels else None)
                     if v is not None)

    step = _Step('window', fn, name=name)
    step.post = post
    step.make_window = lambda: make_window(params()[0])
    step.out_channels = out_channels
    # Channels of fn's result, before post's reduction over the channel
    # axis (the whole C_out also where post keeps only a block).
    step.fn_out_channels = lambda c_in: params()[0].shape[0]
    step.param_vars = param_vars
    step.split = split
    step.in_channels = lambda: params()[0].shape[1] * groups
    return step


def _pool_step(grid, kind, ksize, stride, pad, cover_all, pad_value, name):
    layer = 'distconv.Tiled (%s)' % name
    ksize, stride, pad = functions._pool_args(grid, layer, ksize, stride, pad)
    if kind == 'max':
        window = Window(ksize, stride, pad, None, cover_all, -numpy.inf)
    else:
        if pad_value is not None and pad_value != 0:
            raise ValueError('%s: pad_value must be 0 or None, got %r'
                             % (layer, pad_value))
        window = Window(ksize, stride, pad, None, False, 0)

    def fn(x_in, in_box, level_shape):
        if kind == 'max':
            return F.max_pooling_nd(x_in, ksize, stride, 0, cover_all=False)
        y = F.average_pooling_nd(x_in, ksize, stride, 0)
        if pad_value is None:
            lay = _ShapeOnly(level_shape)
            y = y * functions._inside_fraction_inverse(x_in, in_box, lay,
                                                       ksize, stride)
        return y

    step = _Step('window', fn, depth=2 if (kind == 'avg' and
                                           pad_value is None) else 1,
                 name=name)
    step.post = lambda y: y
    step.make_window = lambda: window
    step.out_channels = lambda c_in: c_in
    step.fn_out_channels = step.out_channels
    step.param_vars = lambda: ()
    step.split = None
    step.in_channels = lambda: None
    return step


class _ShapeOnly(object):
    def __init__(self, spatial_shape):
        self.spatial_shape = tuple(spatial_shape)


_POOLS = {
    functions.max_pooling_2d: 'max', functions.max_pooling_nd: 'max',
    functions.average_pooling_2d: 'avg',
    functions.average_pooling_nd: 'avg',
}
_CONVS = (functions.convolution_2d, functions.convolution_nd)


def describe_layer(grid: SpatialGrid, layer: Any, index: int = 0) -> _Step:
    """How :class:`Tiled` runs one entry of its ``layers`` list.

    Accepted: distconv ``Convolution2D``/``ConvolutionND`` links (any
    split), distconv ``BatchNormalization`` links (spatial layout),
    ``functools.partial`` of distconv's convolution and pooling functions
    with everything but the input bound (``partial(distconv.max_pooling_2d,
    grid, ksize=3, stride=2, pad=1)``), and element-wise callables (ReLU,
    dropout with a seed shared by the processes, ...), which run unchanged
    on every computed cell.

    Raises:
        ValueError: For anything else (a plain Chainer window link, whose
            halos Tiled could not know).
    """
    name = '%d: %s' % (index, getattr(layer, 'name', None) or
                       type(layer).__name__)
    if isinstance(layer, (links.Convolution2D, links.ConvolutionND)):
        if layer.W.array is None:
            raise ValueError(
                'distconv.Tiled: layer %s is not initialised; give it '
                'in_channels.' % name)
        _no_split_input(getattr(layer, 'split_input', False), name)
        cover_all = getattr(layer, 'cover_all', False)
        step = _conv_step(grid, lambda: layer.W, lambda: layer.b,
                          layer.stride, layer.pad, layer.dilate, cover_all,
                          layer.groups, layer.split, name,
                          getattr(layer, 'split_output', False))
        step.link = layer
        return step
    if isinstance(layer, links.BatchNormalization):
        if layer.layout != 'spatial':
            raise ValueError(
                "distconv.Tiled: batch normalisation %s has layout=%r; "
                "inside a tile the layout is spatial." % (name, layer.layout))
        step = _Step('bn', None, link=layer,
                     channel_split=layer.channel_split, name=name)
        return step
    if isinstance(layer, functools.partial) and (
            layer.func in _POOLS or layer.func in _CONVS):
        sig = inspect.signature(layer.func)
        try:
            bound = sig.bind_partial(*layer.args, **layer.keywords)
        except TypeError as e:
            raise ValueError('distconv.Tiled: cannot read the arguments of '
                             'layer %s: %s' % (name, e))
        args = dict(bound.arguments)
        if args.get('grid', grid) is not grid:
            raise ValueError('distconv.Tiled: layer %s was bound to another '
                             'grid than the Tiled stack.' % name)
        d = {k: p.default for k, p in sig.parameters.items()}
        d.update(args)
        if layer.func in _POOLS:
            kind = _POOLS[layer.func]
            if d.get('return_indices'):
                raise ValueError('distconv.Tiled: return_indices is not '
                                 'supported (layer %s).' % name)
            return _pool_step(
                grid, kind, d['ksize'], d.get('stride'), d.get('pad', 0),
                d.get('cover_all', True) if kind == 'max' else False,
                d.get('pad_value', 0) if kind == 'avg' else 0, name)
        if 'W' not in args:
            raise ValueError('distconv.Tiled: bind W (and b) in the '
                             'convolution partial of layer %s.' % name)
        _no_split_input(d.get('split_input', False), name)
        W = chainer.as_variable(d['W'])
        b = None if d.get('b') is None else chainer.as_variable(d['b'])
        return _conv_step(grid, W, b, d['stride'], d['pad'], d['dilate'],
                          d['cover_all'], d['groups'],
                          d.get('split', 'spatial'), name,
                          bool(d.get('split_output', False)))
    if isinstance(layer, chainer.Link) or not callable(layer):
        raise ValueError(
            'distconv.Tiled: layer %s (%s) is not supported. Use distconv '
            'convolution/batch-normalisation links, partials of distconv '
            'convolution or pooling functions, or element-wise callables.'
            % (name, type(layer).__name__))
    return _Step('pointwise', layer, name=name)


class TiledBatchNormalization(function_node.FunctionNode):
    """Batch normalisation of a computed box, statistics from owned cells.

    Forward: per channel, the mean and variance over the owned cells of
    every process (reduced over ``grid.mpi_data``); every cell of the box
    (owned or computed redundantly) is normalised with them, and the
    running statistics are updated as Chainer does. Backward is the exact
    adjoint: the direct term for every cell, and the statistics' term,
    whose sums run over every computed cell of every process, for the
    owned cells only.

    Args:
        grid (SpatialGrid): The grid.
        owned (tuple): Selection of the owned cells in the box.
        count (int): Owned values per channel over all processes.
        eps, running_mean, running_var, decay: As in Chainer.
    """

    def __init__(self, grid, owned, count, eps, running_mean=None,
                 running_var=None, decay=0.9):
        self.grid = grid
        self.owned = owned
        self.count = count
        self.eps = eps
        self.running_mean = running_mean
        self.running_var = running_var
        self.decay = decay

    def forward(self, inputs):
        self.retain_inputs((0, 1))
        x, gamma, beta = inputs
        xp = backend.get_array_module(x)
        c = x.shape[1]
        xo = x[self.owned]
        axes = (0,) + tuple(range(2, x.ndim))
        n_local = int(numpy.prod([xo.shape[a] for a in axes]))
        xo64 = xo.astype(numpy.float64)
        s = xo64.sum(axis=axes)
        local_mean = s / max(n_local, 1)
        shape = (1, c) + (1,) * (x.ndim - 2)
        q = ((xo64 - local_mean.reshape(shape)) ** 2).sum(axis=axes)
        shift = s * s / n_local if n_local else xp.zeros_like(s)
        tot = _comm.allreduce_sum(self.grid.mpi_data,
                                  xp.concatenate([s, q, shift]))
        m = self.count
        mean64 = tot[:c] / m
        var64 = xp.maximum(tot[c:2 * c] + (tot[2 * c:] - tot[:c] * mean64),
                           0) / m
        interm = numpy.promote_types(x.dtype, gamma.dtype)
        mean = mean64.astype(interm)
        var = var64.astype(interm)
        inv_std = 1 / xp.sqrt(var + self.eps, dtype=interm)
        self._mean, self._inv_std = mean, inv_std
        xhat = (x - mean.reshape(shape)) * inv_std.reshape(shape)
        y = xhat * gamma.reshape(shape) + beta.reshape(shape)
        if self.running_mean is not None:
            adjust = m / max(m - 1., 1.)
            self.running_mean *= self.decay
            self.running_mean += (1 - self.decay) * mean
            self.running_var *= self.decay
            self.running_var += (1 - self.decay) * adjust * var
        return y.astype(x.dtype, copy=False),

    def backward(self, indexes, grad_outputs):
        if chainer.config.enable_backprop:
            raise NotImplementedError(
                'distconv.Tiled: batch normalisation does not support '
                'double backpropagation.')
        x, gamma = self.get_retained_inputs()
        x, gamma = x.array, gamma.array
        xp = backend.get_array_module(x)
        gy = grad_outputs[0]
        gy = xp.zeros_like(x) if gy is None else gy.array
        c = x.shape[1]
        shape = (1, c) + (1,) * (x.ndim - 2)
        axes = (0,) + tuple(range(2, x.ndim))
        mean = self._mean.reshape(shape)
        inv_std = self._inv_std.reshape(shape)
        xhat = (x - mean) * inv_std
        gbeta = gy.astype(numpy.float64).sum(axis=axes)
        ggamma = (gy * xhat).astype(numpy.float64).sum(axis=axes)
        tot = _comm.allreduce_sum(self.grid.mpi_data,
                                  xp.concatenate([gbeta, ggamma]))
        m = self.count
        coef = (gamma * self._inv_std).reshape(shape)
        a = (tot[c:] / m).astype(xhat.dtype).reshape(shape)
        b = (tot[:c] / m).astype(xhat.dtype).reshape(shape)
        gx = coef * gy
        corr = coef * (xhat[self.owned] * a + b)
        gx[self.owned] -= corr
        return (chainer.Variable(gx.astype(x.dtype, copy=False)),
                chainer.Variable(ggamma.astype(gamma.dtype)),
                chainer.Variable(gbeta.astype(gamma.dtype)))


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
