"""Scalability of blocking, double-buffered and overlapped reduction.

Run (as root, from the repository root; ``make bench`` does the set-up and
runs the default)::

    python -m benchmarks.overlap_bench                 # calibrated + sweep
    python -m benchmarks.overlap_bench --quick --model resnet_small
    python -m benchmarks.overlap_bench --sweep         # more link rates
    python -m benchmarks.overlap_bench --emulate       # emulation only

One invocation measures, for the same model, batch, link and iterations:

1. ``alone``: the actual optimizer, no communication (the denominator);
2. ``blocking``: ChainerMN's ``create_multi_node_optimizer``;
3. ``double_buffering``: ``create_double_buffering_optimizer`` (stale);
4. ``overlap_update``: ours, ``wait='update'``;
5. ``overlap_forward``: ours, ``wait='forward'``.

Two ranks run as separate hosts in network namespaces joined by a
tc-shaped veth link (``testbed/netbed.py``), each pinned to a core of its
own with one BLAS thread; MPICH talks TCP over the link.  Scalability, as
the anchor defines it, is iterations/s with N ranks divided by iterations/s
of one rank alone.  ``alone`` runs inside the same job (each rank trains
alone, no communication), so that the denominator is measured under the
same load as the numerators (both cores busy).

Rounds (:mod:`benchmarks.harness.trainer`): every mode keeps one model and
optimizer for the whole job; each round runs every mode once (one untimed,
then ``--iterations`` timed updates), the order alternating between rounds.
Each figure is the median over rounds of that round's scalability, with a
95 % bootstrap interval over rounds (:mod:`benchmarks.harness.stats`).

Calibration: the link rate is chosen so that blocking lands in 0.60-0.72
(the anchor's regime, 0.6672): from the measured compute time and the
gradient size, then corrected from the measured blocking figure.  Every mode
is reported at that rate; a sweep of rates is plotted as scalability versus
rate per mode.  The emulation replays the anchor (ResNet-50, 16 nodes,
10 Gb/s) in one process with the α–β model of
``chainermn_overlap.communication.emulated``, the link scaled to this
machine's compute speed (the scaling is explained in the output).

Writes ``benchmarks/results/overlap.json`` and ``overlap.png``.
"""
import argparse
import inspect
import json
import os
import sys
import time

# Run as a file (not with -m), sys.path starts with benchmarks/ instead of
# the repository root that holds the package: add the root.
if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import anchor, launch, machine, trainer  # noqa: E402
from benchmarks.harness.launch import RESULTS, ROOT  # noqa: E402
# Calibration and the per-round summaries live in benchmarks.harness.bedrun.
from benchmarks.harness.bedrun import (  # noqa: E402,F401
    TARGET_BLOCKING, TARGET_CENTER, TARGET_TOLERANCE, add_scalability,
    slowest_rank_rounds,
    calibrate, expected_seconds, gradient_bytes, measure_alone, next_rate,
    rate_for, run_bed, summaries, summarize)
from testbed import netbed  # noqa: E402

MODES = ['alone', 'blocking', 'double_buffering', 'overlap_update',
         'overlap_forward']
# The anchor: ResNet-50 on 16 nodes at 10 Gb/s, blocking 66.72 %,
# layer-wise non-blocking 92.4 %.
ANCHOR = {'model': 'resnet50', 'nodes': 16, 'bandwidth_bit_per_s': 10e9,
          'blocking_scalability': 0.6672, 'layerwise_scalability': 0.924,
          'latency_s': 25e-6}


def run_bucket_sweep(rate, cfg, t_compute, sizes, log):
    """Ours (both waits) with each fusion bucket size, at one link rate.

    One job per size, each with its own ``alone`` (the denominator under
    the same conditions); the library default is in the calibrated run.
    """
    from chainermn_overlap import config
    rows = []
    for size in sizes:
        nbytes = config.parse_size(size.strip())
        c = dict(cfg, modes=['alone', 'overlap_update', 'overlap_forward'],
                 bucket_size=nbytes, trace=None)
        run = run_bed(rate, c, t_compute, log)
        m = run['modes']
        rows.append({'bucket_size': nbytes, 'label': size.strip(),
                     'scalability': {k: m[k]['scalability']
                                     for k in c['modes']},
                     'run': run})
        log('  bucket size {}: update {:.3f}, forward {:.3f}'.format(
            size.strip(), m['overlap_update']['scalability'],
            m['overlap_forward']['scalability']))
    best = {w: max(rows, key=lambda r: r['scalability'][w])['label']
            for w in ('overlap_update', 'overlap_forward')}
    log('  best bucket size: update {overlap_update}, forward '
        '{overlap_forward} (library default 16MiB, with a 1/2/4/8 MiB tail '
        'for forward)'.format(**best))
    return {'rate_bit_per_s': rate, 'rows': rows, 'best': best}


