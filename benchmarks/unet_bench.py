"""Strong scaling and activation memory of a spatially split 3-D U-Net.

Run (part of ``make bench-spatial``)::

    .venv/bin/python -m benchmarks unet [--insize 48] [--width 8] [--np 2]
        [--bed | --shm] [--rate 400mbit] [--delay 0.1ms]

Model: the U-Net of ``examples/spatial/train_unet3d_spatial.py`` (conv-GN-
ReLU blocks, max pooling, ``DeconvolutionND`` up-convolutions, skips) on
one ``insize^3`` volume, split over a ``(P, 1, 1)`` grid, one job per
process count, one BLAS thread per rank.

Transport (``transport`` in the results):

* ``netbed`` (``--bed``; the default as root where ``ip`` and ``tc`` are
  found): each rank in a network namespace of its own, pinned to a core,
  MPICH over TCP through veth links shaped with tc to ``--rate`` (default
  400 Mbit/s, the first rate of ``spatial_bench --netbed``) and, with
  ``--delay``, a one-way delay (``testbed/netbed.py``); no shared memory.
* ``shared_memory`` (``--shm``, and the fallback elsewhere, said on
  stderr): one ``mpiexec -n P`` on this machine.

Per round, in an order that rotates from round to round (the later turns
of a round run a little slower), three turns:

* ``serial``: the single-process Chainer model on the whole volume (rank 0
  alone, the others in a sleeping barrier);
* ``distributed``: the distributed step on all P ranks (halo exchanges,
  group normalization's allreduces), to a barrier;
* ``local``: the bed's bound. Every rank runs the single-process model on
  a block of its distributed block's shape, all at once, to a barrier: the
  same arithmetic as the distributed step (its convolutions compute the
  same outputs from the same block, padded with zeros instead of halos)
  on the same cores at the same time, with no message, no halo assembly
  and no global statistics. A distributed step can at best match it, so
  ``T(1) / (P T_local)`` is the efficiency this machine allows (it is
  below 1 where two ranks share memory bandwidth or a core is slower),
  and ``T_local / T(P)`` how much of it the distributed step reaches.

Reported: medians of the per-round ratios with 95 % bootstrap intervals
(``benchmarks/harness/stats.py``): speed-up T(1) / T(P) and efficiency =
speed-up / P; the bound's speed-up and efficiency; the fraction of the
bound. On the bed, the link counters of the distributed turns (bytes per
step and rank, and the link seconds they need at the rate, TCP
retransmissions, qdisc drops).

Memory: peak bytes numpy allocates during one training step and the bytes
still held after forward (the activations kept for backward), per process
(the largest), against the single-process model (tracemalloc).

Results go to ``benchmarks/results/unet.json``. On a shared machine the
timings are noise: run it alone.
"""
import argparse
import json
import os
import platform
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import distconv_jobs, launch, stats  # noqa

RESULT_TAG = 'RESULT '


def _models(grid, args):
    import chainer.functions as F
    import numpy as np
    from examples.spatial.train_unet3d_spatial import UNet3D

    np.random.seed(0)
    model = UNet3D(grid, width=args.width, levels=args.levels)

    def loss(x):
        return F.sum(model(x))
    return model, loss


def _step(model, loss_fn, x):
    loss = loss_fn(x)
    model.cleargrads()
    loss.backward()


TURNS = ('serial', 'distributed', 'local')
DEFAULT_RATE = '400mbit'


def _timed(mpi, ranks, fn):
    """Seconds of ``fn()`` on ``ranks`` (None: all) to a barrier, after a
    sleeping barrier; the time of rank 0 (None elsewhere)."""
    distconv_jobs.quiet_barrier(mpi)
    t0 = time.perf_counter()
    if ranks is None or mpi.rank in ranks:
        fn()
    if ranks is None:
        mpi.Barrier()
    return time.perf_counter() - t0


def _ratios(num, den, scale=1.0):
    """Interval of the per-round ``num / den / scale``."""
    return stats.interval([a / b / scale for a, b in zip(num, den)])


