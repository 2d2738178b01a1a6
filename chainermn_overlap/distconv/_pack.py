"""Packing of message regions into contiguous buffers, for numpy and cupy.

Every distconv message (halo exchange and its adjoint, redistribution,
channel-parallel convolutions) is cut out of an array and written back
into one here, with the same code on numpy and cupy (``xp`` from
``chainer.backend.get_array_module``), so every CPU test runs the path a
GPU runs. No MPI is involved, and no per-row copies:

* A *region* is a box in an array's own coordinates: one ``(lo, hi)`` per
  axis. :func:`pack` copies ``array[region]`` for every region, in order,
  each in C order, into one flat buffer (:func:`pieces` gives the view of
  each region's part, what one message carries); :func:`unpack` writes
  (or, for an adjoint, adds) such a buffer back. :func:`pack_regions` and
  :func:`unpack_regions` do the same for global spatial boxes of ``(N, C,
  *spatial)`` arrays, all samples and channels.
* ``method='slice'``: one strided copy per region, the default on every
  backend (so that the CPU tests cover it). ``method='index'``: one gather
  (``take``) or scatter over a cached map of flat indices, a single kernel
  for all regions; its adjoint accumulates with ``add.at`` /
  ``scatter_add``, which handles cells needed by several peers (on cupy in
  an order that is not fixed, so the last bits of such cells may differ).
  Both give the same bytes otherwise; the tests run both.
* :func:`staged` hands a packed device buffer to MPI in one transfer to
  host memory (numpy buffers are used in place); :class:`PinnedStaging`
  keeps page-locked host buffers for callers that reuse them.
"""
import collections
import functools
import math
from typing import Any, List, Optional, Sequence, Tuple

import numpy

import chainer

from chainermn_overlap._host import is_host
from chainermn_overlap._host import to_host
from chainermn_overlap.distconv import geometry

__all__ = ['PinnedStaging', 'alloc', 'copy_box', 'index_map', 'message',
           'pack', 'pack_regions', 'packed_size', 'pieces', 'region_of',
           'spatial_regions', 'staged', 'unpack', 'unpack_regions']

METHODS = ('slice', 'index')
_INDEX_CACHE_SIZE = 64
_index_cache = collections.OrderedDict()

Region = Tuple[Tuple[int, int], ...]


def _shape(region):
    return tuple(max(0, hi - lo) for lo, hi in region)


def _size(shape):
    # Not numpy.prod: on a few ints it costs microseconds per call, and an
    # exchange computes dozens of these.
    return int(math.prod(shape))


def _slices(region):
    return tuple(slice(lo, hi) for lo, hi in region)


def _sel(box, origin):
    return (Ellipsis,) + geometry.box_slices(box, origin)


def _method(method):
    # The same default on numpy and cupy: the CPU tests run the GPU's path.
    if method is None:
        return 'slice'
    if method not in METHODS:
        raise ValueError("method must be 'slice' or 'index', got {!r}"
                         .format(method))
    return method


def region_of(selection: Sequence[Any], shape: Sequence[int]) -> Region:
    """The region that ``array[selection]`` selects in an array of ``shape``.

    Args:
        selection: A basic slice of step 1, or a tuple of them with at
            most one ``Ellipsis``.
        shape: The array's shape.
    """
    sel = list(selection) if isinstance(selection, tuple) else [selection]
    if Ellipsis in sel:
        i = sel.index(Ellipsis)
        sel[i:i + 1] = [slice(None)] * (len(shape) - len(sel) + 1)
    sel += [slice(None)] * (len(shape) - len(sel))
    out = []
    for s, n in zip(sel, shape):
        lo, hi, step = s.indices(n)
        if step != 1:
            raise ValueError('a region needs slices of step 1, got {!r}'
                             .format(s))
        out.append((lo, max(lo, hi)))
    return tuple(out)


def spatial_regions(lead: Sequence[int], boxes: Sequence[Any],
                    origin: Sequence[int]) -> List[Region]:
    """Regions of global spatial ``boxes`` in an ``(N, C, *spatial)`` array
    whose cell 0 is at ``origin``, all of ``lead = (N, C)`` (an empty box is
    an empty region)."""
    head = tuple((0, int(n)) for n in lead)
    out = []
    for box in boxes:
        if geometry.box_is_empty(box):
            out.append(head + tuple((0, 0) for _ in box))
        else:
            out.append(head + tuple((lo - o, hi - o)
                                    for (lo, hi), o in zip(box, origin)))
    return out


