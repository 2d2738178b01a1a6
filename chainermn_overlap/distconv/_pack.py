"""Packing of halo regions into contiguous buffers, for numpy and cupy.

A region exchange sends, for each peer, the cells of one box of the local
block (all samples and channels), and writes received boxes into a larger
array.  This module turns a list of boxes into one contiguous buffer and
back, with no MPI and no per-row copies:

* :func:`pack_regions` copies ``array[..., box]`` for every box, in order,
  each box in C order, into one flat buffer; :func:`unpack_regions` writes
  (or, for the adjoint, adds) such a buffer back into an array.  The layout
  is exactly the concatenation of ``ascontiguousarray(array[..., box])``
  that the exchange sends today, so a peer cannot tell the difference.
* ``method='slice'``: one strided copy per box (numpy's default).
  ``method='index'``: one gather (``take``) or scatter over a cached map of
  flat indices, a single kernel for all boxes (cupy's default); the adjoint
  accumulates with ``scatter_add``/``add.at``, which handles cells needed by
  several peers.  Both give the same bytes; the tests run both on numpy.
* :class:`PinnedStaging`: reused page-locked host buffers for MPIs that are
  not CUDA-aware (a device buffer is copied to pinned memory in one
  transfer, and received bytes go back in one transfer).

Array code goes through ``xp`` (``chainer.backend.get_array_module``); cupy
is only touched when the arrays are cupy arrays.
"""
import collections
from typing import Any, List, Optional, Sequence, Tuple

import numpy

import chainer

from chainermn_overlap.distconv import geometry

__all__ = ['PinnedStaging', 'index_map', 'pack_regions', 'packed_size',
           'unpack_regions']

METHODS = ('slice', 'index')
_INDEX_CACHE_SIZE = 64
_index_cache = collections.OrderedDict()


def _sel(box, origin):
    return (Ellipsis,) + geometry.box_slices(box, origin)


def _nonempty(boxes):
    return [b for b in boxes if not geometry.box_is_empty(b)]


def _check(array, boxes, origin):
    spatial = array.shape[2:]
    if len(origin) != len(spatial):
        raise ValueError('origin {} has {} dimensions, the array {} spatial '
                         'ones'.format(origin, len(origin), len(spatial)))
    for box in _nonempty(boxes):
        for (lo, hi), o, n in zip(box, origin, spatial):
            if lo < o or hi > o + n:
                raise ValueError(
                    'box {} does not lie inside the array (origin {}, '
                    'spatial shape {}): pack only owned cells'.format(
                        box, tuple(origin), spatial))


def packed_size(lead: Sequence[int], boxes: Sequence[Any]) -> int:
    """Elements of the packed buffer of ``boxes`` for leading dims ``lead``."""
    n = int(numpy.prod(lead, dtype=numpy.int64))
    return sum(n * int(numpy.prod(geometry.box_shape(b), dtype=numpy.int64))
               for b in _nonempty(boxes))


def _method(xp, method):
    if method is None:
        return 'slice' if xp is numpy else 'index'
    if method not in METHODS:
        raise ValueError("method must be 'slice' or 'index', got {!r}"
                         .format(method))
    return method


def index_map(shape: Tuple[int, ...], boxes: Sequence[Any],
              origin: Sequence[int], xp: Any = numpy) -> Any:
    """Flat indices into an array of ``shape`` of the packed layout.

    Element ``k`` of the packed buffer is element ``index_map[k]`` of the
    flattened (C order) array.  Computed once per shape, boxes and origin
    (cached, also on the device of ``xp``).
    """
    boxes = tuple(tuple(tuple(iv) for iv in b) for b in boxes)
    key = (tuple(shape), boxes, tuple(origin), xp.__name__)
    got = _index_cache.get(key)
    if got is not None:
        _index_cache.move_to_end(key)
        return got
    flat = numpy.arange(int(numpy.prod(shape, dtype=numpy.int64)),
                        dtype=numpy.int64).reshape(shape)
    parts = [flat[_sel(b, origin)].ravel() for b in _nonempty(boxes)]
    idx = (numpy.concatenate(parts) if parts
           else numpy.zeros(0, dtype=numpy.int64))
    if xp is not numpy:
        idx = xp.asarray(idx)
    _index_cache[key] = idx
    if len(_index_cache) > _INDEX_CACHE_SIZE:
        _index_cache.popitem(last=False)
    return idx


