"""Scalability beyond two ranks: measured at 2-8 ranks on a time-dilated
bed, replayed and projected to 1,024 nodes with SimGrid.

Run (as root, from the repository root; ``make bench-scale`` installs
``python3-simgrid`` and runs the quick setting)::

    python -m benchmarks scale                      # quick: small model
    python -m benchmarks scale --full               # ResNet-50 and -18
    python -m benchmarks scale --validate-only [--full]
    python -m benchmarks scale --project-only --trace T.json

Phases:

1. *Dilation check*: 2 ranks at dilation k = 1, 2 and 4 (each rank a cgroup
   with ``0.8 / k`` of a core, the link at ``rate / k``:
   :mod:`testbed.cpuquota`), interleaved (one job per k per repetition, the
   order alternating); the per-round scalabilities of each k are pooled
   into a median and a 95 % interval.
2. *Measured*: N = 2, 4, 8 ranks, each at the smallest dilation that
   leaves 0.4 core free, ``alone`` (the one-rank reference, under the same
   quota, in the same job), ChainerMN's blocking optimizer, ours fp32,
   float16 wire and PowerSGD rank 4 (``wait='forward'``), paired rounds as
   :mod:`benchmarks.harness.trainer` runs them; the 2-rank job records the
   timeline of ours fp32.
3. *Trace*: that timeline becomes a replay trace
   (:mod:`benchmarks.scale.trace`).
4. *Replay*: SimGrid at the bed's link (rate, measured RTT / 2) for every
   measured N; the error against the bed is reported.
5. *Projection*: N = 16 ... 1,024 at 10, 25 and 100 Gb/s, with the compute
   (a) calibrated so that blocking gives 66.72 % at 16 nodes on 10 Gb/s,
   (b) of a published GPU-class iteration (:data:`benchmarks.scale.project.
   GPU_CLASS`).

Writes ``benchmarks/results/scale.json`` and ``scale.png``.
"""
import argparse
import json
import os
import sys
import tempfile
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import machine, stats  # noqa: E402
from benchmarks.harness.bedrun import (  # noqa: E402
    add_scalability, gradient_bytes, measure_alone, rate_for, run_on,
    summaries)
from benchmarks.harness.launch import RESULTS, ROOT  # noqa: E402
from benchmarks.scale import project as proj  # noqa: E402
from benchmarks.scale import trace as trace_mod  # noqa: E402
from testbed import cpuquota, netbed  # noqa: E402

# Two jobs per rank count, each with its own 'alone': eight ResNet-50
# ranks holding five optimizers each would not fit 24 GiB.
MODE_GROUPS = [['alone', 'blocking', 'overlap_forward'],
               ['alone', 'overlap_forward_float16',
                'overlap_forward_powersgd4']]
VALIDATION_MODES = ['alone', 'blocking', 'overlap_forward']
# MPICH over TCP moved data at 0.96 of the tbf rate on the bed.
EFFICIENCY = 0.96


def settings(args):
    """The configuration of a quick or full run."""
    if args.full:
        models = args.models or ['resnet50', 'resnet18']
        # The dilation check on ResNet-18: the same method at a third of
        # ResNet-50's compute.
        s = {'models': models, 'ranks': [2, 4, 8], 'ks': [1, 2, 4],
             'repeats': 3, 'rounds': 4, 'iterations': 3, 'warmup': 2,
             'validation_model': 'resnet18'}
    else:
        s = {'models': args.models or ['resnet_small'], 'ranks': [2, 4],
             'ks': [1, 2], 'repeats': 1, 'rounds': 2, 'iterations': 2,
             'warmup': 1, 'validation_model': 'resnet_small'}
    # Overrides, e.g. the full dilation check (k = 1, 2, 4, three repeats)
    # on the small ResNet: --full --validate-only --validation-model
    # resnet_small.
    for key in ('validation_model', 'repeats', 'rounds', 'insize', 'batch',
                'ranks'):
        if getattr(args, key, None) is not None:
            s[key] = getattr(args, key)
    return s


