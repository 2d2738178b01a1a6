"""Strong and weak scaling, memory per process and exposed halo time of distconv.

Run (what ``make bench-spatial`` does)::

    .venv/bin/python -m benchmarks.spatial_bench [--insize 512] [--np 1,2,4]

Model: a conv stack (3x3 convolutions with global batch norm and ReLU, a
strided convolution, global pooling), the image split over a (P, 1) grid,
one ``mpiexec -n P`` per process count, each rank with one BLAS thread.

* Strong scaling (fixed global batch ``insize x insize``): inside one run
  it alternates, round by round, the single-process Chainer model on the
  global batch (rank 0 alone) and the distributed step on all P ranks, and
  reports the *median of the per-round ratios* T(1) / T(P) (noise on a
  shared machine hits both alike); efficiency = speed-up / P.
* Weak scaling (fixed block ``insize x insize`` per process, global image
  ``P * insize`` rows): the same alternation, with the single-process
  model on one block; efficiency = T(1) / T(P).
* Memory: peak bytes allocated by numpy during one training step per
  process (tracemalloc, which numpy reports to), and the bytes still held
  after forward (the activations kept for backward), versus one process.
* Exposed halo time: seconds blocked in halo waits per step (forward and
  backward, mean over ranks), alternating round by round three settings:
  the blocking exchange (``overlap=False``), overlap without progress calls
  (``progress_pieces=1``: MPICH moves no data while numpy computes, so
  nothing is hidden) and overlap with progress calls (the default); with
  the median of the per-round ratios to the blocking exchange and the
  fraction of exchanges already complete when their wait began.

Exposed halo time over a shaped link (``--netbed RATE``, as root): the
same three halo settings at 2 processes, each in a network namespace of its
own behind a tc-shaped veth link (``testbed/netbed.py``: MPICH over UCX
TCP, no shared memory, each rank pinned to a core), with each setting's
link counters per step (bytes sent and the seconds of link time they
need, TCP retransmissions, tail-loss probes and timeouts, qdisc drops),
recorded under the key ``halo_netbed`` of the results file (the other keys
are kept; the plot is redrawn)::

    .venv/bin/python -m benchmarks.spatial_bench --netbed 400mbit,50mbit

Results go to ``benchmarks/results/spatial.json`` and a plot to
``benchmarks/results/spatial.png``. This machine has 2 cores: P = 4
oversubscribes them (labelled so); use the P = 2 figures for speed-up, the
P = 4 ones for memory per process.
"""
import argparse
import json
import os
import platform
import sys
import time

# Run as a file (not with -m), sys.path starts with benchmarks/ instead of
# the repository root that holds the package: add the root.
if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import distconv_jobs, launch, stats  # noqa

RESULT_TAG = 'RESULT '


def _model(grid, ch, serial):
    import chainer
    import chainer.functions as F
    import chainer.links as L
    import numpy as np
    from chainermn_overlap import distconv

    class Stack(chainer.Chain):
        def __init__(self):
            super(Stack, self).__init__()
            np.random.seed(0)
            with self.init_scope():
                if serial:
                    self.c1 = L.Convolution2D(3, ch, 3, pad=1)
                    self.b1 = L.BatchNormalization(ch)
                    self.c2 = L.Convolution2D(ch, ch, 3, pad=1)
                    self.b2 = L.BatchNormalization(ch)
                    self.c3 = L.Convolution2D(ch, ch, 3, 2, 1)
                else:
                    self.c1 = distconv.Convolution2D(grid, 3, ch, 3, pad=1)
                    self.b1 = distconv.BatchNormalization(grid, ch)
                    self.c2 = distconv.Convolution2D(grid, ch, ch, 3, pad=1)
                    self.b2 = distconv.BatchNormalization(grid, ch)
                    self.c3 = distconv.Convolution2D(grid, ch, ch, 3, 2, 1)

        def forward(self, x):
            h = F.relu(self.b1(self.c1(x)))
            h = F.relu(self.b2(self.c2(h)))
            h = self.c3(h)
            if serial:
                return F.sum(F.mean(h, axis=(2, 3)))
            return F.sum(distconv.global_average_pooling(grid, h))
    return Stack()


def _step(model, x):
    loss = model(x)
    model.cleargrads()
    loss.backward()


