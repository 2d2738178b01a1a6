"""Who is where in a spatial grid: ranks, coordinates, blocks, communicators.

:class:`GridTopology` is pure arithmetic on ``(shape, channels, size,
rank)``: it validates the grid against the process count and maps ranks to
``(sample group, channel coordinate, spatial rank)`` and back, and gives
the balanced blocks (samples, channels, spatial box) a process holds. No
MPI is involved, so every rule can be tested for any process count without
processes. :class:`GridCommunicators` creates the grid's private mpi4py
communicators from a topology (collective).

Rank order: ``rank = (group * channels + channel_rank) * prod(shape) +
spatial_rank``; inside a spatial grid, ``spatial_rank`` is row-major over
``shape``.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy

from chainermn_overlap.communication import blocking
from chainermn_overlap.distconv import geometry

__all__ = ['GridCommunicators', 'GridTopology']


def _checked_shape(shape):
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise ValueError(
            'distconv.SpatialGrid: shape must be a tuple of process '
            'counts per spatial dimension such as (2, 2), got %r'
            % (shape,))
    if not shape or any(s < 1 for s in shape):
        raise ValueError(
            'distconv.SpatialGrid: shape must be a non-empty tuple of '
            'positive process counts, got %r' % (shape,))
    return shape


def _checked_channels(channels):
    if not isinstance(channels, (int, numpy.integer)) or channels < 1:
        raise ValueError(
            'distconv.SpatialGrid: channels must be a positive int (the '
            'number of processes along the channel axis), got %r'
            % (channels,))
    return int(channels)


class GridTopology(object):
    """The layout of ``size`` processes as sample groups x channels x space.

    Args:
        shape (tuple of int): Processes per spatial dimension.
        size (int): Number of processes.
        rank (int): This process's rank.
        channels (int): Processes along the channel axis.

    Raises:
        ValueError: If the shape or channel count is malformed, or their
            product does not divide ``size``.

    Attributes:
        shape, ndim, size, rank, spatial_size, channels, n_groups, group,
        channel_rank, spatial_rank, coords: As documented on
            :class:`~chainermn_overlap.distconv.grid.SpatialGrid`.
    """

    def __init__(self, shape: Sequence[int], size: int, rank: int,
                 channels: int = 1) -> None:
        shape = _checked_shape(shape)
        channels = _checked_channels(channels)
        spatial = geometry.grid_size(shape)
        if channels > 1 and size % (spatial * channels) != 0:
            raise ValueError(
                'distconv.SpatialGrid: grid shape %r with channels=%d needs '
                'a multiple of %d processes (sample groups x channels x '
                'prod(shape)), but the communicator has %d. Choose shape '
                'and channels whose product divides %d.'
                % (shape, channels, spatial * channels, size, size))
        if size % spatial != 0:
            raise ValueError(
                'distconv.SpatialGrid: grid shape %r needs a multiple of %d '
                'processes, but the communicator has %d. Use a grid whose '
                'product divides %d (the quotient is the number of sample '
                'groups), or launch a multiple of %d processes.'
                % (shape, spatial, size, size, spatial))
        self.shape = shape
        self.ndim = len(shape)
        self.size = int(size)
        self.rank = int(rank)
        self.spatial_size = spatial
        self.channels = channels
        self.n_groups = size // (spatial * channels)
        self.group, self.channel_rank, self.spatial_rank = self.coord_of(
            self.rank)
        self.coords = geometry.grid_coords(shape, self.spatial_rank)

    def world_rank(self, group: int, channel_rank: int,
                   spatial_rank: int) -> int:
        """Rank in the communicator of grid position (group, c, s)."""
        return ((group * self.channels + channel_rank) * self.spatial_size
                + spatial_rank)

    def coord_of(self, world_rank: int) -> Tuple[int, int, int]:
        """``(group, channel_rank, spatial_rank)`` of a communicator rank."""
        P, C = self.spatial_size, self.channels
        return world_rank // (P * C), (world_rank // P) % C, world_rank % P

    def channel_range(self, n: int, channel_rank: int = None
                      ) -> geometry.Interval:
        """Channels ``[lo, hi)`` of ``n`` held at a channel coordinate
        (default: this process's)."""
        c = self.channel_rank if channel_rank is None else channel_rank
        return geometry.block_range(n, self.channels, c)

    def sample_range(self, n: int) -> geometry.Interval:
        """Samples ``[lo, hi)`` of a global batch of ``n`` in this group."""
        return geometry.block_range(n, self.n_groups, self.group)

    def block(self, spatial_shape: Sequence[int],
              spatial_rank: int = None) -> geometry.Box:
        """The box of a tensor with global ``spatial_shape`` held at a
        spatial rank (default: this process's)."""
        coords = self.coords if spatial_rank is None else \
            geometry.grid_coords(self.shape, spatial_rank)
        return geometry.block_box(spatial_shape, self.shape, coords)


class GridCommunicators(object):
    """The grid's private communicators (created collectively).

    distconv's point-to-point messages and reductions run on these, so they
    can never match messages of the user or of a gradient-communication
    thread that uses the original communicator.

    Args:
        mpi_comm: The mpi4py communicator the topology describes.
        topology (GridTopology): Its layout.

    Attributes:
        world: A duplicate of ``mpi_comm`` (layout checks, gathers).
        spatial: The processes of this spatial grid (same sample group and
            channel coordinate; rank = spatial rank).
        channel: The channel axis (same sample group and spatial rank;
            rank = channel coordinate).
        data: Every process with this channel coordinate (rank = ``group *
            prod(shape) + spatial_rank``).
    """

    def __init__(self, mpi_comm: Any, topology: GridTopology) -> None:
        t = topology
        what = "the distconv grid's {} communicator".format
        self.world = blocking.dup(mpi_comm, what('world'))
        self.spatial = blocking.split(
            mpi_comm, t.group * t.channels + t.channel_rank, t.spatial_rank,
            what('spatial'))
        self.channel = blocking.split(
            mpi_comm, t.group * t.spatial_size + t.spatial_rank,
            t.channel_rank, what('channel'))
        self.data = blocking.split(
            mpi_comm, t.channel_rank,
            t.group * t.spatial_size + t.spatial_rank, what('data'))
