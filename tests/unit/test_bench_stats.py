"""Intervals, paired comparisons and turn-taking of the benchmarks."""
import os
import subprocess
import threading

import numpy as np

import pytest

from benchmarks.harness import interleave, stats, trainer, turns


def test_interval_of_a_known_sample():
    rng = np.random.RandomState(3)
    # Medians of 15 draws of N(0.9, 0.01): the 95 % interval of the median
    # holds the true median in about 95 of 100 samples.
    inside = 0
    for _ in range(100):
        iv = stats.interval(rng.normal(0.9, 0.01, 15))
        assert iv['ci'][0] <= iv['median'] <= iv['ci'][1]
        inside += iv['ci'][0] <= 0.9 <= iv['ci'][1]
    assert 85 <= inside <= 100
    # The same data give the same interval (fixed seed).
    v = rng.rand(10)
    assert stats.interval(v) == stats.interval(v)


def test_interval_narrows_with_rounds():
    rng = np.random.RandomState(0)
    few = stats.interval(rng.normal(0.9, 0.03, 5))['half_width']
    many = stats.interval(rng.normal(0.9, 0.03, 80))['half_width']
    assert many < few


def test_paired_sees_a_shift_that_unpaired_intervals_hide():
    rng = np.random.RandomState(1)
    drift = rng.normal(0.0, 0.05, 12)     # the machine's speed per round
    a = 0.80 + drift
    b = 0.82 + drift + rng.normal(0.0, 0.002, 12)
    cmp = stats.paired(list(a), list(b))
    assert cmp['claimed']
    assert cmp['difference']['median'] == pytest.approx(0.02, abs=0.003)
    # Each alone: intervals overlap widely.
    ia, ib = stats.interval(a), stats.interval(b)
    assert ia['ci'][1] > ib['ci'][0]


def test_false_claims_stay_near_the_nominal_rate():
    # A/A: no real difference.  The percentile bootstrap of a median
    # undercovers a little on few rounds (6.5 % of claims at 10-15 rounds
    # in a 400-case simulation, for a nominal 5 %): the documented rate.
    rng = np.random.RandomState(2)
    claims = 0
    for _ in range(200):
        drift = rng.normal(0.0, 0.05, 12)
        a = 0.8 + drift + rng.normal(0, 0.01, 12)
        b = 0.8 + drift + rng.normal(0, 0.01, 12)
        claims += stats.paired(list(a), list(b))['claimed']
    assert claims <= 0.10 * 200


def test_excludes():
    assert stats.excludes([0.01, 0.03], 0.0)
    assert stats.excludes([-0.03, -0.01], 0.0)
    assert not stats.excludes([-0.01, 0.03], 0.0)
    assert not stats.excludes([None, None], 0.0)


def test_alternating_order():
    assert turns.alternating(['a', 'b'], 3) == [['a', 'b'], ['b', 'a'],
                                                ['a', 'b']]


def _rank(spec, rank, log, fail_at=-1):
    client = turns.TurnClient(rank=rank, spec=spec)
    for cmd in client.commands():
        log.append((rank, cmd['op'], cmd.get('round')))
        if cmd.get('round', -2) == fail_at:
            return      # dies without answering
        client.answer({'rank': rank, 'round': cmd.get('round')})


def test_conductor_gives_turns_and_collects_answers():
    log = []
    with turns.Conductor({'a': 2, 'b': 2}) as c:
        threads = [threading.Thread(target=_rank, args=(
            c.env(job)[turns.ENV], r, log)) for job in 'ab' for r in (0, 1)]
        for t in threads:
            t.start()
        assert c.turn('a', {'op': 'warmup'}, 10) == [
            {'rank': 0, 'round': None}, {'rank': 1, 'round': None}]
        answers = c.turn('b', {'op': 'round', 'round': 4}, 10)
        assert [a['round'] for a in answers] == [4, 4]
        for job in 'ab':
            assert c.turn(job, {'op': 'stop'}, 10) == [{'op': 'stop'}] * 2
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        folder = c.folder
    assert not os.path.exists(folder)


def test_a_rank_that_does_not_answer_is_reported():
    log = []
    with turns.Conductor({'a': 1}) as c:
        t = threading.Thread(target=_rank, args=(c.env('a')[turns.ENV], 0,
                                                 log, 1), daemon=True)
        t.start()
        c.turn('a', {'op': 'round', 'round': 0}, 10)
        with pytest.raises(turns.TurnError, match='within 1 s'):
            c.turn('a', {'op': 'round', 'round': 1}, 1)
        with pytest.raises(turns.TurnError, match='ended during.*exit 9'):
            c.turn('a', {'op': 'round', 'round': 2}, 30,
                   alive=lambda: 'exit 9')


def test_job_summary_from_answers():
    def answer(r, scale):
        return {'op': 'round', 'round': r, 'stats': {'alone': None,
                                                     'fast': None},
                'modes': {'alone': {'seconds': [1.0 * scale, 1.0 * scale],
                                    'tail_seconds': 0.0},
                          'fast': {'seconds': [1.25 * scale] * 2,
                                   'tail_seconds': 0.1}}}
    rounds = [[answer(r, s), answer(r, s)] for r, s in enumerate((1, 2, 1))]
    raw = trainer.result_from_answers(rounds, ['alone', 'fast'])
    assert raw['modes']['fast']['tail_seconds'] == [0.1, 0.1, 0.1]
    s = interleave.job_summary(rounds, ['alone', 'fast'])
    assert s['fast']['scalability_rounds'] == pytest.approx([0.8] * 3)
    cmp = interleave.compare(s, s, [('fast', 'fast')])['fast/fast']
    assert cmp['speed_ratio']['median'] == 1.0
    assert not cmp['scalability']['claimed']


def test_unknown_trainer_modes_are_refused():
    for mode in ('overlap_update_powersgd5', 'overlap_sideways',
                 'blockin'):
        with pytest.raises(ValueError, match='unknown benchmark mode'):
            trainer.make_optimizer(mode, None, {})


def test_ab_refuses_what_is_not_a_revision():
    from benchmarks.harness import ab
    with pytest.raises(ab.ABError, match='not a revision'):
        ab.resolve('no-such-branch-of-this-repository')


def _in_git_checkout():
    from benchmarks.harness import launch
    return subprocess.run(['git', '-C', launch.ROOT, 'rev-parse', 'HEAD'],
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


@pytest.mark.skipif(not _in_git_checkout(),
                    reason='revisions need a git checkout (the installed-'
                    'wheel run copies the tests without one)')
def test_ab_resolves_revisions_of_the_checkout():
    from benchmarks.harness import ab
    assert len(ab.resolve('HEAD')['commit']) == 40
    assert ab.resolve(ab.WORKTREE)['rev'] == ab.WORKTREE