def quiet_note(load):
    """What the load at the start says of the figures."""
    if load[0] < 0.5:
        return ('quiet machine: 1-minute load {:.2f} at the start (see '
                'loadavg fields per job)'.format(load[0]))
    return ('measured under load (1-minute load {:.2f} at the start): '
            'rerun on a quiet machine for final figures'.format(load[0]))


def job_cfg(model, modes, s, trace=None):
    small = model == 'resnet_small'
    # --insize / --batch size the ResNet-18/-50 jobs; the small ResNet
    # keeps its own setting (it is the quick model and the dilation check's).
    return {'model': model,
            'batch': 16 if small else s.get('batch') or 4,
            'insize': 64 if small else s.get('insize') or 224,
            'iterations': s['iterations'],
            'warmup': s['warmup'], 'settle': 1, 'modes': list(modes),
            'bucket_size': None, 'rounds': s['rounds'], 'trace': trace}


def run_dilated(ranks, rate, k, cfg, t_compute, log, period_us=None):
    """One trainer job on a DilatedBed; summary, bed record."""
    load = os.getloadavg()
    with cpuquota.DilatedBed(ranks, rate, dilation=k,
                             period_us=period_us) as bed:
        raw, res = run_on(bed, cfg, t_compute * k * ranks,
                          '{} ranks, k={}'.format(ranks, k))
        record = bed.describe()
    summary = summaries(raw)
    add_scalability(summary)
    for m in summary.values():
        # Dilated seconds back to undilated ones.
        m['it_per_s_median_undilated'] = m['it_per_s_median'] * k
    log('  {} ranks k={:g}: '.format(ranks, k) + ', '.join(
        '{} {:.3f}'.format(m, summary[m]['scalability'])
        for m in cfg['modes'] if m != 'alone'))
    return {'ranks': ranks, 'k': k, 'modes': summary, 'bed': record,
            'seconds': res['seconds'], 'loadavg_before': load,
            'loadavg_after': os.getloadavg()}


def pooled(jobs, mode):
    per_round = [x for j in jobs for x in j['modes'][mode][
        'scalability_rounds']]
    iv = stats.interval(per_round)
    return {'scalability': iv['median'], 'ci': iv['ci'],
            'rounds': per_round}


def validate(rate, s, t_compute, log):
    """Phase 1: N = 2 at every k, interleaved."""
    cfg = job_cfg(s['validation_model'], VALIDATION_MODES, s)
    jobs = {k: [] for k in s['ks']}
    for rep in range(s['repeats']):
        order = s['ks'] if rep % 2 == 0 else s['ks'][::-1]
        for k in order:
            jobs[k].append(run_dilated(2, rate, k, cfg, t_compute, log,
                                       s.get('period_us')))
    out = {'model': cfg['model'], 'rate_bit_per_s': rate, 'by_k': {}}
    for k, js in jobs.items():
        out['by_k'][str(k)] = {m: pooled(js, m) for m in VALIDATION_MODES
                               if m != 'alone'}
        out['by_k'][str(k)]['jobs'] = js
    spread = {}
    for m in VALIDATION_MODES[1:]:
        vals = [out['by_k'][str(k)][m]['scalability'] for k in s['ks']]
        spread[m] = max(vals) - min(vals)
    out['largest_difference_between_k'] = spread
    return out


def measure(model, rate, s, t_compute, trace_dir, log):
    """Phase 2: every N at its smallest dilation; the N=2 job traced."""
    cores = len(os.sched_getaffinity(0))
    rows = []
    for n in s['ranks']:
        k = cpuquota.min_dilation(n, cores)
        row = None
        for g, modes in enumerate(MODE_GROUPS):
            trace = (os.path.join(trace_dir, 'timeline.rank{rank}.json')
                     if n == s['ranks'][0] and g == 0 else None)
            job = run_dilated(n, rate, k, job_cfg(model, modes, s, trace),
                              t_compute, log, s.get('period_us'))
            if row is None:
                row = job
            else:
                job['modes']['alone_of_second_job'] = job['modes'].pop(
                    'alone')
                row['modes'].update(job['modes'])
                row['second_job'] = {key: job[key] for key in (
                    'seconds', 'loadavg_before', 'loadavg_after')}
        rows.append(row)
    return rows