def _check_boxes(shape, boxes, origin):
    spatial = tuple(shape[2:])
    if len(origin) != len(spatial):
        raise ValueError('origin {} has {} dimensions, the array {} spatial '
                         'ones'.format(origin, len(origin), len(spatial)))
    for box in boxes:
        if geometry.box_is_empty(box):
            continue
        for (lo, hi), o, n in zip(box, origin, spatial):
            if lo < o or hi > o + n:
                raise ValueError(
                    'box {} does not lie inside the array (origin {}, '
                    'spatial shape {}): pack only owned cells'.format(
                        box, tuple(origin), spatial))


def _checked_shapes(shape, regions):
    """The shape of each region; a ValueError if one leaves the array."""
    out = []
    for region in regions:
        rshape = _shape(region)
        if len(region) != len(shape) or (_size(rshape) and any(
                lo < 0 or hi > n for (lo, hi), n in zip(region, shape))):
            raise ValueError('region {} does not lie inside an array of '
                             'shape {}'.format(region, tuple(shape)))
        out.append(rshape)
    return out


_Layout = collections.namedtuple('_Layout', ['regions', 'shapes', 'slices',
                                             'sizes', 'total'])


def _make_layout(shape, regions):
    regions = tuple(tuple((int(lo), int(hi)) for lo, hi in r)
                    for r in regions)
    shapes = _checked_shapes(shape, regions)
    sizes = tuple(_size(s) for s in shapes)
    return _Layout(regions, tuple(shapes),
                   tuple(_slices(r) for r in regions), sizes, sum(sizes))


@functools.lru_cache(maxsize=1024)
def _cached_region_layout(shape, regions):
    return _make_layout(shape, regions)


@functools.lru_cache(maxsize=1024)
def _cached_box_layout(shape, boxes, origin):
    _check_boxes(shape, boxes, origin)
    return _make_layout(shape, spatial_regions(shape[:2], boxes, origin))


def _region_layout(shape, regions):
    """The validated layout of ``regions`` in an array of ``shape``.

    Cached: an exchange packs the same boxes every iteration, and the
    bookkeeping would otherwise cost more than copying a small halo.
    """
    try:
        return _cached_region_layout(tuple(shape), tuple(regions))
    except TypeError:  # unhashable (lists): computed every time
        return _make_layout(tuple(shape), list(regions))


def _box_layout(shape, boxes, origin):
    """The validated layout of global spatial boxes (see
    :func:`pack_regions`)."""
    try:
        return _cached_box_layout(shape, tuple(boxes), tuple(origin))
    except TypeError:
        _check_boxes(tuple(shape), boxes, origin)
        return _make_layout(tuple(shape),
                            spatial_regions(shape[:2], boxes, origin))


def packed_size(lead: Sequence[int], boxes: Sequence[Any]) -> int:
    """Elements of the packed buffer of ``boxes`` for leading dims ``lead``."""
    n = _size(lead)
    return sum(n * _size(geometry.box_shape(b)) for b in boxes
               if not geometry.box_is_empty(b))


def pieces(buffer: Any, shapes: Sequence[Tuple[int, ...]],
           sizes: Optional[Sequence[int]] = None) -> List[Any]:
    """Views of a flat buffer, one per shape, laid out one after another
    (``sizes``: the shapes' sizes, if known)."""
    if sizes is None:
        sizes = [_size(s) for s in shapes]
    out, off = [], 0
    for shape, size in zip(shapes, sizes):
        out.append(buffer[off:off + size].reshape(shape))
        off += size
    return out


def alloc(xp: Any, shapes: Sequence[Tuple[int, ...]], dtype: Any,
          zero: bool = False) -> Tuple[Any, List[Any]]:
    """A flat buffer (zeros with ``zero``) and its :func:`pieces`."""
    n = sum(_size(s) for s in shapes)
    buf = (xp.zeros if zero else xp.empty)(n, dtype=dtype)
    return buf, pieces(buf, shapes)


