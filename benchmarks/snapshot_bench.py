"""Snapshots of sharded optimizers: bytes on disk and memory while saving.

Run (from the repository root)::

    python -m benchmarks snapshot [--ranks 4] [--hidden 2048]

Workload: an MLP 1024 -> H -> 1024 -> 10 (H = 2048: 4.2 M parameters,
16.8 MB in float32) with Adam (two state arrays per parameter, 33.6 MB),
trained two steps at ``--ranks`` ranks (``mpiexec`` on this machine), then
one :func:`~chainermn_overlap.extensions.auto_snapshot` snapshot written.
Modes: ours unsharded; ``shard='optimizer'`` and ``'parameters'``, each
with sharded snapshot files (each rank writes its slices of the states and
of the parameters) and, as before them, with whole states and parameters
in every file (the states gathered on every rank:
``--whole-snapshots`` of ``tests/unit/restart_job.py``, the same patch).

Reported per mode: bytes of the snapshot folder on disk, the optimizer
state's share of them in copies of the state (1.0: each state once), and
per rank the peak of ``tracemalloc`` (numpy's allocations, after
``gc.collect()``) during the write above what the rank held before it,
beside the optimizer's bucket size (the target: at most one bucket).

Writes ``benchmarks/results/snapshot.json``.
"""
import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tracemalloc

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402

MODULE = 'benchmarks.snapshot_bench'
RESULT_TAG = 'SNAPSHOT_BENCH_RESULT '
# (name, shard, sharded files)
MODES = [('unsharded', None, False),
         ('optimizer_whole_files', 'optimizer', False),
         ('optimizer', 'optimizer', True),
         ('parameters_whole_files', 'parameters', False),
         ('parameters', 'parameters', True)]
BUCKET = 4 << 20


def _folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(path) for f in files)


def worker(cfg):
    import numpy
    import chainer
    import chainer.links as L
    from chainer import training
    import chainermn
    import chainermn_overlap
    from chainermn_overlap import extensions
    from chainermn_overlap.optimizers.sharding import shards

    comm = chainermn.create_communicator('naive')
    if not cfg['sharded_files']:
        shards.saving = lambda optimizers: contextlib.nullcontext()
    numpy.random.seed(0)
    h = cfg['hidden']
    model = L.Classifier(chainer.Sequential(
        L.Linear(1024, h), chainer.functions.relu, L.Linear(h, 1024),
        chainer.functions.relu, L.Linear(1024, 10)))
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.Adam(), comm, bucket_size=BUCKET,
        shard=cfg['shard'])
    opt.setup(model)
    rng = numpy.random.RandomState(comm.rank)
    data = chainer.datasets.TupleDataset(
        rng.randn(16, 1024).astype(numpy.float32),
        rng.randint(0, 10, 16).astype(numpy.int32))
    it = chainer.iterators.SerialIterator(data, 8)
    trainer = training.Trainer(training.StandardUpdater(it, opt),
                               (3, 'iteration'), out=cfg['dir'])
    snap = extensions.auto_snapshot(comm, cfg['dir'],
                                    trigger=(10**6, 'iteration'))
    trainer.extend(snap)
    measured = {}

    @training.make_extension(trigger=(3, 'iteration'), priority=-200)
    def measure(trainer):
        if cfg['shard'] != 'parameters':
            # (With shard='parameters' synchronize() would fetch every
            # parameter whole before the write is measured: the write
            # synchronizes itself.)
            opt.synchronize()
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        snap.write(trainer)
        measured['peak'] = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
    trainer.extend(measure)
    trainer.run()
    peak = measured['peak']
    peaks = comm.mpi_comm.gather(peak, root=0)
    n_params = sum(p.size for p in model.params())
    opt.close()
    if comm.rank == 0:
        launch.emit_result(RESULT_TAG, {'peaks': peaks,
                                        'parameters': int(n_params)})


def run_mode(n, name, shard, sharded, hidden, log):
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    tmp = tempfile.mkdtemp(prefix='cmo_snapbench_')
    try:
        cfg = {'dir': tmp, 'shard': shard, 'sharded_files': sharded,
               'hidden': hidden}
        proc = subprocess.run(
            [mpiexec, '-n', str(n)] + launch.worker_command(MODULE, cfg),
            env=dict(os.environ, **launch.worker_env()),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError('{} at {} ranks failed:\n{}'.format(
                name, n, proc.stderr[-3000:]))
        res = launch.read_result(proc.stdout, RESULT_TAG, name)
        disk = _folder_bytes(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    p = res['parameters']
    params_bytes, state_bytes = 4 * p, 8 * p
    # Sharded files hold each parameter slice once (its owner's), whole
    # files the whole parameters (4 B each) each: the rest is the optimizer
    # state (and small entries: iterators, random states).
    state_on_disk = disk - (1 if sharded else n) * params_bytes
    row = {'shard': shard, 'sharded_files': sharded, 'disk_bytes': disk,
           'parameters': p, 'state_bytes': state_bytes,
           'state_copies_on_disk': state_on_disk / float(state_bytes),
           'disk_copies_of_params_and_state':
               disk / float(params_bytes + state_bytes),
           'save_peak_bytes_per_rank': res['peaks'],
           'save_peak_max_in_buckets': max(res['peaks']) / float(BUCKET),
           'bucket_bytes': BUCKET}
    log('  {:24s} disk {:7.1f} MB (state x{:4.2f}), save peak per rank '
        'max {:6.1f} MB = {:5.2f} buckets'.format(
            name, disk / 1e6, row['state_copies_on_disk'],
            max(res['peaks']) / 1e6, row['save_peak_max_in_buckets']))
    return row


def main(argv=None):
    if launch.dispatch_worker(argv, worker):
        return 0
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--ranks', type=int, default=4)
    p.add_argument('--hidden', type=int, default=2048)
    p.add_argument('--out', default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), 'results',
        'snapshot.json'))
    args = p.parse_args(argv)

    def log(msg):
        sys.stdout.write(msg + '\n')
        sys.stdout.flush()
    log('snapshot of an Adam MLP (hidden {}) at {} ranks'.format(
        args.hidden, args.ranks))
    rows = {name: run_mode(args.ranks, name, shard, sharded, args.hidden,
                           log)
            for name, shard, sharded in MODES}
    result = {'machine': machine_description(),
              'config': {'ranks': args.ranks, 'hidden': args.hidden,
                         'optimizer': 'Adam', 'bucket_bytes': BUCKET,
                         'memory': 'tracemalloc peak during '
                         'AutoSnapshot.write above the bytes held before',
                         'disk': 'bytes of the snapshot folder'},
              'rows': rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1, sort_keys=True)
    log('saved ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