def make_trace(model, timeline, measured, log):
    from benchmarks.harness import workloads
    pb = trace_mod.param_bytes_of(workloads.build_model(model))
    first = measured[0]
    alone = 1.0 / first['modes']['alone']['it_per_s_median_undilated']
    bed = first['bed']
    t = trace_mod.from_timeline(timeline, pb, meta={
        'model': model, 'ranks': first['ranks'], 'dilation': first['k'],
        'alone_iteration_s': alone,
        'link': {'rate_bit_per_s': bed['dilation']['undilated'][
            'rate_bit_per_s'], 'rtt_s': bed['rtt']['median_s']}})
    if first['k'] != 1:
        raise RuntimeError('the traced job ran dilated (k={}); trace the '
                           'first N at k=1'.format(first['k']))
    log('  trace: {} layers, {} buckets, engine step {:.1f} ms (median of '
        '{} gaps)'.format(len(t['layers']), len(t['buckets']),
                          t['engine']['step_overhead_s'] * 1e3,
                          t['engine']['step_gaps_measured']))
    return t


def replay_measured(trace_path, measured, log):
    """Phase 4: the replay at each measured N against the bed."""
    out = []
    for row in measured:
        bed = row['bed']
        rate = bed['dilation']['undilated']['rate_bit_per_s']
        lat = bed['rtt']['median_s'] / 2.0 / row['k']
        entry = {'ranks': row['ranks'], 'k': row['k']}
        for mode, bed_mode in (('ours', 'overlap_forward'),
                               ('blocking', 'blocking')):
            r = proj.replay(trace_path, row['ranks'], rate, lat, mode,
                            efficiency=EFFICIENCY)
            got = row['modes'][bed_mode]['scalability']
            entry[mode] = {'replay': r['scalability'], 'measured': got,
                           'measured_ci': row['modes'][bed_mode][
                               'scalability_ci'],
                           'error': r['scalability'] - got}
        log('  {} ranks: ours replay {:.3f} vs bed {:.3f}; blocking replay '
            '{:.3f} vs bed {:.3f}'.format(
                row['ranks'], entry['ours']['replay'],
                entry['ours']['measured'], entry['blocking']['replay'],
                entry['blocking']['measured']))
        out.append(entry)
    return out


def replay_trace_run(trace_path, trace, log):
    """The replay at the link and rank count the trace was recorded at,
    against that run's measured scalabilities (``trace['measured']``)."""
    link, measured = trace.get('link'), trace.get('measured') or {}
    if not link or not trace.get('ranks'):
        return None
    out = {'ranks': trace['ranks'], 'rate_bit_per_s': link['rate_bit_per_s'],
           'latency_s': link['rtt_s'] / 2.0}
    for mode in ('ours', 'blocking'):
        r = proj.replay(trace_path, trace['ranks'], link['rate_bit_per_s'],
                        link['rtt_s'] / 2.0, mode, efficiency=EFFICIENCY)
        out[mode] = {'replay': r['scalability']}
        if mode in measured:
            out[mode].update(measured=measured[mode],
                             error=r['scalability'] - measured[mode])
        log('  replay at the traced run\'s link, {}: {:.3f}{}'.format(
            mode, r['scalability'], '' if mode not in measured else
            ' (measured {:.3f})'.format(measured[mode])))
    return out