def _halo_modes(grid, dist, x_local, mpi, rounds, link=None):
    """Exposed halo time per step with the three exchange settings.

    ``link``: a callable returning counters
    (:func:`benchmarks.harness.distconv_jobs.link_counters`), read around
    each step; their sums over steps and ranks are reported.
    """
    import numpy as np
    from mpi4py import MPI
    modes = (('blocking', False, 1), ('overlap_no_progress', True, 1),
             ('overlap_progress', True, grid.progress_pieces))
    default = grid.progress_pieces
    waits = {m[0]: [] for m in modes}
    steps = {m[0]: [] for m in modes}
    halos = {m[0]: [0, 0] for m in modes}
    counts = {m[0]: [] for m in modes}
    for _ in range(rounds):
        for name, overlap, pieces in modes:
            grid.overlap, grid.progress_pieces = overlap, pieces
            grid.stats.clear()
            c0 = link() if link else None
            distconv_jobs.quiet_barrier(mpi)
            t0 = time.perf_counter()
            _step(dist, x_local)
            t = time.perf_counter() - t0
            if link:
                c1 = link()
                counts[name].append({k: c1[k] - c0[k] for k in c0})
            st = grid.stats
            # Mean over ranks: a wait hides on one rank what its peer lags.
            waits[name].append(mpi.allreduce(
                st['forward_wait_s'] + st['backward_wait_s']) / mpi.size)
            steps[name].append(mpi.allreduce(t, op=MPI.MAX))
            halos[name][0] += (st['forward_halos_ready']
                               + st['backward_halos_ready'])
            halos[name][1] += st['forward_halos'] + st['backward_halos']
    grid.overlap, grid.progress_pieces = True, default
    off = waits['blocking']
    out = {}
    for name, _, pieces in modes:
        ready = mpi.allreduce(halos[name][0])
        total = mpi.allreduce(halos[name][1])
        out[name] = {
            'progress_pieces': pieces,
            'median_exposed_halo_s_per_step': float(np.median(waits[name])),
            'median_ratio_to_blocking': float(np.median(
                [w / b for w, b in zip(waits[name], off) if b > 0]
                or [float('nan')])),
            'median_step_s': float(np.median(steps[name])),
            'exchanges_complete_before_wait': (ready / total if total
                                               else None)}
        if link:
            out[name]['link'] = distconv_jobs.link_summary(mpi, counts[name])
    return out


def halo_worker(args):
    """The halo settings only, at P processes (the shaped-link run)."""
    import chainermn
    import numpy as np
    from chainermn_overlap import distconv
    comm = chainermn.create_communicator('naive')
    grid = distconv.SpatialGrid(comm, (comm.size, 1))
    shape = (args.batchsize, 3, args.insize, args.insize)
    dist = _model(grid, args.channels, serial=False)
    box = grid.block(shape[2:])
    x_local = np.random.RandomState(1).randn(
        shape[0], 3, *[b - a for a, b in box]).astype(np.float32)
    _step(dist, x_local)  # warm-up: plans, validation, connections
    out = {'processes': comm.size, 'grid': [comm.size, 1],
           'global_image': list(shape[2:]),
           'block_per_process': [b - a for a, b in box],
           'halo': _halo_modes(grid, dist, x_local, comm.mpi_comm,
                               args.rounds, link=distconv_jobs.link_counters)}
    if comm.rank == 0:
        launch.emit_result(RESULT_TAG, out)


def _worker_cmd(args, scaling):
    """This module's worker for ``scaling`` ('strong', 'weak' or 'halo')."""
    return launch.module_command(
        'benchmarks.spatial_bench', '--worker', '--scaling', scaling,
        '--insize', args.insize, '--batchsize', args.batchsize,
        '--channels', args.channels, '--rounds', args.rounds)


def _netbed_run(args, rate):
    """Runs :func:`halo_worker` on 2 ranks over a link of ``rate``."""
    res, record = distconv_jobs.bed_job(2, _worker_cmd(args, 'halo'),
                                        args.netbed_timeout, rate)
    desc = record['bed']
    run = distconv_jobs.job_result(
        res, RESULT_TAG,
        'spatial_bench: the shaped-link halo run at %s' % rate)
    for mode in run['halo'].values():
        # Seconds the shaped link needs for one step's traffic (both ranks
        # send alike): above the step's compute time, waits cannot hide.
        mode['link']['link_s_per_step'] = max(
            mode['link']['median_tx_bytes_per_step_per_rank']) * 8 / \
            desc['rate_bit_per_s']
    run.update(
        label='2 processes in separate network namespaces, MPICH over UCX '
              'TCP through a tc-shaped veth link at %s (no shared memory), '
              'each pinned to a core; shared %d-core machine, noisy'
              % (rate, os.cpu_count()),
        rate=rate, rate_bit_per_s=desc['rate_bit_per_s'],
        seconds=res['seconds'],
        bed={k: desc[k] for k in ('topology', 'tbf_burst_bytes',
                                  'tc_commands', 'pinning', 'mpi_env')},
        loadavg_before=record['loadavg_before'],
        loadavg_after=record['loadavg_after'])
    return run


