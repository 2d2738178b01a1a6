"""Fewer bytes, faster: float16 on the wire and PowerSGD on the test bed.

Run (as root, from the repository root; ``make bench`` runs it after the
overlap benchmark)::

    python -m benchmarks.compression_bench \\
        [--models resnet50:4:224 resnet18:8:128] [--rounds 10] \\
        [--modes MODE ...] [--slow-modes MODE ...] [--out FILE]

``--modes`` and ``--slow-modes`` run a subset (``alone`` always runs),
for more rounds of the modes a page quotes in the same time
(``compression_40_rounds.json`` is such a run); ``--reanalyse FILE``
recomputes a saved result's rows from its rounds.

Two ranks as hosts in network namespaces joined by a tc-shaped link, each
pinned to a core of its own with one BLAS thread (``testbed/netbed.py``,
as ``benchmarks/overlap_bench.py``).  Two models: ResNet-50 (batch 4 at
224 px) and a lighter one, ResNet-18 at 128 px (batch 8): 0.73x ResNet-50's
compute per parameter, so what each byte costs weighs more.  Modes,
interleaved in rounds in one job per link (:mod:`benchmarks.harness.trainer`):
``alone`` (the denominator), ChainerMN ``blocking``, and ours with
``wait='forward'``: float32 on the wire, float16 on the wire, PowerSGD of
rank 1 and 4; and PowerSGD of rank 4 with ``wait='update'``.  Two links
per model:

* ``calibrated``: blocking lands at the anchor's 0.667 (gradient transfer
  about 0.5 x one rank's compute), found as in ``overlap_bench``;
* ``slow``: a quarter of that rate (gradient transfer about 2 x compute),
  where no overlap of float32 can pass ~0.5.

Each figure is the median over rounds of the per-round scalability, with
its 95 % bootstrap interval (:mod:`benchmarks.harness.stats`).  The bed's own
bound is measured in the same run: the compute slowdown per byte while the link
carries allreduces (``benchmarks/comm_cost.py``), so a mode moving ``B``
bytes per iteration, with compression compute ``t_z``, can reach at most
``t_c / max(t_c + B * cost + t_z, B / link)``.  Each mode's scalability is
reported beside that bound and as a fraction of it.

Writes ``benchmarks/results/compression.json`` and ``compression.png``.
"""
import argparse
import json
import os
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks import comm_cost  # noqa: E402
from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness import bedrun as ob  # noqa: E402
from testbed import netbed  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402

MODES = ['alone', 'blocking', 'overlap_forward', 'overlap_forward_float16',
         'overlap_forward_powersgd1', 'overlap_forward_powersgd4',
         'overlap_update_powersgd4']
LABELS = {'overlap_forward': 'float32', 'overlap_forward_float16': 'float16',
          'overlap_forward_powersgd1': 'PowerSGD r=1',
          'overlap_forward_powersgd2': 'PowerSGD r=2',
          'overlap_forward_powersgd4': 'PowerSGD r=4',
          'overlap_update_powersgd4': 'PowerSGD r=4, update',
          'blocking': 'ChainerMN blocking', 'alone': 'one rank alone'}


def bound(t_compute, nbytes, cost_per_byte, link_bytes_per_s, t_extra=0.0):
    """Scalability this bed allows for ``nbytes`` per iteration; pure.

    A measured cost below zero (noise: moving bytes cannot speed compute
    up) counts as zero.
    """
    busy = t_compute + nbytes * max(cost_per_byte, 0.0) + t_extra
    return t_compute / max(busy, nbytes / link_bytes_per_s)


def wire_bytes(mode, model_name, grad_bytes):
    """Gradient bytes each rank reduces per iteration in ``mode``.

    Computed from the model (the optimizers' own counters also count, with
    ``wait='forward'``, the buckets of the warm-up iteration waited for in
    the first timed one).
    """
    if mode.endswith('float16'):
        return grad_bytes / 2.0
    if 'powersgd' in mode:
        from benchmarks.harness import workloads
        from chainermn_overlap import PowerSGD
        shapes = [p.shape for p in
                  workloads.build_model(model_name).params()]
        rank = int(mode.rsplit('powersgd', 1)[1])
        return PowerSGD(rank=rank).wire_elements(shapes) * 4.0
    return float(grad_bytes)


