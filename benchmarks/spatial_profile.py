"""Where the time of a distconv forward/backward goes (profiling aid).

Run::

    .venv/bin/python -m benchmarks.spatial_profile                  # 1 process
    .venv/bin/mpiexec -n 4 .venv/bin/python -m benchmarks.spatial_profile \
        --grid 2,2 [--overlap 0|1] [--check cached|always] [--cprofile]

Runs a conv-BN-ReLU-pool stack on one synthetic batch for a few steps and
reports, per step on rank 0: forward and backward wall time, the time spent
validating layouts (``SpatialGrid.check_spatial``/``check_samples``), the
exposed halo wait (time blocked in exchanges, from the grid's statistics)
and, with ``--cprofile``, the top functions by cumulative time. With 4
processes on a 2-core machine the processes oversubscribe the cores: the
split is indicative, the absolute times are not. Prints one JSON object.
"""
import argparse
import cProfile
import io
import json
import pstats
import time

import chainer
import chainer.functions as F
import chainermn
import numpy as np

from chainermn_overlap import distconv


class Stack(chainer.Chain):

    def __init__(self, grid, ch=16):
        super(Stack, self).__init__()
        self.grid = grid
        with self.init_scope():
            self.c1 = distconv.Convolution2D(grid, 3, ch, 3, pad=1)
            self.b1 = distconv.BatchNormalization(grid, ch)
            self.c2 = distconv.Convolution2D(grid, ch, ch, 3, pad=1)
            self.b2 = distconv.BatchNormalization(grid, ch)
            self.c3 = distconv.Convolution2D(grid, ch, ch, 3, stride=2, pad=1)

    def forward(self, x):
        g = self.grid
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(self.b2(self.c2(h)))
        h = distconv.max_pooling_2d(g, h, 3, 2, 1)
        h = self.c3(h)
        return F.sum(distconv.global_average_pooling(g, h))


def _timed(grid, name, timers):
    orig = getattr(grid, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            timers['validate_s'] += time.perf_counter() - t0
    setattr(grid, name, wrapper)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--grid', default='')
    p.add_argument('--insize', type=int, default=128)
    p.add_argument('--batchsize', type=int, default=4)
    p.add_argument('--channels', type=int, default=16)
    p.add_argument('--steps', type=int, default=6)
    p.add_argument('--overlap', type=int, default=1)
    p.add_argument('--check', default='cached')
    p.add_argument('--cprofile', action='store_true')
    args = p.parse_args()
    comm = chainermn.create_communicator('naive')
    shape = tuple(int(v) for v in args.grid.split(',')) if args.grid \
        else (comm.size, 1)
    kwargs = {}
    try:
        grid = distconv.SpatialGrid(comm, shape, overlap=bool(args.overlap),
                                    check=args.check)
        kwargs = {'overlap': bool(args.overlap), 'check': args.check}
    except TypeError:  # a version without these options
        grid = distconv.SpatialGrid(comm, shape)
    np.random.seed(0)
    model = Stack(grid, args.channels)
    timers = {'validate_s': 0.0}
    _timed(grid, 'check_spatial', timers)
    _timed(grid, 'check_samples', timers)
    rng = np.random.RandomState(1)
    x_local = grid.scatter(rng.randn(args.batchsize, 3, args.insize,
                                     args.insize).astype(np.float32))
    fwd, bwd, val, wait = [], [], [], []
    prof = cProfile.Profile() if args.cprofile else None
    for step in range(args.steps + 1):
        stats = getattr(grid, 'stats', None)
        if stats is not None:
            stats.clear()
        timers['validate_s'] = 0.0
        comm.mpi_comm.Barrier()
        if prof is not None and step > 0:
            prof.enable()
        t0 = time.perf_counter()
        loss = model(x_local)
        t1 = time.perf_counter()
        model.cleargrads()
        loss.backward()
        t2 = time.perf_counter()
        if prof is not None and step > 0:
            prof.disable()
        if step == 0:
            continue  # warm-up: first-use validation, plans, allocations
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        val.append(timers['validate_s'])
        wait.append(sum(v for k, v in (stats or {}).items()
                        if k.endswith('wait_s')))
    result = {
        'label': 'noisy: shared 2-core machine',
        'processes': comm.size, 'grid': list(shape), 'options': kwargs,
        'insize': args.insize, 'batchsize': args.batchsize,
        'channels': args.channels,
        'median_forward_s': float(np.median(fwd)),
        'median_backward_s': float(np.median(bwd)),
        'median_validate_s': float(np.median(val)),
        'median_exposed_halo_wait_s': float(np.median(wait)),
        'validate_fraction': float(np.median(
            [v / (f + b) for v, f, b in zip(val, fwd, bwd)])),
    }
    if stats is not None:
        result['stats_last_step'] = {k: (round(v, 6) if isinstance(v, float)
                                         else v) for k, v in stats.items()}
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats('cumulative').print_stats(
            25)
        result['cprofile_top'] = out.getvalue().splitlines()[:60]
    result['validation_micro_us'] = _validation_micro(comm, shape, x_local)
    if comm.rank == 0:
        print(json.dumps(result, indent=1))


def _validation_micro(comm, shape, x_local, calls=300):
    """Per-call cost of a layout check with the ranks in lockstep.

    A barrier before each timed loop and many calls make this the
    intrinsic cost (packing, messages, Python checks), not the waiting for
    a slower rank that dominates the in-training figure.
    """
    out = {}
    for check in ('always', 'cached'):
        try:
            g = distconv.SpatialGrid(comm, shape, check=check)
        except TypeError:
            g = distconv.SpatialGrid(comm, shape)
        sig = ('micro', (16, 3, 3, 3), (16,), '1', '1', False, '1', '1')
        g.check_spatial(x_local, 'micro', sig)
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            g.check_spatial(x_local, 'micro', sig)
        out[check] = (time.perf_counter() - t0) / calls * 1e6
    comm.mpi_comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        comm.mpi_comm.Barrier()
    out['barrier_reference'] = (time.perf_counter() - t0) / calls * 1e6
    return {k: round(v, 1) for k, v in out.items()}


if __name__ == '__main__':
    main()
