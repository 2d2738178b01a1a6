"""Snapshots of sharded optimizers stay sharded (issue 32, item 1).

auto_snapshot with ``shard=``: each rank's file holds its own slices of
the update-rule states (with their ranges), so the states are on disk once,
not once per rank; a restart at the same rank count reads each rank's own
file; one at another rank count, or into an unsharded optimizer, rebuilds
whole states from every file; ``python -m chainermn_overlap.snapshot
consolidate`` writes one file of whole states.  Every resume is compared
bit for bit with an uninterrupted run (tests/unit/restart_job.py, an MLP
with MomentumSGD, snapshots every 4 iterations).
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from test_restart import (ROOT, assert_bit_identical, assert_finished,
                          injections, mpirun, reference, run_case,
                          trainings)

OPT = 'updater/optimizer:main/'
RANGES = OPT + 'shard_ranges'
MODEL = 'updater/model:main/'
MODEL_RANGES = MODEL + 'shard_ranges'


def _rank_files(snap_dir, iteration):
    folder = os.path.join(snap_dir, 'snapshot_iter_{:08d}'.format(iteration))
    return sorted(glob.glob(os.path.join(folder, 'rank*.npz')),
                  key=lambda p: int(os.path.basename(p)[4:-4]))


def _state_keys(npz):
    return [k for k in npz.files if k.startswith(OPT) and k.endswith('/v')]


def _whole_states(result):
    """The optimizer's states as the finished run wrote them whole."""
    opt = np.load(result + '.opt.npz')
    return {OPT + k: opt[k] for k in opt.files if k.endswith('/v')}


# 'parameters': the others fetch their parameters from the rank killed;
# clip: with GradientClipping the others wait in its norm's allreduce.
@pytest.mark.parametrize('job', [{'shard': 'optimizer'},
                                 {'shard': 'parameters'},
                                 {'shard': 'optimizer', 'clip': 0.05}],
                         ids=['optimizer', 'parameters', 'optimizer-clip'])
def test_files_hold_slices_and_a_kill_resumes_exactly(tmp_path,
                                                      tmp_path_factory,
                                                      job):
    code, out, result = run_case(tmp_path, job, [('kill', 10, 0, 1)])
    assert [i[:4] for i in injections(out)] == [('kill', 10, 1, 0)], out
    assert [(a, f) for _, a, _, f, _ in trainings(out)] == [
        (0, None), (1, 8)], out
    assert_finished(code, out)
    assert_bit_identical(result, reference(tmp_path_factory, **job))
    # The last snapshot (iteration 24, the end): every state on disk once.
    files = [np.load(p) for p in _rank_files(str(tmp_path / 'snap'), 24)]
    assert len(files) == 2
    whole = _whole_states(result)
    assert whole
    for key, value in whole.items():
        name = '/' + key[len(OPT):-len('/v')]
        parts = []
        for f in files:
            entry = json.loads(str(f[RANGES][()]))[name]
            part = f[key]
            assert part.shape == (entry['hi'] - entry['lo'],), key
            parts.append((entry['lo'], part))
        # Slices, not copies: together exactly the whole state.
        assert sum(p.size for _, p in parts) == value.size, key
        joined = np.concatenate([p for _, p in sorted(parts,
                                                      key=lambda x: x[0])])
        assert joined.tobytes() == value.reshape(-1).tobytes(), key
    _model_slices_cover_each_parameter_once(files)


def _model_slices_cover_each_parameter_once(files):
    """Every parameter of the model is split over the files, once."""
    records = [json.loads(str(f[MODEL_RANGES][()])) for f in files]
    assert records[0]
    for name, entry in records[0].items():
        key = MODEL + name.lstrip('/')
        spans = sorted((rec[name]['lo'], rec[name]['hi'], f[key].size)
                       for rec, f in zip(records, files))
        assert all(hi - lo == n for lo, hi, n in spans), (key, spans)
        assert sum(n for _, _, n in spans) == int(np.prod(entry['shape']))


@pytest.mark.parametrize('shard', ['optimizer', 'parameters'])
def test_snapshot_files_hold_one_copy_at_4_ranks(shard):
    # Adam MLP of benchmarks/snapshot_bench.py (hidden 1024: 2.1 M
    # parameters): the files' total is one copy of parameters and states,
    # each parameter slice written by one rank; before, every file held
    # the whole parameters (2.0 copies at 4 ranks with Adam).  With
    # shard='parameters' the write gathers no whole model: its memory
    # stays below half the parameters' bytes (it fetched them all whole
    # before, 4 bytes each).
    from benchmarks import snapshot_bench
    row = snapshot_bench.run_mode(4, shard, shard, True, 1024,
                                  lambda msg: None)
    assert row['disk_copies_of_params_and_state'] <= 1.1, row
    if shard == 'parameters':
        assert max(row['save_peak_bytes_per_rank']) < \
            2 * row['parameters'], row


def test_negative_control_whole_files_hold_four_copies_of_parameters():
    from benchmarks import snapshot_bench
    row = snapshot_bench.run_mode(4, 'optimizer_whole_files', 'optimizer',
                                  False, 1024, lambda msg: None)
    assert row['disk_copies_of_params_and_state'] > 1.9, row


