"""The sharding peers study (benchmarks/peers_sharding.py) and its PyTorch
worker (benchmarks/harness/peers_torch_shard.py).

The pure parts run in the main venv without torch: which modes pair with
which, the memory arithmetic, the checks on the peers' parameter sums, the
rows the study prints and the docs table that renders them (from a result
made up here).  Two tests start the workers at two ranks under mpiexec:
PyTorch's (skipped without the peer venv, ``make peers-venv``), whose
modes must train alike and record the one that does not run here, and the
memory jobs of both sides.  The docs table that renders a result is
tested with the pages, in ``test_docs_peers_sharding.py``.
"""
import json
import os
import socket
import subprocess

import pytest

from benchmarks import peers_sharding as ps
from benchmarks.harness import interleave, peers_torch_shard as pts, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

PEERS_PY = os.path.join(ROOT, '.venv-peers', 'bin', 'python')
MPIEXEC = os.path.join(ROOT, '.venv', 'bin', 'mpiexec')
ZERO1_OVERLAP_ERROR = ('RuntimeError: Gloo backend using Overlapping DDP '
                       'with ZeRO may meet hangs')
TIMEOUT = 240


# ---------------------------------------------------------------------------
# Modes and pairs
# ---------------------------------------------------------------------------

def test_pairs_compare_the_same_stage():
    ps.check_pairs()
    assert {t for t, _ in ps.PAIRS} == set(ps.THEIRS) - {'alone'}
    assert {o for _, o in ps.PAIRS} == set(ps.OURS) - {'alone'}


def test_a_pair_of_different_stages_is_refused():
    with pytest.raises(ValueError, match='stage 3 with stage 1'):
        ps.check_pairs([('fsdp2_full', 'overlap_forward_shard_optimizer')])
    # Only the pairs that shard alike may cross the stages' names.
    with pytest.raises(ValueError, match='stage 2 with stage 3'):
        ps.check_pairs([('fsdp2_grad_op',
                         'overlap_forward_shard_parameters')])
    ps.check_pairs([('fsdp2_grad_op',
                     'overlap_forward_shard_parameters_unbounded')])
    with pytest.raises(ValueError, match='outside'):
        ps.check_pairs([('ddp_fp32', 'overlap_forward')])


def test_the_modes_exist_on_each_side():
    assert set(ps.THEIRS) == set(pts.MODES) == set(pts.STAGE) \
        == set(pts.SETTINGS)
    for mode in ps.OURS:
        # What trainer.make_optimizer builds (the options only: no MPI).
        assert mode in ('alone', 'overlap_forward') \
            or 'shard' in trainer.WIRE_OPTIONS[mode]()


def test_selection_keeps_alone_and_the_stages_asked_for():
    ours, theirs, pairs = ps.selection([3])
    assert ours == ['alone', 'overlap_forward_shard_parameters',
                    'overlap_forward_shard_parameters_unbounded']
    assert theirs == ['alone', 'fsdp2_full', 'fsdp1_full']
    assert pairs == [('fsdp2_full', 'overlap_forward_shard_parameters'),
                     ('fsdp1_full', 'overlap_forward_shard_parameters')]
    # FSDP's grad-op modes meet our stage 3 without prefetch bound only
    # when both stages are asked for.
    ours, theirs, pairs = ps.selection([2, 3])
    assert ('fsdp1_grad_op',
            'overlap_forward_shard_parameters_unbounded') in pairs
    assert ('fsdp1_grad_op', 'overlap_forward_shard_gradients') in pairs
    assert ps.selection() == (ps.OURS, ps.THEIRS, ps.PAIRS)
    with pytest.raises(ValueError, match='do not exist'):
        ps.selection([4])


def test_the_peer_config_check():
    with pytest.raises(ValueError, match='unknown mode'):
        pts.check_config({'modes': ['ddp_fp32']}, 2)
    with pytest.raises(ValueError, match='at least 2 ranks'):
        pts.check_config({'modes': ['alone', 'zero1']}, 1)
    pts.check_config({'modes': ['alone']}, 1)
    pts.check_config({'modes': list(pts.MODES)}, 2)


# ---------------------------------------------------------------------------
# Memory arithmetic
# ---------------------------------------------------------------------------

def test_ideal_bytes_per_parameter():
    assert [ps.ideal(s, 2) for s in (None, 0, 1, 2, 3)] == \
        [16, 16, 12, 10, 8]
    assert [ps.ideal(s, 4) for s in (1, 2, 3)] == [10, 7, 4]


