"""Soak: 20 real host faults in one long multi-host run, recovery timed.

Run (as root; builds the multi-host test bed of ``testbed/hosts.py``)::

    python -m benchmarks.hosts_soak [--faults 20] [--hosts 2] [--slots 2]
        [--watchdog 3] [--seed 0] [--out benchmarks/results/hosts_soak.json]

(or ``make bench-hosts``).  One job (``tests/unit/restart_job.py``, a
Trainer with ``auto_snapshot`` in the bed's shared folder, paced to about
0.1 s per iteration) runs under ``python -m chainermn_overlap.launch
--hostfile ... --min-hosts 1`` from the login namespace.  The soak breaks
it ``--faults`` times, cycling through three kinds, each on a host the
running attempt uses, once that attempt has written a snapshot of its own:

* ``kill``: every process of the host SIGKILLed (sshd stays: the host is
  back at once);
* ``cut``: the host's link taken down mid-iteration; the watchdog
  (``--watchdog`` seconds) ends the attempt; the link is healed once the
  launcher reports the end;
* ``lose``: the host's sshd stopped and its processes killed; sshd comes
  back once the next attempt (without it) has started, so the one after
  takes the host back.

Recorded per fault: the time from the fault to the first completed
iteration of the next attempt (and, for ``cut``, that time less the
watchdog's), the resume point against the newest snapshot the job had
reported before the fault (a resume from an older one would be a lost
snapshot), and the host set of each attempt.  The job must finish, with
no snapshot lost or loaded corrupt and its loss falling.  Results:
``--out`` (JSON), with the machine's load average at the start and the
end: figures taken while other jobs share the machine say so in
``label``.
"""
import argparse
import json
import os
import random
import re
import statistics
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import launch  # noqa: E402
from testbed import faults, hosts, jobs  # noqa: E402
from testbed._system import require_root  # noqa: E402

JOB = os.path.join(launch.ROOT, 'tests', 'unit', 'restart_job.py')
KINDS = ('kill', 'cut', 'lose')
_START = re.compile(r'attempt (\d+): starting (\d+) rank\(s\) on (\S+):')


def _running(job, after):
    """(line index, attempt, hosts) of the first attempt started after."""
    i, _, m = job.wait_for(_START.pattern, timeout=180, start=after)
    return i, int(m.group(1)), [h.split(':')[0]
                                for h in m.group(3).split(',')]


def _last_logged(job, before):
    done = [it for t, ln in job.lines if t <= before
            for it, _, _, _ in jobs.losses(ln)]
    return max(done) if done else None


def soak(args):
    rng = random.Random(args.seed)
    records = []
    with hosts.HostBed(args.hosts, slots=args.slots) as bed:
        iterations = args.faults * 25 + 150
        launcher_args = ['--backoff', '0.2', '--min-hosts', '1',
                         '--max-restarts', str(args.faults + 10)]
        job_args = [JOB, '--out', os.path.join(bed.shared, 'snap'),
                    '--result', os.path.join(bed.shared, 'final.npz'),
                    '--iterations', str(iterations), '--every', '10',
                    '--timeout', str(args.watchdog), '--sleep', '0.03',
                    '--log-loss']
        t0 = time.time()
        job = jobs.HostJob(bed, launcher_args, job_args)
        at = 0
        plan = [KINDS[k % len(KINDS)] for k in range(args.faults)]
        for k in range(args.faults):
            at, attempt, running = _running(job, at)
            # A cut link between ranks of one host stops nothing (they
            # still reach each other's addresses): a cut waits for an
            # attempt on two hosts or more.
            fits = [x for x in plan if x != 'cut' or len(running) > 1]
            kind = fits[0] if fits else 'kill'
            if kind in plan:
                plan.remove(kind)
            # The attempt has written a snapshot of its own: progress.
            job.wait_for(r'loss at iteration \d+ attempt {} '.format(
                attempt), timeout=180, start=at)
            time.sleep(rng.uniform(0.0, 0.5))
            target = bed.names.index(rng.choice(running))
            fault = {'kill': faults.kill_host, 'cut': faults.cut_link,
                     'lose': faults.lose_host}[kind](bed, target)
            newest = _last_logged(job, fault['time'])
            end_at, end_t, _ = job.wait_for(
                r'attempt {} \(.*\) ended after'.format(attempt),
                timeout=180, start=at)
            if kind == 'cut':
                faults.heal_link(bed, target)
            nxt, next_attempt, next_hosts = _running(job, end_at)
            if kind == 'lose':
                faults.start_sshd(bed, target)
            trained = job.wait_for(
                r'training at iteration \d+ attempt {} '.format(
                    next_attempt), timeout=180, start=nxt)[2]
            back = jobs.trainings(trained.string)[0]
            seconds = back[4] - fault['time']
            records.append({
                'fault': kind, 'host': bed.names[target],
                'attempt': attempt, 'ran_on': running,
                'next_attempt': next_attempt, 'next_ran_on': next_hosts,
                'evidence': {x: fault.get(x) for x in (
                    'killed', 'left', 'state', 'reachable', 'ssh_rc',
                    'ssh_error') if x in fault},
                'to_attempt_end_s': end_t - fault['time'],
                'recovery_s': seconds,
                'recovery_less_watchdog_s': seconds - (
                    args.watchdog if kind == 'cut' else 0.0),
                'newest_snapshot_reported': newest,
                'resumed_from': back[3]})
            sys.stderr.write('hosts_soak: fault {}/{} {} on {}: training '
                             'again after {:.1f} s, from {}\n'.format(
                                 k + 1, args.faults, kind,
                                 bed.names[target], seconds, back[3]))
            at = nxt
        code = job.finish(timeout=900)
        wall = time.time() - t0
        text = job.text
        desc = bed.describe()
    return records, code, text, wall, desc, iterations


