"""Moving whole tensors in and out of a grid: scatter, gather, loss scale.

For users and tests, not for the training path: :func:`scatter` cuts this
process's block out of a global batch held everywhere, :func:`gather`
assembles the global tensor on every process (it allocates the whole
tensor), and :func:`loss_scale` turns a sum of per-sample losses into the
loss whose gradients, averaged over processes, are the single-process
ones. The cutting and assembling are pure (:func:`scatter`,
:func:`assemble`); only :func:`gather` and :func:`loss_scale` communicate.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence, Union

import chainer
from chainer import backend
import numpy

from chainermn_overlap import _mpi_json
from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import layout as layout_mod

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.topology import GridTopology

    Input = Union[chainer.Variable, NdArray]

__all__ = ['assemble', 'gather', 'loss_scale', 'scatter', 'scatter_samples']


def _array(x):
    return x.array if isinstance(x, chainer.Variable) else x


def _box_slices(box):
    return tuple(slice(a, b) for a, b in box)


def scatter(topo: GridTopology, x: Input,
            channel_split: bool = False) -> NdArray:
    """This process's block of a global batch (see
    :meth:`SpatialGrid.scatter`)."""
    arr = _array(x)
    if arr.ndim != 2 + topo.ndim:
        raise ValueError(
            'distconv.SpatialGrid.scatter: expected (N, C, %s) for grid '
            '%r, got shape %r.' % (', '.join(layout_mod.axis_names(
                topo.ndim)), topo.shape, arr.shape))
    lo, hi = topo.sample_range(arr.shape[0])
    ch = slice(*topo.channel_range(arr.shape[1])) if channel_split \
        else slice(None)
    sl = (slice(lo, hi), ch) + _box_slices(topo.block(arr.shape[2:]))
    xp = backend.get_array_module(arr)
    return xp.ascontiguousarray(arr[sl])


def scatter_samples(topo: GridTopology, t: Input) -> NdArray:
    """This group's samples of a per-sample array (e.g. labels)."""
    arr = _array(t)
    lo, hi = topo.sample_range(arr.shape[0])
    return arr[lo:hi]


def assemble(topo: GridTopology, parts: Sequence[numpy.ndarray],
             layout: layout_mod.Layout, channel_split: bool = False,
             reduce_copies: bool = False) -> numpy.ndarray:
    """The global tensor from every rank's block (pure).

    Args:
        topo (GridTopology): The grid's topology.
        parts (list): Every rank's block, in rank order.
        layout (Layout): The tensor's global layout.
        channel_split, reduce_copies (bool): See :func:`gather`.

    Returns:
        numpy.ndarray: ``(N, C, *spatial)``.
    """
    n_total = sum(layout.group_samples)
    out = numpy.zeros((n_total, layout.channels) + layout.spatial_shape,
                      dtype=parts[0].dtype)
    offset = 0
    for g in range(topo.n_groups):
        n = layout.group_samples[g]
        for c in range(topo.channels):
            if channel_split:
                ch = slice(*topo.channel_range(layout.channels, c))
            elif c and not reduce_copies:
                continue
            else:
                ch = slice(None)
            for s in range(topo.spatial_size):
                sl = (slice(offset, offset + n), ch) + _box_slices(
                    topo.block(layout.spatial_shape, s))
                part = parts[topo.world_rank(g, c, s)]
                if reduce_copies and not channel_split:
                    out[sl] += part
                else:
                    out[sl] = part
        offset += n
    return out


def gather(topo: GridTopology, mpi_comm: Any, y: Input,
           layout: layout_mod.Layout, channel_split: bool = False,
           reduce_copies: bool = False) -> NdArray:
    """Assembles the global tensor on every process (collective).

    Args:
        topo (GridTopology): The grid's topology.
        mpi_comm: The grid's world communicator.
        y: This process's block, checked to have ``layout``.
        layout (Layout): The tensor's global layout.
        channel_split (bool): Whether ``y`` holds this process's block of
            the channels (True) or all of them (False).
        reduce_copies (bool): Sum the copies of the channel coordinates of
            a tensor that is not channel split instead of taking
            coordinate 0's (see :meth:`SpatialGrid.gather`).

    Returns:
        The global array ``(N, C, *spatial)`` on ``y``'s device.
    """
    arr = _array(y)
    parts = _mpi_json.allgather_arrays(mpi_comm, _comm.to_host(arr))
    return _comm.like(assemble(topo, parts, layout, channel_split,
                               reduce_copies), arr)


def loss_scale(mpi_comm: Any, size: int, n_local: int) -> float:
    """``size`` over the sum of ``n_local`` over the processes (see
    :meth:`SpatialGrid.loss_scale`; collective)."""
    total = int(_comm.allreduce_sum(
        mpi_comm, numpy.array([n_local], dtype=numpy.int64))[0])
    if total == 0:
        raise ValueError('distconv.SpatialGrid.loss_scale: the global '
                         'batch is empty on every process.')
    return float(size) / total