def projection(trace_path, trace, log, quick, algorithms=('halving',)):
    """Phase 5: both compute calibrations, for each long-message
    algorithm (``'halving'``: MPICH's, which the engine's MPI_Allreduce
    runs; ``'ring'``: 2 (N-1) latency terms per chunk, as a ring
    library's)."""
    nodes = proj.NODES if not quick else (16, 256, 1024)
    c_a, cal = proj.calibrate_reference(trace_path, EFFICIENCY)
    alone = trace.get('alone_iteration_s') or cal['compute_s']
    c_b = proj.GPU_CLASS['iteration_s'] / alone
    step = trace['engine']['step_overhead_s']
    out = {'reference': proj.REFERENCE, 'horovod': proj.HOROVOD,
           'latency_s': proj.REFERENCE['latency_s'],
           'efficiency': EFFICIENCY,
           'step_overhead_rule': 'the trace\'s measured engine step, '
                                 'scaled with the compute',
           'reference_calibration': {'compute_scale': c_a,
                                     'compute_s': cal['compute_s'] * c_a},
           'gpu_class': dict(proj.GPU_CLASS, compute_scale=c_b)}
    for algorithm in algorithms:
        suffix = '' if algorithm == 'halving' else '_' + algorithm
        log('  (a) reference calibration, {}: compute x{:.4f} ({:.3f} s per '
            'iteration)'.format(algorithm, c_a, cal['compute_s'] * c_a))
        out['reference_calibration']['rows' + suffix] = proj.project(
            trace_path, c_a, EFFICIENCY, step, nodes=nodes, log=log,
            algorithm=algorithm)
        log('  (b) GPU-class, {}: compute x{:.4f} ({:.3f} s, {})'.format(
            algorithm, c_b, proj.GPU_CLASS['iteration_s'],
            proj.GPU_CLASS['source']))
        out['gpu_class']['rows' + suffix] = proj.project(
            trace_path, c_b, EFFICIENCY, step, nodes=nodes, log=log,
            algorithm=algorithm)
    return out


