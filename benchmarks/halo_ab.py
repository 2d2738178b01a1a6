"""Halo exchange time of two source trees, measured in interleaved rounds.

Run (from the repository root, on a quiet machine)::

    git worktree add /tmp/halo_base <baseline commit>   # or git archive
    .venv/bin/python -m benchmarks.halo_ab --a /tmp/halo_base --b . \\
        --rounds 21
    .venv/bin/python -m benchmarks.halo_ab --a /tmp/halo_base --b . --quick

Each round runs, for each process count (2 and 4), one ``mpiexec`` job per
tree, in alternating order (A then B in even rounds, B then A in odd ones),
so slow drifts of the machine hit both trees alike. A job imports
``chainermn_overlap`` from its tree (``PYTHONPATH``) and times the forward
and backward of the halo exchange for each case that fits: the blocking
:class:`RegionExchange` and the overlapped pair (``HaloStart`` /
``HaloFinish``) on the exchange plan of a convolution window, 2-D and 3-D,
narrow and wide halos, float32. One sample is the median over iterations
of the slowest rank's time. The report gives per tree the median over
rounds, the median of the per-round ratios B/A with a bootstrap 95%
interval (resampling rounds), and whether the two trees produced the same
bytes (sha256 of the exchanged box and the input gradient). JSON goes to
``benchmarks/results/halo_ab.json`` (``--out``).
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, 'results')

# name: (global input (N, C, *spatial), grid per process count, ksize,
# dilate); pad = dilate * (ksize - 1) // 2, stride 1. "wide": a halo of 6
# or 12 cells, wider than a 3-D block and a good part of a 2-D one.
CASES = {
    '2d-narrow': ((4, 32, 128, 128), {2: (2, 1), 4: (2, 2)}, 3, 1),
    '2d-wide': ((4, 32, 128, 128), {2: (2, 1), 4: (2, 2)}, 7, 4),
    '3d-narrow': ((2, 16, 32, 32, 32), {2: (2, 1, 1), 4: (1, 2, 2)}, 3, 1),
    '3d-wide': ((2, 16, 32, 32, 32), {2: (2, 1, 1), 4: (1, 2, 2)}, 5, 3),
}
MODES = ('blocking', 'overlapped')


def _sha(arr):
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


# ----------------------------------------------------------------------
# Worker: one mpiexec job of one tree
# ----------------------------------------------------------------------
def _exchange_step(mode, grid, x, plan, slab_ins, gys):
    """Forward and backward of one exchange; returns (outputs, x.grad)."""
    import chainer
    from chainermn_overlap.distconv import exchange
    xv = chainer.Variable(x)
    if mode == 'blocking':
        outs = [exchange.region_exchange(grid, xv, plan, 0)]
    else:
        state = exchange.HaloState(grid, plan)
        token = exchange.HaloStart(state, []).apply((xv,))[0]
        outs = list(exchange.HaloFinish(state, slab_ins, 0).apply(
            (xv, token, token)))
    chainer.backward(outs, [chainer.Variable(g) for g in gys])
    return outs, xv.grad


def _worker(args):
    import chainer
    import chainermn
    import chainermn_overlap
    from chainermn_overlap import distconv
    from chainermn_overlap.distconv import geometry
    comm = chainermn.create_communicator('naive')
    mpi = comm.mpi_comm
    chainer.config.train = True
    out = {'package': os.path.dirname(chainermn_overlap.__file__),
           'cases': {}}
    grids = {}
    for name, (shape, by_size, k, d) in sorted(CASES.items()):
        gshape = by_size.get(comm.size)
        if gshape is None:
            continue
        if gshape not in grids:
            grids[gshape] = distconv.SpatialGrid(comm, gshape)
        g = grids[gshape]
        nd = len(gshape)
        pad = d * (k - 1) // 2
        plan, _, _, _, _, _, slab_ins, _ = geometry.overlap_plan(
            shape[2:], gshape, (k,) * nd, (1,) * nd, (pad,) * nd,
            (d,) * nd, False, g.spatial_rank)
        rng = np.random.RandomState(g.rank)
        lead = shape[:2]
        x = rng.randn(*(lead + geometry.box_shape(plan.own))).astype(
            np.float32)
        for mode in MODES:
            boxes = [plan.ext] if mode == 'blocking' else slab_ins
            gys = [rng.randn(*(lead + geometry.box_shape(b))).astype(
                np.float32) for b in boxes]
            times = []
            for it in range(args.warmup + args.reps):
                mpi.Barrier()
                t0 = time.perf_counter()
                outs, gx = _exchange_step(mode, g, x, plan, slab_ins, gys)
                times.append(time.perf_counter() - t0)
                if it == 0:
                    digest = _sha(np.concatenate(
                        [o.array.ravel() for o in outs] + [gx.ravel()]))
            slowest = np.max(mpi.allgather(times[args.warmup:]), axis=0)
            digests = mpi.allgather(digest)
            out['cases']['%s/%s/np%d' % (name, mode, comm.size)] = {
                'seconds': float(np.median(slowest)),
                'sha256': hashlib.sha256(
                    ''.join(digests).encode()).hexdigest()}
    if comm.rank == 0:
        with open(args.json_out, 'w') as f:
            json.dump(out, f)


# ----------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------
def _run_job(tree, size, args):
    fd, path = tempfile.mkstemp(suffix='.json')
    os.close(fd)
    env = dict(os.environ)
    env['PYTHONPATH'] = os.path.abspath(tree)
    for v in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'):
        env[v] = '1'
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    cmd = [mpiexec, '-n', str(size), sys.executable, os.path.abspath(
        __file__), '--worker', '--json-out', path, '--reps', str(args.reps),
        '--warmup', str(args.warmup)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=os.path.abspath(tree),
                              capture_output=True, text=True,
                              timeout=args.job_timeout)
        if proc.returncode != 0:
            raise RuntimeError('halo_ab: the job of %s at %d processes '
                               'failed (exit %d):\n%s' % (
                                   tree, size, proc.returncode,
                                   (proc.stdout + proc.stderr)[-3000:]))
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def bootstrap_ci(ratios, n=2000, seed=0):
    """95% interval of the median of ``ratios`` (resampling them)."""
    ratios = np.asarray(ratios, dtype=np.float64)
    rng = np.random.RandomState(seed)
    meds = np.median(ratios[rng.randint(0, len(ratios),
                                        (n, len(ratios)))], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def summarise(samples):
    """``samples[case][tree]``: per-round seconds -> the report dict."""
    cases = {}
    for case, by_tree in sorted(samples.items()):
        a, b = np.array(by_tree['a']), np.array(by_tree['b'])
        ratios = b / a
        lo, hi = bootstrap_ci(ratios)
        cases[case] = {
            'median_a_s': float(np.median(a)),
            'median_b_s': float(np.median(b)),
            'median_ratio_b_over_a': float(np.median(ratios)),
            'ci95_ratio': [lo, hi], 'rounds': len(ratios),
            'a_s': a.tolist(), 'b_s': b.tolist()}
    return cases


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--a', help='baseline source tree')
    p.add_argument('--b', help='source tree to compare with the baseline')
    p.add_argument('--rounds', type=int, default=21)
    p.add_argument('--reps', type=int, default=20,
                   help='timed iterations per case and job')
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--sizes', default='2,4', help='process counts')
    p.add_argument('--quick', action='store_true',
                   help='2 rounds of 3 iterations (checks that it runs)')
    p.add_argument('--job-timeout', type=float, default=900)
    p.add_argument('--out', default=os.path.join(RESULTS, 'halo_ab.json'))
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--json-out', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if not args.a or not args.b:
        p.error('give both trees: --a BASELINE --b OTHER')
    for tree in (args.a, args.b):
        if not os.path.isfile(os.path.join(tree, 'chainermn_overlap',
                                           'distconv', 'exchange.py')):
            p.error('%s is not a source tree of chainermn_overlap (no '
                    'chainermn_overlap/distconv/exchange.py)' % tree)
    if args.quick:
        args.rounds, args.reps, args.warmup = 2, 3, 1
    sizes = [int(s) for s in args.sizes.split(',')]
    trees = {'a': args.a, 'b': args.b}
    samples, digests, packages = {}, {}, {}
    load = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        order = ('a', 'b') if rnd % 2 == 0 else ('b', 'a')
        for size in sizes:
            for key in order:
                res = _run_job(trees[key], size, args)
                packages[key] = res['package']
                for case, r in res['cases'].items():
                    samples.setdefault(case, {'a': [], 'b': []})[key].append(
                        r['seconds'])
                    digests.setdefault(case, {})[key] = r['sha256']
        load.append(os.getloadavg()[0])
        sys.stdout.write('round %d/%d done\n' % (rnd + 1, args.rounds))
        sys.stdout.flush()
    cases = summarise(samples)
    for case in cases:
        cases[case]['same_bytes'] = (digests[case]['a'] ==
                                     digests[case]['b'])
    ratios = [c['median_ratio_b_over_a'] for c in cases.values()]
    doc = {'trees': {k: os.path.abspath(v) for k, v in trees.items()},
           'packages': packages, 'rounds': args.rounds, 'reps': args.reps,
           'warmup': args.warmup, 'sizes': sizes, 'cpus': os.cpu_count(),
           'loadavg_1min': load, 'cases': cases,
           'geomean_ratio_b_over_a': float(np.exp(np.mean(np.log(ratios)))),
           'all_same_bytes': all(c['same_bytes'] for c in cases.values())}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    print('%-28s %11s %11s %8s %17s %s' % ('case', 'A median', 'B median',
                                           'B/A', '95% CI', 'same bytes'))
    for case, c in sorted(cases.items()):
        print('%-28s %9.3f ms %9.3f ms %8.3f   [%.3f, %.3f] %s' % (
            case, 1e3 * c['median_a_s'], 1e3 * c['median_b_s'],
            c['median_ratio_b_over_a'], c['ci95_ratio'][0],
            c['ci95_ratio'][1], c['same_bytes']))
    print('geometric mean of B/A over cases: %.3f; all same bytes: %s; '
          'load average %.2f -> %.2f; JSON: %s' % (
              doc['geomean_ratio_b_over_a'], doc['all_same_bytes'], load[0],
              load[-1], args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
