"""Pure helpers of the benchmarks (no root, no MPI)."""

import pytest

from benchmarks.harness import anchor
from benchmarks import overlap_bench as ob


def test_rate_for_hits_the_target_in_the_model():
    # t_c = 1 s, 1e8 bit at rate r: blocking = t_c / (t_c + 1e8 / r).
    r = ob.rate_for(0.66, 1.0, 1e8)
    assert 1.0 / (1.0 + 1e8 / r) == pytest.approx(0.66)


def test_next_rate_stays_in_the_bracket_and_survives_noise():
    # Blocking measured faster than alone (noise): go slower, by at most 8x.
    r = ob.next_rate(100e6, 1.2, 1.0, 0.9, None, 100e6)
    assert 100e6 / 8 <= r < 100e6
    # A sensible measurement: the model's proposal (t_comm 1 s at 100 Mbit/s
    # -> 0.499 s for the anchor's 0.6672 needs 200 Mbit/s), inside the bracket.
    r = ob.next_rate(100e6, 0.5, 1.0, 2.0, 100e6, None)
    assert r == pytest.approx(100e6 / (1 / ob.TARGET_CENTER - 1), rel=1e-6)
    # A proposal outside a closed bracket falls back to its geometric mean.
    r = ob.next_rate(100e6, 0.5, 1.0, 2.0, 100e6, 150e6)
    assert r == pytest.approx((100e6 * 150e6) ** 0.5)


def test_summarize_and_scalability_per_round():
    s = ob.add_scalability({
        'alone': ob.summarize({'round_seconds': [[1.0, 1.0], [2.0, 2.0],
                                                 [1.0, 1.2]]}),
        'blocking': ob.summarize({'round_seconds': [[1.5, 1.5], [3.2, 3.2],
                                                    [1.6, 1.6]]}),
    })
    # Over all iterations: median 1.1 s, slowest 2 s.
    assert s['alone']['it_per_s_median'] == pytest.approx(1 / 1.1)
    assert s['alone']['it_per_s_min'] == 0.5
    # Per round: 1/1.5, 2/3.2, 1.1/1.6; the machine slowed down in round 2
    # for both, which a ratio of overall medians would not see.
    rounds = [1 / 1.5, 2 / 3.2, 1.1 / 1.6]
    assert s['blocking']['scalability_rounds'] == pytest.approx(rounds)
    assert s['blocking']['scalability'] == pytest.approx(1 / 1.5)
    lo, hi = s['blocking']['scalability_ci']
    assert min(rounds) <= lo <= 1 / 1.5 <= hi <= max(rounds)
    assert s['alone']['scalability'] == 1.0


def test_emulation_settings_keep_the_anchor_ratio():
    from chainermn_overlap.communication import emulated
    nbytes = 102228128
    st = ob.emulation_settings(3.0, nbytes)
    t_comm = emulated.ring_allreduce_seconds(
        nbytes, 16, st['latency_s'], st['bandwidth_bit_per_s'] / 8)
    # Blocking under the model reproduces the anchor's 66.72 %.
    assert 3.0 / (3.0 + t_comm) == pytest.approx(0.6672, rel=1e-9)
    assert st['emulation'] and 'EMULATION' in st['label']


def test_compression_bound():
    from benchmarks.compression_bench import bound
    # CPU-limited: 1 s compute + 100 MB at 2 ms/MB of compute = 1.2 s.
    assert bound(1.0, 100e6, 2e-9, 1e9) == pytest.approx(1 / 1.2)
    # Link-limited: 100 MB at 50 MB/s = 2 s > 1.2 s.
    assert bound(1.0, 100e6, 2e-9, 50e6) == pytest.approx(0.5)
    # Compression compute counts; a negative (noisy) cost counts as zero.
    assert bound(1.0, 0, -1.0, 1e9, t_extra=0.25) == pytest.approx(0.8)


def test_anchor_wire_bytes():
    # A ring allreduce moves 2 (n-1)/n of the array per rank.
    assert anchor.wire_bytes(1000, 2) == 1000
    assert anchor.wire_bytes(1600, 16) == pytest.approx(3000)


def test_scaling_keeps_the_ratio():
    # A machine 10x slower than the anchor needs a 10x slower link.
    assert anchor.scale_bandwidth(10e9, 0.3, 3.0) == pytest.approx(1e9)
    nbytes, nodes, bw = 102 * 10 ** 6, 16, 10e9
    tc = anchor.anchor_compute_seconds(nbytes, nodes, bw, 0.6672)
    from chainermn_overlap.communication import emulated as em
    t_comm = em.ring_allreduce_seconds(nbytes, nodes, 0.0, bw / 8)
    assert tc / (tc + t_comm) == pytest.approx(0.6672)


def test_the_reference_is_the_slower_rank_alone():
    alone = {'round_seconds': [[1.0, 1.0], [1.0, 1.0]],
             'round_seconds_by_rank': [[[1.0, 1.0], [1.0, 1.0]],
                                       [[1.1, 1.1], [0.9, 0.9]]]}
    mode = {'round_seconds': [[1.2, 1.2], [1.2, 1.2]],
            'round_seconds_by_rank': [[[1.2, 1.2], [1.2, 1.2]]] * 2}
    assert ob.slowest_rank_rounds(alone) == [[1.1, 1.1], [1.0, 1.0]]
    s = ob.add_scalability({'alone': dict(alone), 'mode': dict(mode)})
    # Round 1: rank 1 alone was slower (1.1 s): the job is bound by it.
    assert s['mode']['scalability_rounds'] == pytest.approx([1.1 / 1.2,
                                                             1.0 / 1.2])
