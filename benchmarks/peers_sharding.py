"""Our sharding against PyTorch's ZeRO and FSDP on one bed, in one run.

Run (as root, from the repository root; ``make bench-peers`` runs it after
the DDP study, ``make bench-peers-sharding`` alone, both building the
PyTorch environment ``.venv-peers`` first)::

    python -m benchmarks.peers_sharding [--model resnet18 --batch 8
        --insize 128] [--rate 1gbit] [--skip-memory | --skip-speed]

Both frameworks train the same ResNet (ResNet-18 at 128 px by default;
:mod:`benchmarks.harness.torch_models` mirrors our Chainer model parameter
for parameter) with the same optimizer, Adam at lr 1e-4 (8 bytes of state
per parameter on both sides), on two ranks, by ZeRO stage:

* ours (:mod:`benchmarks.harness.trainer`, ``wait='forward'``, the
  library's default buckets and ``shard_*`` settings): ``alone``, unsharded
  (``overlap_forward``) and ``shard='optimizer'``, ``'gradients'``,
  ``'parameters'`` (stages 1 to 3), and ``'parameters'`` with
  ``shard_prefetch=None``, which shards as FSDP's grad-op modes do
  (parameters sharded between steps, whole from forward through
  backward) and is paired with them besides stage 2;
* PyTorch (:mod:`benchmarks.harness.peers_torch_shard`, gloo, each peer's
  default bucket and prefetch settings, recorded in the result): ``alone``,
  DDP with Adam (unsharded), ``ZeroRedundancyOptimizer`` with and without
  ``overlap_with_ddp`` (stage 1), FSDP2 and FSDP1 without resharding after
  forward (stage 2: ``reshard_after_forward=False``, ``SHARD_GRAD_OP``) and
  with it (stage 3: ``True``, ``FULL_SHARD``).  A peer that does not run
  on CPU/gloo keeps its row with its error (``zero1_overlap``: torch
  refuses the overlapping hook on gloo).

**Speed**, as :mod:`benchmarks.peers_bench` measures against DDP: the link
is calibrated with ours (ChainerMN's blocking optimizer at the anchor's
0.667, :func:`benchmarks.harness.bedrun.calibrate`) or set with
``--rate``; PyTorch's batch is compute-matched (the smallest whose
single-rank step takes at least 97 % of ours); both jobs start at once on
one bed and take turns round by round
(:mod:`benchmarks.harness.interleave`).  Each side's scalability is against
its own ``alone`` in the same round; each figure is the median over rounds
with its 95 % bootstrap interval, and ours minus theirs is paired by round
for: unsharded vs ``ddp_adam``; stage 1 vs ``zero1`` and
``zero1_overlap``; stage 2 vs ``fsdp2_grad_op`` and ``fsdp1_grad_op``;
stage 3 vs ``fsdp2_full`` and ``fsdp1_full``.

**Memory**, measured the same way on both sides, on this machine (no bed):
one short job per side and mode, each in a fresh pair of processes
(``mpiexec -n 2``), batch 2 at 64 px on both sides, so that activations are
small against the parameters (their estimate is recorded: the bytes
autograd saves for backward, per parameter).  Per rank, from
``/proc/self/status``: the baseline ``VmRSS`` after the imports, the
input batch and two updates of a tiny network in the same mode (our small
ResNet, PyTorch's one-block twin: what a library maps once per process,
code pages, kernels, thread pools, about 50 MB for torch and little for
ours, goes into the baseline rather than onto the parameters;
``--no-code-warmup`` leaves it out), before the model exists; then the
model and optimizer, 3 updates; *persistent* = ``VmRSS`` after an update (after
``gc.collect()``) minus the baseline; *peak* = ``VmHWM`` during one more
update, the peak reset just before it (``clear_refs`` 5), minus the
baseline.  Both in bytes per parameter per rank, the larger rank's
reported, next to the ideal of the stage (Adam in float32 at N ranks:
unsharded 16, stage 1 8 + 8/N, stage 2 4 + 12/N, stage 3 16/N).  Both sides
run under ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every block of
64 KiB or more on its own and unmaps it when freed, so resident memory is
what is held, not what a heap kept after freeing.  Ours is measured
right after ``update()``, never after ``synchronize()`` (which makes a
stage-3 rank's parameters whole until the next update); its reductions
still in flight count.

Writes ``benchmarks/results/peers_sharding.json`` (``--out`` elsewhere):
the machine, the configuration, the link, both batches, every mode's
rounds and intervals, the peers' errors, the memory rows and, per pair,
the ``stages`` rows that the table prints and the docs show.
"""
import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks import peers_bench  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    bedrun, interleave, launch, peers_torch_shard, stats, trainer)
from benchmarks.harness.machine import machine_description  # noqa: E402
from testbed import netbed  # noqa: E402

