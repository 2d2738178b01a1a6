"""``make test``: every test tier, three lanes side by side, then the timed ones.

Usage::

    python tests/tiers.py                  # all tiers (make test)
    python tests/tiers.py --list           # the tiers, their lanes and commands
    python tests/tiers.py --only unit mpi-2 [--serial]

The tiers (``--list`` prints them):

* ``unit``: no MPI job of its own, or small jobs it starts itself;
* ``commands``: every documented command run as typed (``tests/commands``);
* ``mpi-N``: the MPI suite at N = 1, 2, 3, 4 ranks (``tests/mpi_run.py``);
* ``shard-MODE``: the equivalence suites again with ``shard=MODE``;
* ``netbed``: the network test bed (namespaces, shaped links, ssh hosts);
* ``timing``: the tests that assert a measured time or ratio (marked
  ``@pytest.mark.timing``), left out of every other tier.

Three lanes run at once: ``compute`` (the MPI tiers, which keep the
cores busy), ``waits`` (the unit tier) and ``hosts`` (the network test bed
and the documented commands): the last two spend much of their time
waiting (for a timeout, a restart, an ssh host, a shaped link), so that
one lane's waits are another's compute.  No two tiers share a port (MPICH
and the servers pick free ones), a namespace (the bed names its own after
its process) or a folder.  Then the ``timing`` tier runs alone, on a
machine with nothing else of the suite running, so that a timing
assertion measures the code and not the other lanes.  Each tier's output goes to
``.test-logs/TIER.log``; a tier that fails has its log's end printed.  The
exit status is 1 when any tier failed, and the last line counts the tests
of every tier.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOGS = os.path.join(ROOT, '.test-logs')
PY = sys.executable
MPI_RUN = [PY, os.path.join(HERE, 'mpi_run.py')]
PYTEST = [PY, '-m', 'pytest', '-q', '-p', 'no:cacheprovider']
NOT_TIMING = ['-m', 'not timing']
SHARD_FILES = ['tests/mpi/test_equivalence.py', 'tests/mpi/test_changed_params.py',
               'tests/mpi/test_autosync.py']
# At 4 ranks, the tests whose code differs from 2 and 3 ranks: distconv's
# grids (2x2 needs 4), sharding's 4-way slices (the memory targets are
# stated at 4), the shard server, and the float16 and PowerSGD rings of
# our own.  The rest (the optimizer's equivalence, reliability, engines,
# examples) splits a batch evenly at 2 and unevenly at 3, which is all a
# rank count changes in their code; running them at 4 on 2 cores cost
# 120 s of make test and checked nothing 2 and 3 do not.
AT_FOUR = ['tests/mpi/distconv', 'tests/mpi/test_sharding.py',
           'tests/mpi/test_shard_memory.py',
           'tests/mpi/test_shard_server.py', 'tests/mpi/test_compression.py']
# At 3 ranks (uneven batches, slices and blocks), not the tests whose
# code does not depend on the rank count or whose targets are stated at 2
# and 4: the reliability runs (the 2,000-step one is at 2 ranks), the
# memory of each stage and the shard server (2 and 4), distconv's examples
# and tuner (1, 2 and 4; their layers run at 3 in the other files).
NOT_AT_THREE = ['--ignore=' + f for f in (
    'tests/mpi/test_reliability.py',
    'tests/mpi/test_shard_memory.py', 'tests/mpi/test_shard_serving.py',
    'tests/mpi/distconv/test_distconv_example.py',
    'tests/mpi/distconv/test_distconv_example_channels.py',
    'tests/mpi/distconv/test_distconv_tuner.py',
    'tests/mpi/distconv/test_distconv_tuner_tiling.py')]
# MPICH's blocking calls poll, yielding the core every so many polls; with
# this its yield is a short nanosleep instead of sched_yield, which on a
# core shared by 2 ranks and more kept the waiting rank spinning.  One -n 4
# piece (test_compression and distconv's exchange, 2 cores, back to back
# beside other work): 23.0, 23.9, 28.4 CPU-s without, 19.3, 19.3, 22.5 with
# (the system time 3.5-4.1 s against 1.0-1.9 s); the whole mpi-4 tier,
# beside other work: 187.9 CPU-s (25.0 of them system) without, 164.2
# (9.4) with.  Not for the timing tiers,
# which measure the library as it is run.
BUSY_WAIT_ENV = {'MPIR_CVAR_ENABLE_HEAVY_YIELD': '1'}
# A tier past this is killed and failed (a hang must not hold CI).
TIER_TIMEOUT = float(os.environ.get('TEST_TIMEOUT', 1200))


class Tier(object):
    def __init__(self, name, lane, argv, env=None):
        self.name, self.lane, self.argv = name, lane, argv
        self.env = env or {}
        self.seconds = None
        self.code = None
        self.cpu = None
        self.counts = {}

    @property
    def log(self):
        return os.path.join(LOGS, self.name + '.log')


def tiers():
    """Every tier, in the order each lane runs them."""
    out = [Tier('mpi-%d' % n, 'compute',
                MPI_RUN + ['-n', str(n), '--timeout', str(TIER_TIMEOUT), '--']
                + (AT_FOUR if n == 4 else ['tests/mpi'])
                + (NOT_AT_THREE if n == 3 else []) + ['-q'] + NOT_TIMING)
           for n in (4, 3, 2, 1)]
    # Bit for bit at 2 ranks for each stage; uneven shards at 3 for stage 3,
    # which slices what stages 1 and 2 slice (the optimizer's state, the
    # gradients' reduce-scatter) with the same layout, and the parameters
    # too (tests/mpi/test_sharding.py runs every stage at 3 and 4 ranks).
    for mode in ('optimizer', 'gradients', 'parameters'):
        for n in ((2, 3) if mode == 'parameters' else (2,)):
            out.append(Tier(
                'shard-%s-%d' % (mode, n), 'compute',
                MPI_RUN + ['-n', str(n), '--timeout', str(TIER_TIMEOUT), '--']
                + SHARD_FILES + ['-q'] + NOT_TIMING,
                env={'CHAINERMN_OVERLAP_TEST_SHARD': mode}))
    out += [
        Tier('netbed', 'hosts', PYTEST + ['-rs', 'tests/netbed'] + NOT_TIMING),
        Tier('unit', 'waits', PYTEST + ['tests/unit'] + NOT_TIMING),
        Tier('commands', 'hosts', PYTEST + ['tests/commands'] + NOT_TIMING),
        Tier('timing', 'quiet', PYTEST + ['-rs', 'tests/unit', 'tests/netbed',
                                          '-m', 'timing']),
        Tier('timing-mpi-2', 'quiet',
             MPI_RUN + ['-n', '2', '--timeout', str(TIER_TIMEOUT), '--',
                        'tests/mpi', '-q', '-m', 'timing']),
    ]
    return out


SUMMARY = re.compile(r'(\d+) (passed|failed|skipped|errors?|deselected|'
                     r'xfailed|xpassed)')


def counts(text):
    """The counts of pytest's last summary line in ``text``."""
    for line in reversed(text.splitlines()):
        found = SUMMARY.findall(line)
        if found and (' in ' in line or line.startswith('=')):
            out = {}
            for number, what in found:
                what = 'error' if what.startswith('error') else what
                out[what] = out.get(what, 0) + int(number)
            return out
    return {}


