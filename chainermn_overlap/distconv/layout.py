"""What the processes' blocks say about a distributed tensor (pure).

Each process contributes ``(shape, dtype, signature)`` of its block (the
collective part, an allgather, lives in
:mod:`~chainermn_overlap.distconv.layout_check`). From the list of all
contributions, the functions here decide whether the blocks form the grid's
spatial layout (or sample layout) and derive the global description
(:class:`Layout`), or raise the :class:`ValueError` that names the first
offending rank. Every process evaluates the same list, so every process
raises the same error. No MPI is involved.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from chainermn_overlap.distconv import geometry

if TYPE_CHECKING:
    from chainermn_overlap.distconv.topology import GridTopology

__all__ = ['Layout', 'axis_names', 'channel_counts', 'samples_layout',
           'spatial_layout']

_AXIS_NAMES = {1: ('W',), 2: ('H', 'W'), 3: ('D', 'H', 'W')}

Info = Tuple[Tuple[int, ...], str, tuple]


def axis_names(ndim: int) -> Tuple[str, ...]:
    """Names of the spatial axes for messages ('H', 'W', ...)."""
    return _AXIS_NAMES.get(ndim, tuple('S%d' % i for i in range(ndim)))


Layout = collections.namedtuple(
    'Layout', ['spatial_shape', 'group_samples', 'channels',
               'channel_counts'], defaults=(None,))
Layout.__doc__ = """Global description of a spatially distributed tensor.

Attributes:
    spatial_shape (tuple of int): Global spatial extent.
    group_samples (list of int): Number of samples held by each sample group.
    channels (int): Number of channels (axis 1): the global count for a
        tensor whose channels are split over the grid's channel axis, the
        common count when they are not, and this process's count when the
        check did not care (``channel_split=None``).
    channel_counts (tuple of int): Channels held at each channel
        coordinate (one entry when the grid has no channel axis).
"""


def _check_ranks_and_signatures(topo, infos, layer):
    names = axis_names(topo.ndim)
    for r, (shape, _, _) in enumerate(infos):
        if len(shape) != 2 + topo.ndim:
            raise ValueError(
                '%s: input must have shape (N, C, %s) to match the %d-D '
                'grid %r, but rank %d passed shape %r. Use a grid with '
                'one entry per spatial dimension (e.g. (2, 1, 1) for 3-D '
                'data).' % (layer, ', '.join(names), topo.ndim,
                            topo.shape, r, shape))
    sig0 = infos[0][2]
    for r, (_, _, sig) in enumerate(infos):
        if sig != sig0:
            raise ValueError(
                '%s: arguments differ between processes (rank 0: %r, '
                'rank %d: %r). Every process must call the layer with '
                'the same arguments and parameter shapes.'
                % (layer, sig0, r, sig))


def channel_counts(topo: GridTopology, infos: Sequence[Info], layer: str,
                   channel_split: Optional[bool] = False
                   ) -> Tuple[int, ...]:
    """Checks what every layout shares; returns the channel counts.

    Args:
        topo (GridTopology): The grid's topology.
        infos (list): ``(shape, dtype, signature)`` of every rank's block.
        layer (str): Name used in error messages.
        channel_split: True if the channels are split over the channel
            axis (coordinate ``c`` holds block ``c``), False if every
            process holds the same channels, None if only processes of
            the same channel coordinate must agree (element-wise and
            window operations, which treat channels independently).

    Returns:
        tuple of int: Channels held at each channel coordinate.
    """
    _check_ranks_and_signatures(topo, infos, layer)
    dtype0 = infos[0][1]
    ch0 = infos[0][0][1]
    C = topo.channels
    counts = tuple(infos[topo.world_rank(0, c, 0)][0][1] for c in range(C))
    for r, (shape, dtype, _) in enumerate(infos):
        c = topo.coord_of(r)[1]
        want = ch0 if channel_split is False else counts[c]
        if dtype != dtype0 or shape[1] != want:
            if C == 1:
                raise ValueError(
                    '%s: rank 0 passed %d channels of %s but rank %d '
                    'passed %d channels of %s. All processes must hold '
                    'the same channels and dtype.'
                    % (layer, ch0, dtype0, r, shape[1], dtype))
            raise ValueError(
                '%s: rank %d (channel coordinate %d) passed %d channels '
                'of %s, but %s holds %d channels of %s. %s'
                % (layer, r, c, shape[1], dtype,
                   'rank 0' if channel_split is False
                   else 'channel coordinate %d of group 0' % c,
                   want, dtype0,
                   'This layer takes channels that are not split: every '
                   'process must hold all of them (use a layer with '
                   "split='filter' before a split='channel' one, or "
                   'grid.scatter(x, channel_split=False)).'
                   if channel_split is False else
                   'Processes of one channel coordinate must hold the '
                   'same channels and dtype.'))
    if channel_split:
        total = sum(counts)
        expect = tuple(geometry.block_sizes(total, C))
        if counts != expect:
            raise ValueError(
                '%s: expects channels split over the %d channel '
                'coordinates, but they hold %r channels, not the '
                'balanced split %r of %d. Feed it the output of a '
                "split='filter' layer or grid.scatter(x, "
                'channel_split=True).' % (layer, C, list(counts),
                                          list(expect), total))
    return counts


def _group_samples(topo, infos, layer, g, ranks):
    n0 = infos[topo.world_rank(g, 0, 0)][0][0]
    for r in ranks:
        if infos[r][0][0] != n0:
            raise ValueError(
                '%s: ranks %d and %d of sample group %d hold %d '
                'and %d samples. The processes of a sample group '
                'must hold the same samples; split a global '
                'batch with grid.scatter or grid.sample_range.'
                % (layer, topo.world_rank(g, 0, 0), r, g, n0,
                   infos[r][0][0]))
    return n0


def _extent(topo, shapes, ranks, layer, g, d):
    """Global size along dimension ``d`` of one spatial grid's blocks."""
    names = axis_names(topo.ndim)
    by_coord = {}
    for s, shp in enumerate(shapes):
        k = geometry.grid_coords(topo.shape, s)[d]
        size = shp[2 + d]
        if by_coord.setdefault(k, size) != size:
            raise ValueError(
                '%s: processes in the same grid slice along '
                '%s hold blocks of different size (%d and '
                '%d, rank %d of group %d). The input is not '
                'in the block layout of grid %r; create it '
                'with grid.scatter or distconv layers.' % (
                    layer, names[d], by_coord[k], size,
                    ranks[s], g, topo.shape))
    sizes = [by_coord[k] for k in range(topo.shape[d])]
    n = sum(sizes)
    expect = geometry.block_sizes(n, topo.shape[d])
    if sizes != expect:
        raise ValueError(
            '%s: along %s the blocks of group %d have sizes '
            '%r, but the balanced split of %d over %d '
            'processes is %r (input spatial sizes disagree '
            'with the grid layout). Create inputs with '
            'grid.scatter or distconv layers.'
            % (layer, names[d], g, sizes, n, topo.shape[d], expect))
    return n