def test_memory_row_takes_the_larger_rank():
    n = 1024 * 1000
    raw = [{'rank': 0, 'base_kb': 100, 'rss_kb': 100 + 8000,
            'hwm_kb': 100 + 12000, 'parameters': n},
           {'rank': 1, 'base_kb': 200, 'rss_kb': 200 + 9000,
            'hwm_kb': 200 + 11000, 'parameters': n}]
    row = ps.memory_row(raw, 3)
    assert row['persistent_bytes_per_param'] == pytest.approx(9.0)
    assert row['peak_bytes_per_param'] == pytest.approx(12.0)
    assert row['ideal_bytes_per_param'] == 8.0
    assert row['by_rank'] == raw and row['parameters'] == n


def test_memory_row_of_a_failed_mode_is_its_error():
    row = ps.memory_row([{'rank': 0, 'error': 'RuntimeError: no'},
                         {'rank': 1, 'error': 'RuntimeError: no'}], 1)
    assert row['error'] == 'RuntimeError: no'
    assert 'persistent_bytes_per_param' not in row
    assert ps.memory_text(row) == 'RuntimeError: no'


def test_parse_status_reads_the_vm_lines():
    text = ('Name:\tpython\nVmPeak:\t  500 kB\nVmHWM:\t  300 kB\n'
            'VmRSS:\t  250 kB\nThreads:\t3\n')
    assert pts.parse_status(text) == {'VmPeak': 500, 'VmHWM': 300,
                                      'VmRSS': 250}
    here = pts.vm_status()
    assert here['VmHWM'] >= here['VmRSS'] > 0


def test_checksum_checks():
    same = {'alone': 1.0, 'ddp_adam': 5.0, 'fsdp2_full': 5.0 + 1e-9}
    rounds = [[same, dict(same, alone=2.0)]]
    assert ps.in_step(rounds)
    assert ps.train_alike(rounds)
    assert not ps.in_step([[same, dict(same, zero1=5.0, fsdp2_full=6.0)]])
    assert ps.train_alike([[dict(same, fsdp1_full=5.1), same]]) is False
    assert ps.train_alike([[{'alone': 1.0}]]) is None


# ---------------------------------------------------------------------------
# Rows, the printed table and the docs table, from a made-up result
# ---------------------------------------------------------------------------

def _summary(modes, alone_s, step_s):
    out = {}
    for m in modes:
        s = alone_s if m == 'alone' else step_s[m]
        out[m] = {'round_seconds': [[s], [s * 1.01], [s * 0.99]],
                  'scalability_rounds': [alone_s / s] * 3}
    return out


def _made_up_result():
    ours_s = dict(zip(ps.OURS[1:], (1.2, 1.25, 1.3, 2.0, 1.35)))
    theirs_s = {'ddp_adam': 1.4, 'zero1': 1.6, 'fsdp2_grad_op': 1.7,
                'fsdp1_grad_op': 1.8, 'fsdp2_full': 2.5, 'fsdp1_full': 2.6}
    ran = ['alone'] + list(theirs_s)
    result = {'pairs': ps.PAIRS,
              'config': {'model': 'resnet18', 'insize': 128, 'batch': 8},
              'rate_bit_per_s': 1.09e9, 'peer_version': '2.13.0+cpu',
              'peer_batch': 25,
              'ours': {'modes': _summary(ps.OURS, 1.0, ours_s)},
              'theirs': {'modes': _summary(ran, 1.0, theirs_s),
                         'errors': {'zero1_overlap': ZERO1_OVERLAP_ERROR}}}
    pairs = [(t, o) for t, o in [('alone', 'alone')] + ps.PAIRS if t in ran]
    result['comparison'] = interleave.compare(
        result['theirs']['modes'], result['ours']['modes'], pairs)
    n = 1024 * 1000

    def raw(persistent, peak):
        return [{'rank': r, 'base_kb': 0, 'rss_kb': persistent * 1000,
                 'hwm_kb': peak * 1000, 'parameters': n} for r in (0, 1)]
    result['memory'] = {
        'config': {'batch': 2, 'insize': 64},
        'ours': {m: ps.memory_row(raw(16 - 2 * i, 18 - 2 * i),
                                  ps.OUR_STAGE[m])
                 for i, m in enumerate(ps.OURS)},
        'theirs': {m: ps.memory_row(raw(20, 22), pts.STAGE[m])
                   for m in ran}}
    result['memory']['theirs']['zero1_overlap'] = ps.memory_row(
        [{'rank': 0, 'error': ZERO1_OVERLAP_ERROR}], 1)
    result['stages'] = ps.stage_rows(result)
    return result