def summarize(records, code, text, iterations, watchdog):
    """Checks and figures of a soak run."""
    values = [v for _, _, _, v in jobs.losses(text)]
    lost = [r for r in records if r['newest_snapshot_reported'] is not None
            and (r['resumed_from'] or 0) < r['newest_snapshot_reported']]
    rec = [r['recovery_less_watchdog_s'] for r in records]
    launcher_lines = [ln for ln in text.splitlines()
                      if 'chainermn_overlap.launch' in ln]
    checks = {
        'finished': code == 0 and 'finished at iteration {}'.format(
            iterations) in text,
        'faults': len(records),
        'no_snapshot_lost': not lost,
        'no_snapshot_loaded_corrupt': 'could not load' not in text and
        'corrupt' not in text,
        'loss_falls': len(values) >= 6 and
        statistics.mean(values[-5:]) < statistics.mean(values[:5]),
        'no_launcher_traceback': 'Traceback' not in '\n'.join(
            launcher_lines),
        'one_line_per_attempt_end': len(re.findall(
            r'attempt \d+ \(.*\) ended after', text)) >= len(records),
    }
    by_kind = {}
    for kind in KINDS:
        xs = [r['recovery_s'] for r in records if r['fault'] == kind]
        if xs:
            by_kind[kind] = {'n': len(xs), 'median_s': statistics.median(xs),
                             'max_s': max(xs)}
    return {
        'checks': checks,
        'recovery_less_watchdog_median_s': statistics.median(rec),
        'recovery_less_watchdog_max_s': max(rec),
        'recovery_median_s': statistics.median(
            [r['recovery_s'] for r in records]),
        'recovery_max_s': max(r['recovery_s'] for r in records),
        'by_kind': by_kind, 'watchdog_s': watchdog,
        'target': 'median recovery (less the watchdog) under 10 s',
        'target_met': statistics.median(rec) < 10.0,
        'loss_first_last': [values[:5], values[-5:]]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--faults', type=int, default=20)
    p.add_argument('--hosts', type=int, default=2)
    p.add_argument('--slots', type=int, default=2)
    p.add_argument('--watchdog', type=float, default=3.0,
                   help='the job\'s communication timeout (seconds)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'hosts_soak.json'))
    p.add_argument('--log', default=None,
                   help='also write the job\'s whole output here')
    args = p.parse_args(argv)
    require_root(('ip', 'tc'))
    why = hosts.ensure_ssh()
    if why:
        sys.stderr.write('hosts_soak: {}\n'.format(why))
        return 2
    load0 = os.getloadavg()
    records, code, text, wall, desc, iterations = soak(args)
    load1 = os.getloadavg()
    summary = summarize(records, code, text, iterations, args.watchdog)
    cores = os.cpu_count()
    # The soak's own processes load the machine too: judge by the start.
    shared = load0[0] > 0.25 * cores
    from benchmarks.harness import machine
    out = {
        'label': ('measured while other jobs shared the machine (load '
                  'average {:.1f} at the start, {:.1f} at the end, {} '
                  'cores)'.format(load0[0], load1[0], cores) if shared
                  else 'quiet machine (load average {:.1f} at the start, '
                  '{:.1f} at the end, {} cores)'.format(load0[0], load1[0],
                                                        cores)),
        'shared_machine': shared, 'command': ' '.join(
            ['python -m benchmarks.hosts_soak'] + list(
                sys.argv[1:] if argv is None else argv)),
        'summary': summary, 'faults': records, 'wall_s': wall,
        'launcher_exit': code, 'bed': desc,
        'machine': machine.machine_description(),
        'launcher_lines': [ln for ln in text.splitlines()
                           if 'chainermn_overlap.launch' in ln]}
    if args.log:
        with open(args.log, 'w') as f:
            f.write(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(out, f, indent=1)
    sys.stdout.write(
        'hosts_soak: {} faults, recovery (less the {:g} s watchdog) median '
        '{:.1f} s, max {:.1f} s; checks {}; {}; wrote {}\n'.format(
            len(records), args.watchdog,
            summary['recovery_less_watchdog_median_s'],
            summary['recovery_less_watchdog_max_s'],
            'all passed' if all(summary['checks'].values()) else
            summary['checks'], out['label'], args.out))
    return 0 if all(summary['checks'].values()) else 1


if __name__ == '__main__':
    sys.exit(main())
