"""Strong scaling, memory per process and exposed halo time of distconv.

Run (what ``make bench-spatial`` does)::

    .venv/bin/python benchmarks/spatial_bench.py [--insize 512] [--np 1,2,4]

For each process count P it starts ``mpiexec -n P`` on a conv stack
(3x3 convolutions with global batch norm and ReLU, a strided convolution,
global pooling) at a fixed global batch (strong scaling), the image split
over a (P, 1) grid. Inside one run it alternates, round by round, the
single-process Chainer model on the global batch (rank 0 alone) and the
distributed step on all P ranks, and reports the *median of the per-round
ratios* (noise on a shared machine hits both alike). Memory: peak bytes
allocated by numpy during one training step per process (tracemalloc, which
numpy reports to), and the bytes still held after forward (the
activations kept for backward), versus the single-process model. Exposed
halo time: seconds blocked in halo exchanges per step with overlap on and
off. Results go to ``benchmarks/results/spatial.json``.

This machine has 2 cores: P = 4 oversubscribes them (labelled so); use the
P = 2 figures for speed-up, the P = 4 ones for memory per process.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


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


def _memory(model, x):
    """(peak bytes during a step, bytes held after forward) by numpy."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    loss = model(x)
    held = tracemalloc.get_traced_memory()[0] - base
    model.cleargrads()
    loss.backward()
    peak = tracemalloc.get_traced_memory()[1] - base
    del loss
    tracemalloc.stop()
    return peak, held


def _quiet_barrier(mpi):
    """A barrier that sleeps instead of spinning.

    MPICH spins in a blocking barrier; while rank 0 times the serial model
    the other ranks would take the cores it needs (2 cores here).
    """
    req = mpi.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def worker(args):
    import chainermn
    import numpy as np
    from chainermn_overlap import distconv
    comm = chainermn.create_communicator('naive')
    mpi = comm.mpi_comm
    P = comm.size
    grid = distconv.SpatialGrid(comm, (P, 1))
    rng = np.random.RandomState(1)
    shape = (args.batchsize, 3, args.insize, args.insize)
    dist = _model(grid, args.channels, serial=False)
    box = grid.block(shape[2:])
    x_local = rng.randn(shape[0], 3, *[b - a for a, b in box]).astype(
        np.float32)
    serial = x_glob = None
    if comm.rank == 0:
        serial = _model(None, args.channels, serial=True)
        x_glob = rng.randn(*shape).astype(np.float32)
        _step(serial, x_glob)
    _step(dist, x_local)  # warm-up: plans, validation, allocations
    out = {'processes': P, 'grid': [P, 1]}
    ratios, t_serial, t_dist = [], [], []
    for _ in range(args.rounds):
        _quiet_barrier(mpi)
        ts = None
        if comm.rank == 0:
            t0 = time.perf_counter()
            _step(serial, x_glob)
            ts = time.perf_counter() - t0
        _quiet_barrier(mpi)
        t0 = time.perf_counter()
        _step(dist, x_local)
        mpi.Barrier()
        td = time.perf_counter() - t0
        if comm.rank == 0:
            ratios.append(ts / td)
            t_serial.append(ts)
            t_dist.append(td)
    if comm.rank == 0:
        sp = float(np.median(ratios))
        out.update(median_serial_step_s=float(np.median(t_serial)),
                   median_distributed_step_s=float(np.median(t_dist)),
                   speedup_median_of_ratios=sp, efficiency=sp / P)
    # Exposed halo time, overlap on and off, alternating.
    waits = {True: [], False: []}
    for _ in range(args.rounds):
        for overlap in (True, False):
            grid.overlap = overlap
            grid.stats.clear()
            mpi.Barrier()
            _step(dist, x_local)
            waits[overlap].append(grid.stats['forward_wait_s']
                                  + grid.stats['backward_wait_s'])
    grid.overlap = True
    w = {k: mpi.allreduce(float(np.median(v))) / P for k, v in waits.items()}
    out['exposed_halo_s_per_step_mean_over_ranks'] = {
        'overlap_on': w[True], 'overlap_off': w[False]}
    peak, held = _memory(dist, x_local)
    peaks = mpi.gather(peak)
    helds = mpi.gather(held)
    if comm.rank == 0:
        s_peak, s_held = _memory(serial, x_glob)
        out['memory'] = {
            'serial_peak_bytes': s_peak, 'serial_held_after_forward': s_held,
            'max_peak_bytes_per_process': max(peaks),
            'max_held_after_forward_per_process': max(helds),
            'peak_ratio_vs_serial': max(peaks) / s_peak,
            'held_ratio_vs_serial': max(helds) / s_held}
        print('RESULT ' + json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--insize', type=int, default=256)
    p.add_argument('--batchsize', type=int, default=2)
    p.add_argument('--channels', type=int, default=16)
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--np', default='1,2,4')
    p.add_argument('--out', default=os.path.join(HERE, 'results',
                                                 'spatial.json'))
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    env = dict(os.environ, OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
               MKL_NUM_THREADS='1')
    runs = []
    for n in [int(v) for v in args.np.split(',')]:
        cmd = [mpiexec, '-n', str(n), sys.executable, os.path.abspath(
            __file__), '--worker', '--insize', str(args.insize),
            '--batchsize', str(args.batchsize), '--channels',
            str(args.channels), '--rounds', str(args.rounds)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True,
                             cwd=ROOT, timeout=1800)
        lines = [ln for ln in res.stdout.splitlines()
                 if ln.startswith('RESULT ')]
        if res.returncode or not lines:
            sys.stderr.write(res.stdout[-3000:] + res.stderr[-3000:])
            raise SystemExit('spatial_bench: the run at -n %d failed' % n)
        run = json.loads(lines[-1][len('RESULT '):])
        cores = os.cpu_count()
        run['label'] = ('oversubscribed: %d processes on %d cores' %
                        (n, cores) if n > cores else 'noisy: shared machine')
        runs.append(run)
        sys.stdout.write(json.dumps(run) + '\n')
    result = {
        'benchmark': 'distconv strong scaling (fixed global batch), conv '
                     'stack 3x3 conv-BN-ReLU x2 + strided conv, grid (P, 1)',
        'config': vars(args),
        'machine': {'platform': platform.platform(),
                    'python': platform.python_version(),
                    'cpu_count': os.cpu_count(),
                    'loadavg_at_end': os.getloadavg()},
        'notes': 'Timings on a shared 2-core machine are noisy; speed-up is '
                 'the median over rounds of T_serial / T_distributed '
                 'measured in the same run. P > cores oversubscribes: use '
                 'it for memory, not speed. Memory is what numpy allocates '
                 '(tracemalloc).',
        'runs': runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    sys.stdout.write('wrote %s\n' % args.out)


if __name__ == '__main__':
    main()