def _wait_with_cpu(proc, deadline):
    """(exit code, CPU seconds of the tier's whole process tree: user and
    system, its reaped descendants included), or (None, None) past
    ``deadline`` (None: no limit)."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if deadline is not None and time.monotonic() > deadline:
            return None, None
        time.sleep(0.2)


def run_tier(tier, lock):
    os.makedirs(LOGS, exist_ok=True)
    env = dict(os.environ, **tier.env)
    env.setdefault('OMP_NUM_THREADS', '1')
    env.setdefault('OPENBLAS_NUM_THREADS', '1')
    if tier.lane != 'quiet':
        env.update(BUSY_WAIT_ENV)
    t0 = time.monotonic()
    with open(tier.log, 'w') as log:
        proc = subprocess.Popen(tier.argv, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                start_new_session=True)
        tier.code, tier.cpu = _wait_with_cpu(proc, t0 + TIER_TIMEOUT + 60)
        if tier.code is None:
            os.killpg(proc.pid, signal.SIGKILL)
            tier.code, tier.cpu = _wait_with_cpu(proc, None)
            tier.code = 124
            log.write('\ntiers: %s killed after %.0f s\n'
                      % (tier.name, TIER_TIMEOUT + 60))
    tier.seconds = time.monotonic() - t0
    with open(tier.log) as f:
        text = f.read()
    tier.counts = counts(text)
    # pytest's "no tests ran" (5) is a failure here too: a tier that
    # selects nothing has lost what it checks.
    with lock:
        state = 'passed' if tier.code == 0 else 'FAILED (exit %d)' % tier.code
        sys.stdout.write('== %-22s %s in %5.0f s (%5.0f CPU-s)  %s\n' % (
            tier.name, state, tier.seconds, tier.cpu or 0,
            _count_text(tier.counts)))
        if tier.code != 0:
            sys.stdout.write('---- end of %s ----\n%s\n---- end ----\n'
                             % (tier.log, text[-12000:]))
        sys.stdout.flush()


def _count_text(c):
    return ', '.join('%d %s' % (c[k], k) for k in
                     ('passed', 'failed', 'error', 'skipped', 'deselected')
                     if c.get(k))


def run_lanes(selected, serial=False):
    lock = threading.Lock()
    lanes = {}
    for t in selected:
        lanes.setdefault(t.lane, []).append(t)

    def lane(ts):
        for t in ts:
            run_tier(t, lock)

    side_by_side = [lanes.pop(k) for k in ('compute', 'waits', 'hosts')
                    if k in lanes]
    if serial:
        for ts in side_by_side:
            lane(ts)
    else:
        threads = [threading.Thread(target=lane, args=(ts,))
                   for ts in side_by_side]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    for ts in lanes.values():      # the quiet lane, alone
        lane(ts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--list', action='store_true',
                        help='list the tiers and exit')
    parser.add_argument('--only', nargs='+', metavar='TIER',
                        help='run only these tiers (a prefix selects several: '
                        'mpi, shard)')
    parser.add_argument('--serial', action='store_true',
                        help='one tier at a time (no lanes side by side)')
    args = parser.parse_args(argv)
    everything = tiers()
    if args.list:
        for t in everything:
            sys.stdout.write('%-22s %-8s %s\n' % (
                t.name, t.lane, ' '.join(
                    ['%s=%s' % kv for kv in t.env.items()] +
                    [os.path.relpath(a, ROOT) if os.path.isabs(a) else a
                     for a in t.argv])))
        return 0
    selected = everything
    if args.only:
        selected = [t for t in everything if any(
            t.name == o or t.name.startswith(o + '-') for o in args.only)]
        unknown = [o for o in args.only if not any(
            t.name == o or t.name.startswith(o + '-') for t in everything)]
        if unknown:
            parser.error('unknown tier(s) %s; --list shows them'
                         % ', '.join(unknown))
    t0 = time.monotonic()
    run_lanes(selected, serial=args.serial)
    total = {}
    for t in selected:
        for k, v in t.counts.items():
            total[k] = total.get(k, 0) + v
    failed_tiers = [t.name for t in selected if t.code != 0]
    sys.stdout.write('tiers: %d run in %.0f s, %.0f CPU-s; %s\n' % (
        len(selected), time.monotonic() - t0,
        sum(t.cpu or 0 for t in selected),
        'failed: ' + ', '.join(failed_tiers) if failed_tiers
        else 'all passed'))
    sys.stdout.write('tests: %d passed, %d failed, %d skipped\n' % (
        total.get('passed', 0), total.get('failed', 0) + total.get('error', 0)
        + len([t for t in failed_tiers if not _count_text(
            next(x for x in selected if x.name == t).counts)]),
        total.get('skipped', 0)))
    return 1 if failed_tiers else 0


if __name__ == '__main__':
    sys.exit(main())
