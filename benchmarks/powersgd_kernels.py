"""PowerSGD's arithmetic per step, kernel by kernel, on a model's matrices.

Run::

    python -m benchmarks.powersgd_kernels [--model resnet18 --insize 128]
        [--rank 4] [--rounds 15] [--build OTHER.so ...]

One process, no communication: the passes :meth:`PowerSGD.reduce_bucket`
makes over every matrix it compresses (``ef_project``, ``orthogonalize``,
``project_t``, ``reconstruct``), on random matrices of the model's shapes,
against two memory floors measured in the same rounds (``M += E`` over the
same matrices, the bytes of ``ef_project``'s streams; one copy).  Each
``--build`` is another compiled ``chainermn_overlap._native`` (e.g. the one
of an older revision, saved aside) timed in the same rounds, so a change
to the kernels is measured against its predecessor on one machine, in
turns; ``numpy`` is the pure-numpy path the library falls back to.

On the test bed this arithmetic runs on the core that trains, so every
millisecond here is a millisecond of the step (PowerSGD's figures in
``compression_bench``).  Writes ``benchmarks/results/powersgd_kernels.json``.
"""
import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

import chainer  # noqa: E402

from chainermn_overlap import _kernels  # noqa: E402
from chainermn_overlap import compression  # noqa: E402
from benchmarks.harness import launch, stats  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.workloads import build_model  # noqa: E402

PASSES = ['ef_project', 'orthogonalize', 'project_t', 'reconstruct']


def model_shapes(name, insize):
    """Shapes of the parameters (lazy links initialised by one forward)."""
    model = build_model(name)
    x = np.zeros((1, 3, insize, insize), dtype=np.float32)
    with chainer.using_config('train', False), \
            chainer.using_config('enable_backprop', False):
        model(x)
    return [p.shape for p in model.params()]


def load_build(path):
    """A compiled ``_native`` from ``path``, imported under its own name."""
    spec = importlib.util.spec_from_file_location(
        'chainermn_overlap._native', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not module.available:
        raise SystemExit('{}: this CPU cannot run it'.format(path))
    return module


def one_step(native, mats):
    """Seconds per pass over all matrices, with ``native`` (a module) or
    numpy (None)."""
    spent = dict.fromkeys(PASSES, 0.0)
    old = _kernels._native
    try:
        if native is not None:
            _kernels._native = native
        with _kernels.use_native(native is not None):
            for mat, err, q, p, qt in mats:
                t0 = time.perf_counter()
                _kernels.ef_project(mat, err, q, p)
                t1 = time.perf_counter()
                _kernels.orthogonalize(p)
                t2 = time.perf_counter()
                _kernels.project_t(mat, p, qt)
                t3 = time.perf_counter()
                _kernels.reconstruct(mat, err, p, qt)
                t4 = time.perf_counter()
                for name, dt in zip(PASSES, (t1 - t0, t2 - t1, t3 - t2,
                                             t4 - t3)):
                    spent[name] += dt
    finally:
        _kernels._native = old
    return spent


def floors(mats, scratch):
    """The same bytes without the arithmetic: ``M += E`` then ``M -= E``
    (the matrices keep their values; the mean of the two is reported) and
    one copy of every matrix."""
    t0 = time.perf_counter()
    for mat, err, _, _, _ in mats:
        np.add(mat, err, out=mat)
    for mat, err, _, _, _ in mats:
        np.subtract(mat, err, out=mat)
    t1 = time.perf_counter()
    off = 0
    for mat, _, _, _, _ in mats:
        np.copyto(scratch[off:off + mat.size].reshape(mat.shape), mat)
        off += mat.size
    t2 = time.perf_counter()
    return {'M += E': (t1 - t0) / 2, 'copy': t2 - t1}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='resnet18',
                   choices=('resnet18', 'resnet50', 'mlp'))
    p.add_argument('--insize', type=int, default=128)
    p.add_argument('--rank', type=int, default=4)
    p.add_argument('--rounds', type=int, default=15)
    p.add_argument('--build', nargs='*', default=[],
                   help='other compiled _native modules to time alongside')
    p.add_argument('--no-numpy', action='store_true',
                   help='leave out the numpy path (slow on large models)')
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'powersgd_kernels.json'))
    args = p.parse_args()

    psgd = compression.PowerSGD(rank=args.rank)
    shapes = [s for s in model_shapes(args.model, args.insize)
              if psgd.compresses(s)]
    rng = np.random.RandomState(0)
    mats = []
    for shape in shapes:
        n, m = compression.matrix_shape(shape)
        r = min(args.rank, n, m)
        mats.append((rng.standard_normal((n, m)).astype(np.float32),
                     rng.standard_normal((n, m)).astype(np.float32),
                     rng.standard_normal((m, r)).astype(np.float32),
                     np.empty((n, r), np.float32),
                     np.empty((r, m), np.float32)))
    elements = sum(m[0].size for m in mats)
    scratch = np.empty(elements, np.float32)

    variants = {}
    if _kernels.native_available():
        variants['native (this checkout)'] = _kernels._native
    for path in args.build:
        variants['native ({})'.format(path)] = load_build(path)
    if not args.no_numpy:
        variants['numpy'] = None
    names = list(variants)
    for name in names:           # warm-up: page in, caches, BLAS set-up
        one_step(variants[name], mats)
    floors(mats, scratch)        # pages in the scratch of the copy
    times = {name: [] for name in names + ['floors']}
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(one_step(variants[name], mats))
        times['floors'].append(floors(mats, scratch))

    results = {}
    print('{} at {}, PowerSGD rank {}: {} matrices, {:.1f} M elements '
          '({:.0f} MB float32), {} rounds; ms per step, median [95 %]'
          .format(args.model, args.insize, args.rank, len(mats),
                  elements / 1e6, elements * 4 / 1e6, args.rounds))
    for name in names:
        row = {k: stats.interval([1e3 * t[k] for t in times[name]])
               for k in PASSES}
        row['total'] = stats.interval([1e3 * sum(t.values())
                                       for t in times[name]])
        results[name] = row
        print('  {:40s} total {}  ({})'.format(
            name, stats.fmt(row['total'], 2),
            ', '.join('{} {:.2f}'.format(k, row[k]['median'])
                      for k in PASSES)))
    fl = {k: stats.interval([1e3 * t[k] for t in times['floors']])
          for k in ('M += E', 'copy')}
    results['floors'] = fl
    print('  memory floors: M += E {}, copy {}'.format(
        stats.fmt(fl['M += E'], 2), stats.fmt(fl['copy'], 2)))
    for name in names[1:]:
        ratio = stats.interval([sum(b.values()) / sum(a.values())
                                for a, b in zip(times[names[0]],
                                                times[name])])
        results[name]['over_first'] = ratio
        print('  {} / {}: {}'.format(name, names[0], stats.fmt(ratio)))
    out = {'benchmark': 'powersgd_kernels', 'model': args.model,
           'insize': args.insize, 'rank': args.rank, 'rounds': args.rounds,
           'matrices': len(mats), 'elements': elements,
           'threads': os.environ.get('OPENBLAS_NUM_THREADS'),
           'machine': machine_description(), 'results': results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(out, f, indent=1)
    print('saved', args.out)


if __name__ == '__main__':
    main()
