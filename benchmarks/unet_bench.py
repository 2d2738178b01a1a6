"""Strong scaling and activation memory of a spatially split 3-D U-Net.

Run (part of ``make bench-spatial``)::

    .venv/bin/python -m benchmarks unet [--insize 48] [--width 8] [--np 2]

Model: the U-Net of ``examples/spatial/train_unet3d_spatial.py`` (conv-GN-
ReLU blocks, max pooling, ``DeconvolutionND`` up-convolutions, skips) on
one ``insize^3`` volume, split over a ``(P, 1, 1)`` grid, one ``mpiexec -n
P`` per process count, one BLAS thread per rank.

* Strong scaling: inside one run it alternates, round by round, the
  single-process Chainer model on the whole volume (rank 0 alone, the
  others in a sleeping barrier) and the distributed step on all P ranks,
  and reports the median of the per-round ratios T(1) / T(P) with its 95 %
  bootstrap interval; efficiency = speed-up / P.
* Memory: peak bytes numpy allocates during one training step and the
  bytes still held after forward (the activations kept for backward), per
  process (the largest), against the single-process model (tracemalloc).

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
    serial = serial_loss = None
    if comm.rank == 0:
        serial, serial_loss = _models(None, args)
        _step(serial, serial_loss, x_glob)
    _step(dist, dist_loss, x_local)  # warm-up: plans, validation
    ratios, t_serial, t_dist = [], [], []
    for i in range(args.rounds):
        # The order alternates: the second of a round runs a little slower.
        ts = None
        for turn in ((0, 1) if i % 2 == 0 else (1, 0)):
            distconv_jobs.quiet_barrier(mpi)
            if turn == 0:
                if comm.rank == 0:
                    t0 = time.perf_counter()
                    _step(serial, serial_loss, x_glob)
                    ts = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                _step(dist, dist_loss, x_local)
                mpi.Barrier()
                td = time.perf_counter() - t0
        if comm.rank == 0:
            ratios.append(ts / td)
            t_serial.append(ts)
            t_dist.append(td)
    peak, held = distconv_jobs.step_memory(dist, lambda: dist_loss(x_local))
    peaks, helds = mpi.gather(peak), mpi.gather(held)
    if comm.rank != 0:
        return
    s_peak, s_held = distconv_jobs.step_memory(
        serial, lambda: serial_loss(x_glob))
    iv = stats.interval(ratios)
    sp = float(np.median(ratios))
    launch.emit_result(RESULT_TAG, {
        'processes': P, 'grid': [P, 1, 1], 'volume': list(shape[2:]),
        'width': args.width, 'levels': args.levels,
        'median_serial_step_s': float(np.median(t_serial)),
        'median_distributed_step_s': float(np.median(t_dist)),
        'speedup_median_of_ratios': sp, 'efficiency': sp / P,
        'ratio_rounds': iv['values'], 'ratio_ci': iv['ci'],
        'efficiency_ci': [c / P for c in iv['ci']],
        'exchanges': {k: v for k, v in grid.stats.items()
                      if k.startswith('exchange_')},
        'memory': {
            'serial_peak_bytes': s_peak,
            'serial_held_after_forward': s_held,
            'max_peak_bytes_per_process': max(peaks),
            'max_held_after_forward_per_process': max(helds),
            'peak_ratio_vs_serial': max(peaks) / s_peak,
            'held_ratio_vs_serial': max(helds) / s_held}})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--insize', type=int, default=48)
    p.add_argument('--width', type=int, default=8)
    p.add_argument('--levels', type=int, default=3)
    p.add_argument('--rounds', type=int, default=6)
    p.add_argument('--np', default='2')
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'unet.json'))
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    runs = []
    for n in [int(v) for v in args.np.split(',')]:
        cmd = launch.module_command(
            'benchmarks.unet_bench', '--worker', '--insize', args.insize,
            '--width', args.width, '--levels', args.levels, '--rounds',
            args.rounds)
        res = distconv_jobs.mpiexec(n, cmd, 3600)
        run = distconv_jobs.job_result(
            res, RESULT_TAG, 'unet_bench: the run at -n %d' % n)
        runs.append(run)
        sys.stdout.write(json.dumps(run) + '\n')
    result = {
        'benchmark': '3-D U-Net (examples/spatial/train_unet3d_spatial.py), '
                     'one volume split over (P, 1, 1): strong scaling '
                     'against the single-process model in the same run, '
                     'and numpy memory per process',
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