MODULE = 'benchmarks.peers_sharding'
PEER_MODULE = peers_torch_shard.MODULE
MEMORY_TAG = peers_torch_shard.MEMORY_TAG
OURS = ['alone', 'overlap_forward', 'overlap_forward_shard_optimizer',
        'overlap_forward_shard_gradients', 'overlap_forward_shard_parameters',
        'overlap_forward_shard_parameters_unbounded']
THEIRS = ['alone', 'ddp_adam', 'zero1', 'zero1_overlap', 'fsdp2_grad_op',
          'fsdp1_grad_op', 'fsdp2_full', 'fsdp1_full']
OUR_STAGE = {'alone': None, 'overlap_forward': 0,
             'overlap_forward_shard_optimizer': 1,
             'overlap_forward_shard_gradients': 2,
             'overlap_forward_shard_parameters': 3,
             'overlap_forward_shard_parameters_unbounded': 3}
STAGE_NAMES = {None: 'one rank alone', 0: 'unsharded',
               1: 'stage 1 (optimizer state)', 2: 'stage 2 (+ gradients)',
               3: 'stage 3 (+ parameters)'}
# (theirs, ours): the comparison is B - A = ours - theirs.
PAIRS = [('ddp_adam', 'overlap_forward'),
         ('zero1', 'overlap_forward_shard_optimizer'),
         ('zero1_overlap', 'overlap_forward_shard_optimizer'),
         ('fsdp2_grad_op', 'overlap_forward_shard_gradients'),
         ('fsdp1_grad_op', 'overlap_forward_shard_gradients'),
         ('fsdp2_full', 'overlap_forward_shard_parameters'),
         ('fsdp1_full', 'overlap_forward_shard_parameters')]
# Pairs across the stages' names that do the same: FSDP's grad-op modes
# give the whole parameters back after backward (sharded between steps) and
# keep them whole from forward through backward, which is our stage 3 with
# shard_prefetch=None, besides our stage 2 (whole between steps too).
SAME_SHARDING = [
    ('fsdp2_grad_op', 'overlap_forward_shard_parameters_unbounded'),
    ('fsdp1_grad_op', 'overlap_forward_shard_parameters_unbounded')]
