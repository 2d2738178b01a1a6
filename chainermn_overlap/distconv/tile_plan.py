"""Geometry of overlapped tiling: which boxes a tile computes (pure).

Going backwards from the owned output block ``B_k`` of the last layer,
each window layer ``i`` needs the input box ``R_{i-1} =
window_input_box(B_i)`` (which may reach into padding); the process
computes level ``i-1`` on ``B_{i-1} = clip(hull(R_{i-1}, O_{i-1}))`` where
``O_{i-1}`` is its owned block of that level in the layer-by-layer layout
(so batch normalisation finds its owned cells), and pads it to ``E_{i-1} =
hull(R_{i-1}, O_{i-1})`` with the next layer's padding value. Every cell of
``E \\ B`` lies outside the global extent (padding), so the padded array
holds exactly the values the layer-by-layer run reads.

No MPI: :func:`tile_boxes` gives one process's boxes, :func:`redundancy`
the price of tiling, :func:`segments` the split of a layer list into tiles
(:mod:`~chainermn_overlap.distconv.tiling` runs them).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence

import numpy

from chainermn_overlap.distconv import geometry

__all__ = ['Window', 'hull', 'redundancy', 'segments', 'tile_boxes']


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