def pack_regions(xp: Any, array: Any, boxes: Sequence[Any],
                 origin: Sequence[int], out: Any = None,
                 method: Optional[str] = None) -> Tuple[Any, List[Any]]:
    """Packs ``array[..., box]`` for every box into one flat buffer.

    Args:
        xp: ``numpy`` or ``cupy`` (the module of ``array``).
        array: ``(N, C, *spatial)``; its cell 0 is at global ``origin``.
        boxes: global boxes inside the array (empty boxes take no room).
        origin: global coordinate of the array's first cell.
        out: a flat buffer of :func:`packed_size` elements to fill
            (default: a new one).
        method: ``'slice'`` or ``'index'`` (see the module docstring);
            default by ``xp``.

    Returns:
        tuple: ``(buffer, pieces)``: the flat buffer and, per box, the view
        of it shaped ``(N, C, *box_shape)`` (what one message carries).
    """
    _check(array, boxes, origin)
    method = _method(xp, method)
    lead = array.shape[:2]
    n = packed_size(lead, boxes)
    if out is None:
        out = xp.empty(n, dtype=array.dtype)
    elif out.ndim != 1 or out.size != n or out.dtype != array.dtype:
        raise ValueError('out must be a flat {} buffer of {} elements, got '
                         '{} {}'.format(array.dtype, n, out.dtype, out.shape))
    pieces = _pieces(out, lead, boxes)
    if method == 'index':
        src = xp.ascontiguousarray(array).reshape(-1)
        xp.take(src, index_map(array.shape, boxes, origin, xp), out=out)
    else:
        for box, piece in zip(boxes, pieces):
            if not geometry.box_is_empty(box):
                piece[...] = array[_sel(box, origin)]
    return out, pieces


def _pieces(buf, lead, boxes):
    pieces, off = [], 0
    for box in boxes:
        shape = tuple(lead) + geometry.box_shape(box)
        if geometry.box_is_empty(box):
            shape = tuple(lead) + tuple(0 for _ in box)
        size = int(numpy.prod(shape, dtype=numpy.int64))
        pieces.append(buf[off:off + size].reshape(shape))
        off += size
    return pieces


def unpack_regions(xp: Any, buffer: Any, array: Any, boxes: Sequence[Any],
                   origin: Sequence[int], accumulate: bool = False,
                   method: Optional[str] = None) -> Any:
    """Writes (or adds) a packed buffer into ``array[..., box]``, in place.

    The inverse of :func:`pack_regions` for ``accumulate=False`` (boxes
    must not overlap then), its adjoint for ``accumulate=True`` (cells of
    overlapping boxes receive the sum of their copies).

    Args:
        xp: ``numpy`` or ``cupy``.
        buffer: the flat packed buffer.
        array: ``(N, C, *spatial)``, C-contiguous for ``method='index'``.
        boxes, origin, method: as in :func:`pack_regions`.
        accumulate (bool): add instead of overwrite.

    Returns:
        ``array``.
    """
    _check(array, boxes, origin)
    method = _method(xp, method)
    n = packed_size(array.shape[:2], boxes)
    if buffer.size != n:
        raise ValueError('the buffer holds {} elements, the boxes {}'
                         .format(buffer.size, n))
    if method == 'index':
        if not array.flags.c_contiguous:
            raise ValueError("method='index' writes through a flat view: "
                             'the array must be C-contiguous')
        flat = array.reshape(-1)
        idx = index_map(array.shape, boxes, origin, xp)
        values = buffer.reshape(-1)
        if accumulate:
            if xp is numpy:
                numpy.add.at(flat, idx, values)
            else:
                import cupyx
                cupyx.scatter_add(flat, idx, values)
        else:
            flat[idx] = values
        return array
    for box, piece in zip(boxes, _pieces(buffer.reshape(-1),
                                         array.shape[:2], boxes)):
        if geometry.box_is_empty(box):
            continue
        if accumulate:
            array[_sel(box, origin)] += piece
        else:
            array[_sel(box, origin)] = piece
    return array


class PinnedStaging(object):
    """Reused page-locked host buffers for device <-> host staging.

    For MPIs that are not CUDA-aware: a packed device buffer goes to host
    memory in one transfer (page-locked, so the copy runs at full speed),
    and a received host buffer goes back in one.  On numpy arrays nothing
    is copied.  Buffers are kept per (slot, dtype, size), so a repeated
    exchange allocates nothing.
    """

    def __init__(self) -> None:
        self._buffers = {}

    def host_buffer(self, slot: Any, size: int, dtype: Any) -> numpy.ndarray:
        """A (pinned, when cupy is loaded) host buffer kept under ``slot``."""
        dtype = numpy.dtype(dtype)
        key = (slot, dtype.str, int(size))
        buf = self._buffers.get(key)
        if buf is None:
            buf = _pinned_empty(int(size), dtype)
            self._buffers[key] = buf
        return buf

    def to_host(self, device_buffer: Any, slot: Any = 'send') -> Any:
        """A host copy of a flat device buffer (numpy: the buffer itself)."""
        if chainer.backend.get_array_module(device_buffer) is numpy:
            return device_buffer
        host = self.host_buffer(slot, device_buffer.size, device_buffer.dtype)
        try:
            device_buffer.get(out=host)
        except TypeError:  # cupy without get(out=)
            host[...] = device_buffer.get()
        return host

    def to_device(self, host: numpy.ndarray, out: Any) -> Any:
        """Copies ``host`` into the flat device buffer ``out`` (in place)."""
        if chainer.backend.get_array_module(out) is numpy:
            if out is not host:
                out[...] = host
            return out
        out.set(host.reshape(out.shape))
        return out


def _pinned_empty(size, dtype):
    try:
        import cupy
    except ImportError:
        return numpy.empty(size, dtype=dtype)
    try:
        mem = cupy.cuda.alloc_pinned_memory(max(1, size * dtype.itemsize))
    except Exception:  # no driver or device: pageable memory works too
        return numpy.empty(size, dtype=dtype)
    return numpy.frombuffer(mem, dtype=dtype, count=size)
