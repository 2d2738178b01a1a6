"""A/B: two revisions of the library on one bed, interleaved round by round.

Run (as root, from the repository root)::

    python -m benchmarks ab --a main~3 --b WORKTREE \\
        [--modes alone blocking overlap_forward] [--rounds 10] \\
        [--model resnet50 --batch 4 --insize 224] [--rate 740mbit]

``--a`` and ``--b`` are git revisions, or ``WORKTREE`` for the checkout as
it is (uncommitted changes included).  Each revision's package is exported
into a folder of its own, with its C kernels compiled there (the same
compiler flags for both), so both are installed side by side; the
benchmark's own code (:mod:`benchmarks.harness.trainer`) is this checkout's for
both, so only the library differs.  Both jobs start at once on one
two-rank bed and take turns (:mod:`benchmarks.harness.interleave`): warm-up,
then ``--rounds`` rounds in the order AB BA AB ..., each round every mode once
(one untimed, then ``--iterations`` timed updates), with models kept for
the whole job.  The link is ``--rate``, or calibrated first so that
ChainerMN's blocking optimizer lands at the anchor's 0.667 (as
``overlap_bench``).

Reported per mode: each revision's median it/s and scalability (median of
per-round ratios to ``alone`` of the same job and round, with a 95 %
bootstrap interval), and, paired by round, B - A in scalability and B / A
in speed, each with its interval.  A difference is claimed only when its
interval excludes zero (speed: excludes 1).

Writes ``benchmarks/results/ab.json`` (or ``--out``).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, *['..'] * 3)))

from benchmarks.harness import (  # noqa: E402
    bedrun, interleave, launch, stats, trainer)
from benchmarks.harness.machine import machine_description  # noqa: E402
from testbed import netbed  # noqa: E402

PACKAGE = 'chainermn_overlap'
WORKTREE = 'WORKTREE'
# The worker, started with a revision's folder first on sys.path: its
# package wins over the checkout's; the benchmarks come from the checkout
# (PYTHONPATH), which the exported folder does not hold.
BOOT = ('import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); '
        'runpy.run_module("benchmarks.harness.trainer", run_name="__main__")')
BUILD = '''\
from setuptools import Extension, setup
setup(name='ab_kernels', ext_modules=[Extension(
    'chainermn_overlap._native', sources=['chainermn_overlap/_native.c'],
    extra_compile_args=['-O3'])])
'''


class ABError(RuntimeError):
    pass


def resolve(rev):
    """The commit of ``rev`` (or ``WORKTREE``), with its subject line."""
    if rev == WORKTREE:
        head = resolve('HEAD')
        dirty = subprocess.run(['git', '-C', launch.ROOT, 'status',
                                '--porcelain', '--', PACKAGE],
                               stdout=subprocess.PIPE, text=True).stdout
        return {'rev': rev, 'commit': head['commit'],
                'subject': 'the working tree (HEAD {}{})'.format(
                    head['commit'][:10],
                    ' + uncommitted changes' if dirty.strip() else '')}
    proc = subprocess.run(['git', '-C', launch.ROOT, 'log', '-1',
                           '--format=%H %s', rev + '^{commit}', '--'],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise ABError('{!r} is not a revision of this repository ({}); give '
                      'a commit, branch or tag, or {}'.format(
                          rev, proc.stderr.strip(), WORKTREE))
    commit, _, subject = proc.stdout.strip().partition(' ')
    return {'rev': rev, 'commit': commit, 'subject': subject}


def export(rev, dest):
    """The package of ``rev`` in ``dest``, its C kernels built in place.

    Returns:
        str: how the kernels were built.
    """
    os.makedirs(dest)
    if rev == WORKTREE:
        shutil.copytree(os.path.join(launch.ROOT, PACKAGE),
                        os.path.join(dest, PACKAGE),
                        ignore=shutil.ignore_patterns('__pycache__', '*.so'))
    else:
        archive = subprocess.run(
            ['git', '-C', launch.ROOT, 'archive', '--format=tar', rev,
             PACKAGE], stdout=subprocess.PIPE, check=True).stdout
        subprocess.run(['tar', '-x', '-C', dest], input=archive, check=True)
    if not os.path.exists(os.path.join(dest, PACKAGE, '_native.c')):
        return 'no C kernels in this revision'
    with open(os.path.join(dest, 'ab_build.py'), 'w') as f:
        f.write(BUILD)
    proc = subprocess.run([sys.executable, 'ab_build.py', '-q',
                           'build_ext', '--inplace'], cwd=dest,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        raise ABError('building the C kernels of {} failed:\n{}'.format(
            rev, proc.stdout[-2000:]))
    return 'C kernels built'


def job_command(tree, cfg):
    return [sys.executable, '-c', BOOT, tree, launch.WORKER_FLAG,
            json.dumps(cfg)]


def check_packages(warmup_answers, tree, name):
    for answer in warmup_answers:
        where = os.path.realpath(answer.get('package') or '')
        if not where.startswith(os.path.realpath(tree) + os.sep):
            raise ABError('job {} imported {} from {}, not from its own '
                          'folder {}'.format(name, PACKAGE, where, tree))


def report(result, log):
    a, b = result['a'], result['b']
    log('A = {} ({})'.format(a['rev'], a['subject']))
    log('B = {} ({})'.format(b['rev'], b['subject']))
    log('{:<34} {:>22} {:>22} {:>24} {:>22}'.format(
        'mode', 'A scalability', 'B scalability', 'B - A', 'B/A speed'))
    for mode in result['config']['modes']:
        sa, sb = a['modes'][mode], b['modes'][mode]
        cmp = result['comparison']['{0}/{0}'.format(mode)]
        sc = cmp.get('scalability')
        log('{:<34} {:>22} {:>22} {:>24} {:>22}'.format(
            mode, stats.fmt(stats.interval(sa['scalability_rounds'])),
            stats.fmt(stats.interval(sb['scalability_rounds'])),
            (stats.fmt(sc['difference']) + (' *' if sc['claimed'] else ''))
            if sc and mode != 'alone' else '',
            stats.fmt(cmp['speed_ratio'])))
    log('* the interval excludes zero: a difference is claimed')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--a', required=True, help='revision A (or WORKTREE)')
    p.add_argument('--b', required=True, help='revision B (or WORKTREE)')
    p.add_argument('--modes', nargs='+',
                   default=['alone', 'blocking', 'overlap_forward'],
                   help='trainer modes (alone is added when missing)')
    p.add_argument('--model', default='resnet50')
    p.add_argument('--batch', type=int, default=4)
    p.add_argument('--insize', type=int, default=224)
    p.add_argument('--rounds', type=int, default=10)
    p.add_argument('--iterations', type=int, default=3,
                   help='timed iterations per mode and round')
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--settle', type=int, default=1)
    p.add_argument('--rate', default=None,
                   help='link rate (default: calibrated first)')
    p.add_argument('--out', default=os.path.join(launch.RESULTS, 'ab.json'))
    args = p.parse_args(argv)
    modes = ['alone'] + [m for m in args.modes if m != 'alone']
    t_start = time.time()

    def log(msg):
        sys.stdout.write('[{:6.0f} s] {}\n'.format(time.time() - t_start,
                                                   msg))
        sys.stdout.flush()

    try:
        netbed.require_root()
        revs = {'a': resolve(args.a), 'b': resolve(args.b)}
    except (ABError, netbed.NetBedError) as e:
        sys.stderr.write('ab: {}\n'.format(e))
        return 2
    cfg = {'model': args.model, 'batch': args.batch, 'insize': args.insize,
           'iterations': args.iterations, 'warmup': args.warmup,
           'settle': args.settle, 'rounds': args.rounds, 'modes': modes,
           'trace': None}
    tmp = tempfile.mkdtemp(prefix='cmo_ab_')
    try:
        for key, info in revs.items():
            info['tree'] = os.path.join(tmp, key)
            info['kernels'] = export(info['rev'], info['tree'])
            log('{}: {} {} ({}; {})'.format(
                key.upper(), info['rev'], info['commit'][:10],
                info['subject'][:60], info['kernels']))
        t_compute = bedrun.measure_alone(cfg)
        nbytes = bedrun.gradient_bytes(args.model)
        if args.rate:
            rate, calibration = netbed.parse_rate(args.rate), []
        else:
            rate, calibration = bedrun.calibrate(cfg, t_compute, nbytes, log)
        per_turn = bedrun.expected_seconds(dict(cfg, rounds=1), t_compute)
        log('A/B at {:.1f} Mbit/s: {} rounds of {}'.format(
            rate / 1e6, args.rounds, ', '.join(modes)))
        with netbed.NetBed(2, rate) as bed:
            record = bed.describe()
            jobs = {k: {'command': job_command(v['tree'], cfg),
                        'env': launch.worker_env()}
                    for k, v in revs.items()}
            runs = interleave.run_interleaved(bed, jobs, args.rounds,
                                              2 * per_turn, log)
        for key, info in revs.items():
            check_packages(runs[key]['warmup'], info['tree'], key.upper())
    except (ABError, RuntimeError) as e:
        sys.stderr.write('ab: {}\n'.format(e))
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {'benchmark': 'A/B of two revisions, interleaved rounds',
              'machine': machine_description(), 'config': cfg,
              'rate_bit_per_s': rate, 'calibration': calibration,
              't_compute_alone_s': t_compute, 'bed': record}
    for key, info in revs.items():
        info['modes'] = interleave.job_summary(runs[key]['rounds'], modes)
        info['package_versions'] = sorted({a.get('version') or '?'
                                           for a in runs[key]['warmup']})
        result[key] = info
    result['comparison'] = interleave.compare(
        revs['a']['modes'], revs['b']['modes'], [(m, m) for m in modes])
    result['seconds'] = time.time() - t_start
    report(result, log)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    log('saved ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
