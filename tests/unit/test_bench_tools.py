"""Pure helpers of the benchmarks (no root, no MPI)."""
import os

import pytest

from benchmarks import netbed
from benchmarks import overlap_bench as ob


def test_parse_rate():
    assert netbed.parse_rate('400mbit') == 400e6
    assert netbed.parse_rate('1.5gbit') == 1.5e9
    assert netbed.parse_rate(2e8) == 2e8
    with pytest.raises(ValueError, match='400mbit'):
        netbed.parse_rate('fast')
    with pytest.raises(ValueError):
        netbed.parse_rate('0mbit')


def test_parse_delay():
    assert netbed.parse_delay('0.5ms') == pytest.approx(5e-4)
    assert netbed.parse_delay(None) is None
    with pytest.raises(ValueError):
        netbed.parse_delay('5 parsecs')


def test_tbf_burst():
    assert netbed.tbf_burst_bytes(400e6) == 250000
    assert netbed.tbf_burst_bytes(1e6) == 64 * 1024


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


def test_summarize_and_scalability():
    s = ob.add_scalability({
        'alone': ob.summarize({'iteration_seconds': [1.0, 1.0, 2.0]}),
        'blocking': ob.summarize({'iteration_seconds': [1.5, 1.5, 1.6]}),
    })
    assert s['alone']['it_per_s_median'] == 1.0
    assert s['alone']['it_per_s_min'] == 0.5
    assert s['blocking']['scalability'] == pytest.approx(1 / 1.5)


def test_emulation_settings_keep_the_anchor_ratio():
    from chainermn_overlap.communication import emulated
    nbytes = 102228128
    st = ob.emulation_settings(3.0, nbytes)
    t_comm = emulated.ring_allreduce_seconds(
        nbytes, 16, st['latency_s'], st['bandwidth_bit_per_s'] / 8)
    # Blocking under the model reproduces the anchor's 66.72 %.
    assert 3.0 / (3.0 + t_comm) == pytest.approx(0.6672, rel=1e-9)
    assert st['emulation'] and 'EMULATION' in st['label']


def test_netbed_says_plainly_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(os, 'geteuid', lambda: 1000)
    with pytest.raises(SystemExit) as exc:
        netbed.require_root()
    assert exc.value.code == 2
    assert 'needs root' in capsys.readouterr().err


def test_compression_bound():
    from benchmarks.compression_bench import bound
    # CPU-limited: 1 s compute + 100 MB at 2 ms/MB of compute = 1.2 s.
    assert bound(1.0, 100e6, 2e-9, 1e9) == pytest.approx(1 / 1.2)
    # Link-limited: 100 MB at 50 MB/s = 2 s > 1.2 s.
    assert bound(1.0, 100e6, 2e-9, 50e6) == pytest.approx(0.5)
    # Compression compute counts; a negative (noisy) cost counts as zero.
    assert bound(1.0, 0, -1.0, 1e9, t_extra=0.25) == pytest.approx(0.8)