def emulation_settings(t_compute_local, nbytes):
    """The anchor's link, scaled so that comm/compute matches here.

    The anchor gives no compute time per iteration; its own blocking figure
    implies one under the same α–β model:
    ``t_c = t_comm (s / (1 - s))``.  Communication time scales as
    ``1 / bandwidth`` (and the latency term linearly), so a machine whose
    iteration computes in ``t_local`` keeps the anchor's ratio
    ``t_comm / t_c`` with ``bandwidth * t_c / t_local`` and
    ``latency * t_local / t_c``.
    """
    from chainermn_overlap.communication import emulated
    t_c_anchor = anchor.anchor_compute_seconds(
        nbytes, ANCHOR['nodes'], ANCHOR['bandwidth_bit_per_s'],
        ANCHOR['blocking_scalability'], ANCHOR['latency_s'])
    factor = t_c_anchor / t_compute_local
    bw = ANCHOR['bandwidth_bit_per_s'] * factor
    lat = ANCHOR['latency_s'] / factor
    t_comm = emulated.ring_allreduce_seconds(nbytes, ANCHOR['nodes'], lat,
                                             bw / 8)
    return {
        'emulation': True,
        'label': 'EMULATION (alpha-beta ring model, {} virtual nodes; not a '
                 'measured network)'.format(ANCHOR['nodes']),
        'nodes': ANCHOR['nodes'], 'bandwidth_bit_per_s': bw,
        'latency_s': lat,
        'anchor': ANCHOR,
        'anchor_compute_s_implied': t_c_anchor,
        'local_compute_s': t_compute_local,
        'scale_factor': factor,
        'modelled_allreduce_s': t_comm,
        'explanation': (
            'The anchor (ResNet-50, 16 nodes, 10 Gb/s, blocking 66.72%) '
            'implies a compute time of {:.3f} s per iteration: a ring '
            'allreduce of {:.1f} MB over 16 nodes at 10 Gb/s takes {:.3f} s, '
            'and 0.6672 = t_c / (t_c + t_comm). This machine computes an '
            'iteration in {:.3f} s, {:.1f}x slower, so the emulated link is '
            '{:.1f}x slower too: {:.0f} Mbit/s with {:.0f} us per ring step '
            '(modelled allreduce {:.3f} s), keeping t_comm / t_c = {:.3f} as '
            'in the anchor.'.format(
                t_c_anchor, nbytes / 1e6,
                emulated.ring_allreduce_seconds(
                    nbytes, ANCHOR['nodes'], ANCHOR['latency_s'],
                    ANCHOR['bandwidth_bit_per_s'] / 8),
                t_compute_local, 1 / factor, 1 / factor, bw / 1e6, lat * 1e6,
                t_comm, t_comm / t_compute_local))}


def run_emulation(cfg, t_compute, nbytes, log):
    settings = emulation_settings(t_compute, nbytes)
    log('EMULATION: ' + settings['explanation'])
    c = dict(cfg, emulation=settings)
    t0 = time.time()
    stdout = launch.run_pinned(launch.worker_command(trainer.MODULE, c),
                               'the emulation run',
                               timeout=2 * expected_seconds(c, t_compute))
    raw = launch.read_result(stdout, trainer.RESULT_TAG, 'emulation')
    summary = summaries(raw)
    add_scalability(summary)
    return {'emulation': settings, 'label': settings['label'],
            'modes': summary, 'seconds': time.time() - t0,
            'pinning': {'tool': 'taskset', 'cores': [0], 'blas_threads': 1}}


