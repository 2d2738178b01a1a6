"""The ring's chunk at scale: the projection with the fixed 4 MiB chunk
against the chunk that grows with N (``chainermn_overlap/communication/
chunking.py``), beside MPICH's halving, for both compute calibrations::

    .venv/bin/python -m benchmarks.scale.ring_chunks \\
        [--trace benchmarks/results/scale_trace.resnet50.json] \\
        [--out benchmarks/results/scale_ring_chunks.json]

Each row holds ours, ours without the thread's CPU time, blocking and the
overlap bound (see :func:`benchmarks.scale.project.project`).
"""
import argparse
import json
import os
import sys
import time

from benchmarks.harness import machine
from benchmarks.scale import project as proj
from benchmarks.scale_bench import EFFICIENCY
from benchmarks.harness.launch import RESULTS

FIXED_CHUNK_BYTES = 4 << 20
# name -> (algorithm, chunk_bytes given to the replay, what it is)
VARIANTS = {
    'ring_fixed_4mib': ('ring', FIXED_CHUNK_BYTES,
                        'ring, the 4 MiB chunk at every N (before)'),
    'ring_grown': ('ring', None, 'ring, chunk max(4 MiB, 256 KiB * N) (after)'),
    'halving': ('halving', None, "MPICH's halving, the trace's 4 MiB chunk")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--trace', default=os.path.join(
        RESULTS, 'scale_trace.resnet50.json'))
    p.add_argument('--out', default=os.path.join(
        RESULTS, 'scale_ring_chunks.json'))
    args = p.parse_args(argv)
    problem = proj.simgrid_problem()
    if problem:
        raise SystemExit(problem)
    with open(args.trace) as f:
        trace = json.load(f)

    def log(text):
        sys.stderr.write(text + '\n')
    t0 = time.time()
    c_a, cal = proj.calibrate_reference(args.trace, EFFICIENCY)
    alone = trace.get('alone_iteration_s') or cal['compute_s']
    scales = {'reference_calibration': c_a,
              'gpu_class': proj.GPU_CLASS['iteration_s'] / alone}
    step = trace['engine']['step_overhead_s']
    out = {'machine': machine.machine_description(),
           'trace': args.trace, 'efficiency': EFFICIENCY,
           'latency_s': proj.REFERENCE['latency_s'],
           'variants': {k: v[2] for k, v in VARIANTS.items()}}
    for calib, scale in scales.items():
        out[calib] = {'compute_scale': scale}
        for name, (algorithm, chunk, _) in VARIANTS.items():
            log('{}, {}:'.format(calib, name))
            out[calib][name] = proj.project(
                args.trace, scale, EFFICIENCY, step, algorithm=algorithm,
                chunk_bytes=chunk, log=log)
    out['seconds'] = time.time() - t0
    with open(args.out, 'w') as f:
        json.dump(out, f, indent=1)
        f.write('\n')
    log('wrote {}'.format(args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
