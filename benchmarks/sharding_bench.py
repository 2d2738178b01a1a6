"""What sharding saves and costs: bytes per rank, and speed on the test bed.

Run (from the repository root; the speed part needs root for the bed)::

    python -m benchmarks.sharding_bench [--skip-speed] [--ranks 1 2 4]

Memory (``mpiexec -n N`` on this machine, N = 1, 2, 4): the 37.7 M-parameter
MLP of :mod:`benchmarks.harness.workloads` with Adam, batch 8 (activations are
about 1 MB: the parameters dominate).  Each rank counts with ``tracemalloc``
(numpy's allocations, after ``gc.collect()``) everything allocated since
before the model was built: *persistent* bytes after an update (parameters,
gradients, optimizer state, buffers), and the *peak* during a step.  For
``wait='forward'`` both right after ``update()`` (reductions in flight
counted) and after ``synchronize()``.  Modes: ChainerMN's
``create_multi_node_optimizer``, ours unsharded, and ``shard='optimizer'``,
``'gradients'``, ``'parameters'`` (its default ``shard_prefetch='auto'``,
and also ``None`` and the least: :func:`stage3_options`).  The ideal
bytes per parameter are
``16`` (ChainerMN), ``4 + 4 + 8/N``, ``4 + 12/N`` and ``16/N``.

Speed (2 ranks on the network test bed, each pinned to a core, link
calibrated so that ChainerMN's blocking optimizer reaches the anchor's
0.667 on the model, as ``benchmarks/overlap_bench.py`` does): the MLP with
Adam (batch 512 per rank, so that a step computes for seconds) and
ResNet-50 with MomentumSGD (batch 4 at 224 px).  One job per model runs
one rank alone, ours unsharded and each sharding, all with
``wait='forward'``, interleaved in rounds (:mod:`benchmarks.harness.trainer`):
each figure is the median over rounds with its 95 % bootstrap interval,
and each sharding's difference to the unsharded optimizer is paired by
round.

Writes ``benchmarks/results/sharding.json`` and ``sharding.png``.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402

MODULE = 'benchmarks.sharding_bench'
RESULT_TAG = 'SHARDING_BENCH_RESULT '
MEMORY_MODES = ['chainermn', 'none', 'optimizer', 'gradients', 'parameters',
                'gradients_8MiB', 'parameters_unbounded', 'parameters_lean']
# Stage 3 with other budgets than the default (shard_prefetch='auto', no
# bound on gradients in flight): no bound on whole parameters either, and
# the least (one bucket fetched ahead, two of gradients in flight, as
# before shard_prefetch); the options are the trainer's for the same modes.
STAGE3_VARIANTS = ('unbounded', 'lean')


def stage3_options(variant):
    """The ``shard_*`` options of stage 3's ``variant``."""
    from benchmarks.harness import trainer
    opts = trainer.WIRE_OPTIONS['overlap_forward_shard_parameters_'
                                + variant]()
    del opts['shard']
    return opts
# '<shard>_<size>': that shard with shard_in_flight=<size> ('gradients_8MiB':
# two 4 MiB chunks; the default has no bound for 'gradients').
SPEED_MODES = ['alone', 'overlap_forward', 'overlap_forward_shard_optimizer',
               'overlap_forward_shard_gradients',
               'overlap_forward_shard_parameters',
               'overlap_forward_shard_parameters_unbounded',
               'overlap_forward_shard_parameters_lean']


def ideal(mode, n):
    """Ideal persistent bytes per parameter with Adam in float32 (a bound on
    gradients in flight, ``'<shard>_<size>'``, does not change it)."""
    return {'chainermn': 16.0, 'none': 16.0, 'optimizer': 8 + 8.0 / n,
            'gradients': 4 + 12.0 / n,
            'parameters': 16.0 / n}[mode.partition('_')[0]]


# ----------------------------------------------------------------------------
# Memory worker: runs under mpiexec on this machine.