def worker(args):
    import chainermn
    import numpy as np
    from chainermn_overlap import distconv
    comm = chainermn.create_communicator('naive')
    mpi = comm.mpi_comm
    P = comm.size
    grid = distconv.SpatialGrid(comm, (P, 1, 1))
    shape = (1, 1) + (args.insize,) * 3
    x_glob = np.random.RandomState(1).randn(*shape).astype(np.float32)
    box = grid.block(shape[2:])
    x_local = x_glob[(Ellipsis,) + tuple(slice(a, b) for a, b in box)].copy()
    dist, dist_loss = _models(grid, args)
    local, local_loss = _models(None, args)
    serial = serial_loss = None
    if comm.rank == 0:
        serial, serial_loss = _models(None, args)
        _step(serial, serial_loss, x_glob)
    _step(dist, dist_loss, x_local)  # warm-up: plans, validation, links
    _step(local, local_loss, x_local)
    link = distconv_jobs.link_counters if args.bed else None
    steps = {
        'serial': ((0,), lambda: _step(serial, serial_loss, x_glob)),
        'distributed': (None, lambda: _step(dist, dist_loss, x_local)),
        'local': (None, lambda: _step(local, local_loss, x_local))}
    times = {t: [] for t in TURNS}
    counts = []
    for i in range(args.rounds):
        for turn in TURNS[i % 3:] + TURNS[:i % 3]:
            c0 = link() if link and turn == 'distributed' else None
            times[turn].append(_timed(mpi, *steps[turn]))
            if c0 is not None:
                c1 = link()
                counts.append({k: c1[k] - c0[k] for k in c0})
    links = distconv_jobs.link_summary(mpi, counts) if link else None
    peak, held = distconv_jobs.step_memory(dist, lambda: dist_loss(x_local))
    peaks, helds = mpi.gather(peak), mpi.gather(held)
    if comm.rank != 0:
        return
    s_peak, s_held = distconv_jobs.step_memory(
        serial, lambda: serial_loss(x_glob))
    ts, td, tl = times['serial'], times['distributed'], times['local']
    sp, bound = _ratios(ts, td), _ratios(ts, tl)
    eff, beff = _ratios(ts, td, P), _ratios(ts, tl, P)
    frac = _ratios(tl, td)
    launch.emit_result(RESULT_TAG, {
        'processes': P, 'grid': [P, 1, 1], 'volume': list(shape[2:]),
        'block_per_process': [b - a for a, b in box],
        'width': args.width, 'levels': args.levels,
        'turn_order': 'rotating: round i starts at turn i mod 3 of %s'
                      % (TURNS,),
        'median_serial_step_s': float(np.median(ts)),
        'median_distributed_step_s': float(np.median(td)),
        'median_local_no_exchange_step_s': float(np.median(tl)),
        'round_seconds': times,
        'speedup_median_of_ratios': sp['median'], 'efficiency':
        eff['median'], 'ratio_rounds': sp['values'], 'ratio_ci': sp['ci'],
        'efficiency_ci': eff['ci'],
        'bound': {
            'what': 'every rank runs the single-process model on a block '
                    'of its distributed shape at the same time, no '
                    'exchange: the efficiency this machine allows',
            'speedup': bound['median'], 'speedup_ci': bound['ci'],
            'efficiency': beff['median'], 'efficiency_ci': beff['ci']},
        'fraction_of_bound': frac['median'],
        'fraction_of_bound_ci': frac['ci'],
        'link': links,
        'exchanges': {k: v for k, v in grid.stats.items()
                      if k.startswith('exchange_')},
        'memory': {
            'serial_peak_bytes': s_peak,
            'serial_held_after_forward': s_held,
            'max_peak_bytes_per_process': max(peaks),
            'max_held_after_forward_per_process': max(helds),
            'peak_ratio_vs_serial': max(peaks) / s_peak,
            'held_ratio_vs_serial': max(helds) / s_held}})


def _transport(args):
    """'netbed' or 'shared_memory', from the flags and this machine."""
    if args.shm:
        return 'shared_memory'
    why = distconv_jobs.why_no_netbed()
    if why is None:
        return 'netbed'
    if args.bed:
        raise SystemExit('unet_bench: --bed: the network test bed %s; run '
                         'as root with iproute2, or give --shm' % why)
    sys.stderr.write('unet_bench: the network test bed %s: timing over '
                     'shared memory instead (transport shared_memory; '
                     'run as root for the bed)\n' % why)
    return 'shared_memory'