def analyse(run, grad_bytes, cost, link_bytes_per_s, model):
    """Adds bytes per iteration, the bound and its fraction to each mode.

    The compute time in the bound is one rank alone in the same rounds
    (the denominator of every scalability here), not the first guess
    taken before calibration: that guess, one short process, ran 10 %
    faster than ``alone`` in the rounds on ResNet-18 (0.674 s against
    0.745 s).
    """
    t_compute = 1.0 / run['modes']['alone']['it_per_s_median']
    rows = {}
    for mode, s in run['modes'].items():
        if mode == 'alone':
            continue
        stats = s.get('communication_stats') or {}
        iters = s['iterations']
        nbytes = wire_bytes(mode, model, grad_bytes)
        # CPU seconds of the compression (its thread's time), per timed
        # iteration (the counter is reset when timing starts).
        t_z = stats.get('compression_seconds', 0.0) / iters
        b = bound(t_compute, nbytes, cost, link_bytes_per_s, t_z)
        rows[mode] = {'label': LABELS[mode],
                      'scalability': s['scalability'],
                      'scalability_ci': s['scalability_ci'],
                      'scalability_rounds': s['scalability_rounds'],
                      'bytes_per_iteration': nbytes,
                      'compression_seconds_per_iteration': t_z,
                      'hidden_fraction': stats.get('hidden_fraction'),
                      'bound': b, 'fraction_of_bound': s['scalability'] / b}
    return rows


