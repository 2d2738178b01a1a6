"""Start-up cost of the compatibility file: interpreter start and ``import chainer``, with it and without.

``chainermn_overlap-compat.pth`` runs at every start of the environment's
Python (``_chainermn_overlap_compat``).  This study times, in the same run
and interleaved (with, without, with, ...), ``python -c pass`` (the cost
every program of the environment pays) and ``python -c 'import chainer'``
(with the stand-ins off, Chainer needs ``numpy.distutils``; on Python 3.12+
that import fails, so there it is timed only with them on), and reports
medians with the spread of the paired differences::

    python -m benchmarks startup [--rounds 40] [--out benchmarks/results/startup.json]

Without the stand-ins means ``CHAINERMN_OVERLAP_NO_COMPAT=1``: the start-up
file's line still runs but stops at the variable.  The line's whole cost is
also timed alone: ``exec`` of it as ``site`` runs it (compiled each time),
with the finder removed before each run, averaged over 2,000 runs.  The
line imports nothing; ``_chainermn_overlap_compat`` is imported only when a
missing stand-in module is looked up.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, 'results', 'startup.json')
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.stats import bootstrap_interval  # noqa: E402

OFF_ENV = 'CHAINERMN_OVERLAP_NO_COMPAT'


def once(code, env):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, '-c', code], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def compare(code, rounds, variants):
    """Interleaved timings of ``code`` under each (name, env); seconds."""
    times = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, env in variants:
            times[name].append(once(code, env))
    return times


def summary(times, base, other):
    diffs = [b - a for a, b in zip(times[base], times[other])]
    low, high = bootstrap_interval(diffs)
    return {'median_ms': {k: 1e3 * statistics.median(v)
                          for k, v in times.items()},
            'paired_difference_ms': {
                'what': '%s - %s' % (other, base),
                'median': 1e3 * statistics.median(diffs),
                'interval95': [1e3 * low, 1e3 * high]}}


LINE_COST = '''
import sys, sysconfig, time, os
path = os.path.join(sysconfig.get_paths()['purelib'], 'chainermn_overlap-compat.pth')
line = open(path).read().strip()
base = [f for f in sys.meta_path
        if not getattr(f, '__chainermn_overlap_stand_ins__', False)]
n = 2000
t0 = time.perf_counter()
for _ in range(n):
    sys.meta_path[:] = base
    exec(line)
print((time.perf_counter() - t0) / n * 1e6)
'''


def line_cost_us(env):
    """Microseconds one run of the start-up file's line takes."""
    out = subprocess.run([sys.executable, '-c', LINE_COST], env=env,
                         check=True, stdout=subprocess.PIPE,
                         universal_newlines=True)
    return float(out.stdout.strip())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rounds', type=int, default=40)
    parser.add_argument('--out', default=RESULTS)
    args = parser.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k != OFF_ENV}
    env.setdefault('OMP_NUM_THREADS', '1')
    env.setdefault('OPENBLAS_NUM_THREADS', '1')
    variants = [('stand_ins_off', dict(env, **{OFF_ENV: '1'})),
                ('stand_ins_on', env)]
    result = {'machine': machine_description(), 'rounds': args.rounds,
              'python': sys.executable,
              'method': 'wall time of a subprocess, variants interleaved '
                        'in each round, medians and a bootstrap 95% '
                        'interval of the paired differences'}
    result['line_us'] = statistics.median(
        line_cost_us(env) for _ in range(5))
    result['pass'] = summary(compare('pass', args.rounds, variants),
                             'stand_ins_off', 'stand_ins_on')
    if sys.version_info < (3, 12):
        result['import_chainer'] = summary(
            compare('import chainer', args.rounds, variants),
            'stand_ins_off', 'stand_ins_on')
    else:
        times = compare('import chainer', args.rounds, variants[1:])
        result['import_chainer'] = {'median_ms': {
            k: 1e3 * statistics.median(v) for k, v in times.items()},
            'note': 'without the stand-ins import chainer fails here'}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    for what in ('pass', 'import_chainer'):
        r = result[what]
        line = '%-15s ' % what + '  '.join(
            '%s %.1f ms' % kv for kv in sorted(r['median_ms'].items()))
        if 'paired_difference_ms' in r:
            d = r['paired_difference_ms']
            line += '  difference %+.2f ms [%+.2f, %+.2f]' % (
                d['median'], d['interval95'][0], d['interval95'][1])
        print(line)
    print('the start-up line alone: %.1f us' % result['line_us'])
    print('written', args.out)


if __name__ == '__main__':
    main()