def plot(result, path):
    """Two panels (reference calibration, GPU-class): per link rate, ours
    as recorded (solid), ours without the thread's CPU time (dashed),
    blocking (dotted), the bound (thin); measured bed points and the
    references marked."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return 'matplotlib is not installed: no plot'
    p = result['projection']
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), sharey=True)
    colors = {10e9: 'C0', 25e9: 'C1', 100e9: 'C2'}
    for ax, key, title in ((axes[0], 'reference_calibration',
                            '(a) compute of the reference setting'),
                           (axes[1], 'gpu_class', '(b) GPU-class compute')):
        for rate, color in colors.items():
            rows = [r for r in p[key].get('rows', [])
                    if r['rate_bit_per_s'] == rate]
            if not rows:
                continue
            xs = [r['nodes'] for r in rows]
            for field, ls, what in (('ours', '-', 'ours'),
                                    ('ours_no_interference', '--',
                                     'ours, no thread CPU'),
                                    ('blocking', ':', 'blocking'),
                                    ('bound', '-', 'bound')):
                ax.plot(xs, [r[field] for r in rows], ls=ls, color=color,
                        marker='.' if field != 'bound' else None,
                        lw=0.6 if field == 'bound' else 1.4,
                        label='{} {:.0f} Gb/s'.format(what, rate / 1e9))
        ax.plot([16], [proj.REFERENCE['layerwise']], 'r*', ms=12,
                label='reference layer-wise 0.924 (16)')
        ax.plot([16], [proj.REFERENCE['blocking']], 'rx', ms=9,
                label='reference blocking 0.6672 (16)')
        ax.plot([512], [proj.HOROVOD['scalability']], 'g^', ms=9,
                label='Horovod 0.90 (512, ResNet-101, 25 Gb/s)')
        ax.set_title(title, fontsize=9)
        ax.set_xscale('log', base=2)
        ax.set_xlabel('nodes')
        ax.grid(True, alpha=0.3)
    for model, rows in (result.get('measured') or {}).items():
        mid = [r['modes']['overlap_forward']['scalability'] for r in rows]
        ci = [r['modes']['overlap_forward'].get('scalability_ci') or [m, m]
              for r, m in zip(rows, mid)]
        axes[0].errorbar([r['ranks'] for r in rows], mid,
                         yerr=[[m - c[0] for m, c in zip(mid, ci)],
                               [c[1] - m for m, c in zip(mid, ci)]],
                         fmt='ko', capsize=3,
                         label='measured ours, {} (bed{})'.format(
                             model, '' if result.get('note', '').startswith(
                                 'quiet') else ', under load'))
    if result.get('measured'):
        axes[0].legend(fontsize=6, loc='lower right')
    axes[0].set_ylabel('scalability')
    axes[0].set_ylim(0, 1.05)
    axes[1].legend(fontsize=6, ncol=2, loc='lower left')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--full', action='store_true',
                   help='ResNet-50 and -18 at N = 2, 4, 8; k = 1, 2, 4 '
                        '(default: the quick setting, the small ResNet)')
    p.add_argument('--models', nargs='*', default=None)
    p.add_argument('--rate', default=None,
                   help='undilated link rate (default: blocking near 0.667 '
                        'at 2 ranks by the alpha-beta estimate)')
    p.add_argument('--validate-only', action='store_true')
    p.add_argument('--validation-model', default=None,
                   help='model of the dilation check (default: resnet18 '
                        'with --full, else resnet_small)')
    p.add_argument('--repeats', type=int, default=None,
                   help='jobs per dilation in the check (full: 3)')
    p.add_argument('--rounds', type=int, default=None,
                   help='paired rounds per job (full: 4)')
    p.add_argument('--ranks', type=int, nargs='*', default=None,
                   help='rank counts measured (full: 2 4 8; the first is '
                        'traced, at k = 1)')
    p.add_argument('--insize', type=int, default=None,
                   help='image size of the ResNet-18/-50 jobs (default 224; '
                        'the small ResNet keeps 64)')
    p.add_argument('--batch', type=int, default=None,
                   help='batch per rank of the ResNet-18/-50 jobs '
                        '(default 4)')
    p.add_argument('--period-us', type=int, default=None,
                   help='cpu.cfs_period_us of each rank (default: the '
                        'shortest allowing a 1 ms quota)')
    p.add_argument('--skip-validation', action='store_true',
                   help='no dilation check (run it with --validate-only)')
    p.add_argument('--project-only', action='store_true',
                   help='only the projection, from --trace (no root)')
    p.add_argument('--trace', default=None,
                   help='project this trace (with --project-only: only '
                        'that, keeping the bed sections of --out; in a bed '
                        'run: instead of the first measured model\'s)')
    p.add_argument('--algorithms', default=None,
                   help='long-message allreduce(s) of the projection: '
                        'halving (MPICH\'s), ring; comma-separated (default '
                        'both)')
    p.add_argument('--out', default=None,
                   help='results file (default benchmarks/results/scale.json'
                        '; with --validate-only scale_validation.json)')
    args = p.parse_args(argv)
    if args.algorithms is None:
        args.algorithms = 'halving,ring'
    if args.out is None:
        # A dilation check alone must not replace the projection that the
        # docs' tables read.
        args.out = os.path.join(RESULTS, 'scale_validation.json'
                                if args.validate_only else 'scale.json')
    s = settings(args)
    s['period_us'] = args.period_us
    t_start = time.time()

    def log(msg):
        print('[{:6.0f} s] {}'.format(time.time() - t_start, msg))
        sys.stdout.flush()

    problem = proj.simgrid_problem()
    if problem and not args.validate_only:
        raise SystemExit(problem)
    result = {'benchmark': 'scale: 2-8 ranks on a dilated bed, SimGrid '
                           'replay and projection',
              'config': dict(s, full=args.full), 'machine':
              machine.machine_description(),
              'note': quiet_note(os.getloadavg())}
    if args.project_only:
        if not args.trace:
            raise SystemExit('--project-only needs --trace FILE')
        project_trace(result, args, log)
        keep_bed_sections(result, args.out, log)
        return finish(result, args, log)
    netbed.require_root()
    if not cpuquota.cpu_controller_available():
        raise SystemExit('no cgroup v1 cpu controller at {}'.format(
            cpuquota.CPU_ROOT))
    result['measured'], result['replay_vs_bed'] = {}, {}
    for i, model in enumerate([s['validation_model']] + [
            m for m in s['models'] if m != s['validation_model']]):
        cfg = job_cfg(model, ['alone'], s)
        t_c = measure_alone(cfg)
        nbytes = gradient_bytes(model)
        rate = (netbed.parse_rate(args.rate) if args.rate else
                rate_for(0.6672, t_c / 0.8, nbytes * 8 / EFFICIENCY))
        log('{}: {:.3f} s per iteration alone, {:.1f} MB, undilated link '
            '{:.1f} Mbit/s'.format(model, t_c, nbytes / 1e6, rate / 1e6))
        if i == 0 and not args.skip_validation:
            log('dilation check, 2 ranks, k = {}'.format(s['ks']))
            result['validation'] = validate(rate, s, t_c, log)
            if args.validate_only:
                return finish(result, args, log)
        if model not in s['models']:
            continue
        tdir = tempfile.mkdtemp(prefix='cmo-scale-')
        log('measured, N = {}'.format(s['ranks']))
        rows = measure(model, rate, s, t_c, tdir, log)
        result['measured'][model] = rows
        tr = make_trace(model, os.path.join(tdir, 'timeline.rank0.json'),
                        rows, log)
        # Beside the results file (--out elsewhere keeps results/ as is).
        tpath = os.path.join(os.path.dirname(os.path.abspath(args.out)),
                             'scale_trace.{}.json'.format(model))
        with open(tpath, 'w') as f:
            json.dump(tr, f, indent=1)
        result.setdefault('traces', {})[model] = os.path.relpath(tpath, ROOT)
        result['replay_vs_bed'][model] = replay_measured(tpath, rows, log)
        if model == s['models'][0] and not args.trace:
            # The replay at the traced run's own ranks and link.
            result['replay_vs_trace_run'] = dict(
                result['replay_vs_bed'][model][0],
                rate_bit_per_s=tr['link']['rate_bit_per_s'])
            result['projection'] = projection(tpath, tr, log, not args.full,
                                              args.algorithms.split(','))
            result['projection']['model'] = model
    if args.trace:
        # The projection of a given trace (e.g. the calibrated ResNet-50
        # run) beside bed measurements of other models.
        project_trace(result, args, log)
    return finish(result, args, log)


def project_trace(result, args, log):
    with open(args.trace) as f:
        tr = json.load(f)
    result['replay_vs_trace_run'] = replay_trace_run(args.trace, tr, log)
    result['projection'] = projection(args.trace, tr, log, not args.full,
                                      args.algorithms.split(','))
    result['projection']['trace'] = args.trace
    result['projection']['model'] = tr.get('model')


BED_SECTIONS = ('validation', 'measured', 'replay_vs_bed', 'traces')


def keep_bed_sections(result, path, log):
    """A projection rerun keeps the bed measurements already in ``path``
    (with the configuration and machine they were taken on)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        old = json.load(f)
    kept = [key for key in BED_SECTIONS if key in old]
    for key in kept:
        result[key] = old[key]
    if kept:
        result['config_bed'] = old.get('config_bed', old.get('config'))
        result['machine_bed'] = old.get('machine_bed', old.get('machine'))
        log('kept the bed sections of {}: {}'.format(path, ', '.join(kept)))


def finish(result, args, log):
    png = os.path.splitext(args.out)[0] + '.png'
    problem = plot(result, png) if 'projection' in result else 'no projection'
    result['plot'] = None if problem else os.path.relpath(png, ROOT)
    result['machine']['loadavg_at_end'] = os.getloadavg()
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    log('saved ' + args.out + ('' if problem else ' and ' + png))
    left = cpuquota.remove_stale_cgroups()
    if left:
        log('removed cgroups left behind: {}'.format(left))
    return 0


if __name__ == '__main__':
    sys.exit(main())