def run_netbed(args):
    """The halo settings over the shaped link, one bed per rate."""
    from testbed import netbed
    netbed.require_root()
    runs = [_netbed_run(args, rate.strip())
            for rate in args.netbed.split(',')]
    result = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    result['halo_netbed'] = {
        'benchmark': 'exposed halo-exchange time per training step at 2 '
                     'processes over the namespace test bed, conv stack as '
                     'in runs, grid (2, 1)',
        'config': {'insize': args.insize, 'batchsize': args.batchsize,
                   'channels': args.channels, 'rounds': args.rounds},
        'notes': 'median_exposed_halo_s_per_step: seconds blocked in halo '
                 'waits per step (forward + backward), mean over the 2 '
                 'ranks, median over rounds; the three settings alternate '
                 'round by round. The tbf bucket (tbf_burst_bytes) passes '
                 'bursts up to its depth at the veth speed: at high rates '
                 'a halo message fits in it and the link rate barely '
                 'shows; at low rates the step\'s halo traffic exceeds it.',
        'runs': runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    if 'runs' in result:  # the scaling runs are there: redraw with both
        plot(result, os.path.splitext(args.out)[0] + '.png')
    for run in runs:
        sys.stdout.write('%s: %s\n' % (run['rate'], json.dumps(
            {k: v['median_exposed_halo_s_per_step']
             for k, v in run['halo'].items()})))
    sys.stdout.write('wrote key halo_netbed of %s\n' % args.out)
    return runs


def worker(args):
    import chainermn
    import numpy as np
    from chainermn_overlap import distconv
    comm = chainermn.create_communicator('naive')
    mpi = comm.mpi_comm
    P = comm.size
    grid = distconv.SpatialGrid(comm, (P, 1))
    rng = np.random.RandomState(1)
    weak = args.scaling == 'weak'
    # Weak scaling: a fixed block per process, the image grows with P.
    rows = args.insize * P if weak else args.insize
    shape = (args.batchsize, 3, rows, args.insize)
    serial_shape = (args.batchsize, 3, args.insize, args.insize)
    dist = _model(grid, args.channels, serial=False)
    box = grid.block(shape[2:])
    x_local = rng.randn(shape[0], 3, *[b - a for a, b in box]).astype(
        np.float32)
    serial = x_glob = x_block = None
    if comm.rank == 0:
        serial = _model(None, args.channels, serial=True)
        x_glob = rng.randn(*serial_shape).astype(np.float32)
        _step(serial, x_glob)
        if not weak and P > 1:
            # Plain Chainer on one process's block: separates the size
            # effect (Chainer's cost per cell grows with the image: bigger
            # im2col buffers, freshly mapped and page-faulted each step)
            # from distconv's own efficiency.
            x_block = rng.randn(*x_local.shape).astype(np.float32)
            _step(serial, x_block)
    _step(dist, x_local)  # warm-up: plans, validation, allocations
    out = {'scaling': args.scaling, 'processes': P, 'grid': [P, 1],
           'global_image': list(shape[2:]),
           'serial_image': list(serial_shape[2:]),
           'block_per_process': [b - a for a, b in box]}
    ratios, t_serial, t_dist, t_block = [], [], [], []

    def serial_steps():
        if comm.rank != 0:
            return None
        t0 = time.perf_counter()
        _step(serial, x_glob)
        ts = time.perf_counter() - t0
        if x_block is not None:
            t0 = time.perf_counter()
            _step(serial, x_block)
            t_block.append(time.perf_counter() - t0)
        return ts

    for i in range(args.rounds):
        # The order alternates: whichever runs second in a round was
        # measured slower by a few per cent (identical kernels at P = 1).
        distconv_jobs.quiet_barrier(mpi)
        if i % 2 == 0:
            ts = serial_steps()
            distconv_jobs.quiet_barrier(mpi)
        t0 = time.perf_counter()
        _step(dist, x_local)
        mpi.Barrier()
        td = time.perf_counter() - t0
        if i % 2 == 1:
            distconv_jobs.quiet_barrier(mpi)
            ts = serial_steps()
        if comm.rank == 0:
            ratios.append(ts / td)
            t_serial.append(ts)
            t_dist.append(td)
    if comm.rank == 0:
        sp = float(np.median(ratios))
        out.update(median_serial_step_s=float(np.median(t_serial)),
                   median_distributed_step_s=float(np.median(t_dist)))
        # The per-round ratios and their 95 % bootstrap interval.
        iv = stats.interval(ratios)
        out.update(ratio_rounds=iv['values'], ratio_ci=iv['ci'])
        if weak:
            out['weak_efficiency_median_of_ratios'] = sp
        else:
            out.update(speedup_median_of_ratios=sp, efficiency=sp / P)
        if t_block:
            out.update(
                median_serial_block_step_s=float(np.median(t_block)),
                # > 1: Chainer on the whole image costs more per cell than
                # on one block, which alone makes strong scaling look
                # superlinear.
                serial_size_effect=float(np.median(
                    [a / (P * b) for a, b in zip(t_serial, t_block)])),
                # distconv's step vs Chainer on the same block: the
                # efficiency without the size effect.
                efficiency_vs_serial_on_block=float(np.median(
                    [b / d for b, d in zip(t_block, t_dist)])))
    if P > 1:
        out['halo'] = _halo_modes(grid, dist, x_local, mpi, args.rounds)
    if weak:
        if comm.rank == 0:
            launch.emit_result(RESULT_TAG, out)
        return
    peak, held = distconv_jobs.step_memory(dist, lambda: dist(x_local))
    peaks = mpi.gather(peak)
    helds = mpi.gather(held)
    if comm.rank == 0:
        s_peak, s_held = distconv_jobs.step_memory(
            serial, lambda: serial(x_glob))
        out['memory'] = {
            'serial_peak_bytes': s_peak, 'serial_held_after_forward': s_held,
            'max_peak_bytes_per_process': max(peaks),
            'max_held_after_forward_per_process': max(helds),
            'peak_ratio_vs_serial': max(peaks) / s_peak,
            'held_ratio_vs_serial': max(helds) / s_held}
        launch.emit_result(RESULT_TAG, out)


def _run(args, n, scaling):
    res = distconv_jobs.mpiexec(n, _worker_cmd(args, scaling), 1800)
    run = distconv_jobs.job_result(
        res, RESULT_TAG, 'spatial_bench: the %s-scaling run at -n %d'
        % (scaling, n))
    cores = os.cpu_count()
    run['label'] = ('oversubscribed: %d processes on %d cores' % (n, cores)
                    if n > cores else 'noisy: shared %d-core machine' % cores)
    return run


def plot(result, path):
    """Writes a PNG: strong-scaling speed-up and memory, weak efficiency,
    and the exposed halo time per setting (shared memory and, if measured,
    the shaped link of ``halo_netbed``)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    cores = result['machine']['cpu_count']
    strong = [r for r in result['runs'] if r['scaling'] == 'strong']
    weak = [r for r in result['runs'] if r['scaling'] == 'weak']
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))

    def series(ax, runs, key, label, marker):
        ps = [r['processes'] for r in runs]
        vs = [key(r) for r in runs]
        ax.plot(ps, vs, marker + '-', label=label)
        for p, v in zip(ps, vs):
            if p > cores:  # hollow marker: oversubscribed
                ax.plot([p], [v], marker, mfc='white', ms=10, color='k')
    ps = [r['processes'] for r in strong]
    ax = axes[0]
    series(ax, strong, lambda r: r['speedup_median_of_ratios'], 'measured',
           'o')
    series(ax, strong, lambda r: r['processes'] * r.get(
        'efficiency_vs_serial_on_block', 1.0),
        'P x (Chainer on one block / distconv)', 's')
    ax.plot(ps, ps, 'k:', label='ideal')
    ax.axhline(cores, color='grey', lw=0.8, ls='--', label='%d cores' % cores)
    ax.set(title='Strong scaling %dx%d' % tuple(strong[0]['global_image']),
           xlabel='processes', ylabel='speed-up vs 1 process (Chainer)')
    ax = axes[1]
    series(ax, strong, lambda r: r['memory']['peak_ratio_vs_serial'],
           'peak during step', 'o')
    series(ax, strong, lambda r: r['memory']['held_ratio_vs_serial'],
           'held after forward', 's')
    ax.plot(ps, [1.0 / p for p in ps], 'k:', label='1/P')
    ax.set(title='Memory per process', xlabel='processes',
           ylabel='max over processes / 1 process')
    ax = axes[2]
    if weak:
        series(ax, weak, lambda r: r['weak_efficiency_median_of_ratios'],
               'measured', 'o')
        wp = [r['processes'] for r in weak]
        ax.plot(wp, [1.0] * len(wp), 'k:', label='ideal')
        ax.set(title='Weak scaling, %dx%d per process'
               % tuple(weak[0]['serial_image']), xlabel='processes',
               ylabel='efficiency T(1) / T(P)', ylim=(0, 1.2))
    for ax in axes[:3]:
        ax.set_xticks(ps)
    _plot_halo(axes[3], result)
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle('distconv on a shared %d-core machine (hollow: '
                 'oversubscribed; medians of per-round ratios)' % cores,
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


HALO_MODES = (('blocking', 'blocking exchange'),
              ('overlap_no_progress', 'overlap, no progress calls'),
              ('overlap_progress', 'overlap + progress calls'))


def _plot_halo(ax, result):
    """Bars of the exposed halo time per step at P = 2, one group per link:
    shared memory (strong scaling run) and each shaped-link rate."""
    import numpy as np
    groups = [('shared memory', r['halo']) for r in result['runs']
              if r['scaling'] == 'strong' and r['processes'] == 2
              and 'halo' in r]
    groups += [('link %s' % r['rate'], r['halo'])
               for r in result.get('halo_netbed', {}).get('runs', [])]
    width = 0.8 / len(HALO_MODES)
    for i, (key, label) in enumerate(HALO_MODES):
        ms = [1e3 * h[key]['median_exposed_halo_s_per_step']
              for _, h in groups]
        ax.bar(np.arange(len(groups)) + (i - 1) * width, ms, width,
               label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g for g, _ in groups], fontsize=8)
    # Log scale: the settings differ by orders of magnitude.
    ax.set_yscale('log')
    ax.set(title='Exposed halo wait, P = 2',
           ylabel='ms per step (forward + backward)')


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--insize', type=int, default=512)
    p.add_argument('--batchsize', type=int, default=1)
    p.add_argument('--channels', type=int, default=16)
    p.add_argument('--rounds', type=int, default=6)
    p.add_argument('--np', default='1,2,4')
    p.add_argument('--weak-insize', type=int, default=256,
                   help='block size per process for weak scaling')
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'spatial.json'))
    p.add_argument('--plot-only', action='store_true',
                   help='redraw the PNG from an existing --out JSON')
    p.add_argument('--netbed', metavar='RATE', default=None,
                   help='only measure the exposed halo time at 2 processes '
                   'over the namespace test bed at these link rates (e.g. '
                   '400mbit,10mbit; needs root); stored under halo_netbed')
    p.add_argument('--netbed-timeout', type=float, default=600)
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--scaling', default='strong', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        if args.scaling == 'halo':
            return halo_worker(args)
        return worker(args)
    if args.netbed:
        return run_netbed(args)
    if args.plot_only:
        with open(args.out) as f:
            plot(json.load(f), os.path.splitext(args.out)[0] + '.png')
        return None
    runs = []
    nps = [int(v) for v in args.np.split(',')]
    for n in nps:
        runs.append(_run(args, n, 'strong'))
        sys.stdout.write(json.dumps(runs[-1]) + '\n')
    weak_args = argparse.Namespace(**vars(args))
    weak_args.insize = args.weak_insize
    for n in nps:
        runs.append(_run(weak_args, n, 'weak'))
        sys.stdout.write(json.dumps(runs[-1]) + '\n')
    result = {
        'benchmark': 'distconv strong scaling (fixed global batch) and weak '
                     'scaling (fixed block per process), conv stack 3x3 '
                     'conv-BN-ReLU x2 + strided conv, grid (P, 1)',
        'config': {k: v for k, v in vars(args).items()
                   if k not in ('worker', 'scaling')},
        'machine': {'platform': platform.platform(),
                    'python': platform.python_version(),
                    'cpu_count': os.cpu_count(),
                    'loadavg_at_end': os.getloadavg()},
        'notes': 'Timings on a shared 2-core machine are noisy (other '
                 'jobs run on it; see loadavg_at_end); speed-up and weak '
                 'efficiency are medians over rounds of T_serial / '
                 'T_distributed measured in the same run. P > cores '
                 'oversubscribes: use it for memory, not speed. Memory is '
                 'what numpy allocates (tracemalloc). halo: exposed (not '
                 'hidden) halo-wait seconds per step, mean over ranks.',
        'runs': runs}
    if os.path.exists(args.out):
        # The shaped-link figures come from a separate (root) run: keep them.
        with open(args.out) as f:
            previous = json.load(f)
        if 'halo_netbed' in previous:
            result['halo_netbed'] = previous['halo_netbed']
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + '.png'
    plot(result, png)
    sys.stdout.write('wrote %s and %s\n' % (args.out, png))


if __name__ == '__main__':
    main()