def test_negative_control_unsharded_files_hold_whole_copies(tmp_path):
    # Without shard= every rank's file holds the whole state: what the
    # test above shows is not so.
    result = str(tmp_path / 'final.npz')
    mpirun(['--out', str(tmp_path / 'snap'), '--result', result])
    files = [np.load(p) for p in _rank_files(str(tmp_path / 'snap'), 24)]
    whole = _whole_states(result)
    for f in files:
        assert RANGES not in f.files and MODEL_RANGES not in f.files
        for key, value in whole.items():
            assert f[key].shape == value.shape


_FIRST_RUNS = {}


def _first_run(tmp_path_factory, ranks, opts, whole):
    """The snapshot folder of a run stopped at iteration 8 (cached: three
    tests resume from the same 2-rank shard='optimizer' run)."""
    key = (ranks, tuple(opts), whole)
    if key not in _FIRST_RUNS:
        d = tmp_path_factory.mktemp('first')
        extra = ['--whole-snapshots'] if whole else []
        mpirun(['--out', str(d / 'snap'), '--result', str(d / 'final.npz')]
               + opts + extra + ['--stop-at', '8'], ranks=ranks)
        _FIRST_RUNS[key] = str(d / 'snap')
    return _FIRST_RUNS[key]


def _resume(tmp_path, name, first, then, whole=False, factory=None):
    """Runs ``first`` (stopping at iteration 8), then ``then`` from its
    snapshot (a copy of it); returns the result file and the second run's
    output."""
    d = tmp_path / name
    result = str(d / 'final.npz')
    args = ['--out', str(d / 'snap'), '--result', result]
    ranks, opts = first
    shutil.copytree(_first_run(factory, ranks, opts, whole), str(d / 'snap'))
    files = [np.load(p) for p in _rank_files(str(d / 'snap'), 8)]
    assert len(files) == ranks
    assert all((RANGES in f.files) != whole for f in files)
    if not whole:
        _model_slices_cover_each_parameter_once(files)
    ranks, opts = then
    return result, mpirun(args + opts, ranks=ranks)


def test_resume_on_fewer_ranks_from_shards(tmp_path, tmp_path_factory):
    # 4 ranks stop at iteration 8 (a quarter of each state per file), 2
    # ranks go on from there: the same bits as when the 4-rank files held
    # whole states.
    steps = ((4, ['--shard', 'optimizer']), (2, ['--shard', 'optimizer']))
    result, out = _resume(tmp_path, 'sharded', *steps,
                          factory=tmp_path_factory)
    assert 'written by 4 ranks on 2' in out, out
    ref, _ = _resume(tmp_path, 'whole', *steps, whole=True,
                     factory=tmp_path_factory)
    assert_bit_identical(result, ref)


def test_resume_on_fewer_ranks_from_parameter_shards(tmp_path,
                                                    tmp_path_factory):
    # shard='parameters' at 4 ranks wrote each rank's own pieces of the
    # parameters (a quarter each): 2 ranks go on from them, exactly.
    steps = ((4, ['--shard', 'parameters']), (2, ['--shard', 'parameters']))
    result, out = _resume(tmp_path, 'sharded', *steps,
                          factory=tmp_path_factory)
    assert 'written by 4 ranks on 2' in out, out
    ref, _ = _resume(tmp_path, 'whole', *steps, whole=True,
                     factory=tmp_path_factory)
    assert_bit_identical(result, ref)


def test_resume_on_more_ranks_from_shards(tmp_path, tmp_path_factory):
    # 2 -> 4 (a host came back): each new rank rebuilds from both files.
    steps = ((2, ['--shard', 'optimizer']), (4, ['--shard', 'optimizer']))
    result, out = _resume(tmp_path, 'sharded', *steps,
                          factory=tmp_path_factory)
    assert 'written by 2 ranks on 4' in out, out
    ref, _ = _resume(tmp_path, 'whole', *steps, whole=True,
                     factory=tmp_path_factory)
    assert_bit_identical(result, ref)


def test_a_kill_while_a_sharded_snapshot_is_written(tmp_path,
                                                    tmp_path_factory):
    # Rank 1 is killed after writing its temporary file of iteration 8:
    # that snapshot never completes, the restart resumes from 4.
    code, out, result = run_case(tmp_path, {'shard': 'optimizer'},
                                 [('kill_temp', 8, 0, 1)])
    assert [i[:4] for i in injections(out)] == [('kill_temp', 8, 1, 0)], out
    assert [(a, f) for _, a, _, f, _ in trainings(out)] == [
        (0, None), (1, 4)], out
    assert_finished(code, out)
    assert_bit_identical(result, reference(tmp_path_factory,
                                           shard='optimizer'))



