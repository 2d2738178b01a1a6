"""The PyTorch peer worker (benchmarks/harness/peers_torch.py) and its ResNets.

They run in the peer venv (``make peers-venv``: ``.venv-peers``, with
torch), so each test starts that interpreter as a subprocess; without it
they skip.  The models must match the Chainer ones parameter for
parameter; the worker must print a valid result line alone, answer a
conductor, and, at two ranks under mpiexec, keep the parameters of every
DDP mode identical on both ranks.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

from benchmarks.harness import turns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
PEERS_PY = os.path.join(ROOT, '.venv-peers', 'bin', 'python')
TAG = 'TRAINER_RESULT '
DDP_MODES = ['ddp_fp32', 'ddp_fp16', 'ddp_powersgd1', 'ddp_powersgd4']
# Each subprocess: well under a minute on an idle machine; the margin is
# for a loaded one.
TIMEOUT = 240

pytestmark = pytest.mark.skipif(
    not os.access(PEERS_PY, os.X_OK),
    reason='no peer venv at .venv-peers (make peers-venv installs torch '
           'there)')


def _mpiexec():
    for path in (os.path.join(os.path.dirname(sys.executable), 'mpiexec'),
                 os.path.join(ROOT, '.venv', 'bin', 'mpiexec')):
        if os.access(path, os.X_OK):
            return path
    pytest.skip('no mpiexec beside {} nor in .venv (make venv installs '
                'it)'.format(sys.executable))


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in (turns.ENV, 'PMI_RANK', 'PMI_SIZE', 'RANK',
                        'WORLD_SIZE', 'OMPI_COMM_WORLD_RANK',
                        'OMPI_COMM_WORLD_SIZE')}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS='1', **extra)
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _cfg(modes, **over):
    cfg = {'model': 'resnet18', 'batch': 2, 'insize': 32, 'modes': modes,
           'warmup': 2, 'settle': 1, 'iterations': 2, 'rounds': 2,
           'master_addr': '127.0.0.1', 'master_port': _free_port(),
           'ifname': 'lo'}
    cfg.update(over)
    return cfg


def _worker_cmd(cfg):
    return [PEERS_PY, '-m', 'benchmarks.harness.peers_torch', '--worker',
            json.dumps(cfg)]


def _result(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0][len(TAG):])


def _check_result(out, modes, ranks, cfg):
    assert out['ranks'] == ranks
    assert out['rounds'] == cfg['rounds']
    assert sorted(out['modes']) == sorted(modes)
    for mode in modes:
        res = out['modes'][mode]
        assert len(res['round_seconds']) == cfg['rounds']
        assert all(len(r) == cfg['iterations'] and all(t > 0 for t in r)
                   for r in res['round_seconds'])
        assert len(res['round_seconds_by_rank']) == ranks
        assert res['round_seconds_by_rank'][0] == res['round_seconds']
        assert res['tail_seconds'] == [0.0] * cfg['rounds']
        assert res['communication_stats'] is None
        assert len(res['param_checksum_by_rank']) == ranks
        assert res['param_checksum'] == res['param_checksum_by_rank'][0]


def test_model_sizes():
    code = ('import json\n'
            'from benchmarks.harness import torch_models as tm\n'
            'print(json.dumps({n: tm.size(tm.build_model(n))'
            ' for n in tm.MODELS}))\n')
    proc = subprocess.run([PEERS_PY, '-c', code], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    sizes = json.loads(proc.stdout.splitlines()[-1])
    assert sizes == {'resnet18': [62, 11689512],
                     'resnet50': [161, 25557032]}


def test_models_have_the_chainer_models_parameter_shapes():
    code = ('import json\n'
            'from benchmarks.harness import torch_models as tm\n'
            'print(json.dumps({n: sorted(list(p.shape) for p in '
            'tm.build_model(n).parameters()) for n in tm.MODELS}))\n')
    proc = subprocess.run([PEERS_PY, '-c', code], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    torch_shapes = json.loads(proc.stdout.splitlines()[-1])
    from benchmarks.harness import workloads
    for name in ('resnet18', 'resnet50'):
        chainer_shapes = sorted(list(p.shape) for p in
                                workloads.build_model(name).params())
        assert torch_shapes[name] == chainer_shapes, name


def test_alone_at_one_process_prints_a_result():
    cfg = _cfg(['alone'], warmup=1)
    proc = subprocess.run(_worker_cmd(cfg), env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)
    _check_result(_result(proc), ['alone'], 1, cfg)


def test_ddp_modes_need_two_ranks():
    proc = subprocess.run(_worker_cmd(_cfg(['ddp_fp32'])), env=_env(),
                          cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode != 0
    assert 'need at least 2 ranks' in proc.stderr


def test_conducted_at_one_process():
    cfg = _cfg(['alone'], warmup=1, iterations=1)
    with turns.Conductor({'peer': 1}) as conductor:
        with open(os.devnull, 'w') as null:
            proc = subprocess.Popen(_worker_cmd(cfg), cwd=ROOT,
                                    env=_env(**conductor.env('peer')),
                                    stdout=null, stderr=subprocess.PIPE,
                                    text=True)
        try:
            def alive():
                return proc.poll() is None
            warm = conductor.turn('peer', {'op': 'warmup'}, TIMEOUT, alive)
            assert warm[0]['op'] == 'warmup'
            assert warm[0]['version'].startswith('2.13.0')
            for r in range(2):
                ans = conductor.turn('peer', {'op': 'round', 'round': r},
                                     TIMEOUT, alive)[0]
                assert ans['round'] == r
                assert len(ans['modes']['alone']['seconds']) == 1
                assert ans['modes']['alone']['tail_seconds'] == 0.0
                assert ans['stats'] == {'alone': None}
            assert conductor.turn('peer', {'op': 'stop'}, TIMEOUT,
                                  alive) == [{'op': 'stop'}]
            assert proc.wait(TIMEOUT) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()


def test_ddp_modes_keep_both_ranks_identical():
    modes = ['alone'] + DDP_MODES
    cfg = _cfg(modes, iterations=1)
    cmd = [_mpiexec(), '-n', '2'] + _worker_cmd(cfg)
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT)
    out = _result(proc)
    _check_result(out, modes, 2, cfg)
    for mode in DDP_MODES:
        sums = out['modes'][mode]['param_checksum_by_rank']
        assert sums[0] == sums[1], (mode, sums)
    # Each rank trains on its own batch: alone, they drift apart.
    alone = out['modes']['alone']['param_checksum_by_rank']
    assert alone[0] != alone[1]