def _index_map(shape, regions, xp):
    key = (tuple(shape), tuple(regions), xp.__name__)
    got = _index_cache.get(key)
    if got is not None:
        _index_cache.move_to_end(key)
        return got
    flat = numpy.arange(_size(shape), dtype=numpy.int64).reshape(shape)
    parts = [flat[_slices(r)].ravel() for r in regions if _size(_shape(r))]
    idx = (numpy.concatenate(parts) if parts
           else numpy.zeros(0, dtype=numpy.int64))
    if xp is not numpy:
        idx = xp.asarray(idx)
    _index_cache[key] = idx
    if len(_index_cache) > _INDEX_CACHE_SIZE:
        _index_cache.popitem(last=False)
    return idx


def index_map(shape: Tuple[int, ...], boxes: Sequence[Any],
              origin: Sequence[int], xp: Any = numpy) -> Any:
    """Flat indices into an array of ``shape`` of the packed layout.

    Element ``k`` of the packed buffer of the global spatial ``boxes`` is
    element ``index_map[k]`` of the flattened (C order) array. Computed
    once per shape, boxes and origin (cached, also on the device of
    ``xp``).
    """
    boxes = tuple(tuple(tuple(iv) for iv in b) for b in boxes)
    return _index_map(shape, tuple(spatial_regions(shape[:2], boxes,
                                                   origin)), xp)


def pack(xp: Any, array: Any, regions: Sequence[Region], out: Any = None,
         method: Optional[str] = None,
         copy: bool = True) -> Tuple[Any, List[Any]]:
    """Packs ``array[region]`` for every region into one flat buffer.

    Args:
        xp: ``numpy`` or ``cupy`` (the module of ``array``).
        array: Any array; regions are in its own coordinates.
        regions: One ``(lo, hi)`` per axis each (empty ones take no room).
        out: A flat buffer of the packed size to fill (default: new).
        method: ``'slice'`` or ``'index'`` (see the module docstring).
        copy (bool): If False, a single region whose view is already
            C-contiguous is returned as that view (for sending; the array
            must not change until the message has gone).

    Returns:
        tuple: ``(buffer, pieces)``: the flat buffer and, per region, the
        view of it shaped like the region.
    """
    return _pack(xp, array, _region_layout(array.shape, regions), out,
                 method, copy)


def _pack(xp, array, layout, out, method, copy=True):
    """:func:`pack` of a validated layout: every packing runs this."""
    method = _method(method)
    if not copy and out is None and len(layout.slices) == 1:
        view = array[layout.slices[0]]
        if view.flags.c_contiguous:
            return view.reshape(-1), [view]
    n = layout.total
    if out is None:
        out = xp.empty(n, dtype=array.dtype)
    elif out.ndim != 1 or out.size != n or out.dtype != array.dtype:
        raise ValueError('out must be a flat {} buffer of {} elements, got '
                         '{} {}'.format(array.dtype, n, out.dtype, out.shape))
    views = pieces(out, layout.shapes, layout.sizes)
    if method == 'index':
        src = xp.ascontiguousarray(array).reshape(-1)
        xp.take(src, _index_map(array.shape, layout.regions, xp), out=out)
    else:
        for sl, piece, size in zip(layout.slices, views, layout.sizes):
            if size:
                piece[...] = array[sl]
    return out, views


def unpack(xp: Any, buffer: Any, array: Any, regions: Sequence[Region],
           accumulate: bool = False, method: Optional[str] = None) -> Any:
    """Writes (or adds) a packed buffer into ``array[region]``, in place.

    The inverse of :func:`pack` for ``accumulate=False`` (regions must not
    overlap then), its adjoint for ``accumulate=True`` (cells of
    overlapping regions receive the sum of their copies, added in the
    order of the regions).

    Args:
        xp: ``numpy`` or ``cupy``.
        buffer: The flat packed buffer (or any array of that many
            elements, e.g. one received message).
        array: The destination, C-contiguous for ``method='index'``.
        regions, method: As in :func:`pack`.
        accumulate (bool): Add instead of overwrite.

    Returns:
        ``array``.
    """
    return _unpack(xp, buffer, array, _region_layout(array.shape, regions),
                   accumulate, method)