def test_stage_rows_pair_each_side_and_keep_the_error():
    rows = _made_up_result()['stages']
    assert [(r['theirs'], r['ours']) for r in rows] == \
        [('alone', 'alone')] + ps.PAIRS
    by = {r['theirs']: r for r in rows}
    assert by['zero1']['difference']['median'] == pytest.approx(
        1 / 1.25 - 1 / 1.6)
    assert by['zero1']['ours_memory']['persistent_bytes_per_param'] == \
        pytest.approx(12.0)
    failed = by['zero1_overlap']
    assert failed['theirs_error'] == ZERO1_OVERLAP_ERROR
    assert failed['theirs_scalability'] is None
    assert failed['difference'] is None
    assert failed['ours_scalability']['median'] == pytest.approx(1 / 1.25)


def test_the_printed_table_names_the_failed_peer():
    lines = []
    ps.report(_made_up_result(), lines.append)
    text = '\n'.join(lines)
    assert 'zero1_overlap did not run: ' + ZERO1_OVERLAP_ERROR in text
    assert len([ln for ln in lines if 'stage 2' in ln]) == 2


# ---------------------------------------------------------------------------
# The workers at two ranks
# ---------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ('CMO_TURNS', 'PMI_RANK', 'PMI_SIZE', 'RANK',
                        'WORLD_SIZE')}
    env.update(ps.MEMORY_ENV, PYTHONPATH=ROOT)
    return env


needs_peers = pytest.mark.skipif(
    not os.access(PEERS_PY, os.X_OK) or not os.access(MPIEXEC, os.X_OK),
    reason='no peer venv at .venv-peers (make peers-venv installs torch '
           'there) or no mpiexec in .venv')


@needs_peers
def test_peer_modes_train_alike_and_record_what_does_not_run():
    cfg = {'model': 'resnet18', 'batch': 2, 'insize': 32,
           'modes': list(pts.MODES), 'warmup': 2, 'settle': 0,
           'iterations': 1, 'rounds': 1, 'master_addr': '127.0.0.1',
           'master_port': _free_port(), 'ifname': 'lo'}
    proc = subprocess.run(
        [MPIEXEC, '-n', '2', PEERS_PY, '-m', pts.MODULE, pts.WORKER_FLAG,
         json.dumps(cfg)], env=_env(), cwd=ROOT, capture_output=True,
        text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(ln[len(pts.RESULT_TAG):])
           for ln in proc.stdout.splitlines()
           if ln.startswith(pts.RESULT_TAG)][0]
    assert out['errors'] == {'zero1_overlap': ZERO1_OVERLAP_ERROR}
    assert sorted(out['modes']) == sorted(set(pts.MODES) - {'zero1_overlap'})
    sums = [{m: r['param_checksum_by_rank'][k]
             for m, r in out['modes'].items()} for k in (0, 1)]
    assert ps.in_step([sums]) and ps.train_alike([sums])
    # Negative control: alone trains each rank's own batch.
    assert sums[0]['alone'] != sums[1]['alone']


@needs_peers
def test_memory_jobs_of_both_sides(tmp_path):
    log = []
    cfg = {'model': 'resnet18', 'batch': 2, 'insize': 64, 'warmup': 1}
    ours = ps.run_memory('ours', ['overlap_forward_shard_parameters'],
                         ps.OUR_STAGE, cfg, log.append, timeout=TIMEOUT)
    theirs = ps.run_memory('theirs', ['fsdp2_full'], pts.STAGE, cfg,
                           log.append, timeout=TIMEOUT)
    for row in (ours['overlap_forward_shard_parameters'],
                theirs['fsdp2_full']):
        assert 'error' not in row, row
        assert row['ideal_bytes_per_param'] == 8.0
        # Stage 3 at 2 ranks holds about half of the unsharded 16.
        assert 6 < row['persistent_bytes_per_param'] < 12, row
        assert row['peak_bytes_per_param'] >= \
            row['persistent_bytes_per_param'], row