def plot(result, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    models = list(result['models'])
    fig, axes = plt.subplots(1, len(models), figsize=(10 * len(models) / 1.6,
                                                      4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        res = result['models'][name]
        links = list(res['links'])
        modes = [m for m in MODES if any(
            m in res['links'][link]['rows'] for link in links)]
        width = 0.8 / len(links)
        for i, link in enumerate(links):
            rows = res['links'][link]['rows']
            shown = [(j, m) for j, m in enumerate(modes) if m in rows]
            xs = [j + i * width for j, _ in shown]
            ys = [rows[m]['scalability'] for _, m in shown]
            err = [[y - rows[m]['scalability_ci'][0] for y, (_, m) in
                    zip(ys, shown)],
                   [rows[m]['scalability_ci'][1] - y for y, (_, m) in
                    zip(ys, shown)]]
            ax.bar(xs, ys, width, yerr=err, capsize=2,
                   label='{} ({:.0f} Mbit/s)'.format(
                       link, res['links'][link]['rate_bit_per_s'] / 1e6))
            ax.scatter(xs, [rows[m]['bound'] for _, m in shown], marker='_',
                       s=300, color='k')
        ax.set_xticks([j + width * (len(links) - 1) / 2
                       for j in range(len(modes))])
        ax.set_xticklabels([LABELS[m] for m in modes], rotation=30,
                           fontsize=8)
        ax.set_ylabel('scalability (2 ranks)')
        ax.set_ylim(0, 1.05)
        c = res['config']
        ax.set_title('{} batch {} at {}px; black: the bed\'s bound; bars: '
                     '95% CI'.format(c['model'], c['batch'], c['insize']),
                     fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def measure_model(spec, args, log):
    """Calibration, the bed's cost per byte and both links for one model."""
    model, batch, insize = spec
    from chainermn_overlap import _kernels
    cfg = {'model': model, 'batch': batch, 'insize': insize,
           'iterations': args.iterations, 'warmup': args.warmup,
           'settle': args.settle, 'rounds': args.rounds, 'trace': None,
           'native_kernels': _kernels.native_enabled()}
    t_compute = ob.measure_alone(cfg)
    grad_bytes = ob.gradient_bytes(model)
    log('{} batch {} at {} px: compute {:.3f} s per iteration alone; '
        'gradients {:.1f} MB'.format(model, batch, insize, t_compute,
                                     grad_bytes / 1e6))
    if args.rate:
        rate, calibration = netbed.parse_rate(args.rate), []
    else:
        rate, calibration = ob.calibrate(cfg, t_compute, grad_bytes, log)
    log('measuring the bed\'s cost per byte at {:.0f} Mbit/s'.format(
        rate / 1e6))
    cost_summary, _, _, cost_cfg = comm_cost.measure(rate, steps=20,
                                                     rounds=3)
    cost = comm_cost.cost_per_byte(cost_summary)
    link_bps = cost_summary['reducing']['allreduce_MB_per_s_median'] * 1e6
    log('  {:.3g} s of compute per MB moved; allreduce {:.1f} MB/s'.format(
        cost * 1e6, link_bps / 1e6))
    out = {'config': cfg, 't_compute_alone_s': t_compute,
           'gradient_bytes': grad_bytes, 'calibration': calibration,
           'cost': {'seconds_per_byte': cost,
                    'allreduce_bytes_per_s': link_bps,
                    'summary': cost_summary, 'config': cost_cfg},
           'links': {}}
    for name, r, modes in (('calibrated', rate, args.modes),
                           ('slow', rate / args.slow_factor,
                            args.slow_modes or args.modes)):
        log('{} link, {:.0f} Mbit/s'.format(name, r / 1e6))
        run = ob.run_bed(r, dict(cfg, modes=modes), t_compute, log)
        # The slow link moves bytes slower; its cost per byte in compute is
        # the kernel's and the copies', the same as at the calibrated rate.
        rows = analyse(run, grad_bytes, cost, link_bps * r / rate, model)
        out['links'][name] = {'rate_bit_per_s': r, 'rows': rows, 'run': run}
        for m, row in rows.items():
            z = row['compression_seconds_per_iteration']
            log('  {:14s} {:.3f} [{:.3f}, {:.3f}]  (bound {:.3f}, {:.0%} of '
                'it; {:.2f} MB/it{})'.format(
                    row['label'], row['scalability'],
                    row['scalability_ci'][0], row['scalability_ci'][1],
                    row['bound'], row['fraction_of_bound'],
                    row['bytes_per_iteration'] / 1e6,
                    ', compression {:.3f} s/it'.format(z) if z else ''))
    out['checks'] = checks(out['links']['calibrated']['rows'],
                           out['links']['slow']['rows'])
    return out


def reanalyse(result):
    """Recomputes every row and check of a saved result from its raw
    rounds (for a result saved by an earlier version of :func:`analyse`).
    """
    for model, out in result['models'].items():
        rate = out['links']['calibrated']['rate_bit_per_s']
        for link in out['links'].values():
            link['rows'] = analyse(
                link['run'], out['gradient_bytes'],
                out['cost']['seconds_per_byte'],
                out['cost']['allreduce_bytes_per_s']
                * link['rate_bit_per_s'] / rate, model)
        out['checks'] = checks(out['links']['calibrated']['rows'],
                               out['links']['slow']['rows'])
    result['checks'] = {'{}: {}'.format(m, k): v
                        for m, res in result['models'].items()
                        for k, v in res['checks'].items()}
    return result


def checks(cal, slow):
    """The targets, for the modes that were run."""
    def scal(rows, mode):
        return rows[mode]['scalability'] if mode in rows else None
    wanted = [
        ('float16 >= float32', cal, 'overlap_forward_float16',
         lambda v: v >= scal(cal, 'overlap_forward')
         if 'overlap_forward' in cal else None),
        ('PowerSGD r=4 >= 0.95 (calibrated)', cal,
         'overlap_forward_powersgd4', lambda v: v >= 0.95),
        ('PowerSGD r=4 >= 0.90 (slow)', slow, 'overlap_forward_powersgd4',
         lambda v: v >= 0.90),
        ('PowerSGD r=4, wait=update >= 0.95 (calibrated)', cal,
         'overlap_update_powersgd4', lambda v: v >= 0.95),
        ('PowerSGD r=4, wait=update >= 0.90 (slow)', slow,
         'overlap_update_powersgd4', lambda v: v >= 0.90),
    ]
    out = {}
    for name, rows, mode, test in wanted:
        v = scal(rows, mode)
        ok = test(v) if v is not None else None
        if ok is not None:
            out[name] = ok
    return out


def parse_model(text):
    """``resnet50:4:224`` -> ('resnet50', 4, 224)."""
    try:
        name, batch, insize = text.split(':')
        return name, int(batch), int(insize)
    except ValueError:
        raise argparse.ArgumentTypeError(
            'a model is NAME:BATCH:INSIZE (e.g. resnet18:8:128), got {!r}'
            .format(text))


def parse_mode(text):
    """A mode of :data:`MODES`."""
    if text not in MODES:
        raise argparse.ArgumentTypeError(
            'unknown mode {!r}; choose from {}'.format(text, ', '.join(MODES)))
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', nargs='+', type=parse_model,
                   default=[('resnet50', 4, 224), ('resnet18', 8, 128)],
                   help='NAME:BATCH:INSIZE each (default resnet50:4:224 '
                        'resnet18:8:128)')
    p.add_argument('--iterations', type=int, default=3,
                   help='timed iterations per mode and round')
    # 3 warm-up iterations: PowerSGD's first compressed iterations (error
    # buffers first touched, ranks settling into step) ran 0.3 s slower
    # than the steady state in 2-warm-up runs.
    p.add_argument('--warmup', type=int, default=3,
                   help='untimed iterations of each mode before round 1')
    p.add_argument('--settle', type=int, default=1,
                   help='untimed iterations of each mode in every round')
    p.add_argument('--rounds', type=int, default=10)
    p.add_argument('--modes', nargs='+', type=parse_mode, default=MODES,
                   help='modes at both links (default: all; "alone", '
                        'the denominator, is always run)')
    p.add_argument('--slow-modes', nargs='+', type=parse_mode, default=None,
                   help='modes at the slow link (default: --modes)')
    p.add_argument('--rate', default=None,
                   help='skip calibration: the calibrated link rate')
    p.add_argument('--slow-factor', type=float, default=4.0)
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'compression.json'))
    p.add_argument('--reanalyse', metavar='FILE', default=None,
                   help='measure nothing: recompute the rows and checks of '
                        'a saved result from its rounds and rewrite it '
                        '(and its plot)')
    args = p.parse_args(argv)
    if args.reanalyse:
        with open(args.reanalyse) as f:
            result = reanalyse(json.load(f))
        save(result, args.reanalyse, lambda m: sys.stdout.write(m + '\n'))
        return 0
    for attr in ('modes', 'slow_modes'):
        chosen = getattr(args, attr)
        if chosen is not None:
            setattr(args, attr, [m for m in MODES
                                 if m == 'alone' or m in chosen])
    netbed.require_root()
    t_start = time.time()

    def log(msg):
        sys.stdout.write('[{:6.0f} s] {}\n'.format(time.time() - t_start,
                                                   msg))
        sys.stdout.flush()

    result = {'benchmark': 'float16 wire and PowerSGD on the test bed',
              'machine': machine_description(), 'modes': args.modes,
              'slow_modes': args.slow_modes or args.modes,
              'models': {}}
    for spec in args.models:
        result['models'][spec[0]] = measure_model(spec, args, log)
    result['checks'] = {'{}: {}'.format(m, k): v
                        for m, res in result['models'].items()
                        for k, v in res['checks'].items()}
    result['seconds'] = time.time() - t_start
    save(result, args.out, log)
    return 0


def save(result, path, log):
    """Writes the result and its plot; logs the checks."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(result, f, indent=1)
    try:
        plot(result, os.path.splitext(path)[0] + '.png')
    except ImportError:
        log('matplotlib missing: no plot')
    for k, v in result['checks'].items():
        log('check {}: {}'.format(k, 'yes' if v else 'NO'))
    log('saved ' + path)


if __name__ == '__main__':
    sys.exit(main())