def _measure(mode, wait, comm, cfg, x, t):
    import tracemalloc
    import chainer
    import chainer.functions as F
    import chainermn
    import chainermn_overlap
    from benchmarks.harness import workloads
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    model = workloads.build_model('mlp')
    nparams = sum(p.size for p in model.params())
    actual = chainer.optimizers.Adam(alpha=1e-4)
    if mode == 'chainermn':
        opt = chainermn.create_multi_node_optimizer(actual, comm)
    else:
        shard, _, variant = mode.partition('_')
        opt = chainermn_overlap.create_overlapped_optimizer(
            actual, comm, wait=wait, shard=None if mode == 'none' else shard,
            **(stage3_options(variant) if variant in STAGE3_VARIANTS
               else {'shard_in_flight': variant or 'auto'}))
    opt.setup(model)

    def lossfun():
        return F.softmax_cross_entropy(model(x), t)
    for _ in range(cfg['warmup']):
        opt.update(lossfun)
    # No synchronize() here: with shard='parameters' it would make every
    # parameter whole until the next update.
    comm.mpi_comm.Barrier()
    gc.collect()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    opt.update(lossfun)
    gc.collect()
    after, peak = tracemalloc.get_traced_memory()
    out = {'bytes_per_param_after_update': (after - base) / nparams,
           'peak_bytes_per_param': (peak - base) / nparams,
           'peak_above_persistent_bytes_per_param': (peak - before)
           / nparams}
    if hasattr(opt, 'synchronize'):
        opt.synchronize()
        gc.collect()
        out['bytes_per_param_after_synchronize'] = (
            tracemalloc.get_traced_memory()[0] - base) / nparams
    if hasattr(opt, 'close'):
        opt.close()
    del opt, model
    gc.collect()
    return nparams, out


def memory_worker(cfg):
    import tracemalloc
    import numpy as np
    import chainermn
    from benchmarks.harness import workloads
    comm = chainermn.create_communicator('naive')
    rng = np.random.RandomState(1 + comm.rank)
    x, t = workloads.synthetic_batch(rng, cfg['batch'], 32)
    tracemalloc.start()
    rows = {}
    for mode in MEMORY_MODES:
        for wait in (('update',) if mode == 'chainermn'
                     else ('update', 'forward')):
            nparams, row = _measure(mode, wait, comm, cfg, x, t)
            # The largest rank's figures (the one that limits a job).
            every = comm.mpi_comm.allgather(row)
            rows['{}:{}'.format(mode, wait)] = {
                k: max(r[k] for r in every) for k in row}
    if comm.rank == 0:
        launch.emit_result(RESULT_TAG, {'ranks': comm.size,
                                        'parameters': nparams,
                                        'rows': rows})