def test_a_truncated_shard_file_is_refused(tmp_path, tmp_path_factory):
    # Rank 1's shard file of iteration 8 loses its second half (rank 1
    # then raises, so the job restarts): the restart refuses that snapshot,
    # naming the file, resumes from 4 and still ends bit for bit on the
    # uninterrupted run.  (No rank could rebuild its states from the other
    # files: each holds only its own slices.)
    job = {'shard': 'parameters'}
    code, out, result = run_case(tmp_path, job, [('truncate', 10, 0, 1)])
    assert [i[:4] for i in injections(out)] == [('truncate', 10, 1, 0)], out
    m = re.search(r'truncated \S+snapshot_iter_00000008\S+rank1\.npz '
                  r'\((\d+) -> (\d+) bytes\)', out)
    assert m and int(m.group(2)) == int(m.group(1)) // 2, out
    assert re.search(r'SnapshotWarning: auto_snapshot: skipping the snapshot '
                     r'of iteration 8 .*rank 1: \w+: rank1.npz', out), out
    assert [(a, f) for _, a, _, f, _ in trainings(out)] == [
        (0, None), (1, 4)], out
    assert_finished(code, out)
    assert_bit_identical(result, reference(tmp_path_factory, **job))

def test_resume_into_an_unsharded_optimizer(tmp_path, tmp_path_factory):
    # Written sharded at 2 ranks, read by shard=None at 2 ranks: the
    # states are rebuilt whole from both files.
    steps = ((2, ['--shard', 'optimizer']), (2, []))
    result, _ = _resume(tmp_path, 'sharded', *steps,
                        factory=tmp_path_factory)
    ref, _ = _resume(tmp_path, 'whole', *steps, whole=True,
                     factory=tmp_path_factory)
    assert_bit_identical(result, ref)


def test_resume_with_another_layout_at_the_same_rank_count(
        tmp_path, tmp_path_factory):
    # shard_unit changes the ranges each rank owns: the slices read are
    # gathered once and cut anew (the same bits as from whole states).
    steps = ((2, ['--shard', 'optimizer']),
             (2, ['--shard', 'optimizer', '--shard-unit', 'parameter']))
    result, _ = _resume(tmp_path, 'sharded', *steps,
                        factory=tmp_path_factory)
    ref, _ = _resume(tmp_path, 'whole', *steps, whole=True,
                     factory=tmp_path_factory)
    assert_bit_identical(result, ref)


def _consolidate(*args):
    return subprocess.run(
        [sys.executable, '-m', 'chainermn_overlap.snapshot', 'consolidate']
        + list(args), cwd=ROOT, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=120)


def test_consolidate_writes_one_file_of_whole_states(tmp_path):
    snap = str(tmp_path / 'snap')
    result = str(tmp_path / 'final.npz')
    mpirun(['--out', snap, '--result', result, '--shard', 'optimizer'])
    out = str(tmp_path / 'whole.npz')
    proc = _consolidate(snap, '--out', out)
    assert proc.returncode == 0, proc.stdout
    assert 'iteration 24' in proc.stdout, proc.stdout
    data = np.load(out)
    assert RANGES not in data.files
    assert not [k for k in data.files if k.startswith('auto_snapshot/')]
    for key, value in _whole_states(result).items():
        assert data[key].tobytes() == value.tobytes(), key
    # The parameters, written in slices, are whole again.
    assert MODEL_RANGES not in data.files
    model = {k: data[k] for k in data.files if k.startswith(MODEL)}
    assert model and all(v.ndim >= 1 for v in model.values())
    assert data[MODEL + 'predictor/l2/W'].shape == (32, 32)
    # ChainerMN's optimizer (any Chainer optimizer) loads it.
    check = (
        'import sys, chainer, numpy as np\n'
        'sys.path.insert(0, "tests/unit")\n'
        'from restart_job import MLP\n'
        'm = chainer.links.Classifier(MLP(None))\n'
        'o = chainer.optimizers.MomentumSGD(0.05)\n'
        'o.setup(m)\n'
        'chainer.serializers.load_npz(sys.argv[1], o, path="{}")\n'
        'print("t", o.t)\n'.format(OPT))
    proc = subprocess.run([sys.executable, '-c', check, out], cwd=ROOT,
                          text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=120)
    t = int(np.load(result + '.opt.npz')['t'])
    assert t > 0
    assert proc.returncode == 0 and 't {}'.format(t) in proc.stdout, \
        proc.stdout


def test_consolidate_refuses_a_damaged_snapshot_without_a_traceback(
        tmp_path):
    snap = tmp_path / 'snap'
    proc = _consolidate(str(snap))
    assert proc.returncode == 2 and 'no complete snapshot' in proc.stdout
    assert 'Traceback' not in proc.stdout
    result = str(tmp_path / 'final.npz')
    mpirun(['--out', str(snap), '--result', result, '--shard', 'optimizer',
            '--stop-at', '4'])
    path = _rank_files(str(snap), 4)[1]
    with open(path, 'r+b') as f:
        f.seek(200)
        f.write(b'\0' * 64)
    proc = _consolidate(str(snap))
    assert proc.returncode == 2, proc.stdout
    assert 'corrupt' in proc.stdout and 'rank1.npz' in proc.stdout
    assert 'Traceback' not in proc.stdout
