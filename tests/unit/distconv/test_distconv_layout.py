"""The pure layout checks (distconv/layout.py) on simulated ranks.

Every rank's ``(shape, dtype, signature)`` is made here from the blocks the
topology gives (what the allgather would deliver), then one rank is made
wrong in one way; the check must derive the global layout from correct
blocks and, for each fault, raise the error that names it and the rank.
"""
import pytest

from chainermn_overlap.distconv import layout as Lay
from chainermn_overlap.distconv import geometry as G
from chainermn_overlap.distconv.topology import GridTopology


def infos_for(shape, channels, groups, n, c, spatial, channel_split=False,
              dtype='float32', sig=('conv',)):
    """Every rank's block info of a global (n, c, *spatial) tensor."""
    size = G.grid_size(shape) * channels * groups
    out = []
    for r in range(size):
        t = GridTopology(shape, size, r, channels)
        lo, hi = t.sample_range(n)
        ch = t.channel_range(c) if channel_split else (0, c)
        block = G.box_shape(t.block(spatial))
        out.append(((hi - lo, ch[1] - ch[0]) + block, dtype, sig))
    return size, out


def topo(shape, size, rank=0, channels=1):
    return GridTopology(shape, size, rank, channels)


@pytest.mark.parametrize('shape, channels, groups, split', [
    ((2, 2), 1, 1, False), ((3, 1), 1, 2, False), ((1, 2, 2), 1, 1, None),
    ((2, 1), 2, 1, True), ((2, 1), 3, 2, False), ((1, 1), 3, 1, True)])
def test_correct_blocks_give_the_global_layout(shape, channels, groups,
                                               split):
    n, c, spatial = 5, 7, (9, 7, 4)[:len(shape)]
    size, infos = infos_for(shape, channels, groups, n, c, spatial,
                            channel_split=bool(split))
    summaries = set()
    for r in range(size):
        t = topo(shape, size, r, channels)
        lay, summary = Lay.spatial_layout(t, infos, 'layer', split)
        assert lay.spatial_shape == spatial
        assert lay.group_samples == G.block_sizes(n, groups)
        counts = tuple(G.block_sizes(c, channels)) if split else \
            (c,) * channels
        assert lay.channel_counts == counts
        want_c = c if split is not None else counts[t.channel_rank]
        assert lay.channels == want_c
        summaries.add(repr(summary))
    assert len(summaries) == 1  # the same on every rank: fingerprintable


def _break(infos, r, shape=None, dtype=None, sig=None):
    infos = list(infos)
    s, d, g = infos[r]
    infos[r] = (shape or s, dtype or d, sig or g)
    return infos


def test_each_fault_names_itself_and_the_rank():
    size, infos = infos_for((2, 2), 1, 2, 4, 3, (8, 6))
    t = topo((2, 2), size)
    cases = [
        (_break(infos, 3, shape=(2, 3, 4)), 'rank 3 passed shape'),
        (_break(infos, 5, sig=('pool',)), "rank 5: ('pool',)"),
        (_break(infos, 2, dtype='float64'), 'rank 2 passed 3 channels of '
         'float64'),
        (_break(infos, 1, shape=(2, 4, 4, 3)), 'rank 1 passed 4 channels'),
        (_break(infos, 6, shape=(1, 3, 4, 3)), 'ranks 4 and 6 of sample '
         'group 1 hold 2 and 1 samples'),
        (_break(infos, 1, shape=(2, 3, 3, 3)), 'hold blocks of different '
         'size (4 and 3, rank 1 of group 0)'),
        (_break(_break(infos, 0, shape=(2, 3, 3, 3)), 1,
                shape=(2, 3, 3, 3)), 'blocks of group 0 have sizes [3, 4], '
         'but the balanced split of 7 over 2 processes is [4, 3]'),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError) as e:
            Lay.spatial_layout(t, bad, 'mylayer')
        assert match in str(e.value) and str(e.value).startswith('mylayer')
    # Negative control: the unbroken list passes.
    Lay.spatial_layout(t, infos, 'mylayer')


def test_groups_with_other_spatial_sizes_are_refused():
    size, a = infos_for((2, 1), 1, 1, 2, 3, (8, 6))
    _, b = infos_for((2, 1), 1, 1, 2, 3, (6, 6))
    t = topo((2, 1), 4)
    with pytest.raises(ValueError, match=r'\(8, 6\) in group 0, \(6, 6\) in '
                       'group 1'):
        Lay.spatial_layout(t, a + b, 'layer')


def test_channel_split_must_be_balanced_and_unsplit_must_agree():
    size, infos = infos_for((1, 1), 3, 1, 2, 7, (4, 4), channel_split=True)
    t = topo((1, 1), size, 0, 3)
    assert Lay.channel_counts(t, infos, 'l', True) == (3, 2, 2)
    bad = _break(_break(infos, 0, shape=(2, 2, 4, 4)), 2,
                 shape=(2, 3, 4, 4))
    with pytest.raises(ValueError, match=r'hold \[2, 2, 3\] channels, not '
                       r'the balanced split \[3, 2, 2\]'):
        Lay.channel_counts(t, bad, 'l', True)
    with pytest.raises(ValueError, match='takes channels that are not '
                       'split'):
        Lay.channel_counts(t, infos, 'l', False)
    # None: only the processes of one coordinate must agree.
    assert Lay.channel_counts(t, infos, 'l', None) == (3, 2, 2)


def test_samples_layout_counts_and_errors():
    P, n, c = 3, 7, 2
    size = P
    infos = [((hi - lo, c, 5, 4), 'float32', ())
             for lo, hi in (G.block_range(n, P, s) for s in range(P))]
    (shape, counts), summary = Lay.samples_layout(topo((3, 1), size), infos,
                                                  'l')
    assert shape == (5, 4) and counts == G.block_sizes(n, P)
    assert summary == ((5, 4), tuple(counts))
    bad = _break(infos, 2, shape=(2, c, 5, 3))
    with pytest.raises(ValueError, match=r'rank 0 has \(5, 4\) and rank 2 '
                       r'has \(5, 3\)'):
        Lay.samples_layout(topo((3, 1), size), bad, 'l')


def test_axis_names():
    assert Lay.axis_names(2) == ('H', 'W')
    assert Lay.axis_names(3) == ('D', 'H', 'W')
    assert Lay.axis_names(4) == ('S0', 'S1', 'S2', 'S3')
