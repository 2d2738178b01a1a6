"""Per-iteration overhead of the overlapped optimizer at one rank.

Run::

    python -m benchmarks.overhead [--arch resnet_small|resnet50] \\
        [--iterations N]

One process, no communication to hide: this isolates what the wrapper itself
costs (taps, hooks, packing, the communication thread) against the plain
actual optimizer and ChainerMN's blocking optimizer, on the same model and
data, interleaving the variants round by round so that machine noise hits
all of them alike.  Prints a table and writes benchmarks/results/overhead.json.
"""
import argparse
import json
import os
import platform
import sys
import time

import chainer
import chainer.functions as F
import chainermn
import numpy as np

import chainermn_overlap

# Run as a file (not with -m), sys.path starts with benchmarks/ instead of
# the repository root that holds the package: add the root.
if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.workloads import (  # noqa: E402
    build_model, synthetic_batch)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--arch', default='resnet_small')
    p.add_argument('--batchsize', type=int, default=16)
    p.add_argument('--insize', type=int, default=64)
    p.add_argument('--iterations', type=int, default=9)
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'overhead.json'))
    args = p.parse_args()
    comm = chainermn.create_communicator('naive')
    if comm.size != 1:
        raise SystemExit('run this benchmark on one rank')
    x, t = synthetic_batch(np.random.RandomState(0), args.batchsize,
                           args.insize)

    def lossfun(model):
        return lambda: F.softmax_cross_entropy(model(x), t)

    variants = {
        'plain': lambda o: o,
        'chainermn_blocking':
            lambda o: chainermn.create_multi_node_optimizer(o, comm),
        'overlap_forward': lambda o: chainermn_overlap
            .create_overlapped_optimizer(o, comm, wait='forward'),
        'overlap_update': lambda o: chainermn_overlap
            .create_overlapped_optimizer(o, comm, wait='update'),
        # Timed from the third iteration on, like the others: past the
        # broadcast and the pipeline fill, so this is its steady-state cost
        # (packing, the thread, unpacking).
        'double_buffering': lambda o: chainermn_overlap
            .create_double_buffering_optimizer(o, comm),
    }
    times = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.rounds):
        # Each round starts with another variant, so that no variant always
        # runs first (fresh process state) or last (after the others).
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            make = variants[name]
            model = build_model(args.arch, 0)
            opt = make(chainer.optimizers.MomentumSGD(0.01))
            opt.setup(model)
            fn = lossfun(model)
            for i in range(args.iterations):
                t0 = time.perf_counter()
                opt.update(fn)
                dt = time.perf_counter() - t0
                if i >= 2:  # first steps: broadcast, allocation
                    times[name].append(dt)
            if hasattr(opt, 'close'):
                opt.close()
    med = {k: float(np.median(v)) for k, v in times.items()}
    result = {
        'benchmark': 'overhead at one rank',
        'machine': {'platform': platform.platform(),
                    'processor': platform.processor(),
                    'cpu_count': os.cpu_count(),
                    'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS'),
                    'affinity': sorted(os.sched_getaffinity(0)),
                    'loadavg': os.getloadavg()},
        'config': vars(args),
        'median_seconds': med,
        'min_seconds': {k: float(np.min(v)) for k, v in times.items()},
        'max_seconds': {k: float(np.max(v)) for k, v in times.items()},
        'overhead_vs_plain': {k: med[k] / med['plain'] - 1 for k in med},
    }
    print('{:<20} {:>10} {:>10}'.format('variant', 'median s', 'vs plain'))
    for k in variants:
        print('{:<20} {:>10.4f} {:>+9.1%}'.format(
            k, med[k], result['overhead_vs_plain'][k]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=2)
    print('saved', args.out)


if __name__ == '__main__':
    main()