def spatial_layout(topo: GridTopology, infos: Sequence[Info], layer: str,
                   channel_split: Optional[bool] = None
                   ) -> Tuple[Layout, tuple]:
    """Checks that the blocks form the spatial layout.

    Args:
        topo, infos, layer, channel_split: See :func:`channel_counts`.

    Returns:
        tuple: ``(layout, summary)``: the :class:`Layout` and a
        description of the global layout, the same on every rank (what the
        cached check fingerprints).

    Raises:
        ValueError: If the blocks do not form the grid's layout.
    """
    counts = channel_counts(topo, infos, layer, channel_split)
    P = topo.spatial_size
    group_samples = []
    spatial_shape = None
    for g in range(topo.n_groups):
        for c in range(topo.channels):
            ranks = [topo.world_rank(g, c, s) for s in range(P)]
            n0 = _group_samples(topo, infos, layer, g, ranks)
            shapes = [infos[r][0] for r in ranks]
            gshape = tuple(_extent(topo, shapes, ranks, layer, g, d)
                           for d in range(topo.ndim))
            if spatial_shape is None:
                spatial_shape = gshape
            elif gshape != spatial_shape:
                raise ValueError(
                    '%s: the global spatial size differs between sample '
                    'groups or channel coordinates (%r in group 0, %r in '
                    'group %d, channel coordinate %d). All samples of a '
                    'batch must have the same spatial size.'
                    % (layer, spatial_shape, gshape, g, c))
        group_samples.append(n0)
    if channel_split:
        channels = sum(counts)
    elif channel_split is False:
        channels = counts[0]
    else:
        channels = counts[topo.channel_rank]
    summary = (spatial_shape, group_samples, counts, channel_split)
    return Layout(spatial_shape, group_samples, channels, counts), summary


def samples_layout(topo: GridTopology, infos: Sequence[Info], layer: str
                   ) -> Tuple[Tuple[Tuple[int, ...], List[int]], tuple]:
    """Checks a tensor in sample layout (whole samples per process).

    Returns:
        tuple: ``((spatial_shape, counts), summary)`` where ``counts[s]``
        is the number of samples of spatial rank ``s`` in this process's
        group and ``summary`` describes every rank's count.
    """
    channel_counts(topo, infos, layer, None)
    shape0 = infos[0][0][2:]
    for r, (shape, _, _) in enumerate(infos):
        if shape[2:] != shape0:
            raise ValueError(
                '%s: whole samples must have the same spatial size on '
                'every process, but rank 0 has %r and rank %d has %r.'
                % (layer, shape0, r, shape[2:]))
    counts = [infos[topo.world_rank(topo.group, topo.channel_rank, s)][0][0]
              for s in range(topo.spatial_size)]
    every = tuple(info[0][0] for info in infos)
    return (shape0, counts), (shape0, every)
