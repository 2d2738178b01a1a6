"""The grid topology (distconv/topology.py), tested without processes.

Every rank of a grid is simulated in one process: coordinates must be a
bijection with the documented rank order, the blocks of all ranks must tile
the samples, channels and spatial domain, and bad grids must be refused
with an error that says what to change.
"""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mpi4py import MPI

from chainermn_overlap.distconv import geometry as G
from chainermn_overlap.distconv.topology import GridCommunicators
from chainermn_overlap.distconv.topology import GridTopology


def topologies(shape, channels, groups):
    size = G.grid_size(shape) * channels * groups
    return [GridTopology(shape, size, r, channels) for r in range(size)]


grids = st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=3),
                  st.integers(1, 3), st.integers(1, 3))


@settings(max_examples=60, deadline=None)
@given(grids)
def test_ranks_and_coordinates_are_a_bijection(grid):
    shape, channels, groups = grid
    tops = topologies(shape, channels, groups)
    seen = set()
    for r, t in enumerate(tops):
        assert (t.rank, t.size, t.n_groups) == (r, len(tops), groups)
        assert t.coord_of(r) == (t.group, t.channel_rank, t.spatial_rank)
        assert t.world_rank(t.group, t.channel_rank, t.spatial_rank) == r
        # The documented order: rank = (g * C + c) * prod(shape) + s.
        assert r == ((t.group * channels + t.channel_rank)
                     * G.grid_size(shape) + t.spatial_rank)
        assert t.coords == G.grid_coords(tuple(shape), t.spatial_rank)
        seen.add((t.group, t.channel_rank, t.spatial_rank))
    assert len(seen) == len(tops)


@settings(max_examples=60, deadline=None)
@given(grids, st.integers(0, 9), st.integers(0, 7),
       st.lists(st.integers(0, 7), min_size=3, max_size=3))
def test_blocks_tile_samples_channels_and_space(grid, n, c, spatial):
    shape, channels, groups = grid
    spatial = tuple(spatial[:len(shape)])
    tops = topologies(shape, channels, groups)
    cover = np.zeros((n, c) + spatial, np.int64)
    for t in tops:
        lo, hi = t.sample_range(n)
        clo, chi = t.channel_range(c)
        box = t.block(spatial)
        assert box == t.block(spatial, t.spatial_rank)
        cover[(slice(lo, hi), slice(clo, chi))
              + tuple(slice(a, b) for a, b in box)] += 1
    # Each cell of samples x channels x space is held by exactly one rank.
    assert (cover == 1).all()


def test_channel_range_of_another_coordinate():
    t = GridTopology((1, 1), 3, 0, channels=3)
    assert [t.channel_range(7, c) for c in range(3)] == [(0, 3), (3, 5),
                                                         (5, 7)]
    assert t.channel_range(7) == (0, 3)


@pytest.mark.parametrize('shape, size, channels, match', [
    ((2, 2), 6, 1, 'needs a multiple of 4 processes, but the communicator '
     'has 6'),
    ((2, 1), 6, 2, 'with channels=2 needs a multiple of 4 processes'),
    ((), 4, 1, 'non-empty tuple of positive process counts'),
    ((2, 0), 4, 1, 'non-empty tuple of positive process counts'),
    (2, 4, 1, 'must be a tuple of process counts'),
    ((2, 1), 4, 0, 'channels must be a positive int'),
    ((2, 1), 4, 1.5, 'channels must be a positive int'),
])
def test_bad_grids_say_what_to_change(shape, size, channels, match):
    with pytest.raises(ValueError, match=match):
        GridTopology(shape, size, 0, channels)


def test_communicators_on_one_process():
    t = GridTopology((1, 1), 1, 0)
    comms = GridCommunicators(MPI.COMM_SELF, t)
    for c in (comms.world, comms.spatial, comms.channel, comms.data):
        assert (c.Get_size(), c.Get_rank()) == (1, 0)
    # Private: not the communicator it was made from.
    assert comms.world != MPI.COMM_SELF
    for c in (comms.world, comms.spatial, comms.channel, comms.data):
        c.Free()


def test_shapes_are_normalised():
    t = GridTopology([np.int64(2), 1], 4, 3)
    assert t.shape == (2, 1) and all(type(s) is int for s in t.shape)
    assert list(itertools.chain(t.coords)) == [1, 0]
