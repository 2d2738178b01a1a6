"""The 3-D U-Net benchmark on the network test bed (benchmarks/unet_bench.py).

A tiny run end to end on the bed: the timings come from ranks in separate
namespaces (the halo traffic is counted on the shaped link), with the
no-exchange bound beside them; and the fallback to shared memory where the
bed cannot run, said on stderr (or refused when the bed was asked for).
Timings are not asserted: the bench measures them on a quiet machine.
"""
import argparse
import json
import subprocess
import sys

import pytest

from benchmarks import unet_bench
from benchmarks.harness import distconv_jobs, launch
from test_netbed import needs_root


@needs_root
def test_tiny_run_on_the_bed(tmp_path):
    out = tmp_path / 'unet.json'
    insize, width, rounds = 8, 4, 2
    res = subprocess.run(
        [sys.executable, '-m', 'benchmarks', 'unet', '--bed', '--insize',
         str(insize), '--width', str(width), '--levels', '2', '--rounds',
         str(rounds), '--out', str(out)], cwd=launch.ROOT, capture_output=True,
        text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result['transport'] == 'netbed'
    run, = result['runs']
    assert run['transport'] == 'netbed' and run['processes'] == 2
    assert run['bed']['ranks'] == 2 and run['bed']['rate_bit_per_s'] == 4e8
    assert run['block_per_process'] == [insize // 2, insize, insize]
    for turn in unet_bench.TURNS:
        assert len(run['round_seconds'][turn]) == rounds
        assert all(t > 0 for t in run['round_seconds'][turn])
    for key in ('efficiency', 'fraction_of_bound'):
        assert run[key] > 0
    assert run['bound']['efficiency'] > 0
    # The halo traffic crossed the shaped link: every rank sent at least
    # the forward halo plane of the first level's width-channel convolution
    # (float32) per step.
    link = run['link']
    plane = width * insize * insize * 4
    assert min(link['median_tx_bytes_per_step_per_rank']) >= plane, link
    assert link['rate_bit_per_s'] == 4e8
    assert run['memory']['peak_ratio_vs_serial'] < 1


def _args(**kw):
    return argparse.Namespace(**dict({'shm': False, 'bed': False}, **kw))


def test_falls_back_to_shared_memory_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(distconv_jobs, 'why_no_netbed',
                        lambda: 'needs root (network namespaces)')
    assert unet_bench._transport(_args()) == 'shared_memory'
    err = capsys.readouterr().err
    assert 'needs root' in err and 'shared memory' in err
    with pytest.raises(SystemExit, match='needs root.*--shm'):
        unet_bench._transport(_args(bed=True))
    assert unet_bench._transport(_args(shm=True)) == 'shared_memory'


def test_the_bed_is_the_default_where_it_runs(monkeypatch):
    monkeypatch.setattr(distconv_jobs, 'why_no_netbed', lambda: None)
    assert unet_bench._transport(_args()) == 'netbed'
    assert unet_bench._transport(_args(shm=True)) == 'shared_memory'