def _unpack(xp, buffer, array, layout, accumulate, method):
    """:func:`unpack` of a validated layout: every unpacking runs this."""
    method = _method(method)
    n = layout.total
    if buffer.size != n:
        raise ValueError('the buffer holds {} elements, the boxes {}'
                         .format(buffer.size, n))
    if method == 'index':
        if not array.flags.c_contiguous:
            raise ValueError("method='index' writes through a flat view: "
                             'the array must be C-contiguous')
        flat = array.reshape(-1)
        idx = _index_map(array.shape, layout.regions, xp)
        values = buffer.reshape(-1)
        if not accumulate:
            flat[idx] = values
        elif xp is numpy:
            numpy.add.at(flat, idx, values)
        else:
            import cupyx
            cupyx.scatter_add(flat, idx, values)
        return array
    flat, off = buffer.reshape(-1), 0
    for sl, shape, size in zip(layout.slices, layout.shapes, layout.sizes):
        if size:
            piece = flat[off:off + size].reshape(shape)
            if accumulate:
                array[sl] += piece
            else:
                array[sl] = piece
        off += size
    return array


def pack_regions(xp: Any, array: Any, boxes: Sequence[Any],
                 origin: Sequence[int], out: Any = None,
                 method: Optional[str] = None) -> Tuple[Any, List[Any]]:
    """:func:`pack` of global spatial boxes of an ``(N, C, *spatial)``
    array whose cell 0 is at ``origin`` (all samples and channels).

    Returns:
        tuple: ``(buffer, pieces)``, each piece ``(N, C, *box_shape)``.
    """
    return _pack(xp, array, _box_layout(array.shape, boxes, origin), out,
                 method)


def unpack_regions(xp: Any, buffer: Any, array: Any, boxes: Sequence[Any],
                   origin: Sequence[int], accumulate: bool = False,
                   method: Optional[str] = None) -> Any:
    """:func:`unpack` into global spatial boxes (see :func:`pack_regions`).

    Returns:
        ``array``.
    """
    return _unpack(xp, buffer, array, _box_layout(array.shape, boxes, origin),
                   accumulate, method)


def copy_box(dst: Any, dst_origin: Sequence[int], src: Any,
             src_origin: Sequence[int], box: Any,
             accumulate: bool = False) -> None:
    """``dst[..., box] = src[..., box]`` (``+=`` with ``accumulate``) for a
    global spatial box inside both arrays; an empty box copies nothing."""
    for lo, hi in box:
        if hi <= lo:
            return
    if accumulate:
        dst[_sel(box, dst_origin)] += src[_sel(box, src_origin)]
    else:
        dst[_sel(box, dst_origin)] = src[_sel(box, src_origin)]


def staged(buffer: Any, views: Sequence[Any]) -> List[numpy.ndarray]:
    """Host arrays of a packed buffer's pieces, for MPI.

    numpy: the pieces themselves. A device buffer is copied to host memory
    in one transfer, and views of that copy are returned.
    """
    if type(buffer) is numpy.ndarray or is_host(buffer):
        return list(views)
    return pieces(to_host(buffer), [v.shape for v in views])


def message(xp: Any, array: Any, region: Optional[Region] = None,
            dtype: Any = None) -> numpy.ndarray:
    """One message: ``array[region]`` (default: all of it) as a contiguous
    host array, in ``dtype`` if given (no copy when it already is one)."""
    if dtype is not None and array.dtype != dtype:
        array = array.astype(dtype)
    if region is None:
        region = tuple((0, n) for n in array.shape)
    buf, views = pack(xp, array, [region], copy=False)
    return staged(buf, views)[0]


class PinnedStaging(object):
    """Reused page-locked host buffers for device <-> host staging.

    For MPIs that are not CUDA-aware: a packed device buffer goes to host
    memory in one transfer (page-locked, so the copy runs at full speed),
    and a received host buffer goes back in one. On numpy arrays nothing
    is copied. Buffers are kept per (slot, dtype, size), so a repeated
    exchange allocates nothing; a slot must not be reused while a message
    from it is still in flight.
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
