"""SpatialGrid as the composition of its parts, at any process count.

The grid's attributes are its topology's, its communicators group the
processes the topology says, and the layout check agrees across ranks
even when the ranks' caches differ (a miss on one rank makes every rank
run the full check, without a hang).
"""
import numpy as np
import pytest

from chainermn_overlap import distconv
from chainermn_overlap.distconv.topology import GridTopology
from distconv_mpi_helpers import comm, grid


@pytest.mark.parametrize('shape, channels', [((1, 1), 1), ((2, 1), 1),
                                             ((1, 1), 2), ((2, 1), 2)])
def test_attributes_and_communicators_follow_the_topology(shape, channels):
    c = comm()
    if c.size % (int(np.prod(shape)) * channels):
        pytest.skip('grid does not fit %d processes' % c.size)
    g = distconv.SpatialGrid(c, shape, channels=channels)
    t = GridTopology(shape, c.size, c.rank, channels)
    for name in ('shape', 'ndim', 'size', 'rank', 'spatial_size',
                 'channels', 'n_groups', 'group', 'channel_rank',
                 'spatial_rank', 'coords'):
        assert getattr(g, name) == getattr(t, name), name
    assert g.topology is g.layouts.topology
    # Each communicator holds the ranks the topology assigns to it, ranked
    # by the documented coordinate.
    members = {
        'mpi_spatial': ([t.world_rank(t.group, t.channel_rank, s)
                         for s in range(t.spatial_size)], t.spatial_rank),
        'mpi_channel': ([t.world_rank(t.group, k, t.spatial_rank)
                         for k in range(t.channels)], t.channel_rank),
        'mpi_data': ([t.world_rank(q, t.channel_rank, s)
                      for q in range(t.n_groups)
                      for s in range(t.spatial_size)],
                     t.group * t.spatial_size + t.spatial_rank),
        'mpi_world': (list(range(c.size)), c.rank),
    }
    for name, (ranks, my_rank) in members.items():
        mc = getattr(g, name)
        assert mc.allgather(c.rank) == ranks, name
        assert mc.Get_rank() == my_rank, name


def test_a_cache_miss_on_one_rank_makes_every_rank_check():
    g = grid((2, 1)) if comm().size % 2 == 0 else grid((1, 1))
    x = g.scatter(np.zeros((2, 3, 9, 4), np.float32))
    want = g.check_spatial(x, 'layer', ('a',))
    g.check_spatial(x, 'layer', ('a',))
    g.stats.clear()
    if g.rank == 0:
        g.layouts._cache.clear()
    got = g.check_spatial(x, 'layer', ('a',))
    assert got == want
    counts = comm().mpi_comm.allgather(dict(g.stats))
    assert all(s == {'validate_full': 1} for s in counts), counts
    g.check_spatial(x, 'layer', ('a',))
    assert g.stats['validate_cached'] == 1


def test_check_mode_can_be_changed_and_is_validated():
    g = grid((1, 1))
    x = np.zeros((1, 1, 3, 3), np.float32)
    g.check = 'always'
    try:
        assert g.layouts.mode == 'always'
        g.stats.clear()
        g.check_spatial(x, 'l')
        g.check_spatial(x, 'l')
        assert g.stats['validate_full'] == 2
        with pytest.raises(ValueError, match="check must be 'cached' or "
                           "'always'"):
            g.check = 'sometimes'
        assert g.check == 'always'
    finally:
        g.check = 'cached'
