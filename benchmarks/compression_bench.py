"""Fewer bytes, faster: float16 on the wire and PowerSGD on the test bed.

Run (as root, from the repository root; ``make bench`` runs it after the
overlap benchmark)::

    python -m benchmarks.compression_bench [--model resnet50 --insize 112]

Two ranks as hosts in network namespaces joined by a tc-shaped link, each
pinned to a core of its own with one BLAS thread (``benchmarks/netbed.py``,
as ``benchmarks/overlap_bench.py``).  Modes, interleaved in rounds in one job
per link: ``alone`` (the denominator), ChainerMN ``blocking``, and ours with
``wait='forward'``: float32 on the wire, float16 on the wire, PowerSGD of
rank 1, 2 and 4.  Two links:

* ``calibrated``: blocking lands at the anchor's 0.667 (gradient transfer
  about 0.5 x one rank's compute), found as in ``overlap_bench``;
* ``slow``: a quarter of that rate (gradient transfer about 2 x compute),
  where no overlap of float32 can pass ~0.5.

The bed's own bound is measured in the same run: the compute slowdown per
byte while the link carries allreduces (``benchmarks/comm_cost.py``), so a
mode moving ``B`` bytes per iteration, with compression compute ``t_z``,
can reach at most ``t_c / max(t_c + B * cost + t_z, B / link)``.  Each
mode's scalability is reported beside that bound and as a fraction of it.

Writes ``benchmarks/results/compression.json`` and ``compression.png``.
"""
import argparse
import json
import os
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks import comm_cost, launch, netbed  # noqa: E402
from benchmarks import overlap_bench as ob  # noqa: E402
from benchmarks.machine import machine_description  # noqa: E402

MODES = ['alone', 'blocking', 'overlap_forward', 'overlap_forward_float16',
         'overlap_forward_powersgd1', 'overlap_forward_powersgd2',
         'overlap_forward_powersgd4']
LABELS = {'overlap_forward': 'float32', 'overlap_forward_float16': 'float16',
          'overlap_forward_powersgd1': 'PowerSGD r=1',
          'overlap_forward_powersgd2': 'PowerSGD r=2',
          'overlap_forward_powersgd4': 'PowerSGD r=4',
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
        from benchmarks import workloads
        from chainermn_overlap import PowerSGD
        shapes = [p.shape for p in
                  workloads.build_model(model_name).params()]
        rank = int(mode.rsplit('powersgd', 1)[1])
        return PowerSGD(rank=rank).wire_elements(shapes) * 4.0
    return float(grad_bytes)


def analyse(run, t_compute, grad_bytes, cost, link_bytes_per_s, model):
    """Adds bytes per iteration, the bound and its fraction to each mode."""
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
                      'bytes_per_iteration': nbytes,
                      'compression_seconds_per_iteration': t_z,
                      'hidden_fraction': stats.get('hidden_fraction'),
                      'bound': b, 'fraction_of_bound': s['scalability'] / b}
    return rows


def plot(result, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    links = list(result['links'])
    modes = [m for m in MODES if m != 'alone']
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(links)
    for i, link in enumerate(links):
        rows = result['links'][link]['rows']
        xs = [j + i * width for j in range(len(modes))]
        ax.bar(xs, [rows[m]['scalability'] for m in modes], width,
               label='{} ({:.0f} Mbit/s)'.format(
                   link, result['links'][link]['rate_bit_per_s'] / 1e6))
        ax.scatter(xs, [rows[m]['bound'] for m in modes], marker='_',
                   s=300, color='k')
    ax.set_xticks([j + width * (len(links) - 1) / 2
                   for j in range(len(modes))])
    ax.set_xticklabels([LABELS[m] for m in modes], rotation=20)
    ax.set_ylabel('scalability (2 ranks)')
    ax.set_ylim(0, 1.05)
    ax.set_title('{} batch {} at {}px; black: the bed\'s bound'.format(
        result['config']['model'], result['config']['batch'],
        result['config']['insize']))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='resnet50',
                   choices=('resnet50', 'resnet_small'))
    p.add_argument('--batch', type=int, default=4)
    p.add_argument('--insize', type=int, default=224)
    # 3 warm-up iterations per round: PowerSGD's first compressed
    # iterations (error buffers first touched, ranks settling into step)
    # ran 0.3 s slower than the steady state in 2-warm-up runs.
    p.add_argument('--iterations', type=int, default=6)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--rate', default=None,
                   help='skip calibration: the calibrated link rate')
    p.add_argument('--slow-factor', type=float, default=4.0)
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'compression.json'))
    args = p.parse_args(argv)
    netbed.require_root()
    t_start = time.time()

    def log(msg):
        sys.stdout.write('[{:6.0f} s] {}\n'.format(time.time() - t_start,
                                                   msg))
        sys.stdout.flush()

    from chainermn_overlap import _kernels
    cfg = {'model': args.model, 'batch': args.batch, 'insize': args.insize,
           'iterations': args.iterations, 'warmup': args.warmup,
           'rounds': args.rounds, 'trace': None,
           'native_kernels': _kernels.native_enabled()}
    t_compute = ob.measure_alone(cfg)
    grad_bytes = ob.gradient_bytes(args.model)
    log('compute {:.3f} s per iteration alone; gradients {:.1f} MB'.format(
        t_compute, grad_bytes / 1e6))
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
    result = {'benchmark': 'float16 wire and PowerSGD on the test bed',
              'machine': machine_description(), 'config': cfg,
              't_compute_alone_s': t_compute,
              'gradient_bytes': grad_bytes, 'calibration': calibration,
              'cost': {'seconds_per_byte': cost,
                       'allreduce_bytes_per_s': link_bps,
                       'summary': cost_summary, 'config': cost_cfg},
              'links': {}}
    for name, r in (('calibrated', rate), ('slow', rate / args.slow_factor)):
        log('{} link, {:.0f} Mbit/s'.format(name, r / 1e6))
        run = ob.run_bed(r, dict(cfg, modes=MODES), t_compute, log)
        # The slow link moves bytes slower; its cost per byte in compute is
        # the kernel's and the copies', the same as at the calibrated rate.
        rows = analyse(run, t_compute, grad_bytes, cost,
                       link_bps * r / rate, args.model)
        result['links'][name] = {'rate_bit_per_s': r, 'rows': rows,
                                 'run': run}
        for m, row in rows.items():
            log('  {:14s} {:.3f}  (bound {:.3f}, {:.0%} of it; {:.2f} MB/it'
                '{})'.format(row['label'], row['scalability'], row['bound'],
                             row['fraction_of_bound'],
                             row['bytes_per_iteration'] / 1e6,
                             ', compression {:.3f} s/it'.format(
                                 row['compression_seconds_per_iteration'])
                             if row['compression_seconds_per_iteration']
                             else ''))
    cal, slow = result['links']['calibrated']['rows'], \
        result['links']['slow']['rows']
    result['checks'] = {
        'float16 >= float32': cal['overlap_forward_float16']['scalability']
        >= cal['overlap_forward']['scalability'],
        'PowerSGD r=4 >= 0.95 (calibrated)':
            cal['overlap_forward_powersgd4']['scalability'] >= 0.95,
        'PowerSGD r=4 >= 0.85 (slow)':
            slow['overlap_forward_powersgd4']['scalability'] >= 0.85,
    }
    result['seconds'] = time.time() - t_start
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    try:
        plot(result, os.path.splitext(args.out)[0] + '.png')
    except ImportError:
        log('matplotlib missing: no plot')
    for k, v in result['checks'].items():
        log('check {}: {}'.format(k, 'yes' if v else 'NO'))
    log('saved ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
