"""Pure helpers of the network test bed (no root, no MPI)."""
import os

import pytest

from testbed import netbed


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


def test_netbed_says_plainly_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(os, 'geteuid', lambda: 1000)
    with pytest.raises(SystemExit) as exc:
        netbed.require_root()
    assert exc.value.code == 2
    assert 'needs root' in capsys.readouterr().err