def _job(args, n, transport):
    """One job at ``n`` ranks; its run record."""
    cmd = launch.module_command(
        'benchmarks.unet_bench', '--worker', '--insize', args.insize,
        '--width', args.width, '--levels', args.levels, '--rounds',
        args.rounds, *(['--bed'] if transport == 'netbed' else []))
    what = 'unet_bench: the run at -n %d' % n
    if transport == 'shared_memory':
        load = os.getloadavg()
        res = distconv_jobs.mpiexec(n, cmd, args.timeout)
        record = {'loadavg_before': load, 'loadavg_after': os.getloadavg()}
    else:
        res, record = distconv_jobs.bed_job(n, cmd, args.timeout, args.rate,
                                            args.delay)
    run = distconv_jobs.job_result(res, RESULT_TAG, what)
    run.update(record, transport=transport)
    if run.get('link'):
        rate = record['bed']['rate_bit_per_s']
        run['link'].update(
            rate_bit_per_s=rate, delay_s=record['bed']['delay_s'],
            link_s_per_step=max(
                run['link']['median_tx_bytes_per_step_per_rank']) * 8 / rate)
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--insize', type=int, default=48)
    p.add_argument('--width', type=int, default=8)
    p.add_argument('--levels', type=int, default=3)
    p.add_argument('--rounds', type=int, default=6)
    p.add_argument('--np', default='2')
    where = p.add_mutually_exclusive_group()
    where.add_argument('--bed', action='store_true',
                       help='on the network test bed (the default as root)')
    where.add_argument('--shm', action='store_true',
                       help='over shared memory on this machine')
    p.add_argument('--rate', default=DEFAULT_RATE,
                   help='link rate on the bed (default %(default)s)')
    p.add_argument('--delay', default=None,
                   help='one-way link delay on the bed, e.g. 0.1ms')
    p.add_argument('--timeout', type=float, default=3600,
                   help='seconds one job may take')
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'unet.json'))
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    nps = [int(v) for v in args.np.split(',')]
    step = 2 ** (args.levels - 1)
    for n in nps:
        if n < 2 or args.insize % (n * step):
            p.error('--np %d with --insize %d: each process count must be '
                    'at least 2 and divide the volume into blocks whose '
                    'side is a multiple of 2^(levels - 1) = %d (the '
                    'single-process bound runs the U-Net on one block); '
                    'e.g. --insize %d' % (n, args.insize, step,
                                          n * step * max(1, args.insize
                                                         // (n * step))))
    transport = _transport(args)
    runs = []
    for n in nps:
        runs.append(_job(args, n, transport))
        sys.stdout.write(json.dumps(runs[-1]) + '\n')
    result = {
        'benchmark': '3-D U-Net (examples/spatial/train_unet3d_spatial.py), '
                     'one volume split over (P, 1, 1): strong scaling '
                     'against the single-process model in the same run, '
                     'the bound of each rank computing its block with no '
                     'exchange, and numpy memory per process',
        'transport': transport,
        'notes': 'transport netbed: each rank in its own network '
                 'namespace, MPICH over TCP through tc-shaped veth links '
                 '(link: rate_bit_per_s, delay_s; bed: NetBed.describe()); '
                 'shared_memory: one mpiexec on this machine. bound: every '
                 'rank runs the single-process model on a block of its '
                 'distributed shape at once, no exchange: T(1) / (P '
                 'T_local) is the efficiency the machine allows; '
                 'fraction_of_bound = T_local / T(P). All figures: medians '
                 'of per-round ratios, 95 % bootstrap intervals.',
        'config': {k: v for k, v in vars(args).items() if k != 'worker'},
        'machine': {'platform': platform.platform(),
                    'python': platform.python_version(),
                    'cpu_count': os.cpu_count(),
                    'loadavg_at_end': os.getloadavg()},
        'runs': runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    sys.stdout.write('wrote %s\n' % args.out)
    return None


if __name__ == '__main__':
    main()
