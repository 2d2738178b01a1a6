"""Pure candidate generators of the tuner for channel axes and tiling."""
from chainermn_overlap.distconv import tuner


def test_grids_with_channels_divide_size():
    got = tuner.grids_with_channels(4, 2)
    assert {'grid': [1, 1], 'channels': 4} in got
    assert {'grid': [2, 1], 'channels': 2} in got
    assert {'grid': [2, 2], 'channels': 1} in got
    for g in got:
        assert 4 % (g['grid'][0] * g['grid'][1] * g['channels']) == 0
    assert tuner.grids_with_channels(1, 2) == [{'grid': [1, 1],
                                                'channels': 1}]


def test_strategy_candidates_cut_spatial_then_channel():
    cands = tuner.strategy_candidates(2, 2, ['stem', 'res4', 'res5'])
    # Spatial grids: every cut; no spatial split: one candidate.
    pure_channel = [c for c in cands if c['channels'] == 2]
    assert pure_channel == [{'grid': [1, 1], 'channels': 2, 'strategy': {
        'stem': 'channel', 'res4': 'channel', 'res5': 'channel'}}]
    spatial = [c for c in cands if c['grid'] == [2, 1]]
    assert len(spatial) == 4
    assert spatial[2]['strategy'] == {'stem': 'spatial', 'res4': 'spatial',
                                      'res5': 'sample'}
    for c in cands:
        kinds = [c['strategy'][s] for s in ('stem', 'res4', 'res5')]
        # Spatial stages come first.
        assert kinds == sorted(kinds, key=lambda k: k != 'spatial')


def test_strategy_candidates_with_depths():
    cands = tuner.strategy_candidates(2, 2, ['a'], depths=[1, None])
    assert all('depth' in c for c in cands)
    assert len(cands) == 2 * len(tuner.strategy_candidates(2, 2, ['a']))


def test_depth_candidates():
    assert tuner.depth_candidates((2, 1), [1, 2, None]) == [
        {'grid': [2, 1], 'depth': 1}, {'grid': [2, 1], 'depth': 2},
        {'grid': [2, 1], 'depth': None}]
    base = {'grid': [1, 1], 'channels': 2}
    assert tuner.depth_candidates(base, [3])[0] == dict(base, depth=3)


def test_invalid_reason_with_channels():
    assert tuner._invalid_reason((2, 1), 4, 2, 2) is None
    assert 'channel' in tuner._invalid_reason((2, 1), 4, 2, 3)
    assert tuner._channels({'grid': [1], 'channels': 3}) == 3
    assert tuner._channels((1, 1)) == 1