def run_memory(ranks, cfg, log):
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    out = {}
    for n in ranks:
        cmd = [mpiexec, '-n', str(n)] + launch.worker_command(
            MODULE, dict(cfg, phase='memory'))
        log('memory at {} rank(s)'.format(n))
        proc = subprocess.run(cmd, env=dict(os.environ,
                                            **launch.worker_env()),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError('memory run at {} ranks failed:\n{}'.format(
                n, proc.stderr[-3000:]))
        res = launch.read_result(proc.stdout, RESULT_TAG,
                                 'memory at {} ranks'.format(n))
        for key, row in res['rows'].items():
            row['ideal_bytes_per_param'] = ideal(key.split(':')[0], n)
            log('  {:22s} {:6.2f} after update, {:6.2f} after sync, peak '
                '{:6.2f} (ideal {:5.2f})'.format(
                    key, row['bytes_per_param_after_update'],
                    row.get('bytes_per_param_after_synchronize',
                            float('nan')),
                    row['peak_bytes_per_param'],
                    row['ideal_bytes_per_param']))
        out[str(n)] = res
    return out


def worker(cfg):
    if cfg.get('phase') == 'memory':
        memory_worker(cfg)


# ----------------------------------------------------------------------------
# Speed on the bed.

def run_speed(models, cfg, log):
    out = {}
    for model, optimizer in models:
        try:
            out[model] = speed_of(model, optimizer, cfg, log)
        except RuntimeError as e:
            # A job that failed (or hung until the optimizer's watchdog
            # ended it) is recorded with the end of its output, and the
            # next model still runs.
            tail = str(e)[-3000:]
            log('{} ({}): FAILED: {}'.format(model, optimizer,
                                            tail.splitlines()[0]))
            out[model] = {'optimizer': optimizer, 'failed': tail}
    return out


def speed_of(model, optimizer, cfg, log):
    """Step time and scalability of every mode of :data:`SPEED_MODES`
    for one model, on the bed at 2 ranks, calibrated link."""
    from benchmarks.harness import bedrun as ob
    from benchmarks.harness import stats
    mlp = model == 'mlp'
    c = dict(cfg, model=model, optimizer=optimizer,
             insize=32 if mlp else cfg['insize'],
             batch=cfg['mlp_batch'] if mlp else cfg['batch'],
             trace=None)
    t_compute = ob.measure_alone(c)
    nbytes = ob.gradient_bytes(model)
    log('{} ({}): {:.3f} s alone, {:.1f} MB of gradients'.format(
        model, optimizer, t_compute, nbytes / 1e6))
    rate, calibration = ob.calibrate(c, t_compute, nbytes, log)
    modes = cfg.get('modes') or SPEED_MODES
    run = ob.run_bed(rate, dict(c, modes=modes), t_compute, log)
    rows = {}
    for mode in modes:
        s = run['modes'][mode]
        rows[mode] = {'scalability': s.get('scalability'),
                      'scalability_ci': s.get('scalability_ci'),
                      'scalability_rounds': s.get('scalability_rounds'),
                      'it_per_s': s['it_per_s_median'],
                      'step_seconds': 1.0 / s['it_per_s_median'],
                      'hidden_fraction': (s.get('communication_stats')
                                          or {}).get('hidden_fraction')}
        log('  {:34s} {:.3f} s/it, scalability {}'.format(
            mode, rows[mode]['step_seconds'],
            '{:.3f} [{:.3f}, {:.3f}]'.format(
                rows[mode]['scalability'], *rows[mode]['scalability_ci'])
            if rows[mode]['scalability'] else '-'))
    base = rows[modes[1]]['scalability_rounds']
    for mode in modes[2:]:
        # Paired by round: the difference to the unsharded optimizer
        # (the second mode) measured next to it, with its interval.
        cmp = stats.paired(base, rows[mode]['scalability_rounds'])
        rows[mode]['minus_unsharded'] = cmp['difference']['median']
        rows[mode]['minus_unsharded_ci'] = cmp['difference']['ci']
        log('  {:34s} minus unsharded {}'.format(
            mode, stats.fmt(cmp['difference'])))
    return {'optimizer': optimizer, 'rate_bit_per_s': rate,
            't_compute_alone_s': t_compute, 'gradient_bytes': nbytes,
            'calibration': calibration, 'rows': rows, 'run': run}


def plot(result, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    mem = result['memory']
    fig, ax = plt.subplots(figsize=(9, 4))
    ranks = sorted(mem, key=int)
    modes = [m + ':update' for m in MEMORY_MODES]
    width = 0.8 / len(modes)
    for i, key in enumerate(modes):
        xs = [j + i * width for j in range(len(ranks))]
        ax.bar(xs, [mem[n]['rows'][key]['bytes_per_param_after_update']
                    for n in ranks], width, label=key.split(':')[0])
        ax.scatter(xs, [mem[n]['rows'][key]['ideal_bytes_per_param']
                        for n in ranks], marker='_', s=200, color='k')
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ranks))])
    ax.set_xticklabels(['{} rank(s)'.format(n) for n in ranks])
    ax.set_ylabel('bytes per parameter held (Adam)')
    ax.set_title('Persistent bytes per rank after update(); black: ideal')
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    if launch.dispatch_worker(argv, worker):
        return 0
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--ranks', type=int, nargs='+', default=[1, 2, 4])
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--skip-speed', action='store_true')
    p.add_argument('--speed-models', nargs='+',
                   default=['mlp:adam', 'resnet50:momentum'])
    p.add_argument('--insize', type=int, default=224)
    # The MLP moves 151 MB of gradients per step: a batch that gives it
    # seconds of compute keeps the calibrated link inside the rates the
    # bed shapes faithfully (below about 1 Gbit/s).
    p.add_argument('--mlp-batch', type=int, default=512)
    p.add_argument('--iterations', type=int, default=3,
                   help='timed iterations per mode and round')
    p.add_argument('--rounds', type=int, default=8)
    p.add_argument('--speed-modes', nargs='+', default=None,
                   help='modes of the speed run (default: alone, '
                   'unsharded, each stage); the first must be alone, '
                   'the second the unsharded one the others are compared '
                   'to')
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'sharding.json'))
    args = p.parse_args(argv)
    t0 = time.time()

    def log(msg):
        sys.stdout.write('[{:6.0f} s] {}\n'.format(time.time() - t0, msg))
        sys.stdout.flush()
    result = {'benchmark': 'sharded optimizer state, gradients, parameters',
              'machine': machine_description(),
              'config': vars(args)}
    result['memory'] = run_memory(args.ranks, {'batch': args.batch,
                                               'warmup': args.warmup}, log)
    if not args.skip_speed:
        cfg = {'batch': 4, 'mlp_batch': args.mlp_batch,
               'iterations': args.iterations,
               'warmup': args.warmup, 'rounds': args.rounds,
               'insize': args.insize, 'modes': args.speed_modes}
        models = [tuple(m.split(':')) for m in args.speed_models]
        result['speed'] = run_speed(models, cfg, log)
    result['seconds'] = time.time() - t0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    try:
        plot(result, os.path.splitext(args.out)[0] + '.png')
    except ImportError:
        log('matplotlib missing: no plot')
    log('saved ' + args.out)
    failed = [m for m, r in result.get('speed', {}).items()
              if 'failed' in r]
    if failed:
        log('the speed run of {} failed (recorded in the JSON)'.format(
            ', '.join(failed)))
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