PAIRS += SAME_SHARDING
# The same glibc and thread settings for both sides' memory jobs.
MEMORY_ENV = {'MALLOC_MMAP_THRESHOLD_': '65536', 'OMP_NUM_THREADS': '1',
              'OPENBLAS_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}
OUR_SETTINGS = ("wait='forward'; the library's defaults for bucket_size, "
                "shard_in_flight and stage 3's prefetch budget ('auto'), "
                "and shard_prefetch=None in "
                "overlap_forward_shard_parameters_unbounded")


def check_pairs(pairs=PAIRS):
    """Raises ValueError when a pair compares different ZeRO stages or
    names a mode neither side has."""
    for theirs, ours in pairs:
        if theirs not in THEIRS or ours not in OURS:
            raise ValueError('pair ({}, {}) names a mode outside THEIRS {} '
                             'or OURS {}'.format(theirs, ours, THEIRS, OURS))
        if peers_torch_shard.STAGE[theirs] != OUR_STAGE[ours] and \
                (theirs, ours) not in SAME_SHARDING:
            raise ValueError('pair ({}, {}) compares stage {} with stage {}:'
                             ' pair modes of the same stage'.format(
                                 theirs, ours, peers_torch_shard.STAGE[
                                     theirs], OUR_STAGE[ours]))


def selection(stages=(0, 1, 2, 3)):
    """The modes and pairs of the ZeRO ``stages`` asked for (0:
    unsharded), ``alone`` first on both sides.

    Returns:
        tuple: (our modes, PyTorch's modes, pairs).
    """
    bad = [s for s in stages if s not in (0, 1, 2, 3)]
    if bad:
        raise ValueError('stages {} do not exist: choose among 0 '
                         '(unsharded), 1, 2 and 3'.format(bad))
    ours = ['alone'] + [m for m in OURS[1:] if OUR_STAGE[m] in stages]
    theirs = ['alone'] + [m for m in THEIRS[1:]
                          if peers_torch_shard.STAGE[m] in stages]
    pairs = [(t, o) for t, o in PAIRS if o in ours and t in theirs]
    return ours, theirs, pairs


def ideal(stage, n):
    """Ideal bytes per parameter per rank with Adam in float32 at ``n``
    ranks: parameters, gradients and two moments, as the stage shards
    them (``None``, one rank alone, holds them all)."""
    return {None: 16.0, 0: 16.0, 1: 8 + 8.0 / n, 2: 4 + 12.0 / n,
            3: 16.0 / n}[stage]


def memory_row(raw, stage):
    """Bytes per parameter of one mode from its ranks' raw rows.

    Args:
        raw (list): per rank, ``base_kb``, ``rss_kb``, ``hwm_kb`` and
            ``parameters`` (or ``error``), as the memory workers print.
        stage: the mode's ZeRO stage (for the ideal).

    Returns:
        dict: ``persistent_bytes_per_param`` and ``peak_bytes_per_param``
        (the larger rank's), ``ideal_bytes_per_param``, ``by_rank`` (the
        raw rows) and, if any rank failed, ``error`` (the first) instead of
        the figures.
    """
    out = {'ideal_bytes_per_param': ideal(stage, len(raw)), 'by_rank': raw}
    errors = [r['error'] for r in raw if r.get('error')]
    if errors:
        out['error'] = errors[0]
        return out
    n = raw[0]['parameters']
    out['parameters'] = n
    out['persistent_bytes_per_param'] = max(
        (r['rss_kb'] - r['base_kb']) * 1024.0 / n for r in raw)
    out['peak_bytes_per_param'] = max(
        (r['hwm_kb'] - r['base_kb']) * 1024.0 / n for r in raw)
    return out


# ----------------------------------------------------------------------------
# Our memory worker: one mode, under mpiexec on this machine.

def memory_worker(cfg):
    """One mode of ours on every rank (see the module); rank 0 prints the
    memory result line, in the peer worker's form."""
    import numpy as np
    import chainer.functions as F
    import chainermn
    import chainermn_overlap  # noqa: F401  (an import, not the model's)
    from benchmarks.harness import workloads
    vm, reset_peak = peers_torch_shard.vm_status, peers_torch_shard.reset_peak
    comm = chainermn.create_communicator('naive')
    rng = np.random.RandomState(1 + comm.rank)
    x, t = workloads.synthetic_batch(rng, cfg['batch'], cfg['insize'])

    def lossfun_of(model):
        return lambda: F.softmax_cross_entropy(model(x), t)
    if cfg.get('code_warmup', True):
        # The mode's code paths once, on the small ResNet, as the peer's
        # worker does: what is mapped once per process is the baseline's.
        warm = trainer.make_optimizer(cfg['mode'], comm,
                                      dict(cfg, optimizer='adam'))
        warm.setup(workloads.build_model('small'))
        for _ in range(2):
            warm.update(lossfun_of(warm.target))
        if hasattr(warm, 'close'):
            warm.close()
        del warm
    gc.collect()
    row = {'rank': comm.rank, 'base_kb': vm()['VmRSS']}
    model = workloads.build_model(cfg['model'])
    row['parameters'] = int(sum(p.size for p in model.params()))
    opt = trainer.make_optimizer(cfg['mode'], comm,
                                 dict(cfg, optimizer='adam'))
    opt.setup(model)
    lossfun = lossfun_of(model)
    comm.mpi_comm.Barrier()
    # No synchronize(): with shard='parameters' it makes every parameter
    # whole until the next update; what an update leaves in flight counts.
    for _ in range(cfg['warmup']):
        opt.update(lossfun)
    gc.collect()
    row['rss_kb'] = vm()['VmRSS']
    reset_peak()
    opt.update(lossfun)
    row['hwm_kb'] = vm()['VmHWM']
    gc.collect()
    row['rss_after_kb'] = vm()['VmRSS']
    rows = comm.mpi_comm.gather(row, root=0)
    if hasattr(opt, 'close'):
        opt.close()
    if comm.rank == 0:
        launch.emit_result(MEMORY_TAG, {'mode': cfg['mode'],
                                        'ranks': comm.size, 'rows': rows})


def worker(cfg):
    if cfg.get('phase') == 'memory':
        memory_worker(cfg)


def memory_command(side, cfg, ranks=2):
    """``mpiexec -n ranks`` and the memory worker of ``side``."""
    mpiexec = os.path.join(launch.ROOT, '.venv', 'bin', 'mpiexec')
    if side == 'ours':
        cmd = launch.worker_command(MODULE, dict(cfg, phase='memory'))
    else:
        cmd = [peers_bench.PEERS_PYTHON, '-m', PEER_MODULE,
               peers_torch_shard.MEMORY_FLAG, json.dumps(cfg)]
    return [mpiexec, '-n', str(ranks)] + cmd


def run_memory(side, modes, stages, cfg, log, timeout=600):
    """Each of ``modes`` of ``side`` in a fresh pair of processes.

    Returns:
        dict: mode -> :func:`memory_row` (or ``error`` for a job that
        failed as a whole), with ``activation_bytes`` where measured.
    """
    out = {}
    env = dict(os.environ, **launch.worker_env())
    env.update(MEMORY_ENV)
    for mode in modes:
        c = dict(cfg, mode=mode, master_addr='127.0.0.1',
                 master_port=random.randint(20000, 40000), ifname='lo',
                 activations=side == 'theirs' and mode == 'alone')
        proc = subprocess.run(memory_command(side, c), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
        res = launch.find_result(proc.stdout, MEMORY_TAG)
        if proc.returncode != 0 or res is None:
            lines = (proc.stderr or proc.stdout or '').strip().splitlines()
            row = {'error': 'memory job failed (exit {}): {}'.format(
                proc.returncode, lines[-1] if lines else 'no output'),
                'stderr_tail': (proc.stderr or '')[-3000:]}
        else:
            row = memory_row(res['rows'], stages[mode])
            acts = [r['activation_bytes'] for r in res['rows']
                    if 'activation_bytes' in r]
            if acts:
                row['activation_bytes'] = acts[0]
        out[mode] = row
        log('  memory {:6s} {:34s} {}'.format(side, mode, memory_text(row)))
    return out


def memory_text(row):
    """``persistent 8.6, peak 12.1 (ideal 8.0) B/param`` or the error."""
    if row is None:
        return '-'
    if 'error' in row:
        return row['error']
    return 'persistent {:.1f}, peak {:.1f} (ideal {:.1f}) B/param'.format(
        row['persistent_bytes_per_param'], row['peak_bytes_per_param'],
        row['ideal_bytes_per_param'])


# ----------------------------------------------------------------------------
# The stages: one row per pair, what the table and the docs show.

def _scal(summary, mode):
    s = (summary or {}).get(mode)
    if not s or 'scalability_rounds' not in s:
        return None
    return stats.interval(s['scalability_rounds'])


def stage_rows(result):
    """Per pair of ``result['pairs']`` (after one rank alone): the stage,
    both modes, each side's scalability and ours minus theirs (intervals,
    None without a speed run), each side's memory row, the ideal bytes per
    parameter at 2 ranks, and the peer's error."""
    ours = (result.get('ours') or {}).get('modes')
    theirs = (result.get('theirs') or {}).get('modes')
    errors = (result.get('theirs') or {}).get('errors') or {}
    memory = result.get('memory') or {}
    rows = []
    for t, o in [('alone', 'alone')] + [tuple(p) for p in result['pairs']]:
        cmp = (result.get('comparison') or {}).get('{}/{}'.format(t, o), {})
        mem_t = (memory.get('theirs') or {}).get(t)
        error = errors.get(t) or (mem_t or {}).get('error')
        rows.append({
            'stage': OUR_STAGE[o], 'stage_name': STAGE_NAMES[OUR_STAGE[o]],
            'ours': o, 'theirs': t,
            'ours_scalability': _scal(ours, o),
            'theirs_scalability': None if errors.get(t) else _scal(theirs, t),
            'difference': (cmp.get('scalability') or {}).get('difference'),
            'speed_ratio': cmp.get('speed_ratio'),
            'theirs_error': error,
            'ideal_bytes_per_param': ideal(OUR_STAGE[o], 2),
            'ours_memory': (memory.get('ours') or {}).get(o),
            'theirs_memory': mem_t})
    return rows


def report(result, log):
    """The readable table of :func:`stage_rows`."""
    fmt = '{:<26} {:<14} {:>22} {:>22} {:>24} {:>12} {:>12} {:>5}'
    log(fmt.format('stage', 'PyTorch', 'ours', 'PyTorch', 'ours - theirs',
                   'ours B/p', 'theirs B/p', 'ideal'))

    def scal(iv):
        return stats.fmt(iv) if iv else '-'

    def mem(row):
        if not row or 'error' in row:
            return '-'
        return '{:.1f}/{:.1f}'.format(row['persistent_bytes_per_param'],
                                      row['peak_bytes_per_param'])
    for r in result['stages']:
        diff = r['difference']
        log(fmt.format(
            r['stage_name'], r['theirs'], scal(r['ours_scalability']),
            'FAILED' if r['theirs_error'] else scal(r['theirs_scalability']),
            scal(diff) if diff and diff['median'] is not None else '-',
            mem(r['ours_memory']), mem(r['theirs_memory']),
            '{:.1f}'.format(r['ideal_bytes_per_param'])))
    for r in result['stages']:
        if r['theirs_error']:
            log('{} did not run: {}'.format(r['theirs'], r['theirs_error']))
    log('B/p: bytes per parameter per rank, persistent/peak (larger rank); '
        'scalability against each side\'s own rank alone')


# ----------------------------------------------------------------------------
# Speed on the bed

def in_step(checksums):
    """Whether every rank had the same parameter sums in every round
    (``alone`` left out: each rank trains its own batch there)."""
    return all(a[m] == rnd[0][m] for rnd in checksums for a in rnd
               for m in a if m != 'alone')


def train_alike(checksums, rel=1e-6):
    """Whether every distributed mode's parameter sum stayed within
    ``rel`` of the first one's (``ddp_adam`` when it ran) in every round:
    they start from the same weights and take the same updates on the
    same batches, so sharding must change nothing but rounding.  None
    with fewer than two distributed modes."""
    out = None
    for rnd in checksums:
        sums = {m: v for m, v in rnd[0].items() if m != 'alone'}
        if len(sums) < 2:
            return None
        ref = sums.get('ddp_adam', next(iter(sums.values())))
        out = all(abs(v - ref) <= rel * abs(ref) for v in sums.values())
        if not out:
            return False
    return out


def run_speed(args, cfg, log):
    """Calibration, compute matching and the interleaved rounds."""
    ours_modes, theirs_modes, pairs = selection(args.stages)
    t_ours = bedrun.measure_alone(dict(cfg, modes=ours_modes))
    log('ours alone: {:.3f} s per step at batch {}'.format(t_ours,
                                                          args.batch))
    if args.peer_batch:
        peer_batch, matching = args.peer_batch, []
    else:
        peer_batch, matching = peers_bench.match_batch(
            cfg, t_ours, log, module=PEER_MODULE)
    log('PyTorch batch {} (compute-matched to ours)'.format(peer_batch))
    if args.rate:
        rate, calibration = netbed.parse_rate(args.rate), []
    else:
        rate, calibration = bedrun.calibrate(
            dict(cfg, modes=ours_modes), t_ours,
            bedrun.gradient_bytes(args.model), log)
    ours_cfg = dict(cfg, modes=ours_modes)
    theirs_cfg = dict(cfg, modes=theirs_modes, batch=peer_batch,
                      master_addr=None,
                      master_port=random.randint(20000, 40000),
                      ifname='eth0')
    # The longer job's round bounds a turn (PyTorch has more modes).
    per_turn = 2 * max(bedrun.expected_seconds(dict(c, rounds=1), t_ours)
                       for c in (ours_cfg, theirs_cfg))
    log('both at {:.1f} Mbit/s: {} rounds'.format(rate / 1e6, args.rounds))
    with netbed.NetBed(2, rate) as bed:
        theirs_cfg['master_addr'] = bed.addresses[0]
        record = bed.describe()
        jobs = {'ours': {'command': launch.worker_command(trainer.MODULE,
                                                          ours_cfg),
                         'env': launch.worker_env()},
                'theirs': {'command': peers_bench.peer_command(
                    theirs_cfg, PEER_MODULE), 'env': launch.worker_env()}}
        runs = interleave.run_interleaved(bed, jobs, args.rounds, per_turn,
                                          log)
    warm = runs['theirs']['warmup'][0]
    ran = [m for m in theirs_modes if m in warm['modes']]
    out = {'peer_batch': peer_batch, 'peer_batch_matching': matching,
           't_ours_alone_s': t_ours, 'rate_bit_per_s': rate,
           'calibration': calibration, 'bed': record,
           'peer_version': warm.get('version'),
           'ours': {'modes': interleave.job_summary(runs['ours']['rounds'],
                                                    ours_modes)},
           'theirs': {'modes': interleave.job_summary(
               runs['theirs']['rounds'], ran), 'errors': warm['errors'],
               # Per round, each rank's sum of parameters by mode.
               'param_checksums': [[a['param_checksums'] for a in rnd]
                                   for rnd in runs['theirs']['rounds']]}}
    out['checks'] = {
        'PyTorch ranks in step': in_step(out['theirs']['param_checksums']),
        'PyTorch modes train alike': train_alike(
            out['theirs']['param_checksums'])}
    for k, v in out['checks'].items():
        log('check {}: {}'.format(k, {True: 'yes', False: 'NO'}.get(v, v)))
    pairs = [(t, o) for t, o in [('alone', 'alone')] + pairs if t in ran]
    out['comparison'] = interleave.compare(out['theirs']['modes'],
                                           out['ours']['modes'], pairs)
    return out


def main(argv=None):
    if launch.dispatch_worker(argv, worker):
        return 0
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='resnet18',
                   choices=('resnet18', 'resnet50'))
    p.add_argument('--batch', type=int, default=8, help='our batch per rank')
    p.add_argument('--insize', type=int, default=128)
    p.add_argument('--peer-batch', type=int, default=None,
                   help='PyTorch\'s batch (default: compute-matched)')
    p.add_argument('--rounds', type=int, default=12)
    p.add_argument('--iterations', type=int, default=3)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--settle', type=int, default=1)
    p.add_argument('--rate', default=None,
                   help='link rate (default: calibrated with ours)')
    p.add_argument('--memory-batch', type=int, default=2)
    p.add_argument('--memory-insize', type=int, default=64)
    p.add_argument('--memory-warmup', type=int, default=3)
    p.add_argument('--stages', type=int, nargs='+', default=[0, 1, 2, 3],
                   help='ZeRO stages to run (0: unsharded; default all)')
    p.add_argument('--no-code-warmup', action='store_true',
                   help='memory: take the baseline before any update (the '
                   'libraries\' code and pools then count as the model\'s)')
    p.add_argument('--skip-speed', action='store_true',
                   help='memory only (no bed, no root needed)')
    p.add_argument('--skip-memory', action='store_true')
    p.add_argument('--out', default=None)
    args = p.parse_args(argv)
    out = args.out or os.path.join(launch.RESULTS, 'peers_sharding.json')
    t_start = time.time()

    def log(msg):
        sys.stdout.write('[{:6.0f} s] {}\n'.format(time.time() - t_start,
                                                   msg))
        sys.stdout.flush()

    check_pairs()
    ours_modes, theirs_modes, pairs = selection(args.stages)
    if not os.path.exists(peers_bench.PEERS_PYTHON):
        sys.stderr.write('peers_sharding: {} is missing: run make '
                         'bench-peers-sharding (it installs PyTorch there)\n'
                         .format(peers_bench.PEERS_PYTHON))
        return 2
    if not args.skip_speed:
        netbed.require_root()
    cfg = {'model': args.model, 'batch': args.batch, 'insize': args.insize,
           'iterations': args.iterations, 'warmup': max(2, args.warmup),
           'settle': args.settle, 'rounds': args.rounds, 'trace': None,
           'optimizer': 'adam'}
    result = {'benchmark': 'our sharding against PyTorch ZeRO and FSDP, '
                           'interleaved rounds',
              'machine': machine_description(), 'config': cfg,
              'settings': {'ours': OUR_SETTINGS,
                           'theirs': dict(peers_torch_shard.SETTINGS)},
              'stages_run': list(args.stages), 'pairs': pairs}
    if not args.skip_memory:
        mcfg = {'model': args.model, 'batch': args.memory_batch,
                'insize': args.memory_insize, 'warmup': args.memory_warmup,
                'code_warmup': not args.no_code_warmup}
        log('memory: batch {} at {} px, {} updates, then one measured; {}'
            .format(mcfg['batch'], mcfg['insize'], mcfg['warmup'],
                    ' '.join('{}={}'.format(k, v)
                             for k, v in sorted(MEMORY_ENV.items()))))
        mem = {'config': dict(mcfg, env=MEMORY_ENV, ranks=2),
               'ours': run_memory('ours', ours_modes, OUR_STAGE, mcfg,
                                  log),
               'theirs': run_memory('theirs', theirs_modes,
                                    peers_torch_shard.STAGE, mcfg, log)}
        acts = mem['theirs'].get('alone', {}).get('activation_bytes')
        n = mem['theirs'].get('alone', {}).get('parameters')
        if acts and n:
            mem['activation_bytes_estimate'] = acts
            mem['activation_bytes_per_param'] = acts / float(n)
            log('  activations saved for backward: {:.1f} MB, {:.2f} B/param'
                ' ({:.1%} of the unsharded 16)'.format(
                    acts / 1e6, acts / float(n), acts / float(n) / 16))
        result['memory'] = mem
    if not args.skip_speed:
        result.update(run_speed(args, cfg, log))
    result['stages'] = stage_rows(result)
    result['seconds'] = time.time() - t_start
    report(result, log)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, 'w') as f:
        json.dump(result, f, indent=1)
    log('saved ' + out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
