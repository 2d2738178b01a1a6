"""How :class:`~chainermn_overlap.distconv.tiling.Tiled` runs each layer.

:func:`describe_layer` turns one entry of a tiled stack (a distconv
convolution or batch-normalisation link, a partial of a distconv
convolution or pooling function, an element-wise callable) into a step:
its kind (``'window'``, ``'bn'``, ``'pointwise'``), its window
(:class:`~chainermn_overlap.distconv.tile_plan.Window`) and the Chainer
computation it runs on a box that already holds its padding.
"""
from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import chainer
import chainer.functions as F
import numpy

from chainermn_overlap.distconv import functions
from chainermn_overlap.distconv import links
from chainermn_overlap.distconv.tile_plan import Window

if TYPE_CHECKING:
    from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['describe_layer']


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
        return functions._chainer_convolution(x_in, Wv, b_in, stride, 0,
                                              False, dilate, groups)

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