def run_overhead(log, quick):
    """The 1-rank overhead check (benchmarks.overhead), pinned to core 0.

    Always on the small model: a fixed per-iteration cost of the wrapper
    weighs most there, so it is the stricter test of the 2 % budget.
    """
    out = os.path.join(RESULTS, 'overhead.json')
    cmd = launch.module_command('benchmarks.overhead', '--arch',
                                'resnet_small', '--out', out)
    if quick:
        cmd += ['--iterations', '6', '--rounds', '2']
    log('overhead at one rank: ' + ' '.join(cmd[1:]))
    launch.run_pinned(cmd, 'benchmarks.overhead', timeout=1800)
    with open(out) as f:
        return json.load(f)


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # NOQA
    except ImportError:
        return ('matplotlib is not installed, so no plot was drawn; install '
                'it (.venv/bin/pip install matplotlib; make bench does)')
    runs = sorted(result['sweep'], key=lambda r: r['rate_bit_per_s'])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in MODES[1:]:
        xs = [r['rate_bit_per_s'] / 1e6 for r in runs if mode in r['modes']]
        ys = [r['modes'][mode]['scalability'] for r in runs
              if mode in r['modes']]
        lo = [r['modes'][mode]['scalability_min'] for r in runs
              if mode in r['modes']]
        hi = [r['modes'][mode]['scalability_max'] for r in runs
              if mode in r['modes']]
        ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, lo)],
                                  [b - y for y, b in zip(ys, hi)]],
                    marker='o', capsize=3, label=mode)
    cal = result.get('calibrated', {}).get('rate_bit_per_s')
    if cal:
        ax.axvline(cal / 1e6, color='grey', ls=':', label='calibrated rate')
    ax.axhspan(*TARGET_BLOCKING, color='grey', alpha=0.1)
    ax.set_xscale('log')
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel('link rate per rank and direction (Mbit/s, tc tbf)')
    ax.set_ylabel('scalability (it/s with 2 ranks / it/s alone)')
    ax.set_title('{} batch {} ({}x{}), 2 ranks over a shaped veth link'
                 .format(result['config']['model'], result['config']['batch'],
                         result['config']['insize'],
                         result['config']['insize']), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _table(modes, log, title):
    log(title)
    log('  {:<18} {:>10} {:>17} {:>25} {:>8}'.format(
        'mode', 'it/s med', '(min, max)', 'scalability [95% CI]', 'hidden'))
    for m in MODES:
        if m not in modes:
            continue
        s = modes[m]
        st = s.get('communication_stats') or {}
        hidden = st.get('hidden_fraction')
        ci = s.get('scalability_ci') or [float('nan')] * 2
        log('  {:<18} {:>10.4f} ({:>7.4f}, {:>7.4f}) {:>9.3f} '
            '[{:.3f}, {:.3f}] {:>8}'.format(
                m, s['it_per_s_median'], s['it_per_s_min'], s['it_per_s_max'],
                s.get('scalability', float('nan')), ci[0], ci[1],
                '' if hidden is None else '{:.0%}'.format(hidden)))


def checks(result):
    """The issue's acceptance criteria, evaluated on this run."""
    out = {}
    cal = result.get('calibrated')
    if cal:
        m = cal['modes']
        b = m['blocking']['scalability']
        f = m['overlap_forward']['scalability']
        u = m['overlap_update']['scalability']
        out['blocking_in_0.60-0.72'] = TARGET_BLOCKING[0] <= b <= \
            TARGET_BLOCKING[1]
        out['overlap_forward_ge_0.95'] = f >= 0.95
        out['ours_ge_blocking_plus_0.20'] = max(f, u) >= b + 0.20
    emu = result.get('emulation')
    if emu:
        m = emu['modes']
        out['emulation_ordering_forward_ge_update_gt_blocking'] = (
            m['overlap_forward']['scalability']
            >= m['overlap_update']['scalability'] - 0.01
            and m['overlap_update']['scalability']
            > m['blocking']['scalability'])
    ov = result.get('overhead_1rank')
    if ov:
        o = ov['overhead_vs_plain']
        out['overhead_1rank_le_2pct'] = max(o['overlap_forward'],
                                           o['overlap_update']) <= 0.02
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', choices=('resnet50', 'resnet_small'),
                   default='resnet50')
    p.add_argument('--batch', type=int, default=None,
                   help='per-rank batch (default 4 for resnet50, 16 small)')
    p.add_argument('--insize', type=int, default=None,
                   help='image side (default 224 for resnet50, 64 small)')
    p.add_argument('--iterations', type=int, default=None,
                   help='timed iterations per mode and round (default 3; '
                        'quick 2)')
    p.add_argument('--warmup', type=int, default=None,
                   help='untimed iterations of each mode before the first '
                        'round (default 2; quick 1)')
    p.add_argument('--settle', type=int, default=1,
                   help='untimed iterations of each mode at the start of '
                        'every round (default 1)')
    p.add_argument('--rounds', type=int, default=None,
                   help='rounds at the calibrated link: each mode once per '
                        'round, the order alternating (default 12; quick 2)')
    p.add_argument('--quick', action='store_true',
                   help='few iterations, one extra sweep rate, no overhead')
    p.add_argument('--sweep', action='store_true',
                   help='full sweep: 6 link rates around the calibrated one')
    p.add_argument('--emulate', action='store_true',
                   help='only the emulated 16-node replay (no root needed)')
    p.add_argument('--no-emulate', action='store_true',
                   help='skip the emulated replay')
    p.add_argument('--rate', default=None,
                   help='use this link rate instead of calibrating')
    p.add_argument('--bucket-size', default=None,
                   help='fusion bucket size of ours (default: library)')
    p.add_argument('--bucket-sweep', default=None, metavar='SIZES',
                   help='only this: time ours with each of these '
                        'comma-separated fusion bucket sizes (e.g. '
                        '"4MiB,16MiB,64MiB") at --rate (or a calibrated '
                        'rate), one job per size; result key bucket_sweep '
                        '(use --out to keep overlap.json)')
    p.add_argument('--time-limit', type=float, default=5400,
                   help='seconds; phases not started by then are skipped '
                        '(order: calibration and all modes, emulation, '
                        'overhead, sweep)')
    p.add_argument('--out', default=os.path.join(RESULTS, 'overlap.json'))
    args = p.parse_args(argv)

    small = args.model == 'resnet_small'
    cfg = {
        'model': args.model,
        'batch': args.batch or (16 if small else 4),
        'insize': args.insize or (64 if small else 224),
        'iterations': args.iterations or (2 if args.quick else 3),
        'warmup': args.warmup or (1 if args.quick else 2),
        'settle': args.settle,
        'modes': list(MODES),
        'bucket_size': args.bucket_size,
        'rounds': args.rounds or (2 if args.quick else 12),
    }
    import chainermn_overlap
    cfg['overlap_backend'] = inspect.signature(
        chainermn_overlap.create_overlapped_optimizer).parameters[
            'backend'].default
    t_start = time.time()

    def log(msg):
        print('[{:6.0f} s] {}'.format(time.time() - t_start, msg))
        sys.stdout.flush()

    def over_budget(phase):
        if time.time() - t_start > args.time_limit:
            log('time limit of {:.0f} s reached: skipping {}'.format(
                args.time_limit, phase))
            return True
        return False

    if not args.emulate:
        netbed.require_root()
    os.makedirs(RESULTS, exist_ok=True)
    result = {
        'benchmark': 'overlap: scalability of gradient reduction modes',
        'scalability_definition': 'it/s with N ranks / it/s of one rank '
                                  'alone (median iteration times after '
                                  'warm-up; min/max from the spread)',
        'config': cfg, 'machine': machine.machine_description(),
        'note': 'measured while other work may run on this machine: see '
                'loadavg fields; rerun on a quiet machine for final figures',
    }
    nbytes = gradient_bytes(cfg['model'])
    result['gradient_bytes'] = nbytes
    log('{} batch {} at {}x{}: {:.1f} MB of gradients; loadavg {}'.format(
        cfg['model'], cfg['batch'], cfg['insize'], cfg['insize'],
        nbytes / 1e6, ' '.join('{:.2f}'.format(v) for v in os.getloadavg())))
    t_compute = measure_alone(cfg)
    result['alone_pinned_seconds_per_iteration'] = t_compute
    log('one rank alone (pinned, 1 BLAS thread): {:.3f} s per iteration'
        .format(t_compute))

    if not args.emulate:
        if args.rate:
            rate, history = netbed.parse_rate(args.rate), []
        else:
            log('calibrating the link: blocking should land within {:.3f} '
                'of the anchor\'s {:.3f}'.format(TARGET_TOLERANCE,
                                                  TARGET_CENTER))
            rate, history = calibrate(cfg, t_compute, nbytes, log)
        result['calibration'] = history
    if args.bucket_sweep:
        if args.emulate:
            raise SystemExit('--bucket-sweep runs on the test bed, not in '
                             'the emulation: drop --emulate')
        result['bucket_sweep'] = run_bucket_sweep(
            rate, cfg, t_compute, args.bucket_sweep.split(','), log)
        return _finish(result, args, t_start, log)
    if not args.emulate:
        log('all modes at {:.1f} Mbit/s'.format(rate / 1e6))
        trace = os.path.join(RESULTS, 'overlap_trace.rank{rank}.json')
        cal = run_bed(rate, dict(cfg, trace=trace), t_compute, log)
        result['trace'] = os.path.relpath(trace, ROOT)
        log('timeline of wait=forward (open in https://ui.perfetto.dev '
            'or chrome://tracing): ' + trace.format(rank='<r>'))
        result['calibrated'] = cal
        _table(cal['modes'], log, 'calibrated link {:.1f} Mbit/s, 2 ranks '
               '(network namespaces, tc tbf, MPICH/TCP):'.format(rate / 1e6))
    if not args.no_emulate and not over_budget('the emulation'):
        emu_cfg = dict(cfg)
        if cfg['model'] != 'resnet50':
            log('note: the emulation replays the anchor with {} (run with '
                '--model resnet50 for the anchor model)'.format(cfg['model']))
        # The link is scaled to the compute time of one iteration here: the
        # calibrated run's 'alone' (more iterations) when there is one.
        t_local = t_compute
        if 'calibrated' in result:
            t_local = 1.0 / result['calibrated']['modes']['alone'][
                'it_per_s_median']
        emu_cfg['rounds'] = max(2, cfg['rounds'] // 2)
        emu = run_emulation(emu_cfg, t_local, nbytes, log)
        result['emulation'] = emu
        _table(emu['modes'], log, emu['label'] + ':')

    if not args.emulate and not args.quick and not over_budget('overhead'):
        result['overhead_1rank'] = run_overhead(log, args.quick)
        o = result['overhead_1rank']['overhead_vs_plain']
        log('overhead at one rank vs the plain optimizer: ' + ', '.join(
            '{} {:+.1%}'.format(k, v) for k, v in sorted(o.items())))

    if not args.emulate:
        factors = ([0.5, 2.0] if not args.sweep else
                   [0.25, 0.5, 0.75, 1.5, 2.0, 4.0])
        if args.quick and not args.sweep:
            factors = [2.0]
        sweep = [cal]
        for f in factors:
            if over_budget('sweep at {:.2f}x'.format(f)):
                break
            # Three rounds: the sweep shows the trend, the calibrated run
            # above is the measurement.
            c = dict(cfg, rounds=3, trace=None)
            sweep.append(run_bed(rate * f, c, t_compute, log))
            _table(sweep[-1]['modes'], log, 'link {:.1f} Mbit/s:'.format(
                rate * f / 1e6))
        result['sweep'] = sweep
        png = os.path.splitext(args.out)[0] + '.png'
        problem = plot(result, png)
        result['plot'] = None if problem else os.path.relpath(png, ROOT)
        log(problem or 'plot: ' + png)

    return _finish(result, args, t_start, log)


def _finish(result, args, t_start, log):
    result['checks'] = checks(result)
    result['seconds'] = time.time() - t_start
    result['machine']['loadavg_at_end'] = os.getloadavg()
    for k, v in result['checks'].items():
        log('check {:<50} {}'.format(k, 'yes' if v else 'NO'))
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    log('saved ' + args.out)
    left = [n for n in netbed.list_namespaces()
            if n.startswith(netbed.PREFIX + str(os.getpid()))]
    if left:
        raise RuntimeError('namespaces left behind: {}'.format(left))
    return 0


if __name__ == '__main__':
    sys.exit(main())
