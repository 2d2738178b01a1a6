"""A time-dilated test bed: every rank under a CPU quota, the link slowed
by the same factor.

``DilatedBed(ranks, rate, dilation=k, share=0.8)`` is a
:class:`~testbed.netbed.NetBed` whose ranks each run in a cgroup (v1
``cpu`` controller, ``/sys/fs/cgroup/cpu/cmo<pid>q<rank>``) limited to
``share / k`` of a core (``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``),
on a link of ``rate / k`` with ``delay * k``: everything runs k times
slower, so ratios such as scalability keep their meaning while N ranks fit
a machine of fewer cores.  ``share`` is the undilated rank's core (0.8 by
default: at k = 1 two ranks take 1.6 of 2 cores and leave 0.4 to the
kernel's network work); :func:`min_dilation` gives the smallest k at which
N ranks leave that free core fraction.

Each rank enters its cgroup through a one-line shell wrapper (it writes
its pid to ``cgroup.procs``, then ``exec``s ``ip netns exec ... taskset
... rank``), so the rank and every thread it starts are counted.  The
cgroups are removed when the bed closes (after the job
ended) and, as for namespaces, cgroups left by an owner that was killed
are removed by the next bed.
"""
import math
import os

from testbed import netbed
from testbed._system import PREFIX, NetBedError, pid_alive

CPU_ROOT = '/sys/fs/cgroup/cpu'
# The quota is enforced per period: a throttled rank answers no message
# until its next period, a stall that does not scale with k (10 ms periods:
# up to 2 ms at k = 1, 8 ms at k = 4).  By default the period is the
# shortest whose quota is the kernel's minimum of 1 ms (1.25 ms at k = 1,
# 5 ms at k = 4): stalls of at most 0.25 to 4 ms.
MIN_QUOTA_US = 1000
FREE_CORES = 0.4


def min_dilation(ranks, cores, share=0.8, free=FREE_CORES):
    """Smallest whole dilation at which ``ranks`` ranks of ``share`` core
    each, slowed k times, leave ``free`` of ``cores`` cores unused."""
    if cores <= free:
        raise ValueError('{} cores leave nothing once {} are kept free'
                         .format(cores, free))
    return max(1, int(math.ceil(ranks * share / (cores - free) - 1e-9)))


def cpu_controller_available(root=CPU_ROOT):
    return os.path.exists(os.path.join(root, 'cpu.cfs_quota_us'))


def remove_stale_cgroups(root=CPU_ROOT):
    """Removes this bed's cgroups whose owner process is gone."""
    removed = []
    if not os.path.isdir(root):
        return removed
    for name in os.listdir(root):
        if not name.startswith(PREFIX) or 'q' not in name[len(PREFIX):]:
            continue
        owner = name[len(PREFIX):].split('q', 1)[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            try:
                os.rmdir(os.path.join(root, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class DilatedBed(netbed.NetBed):
    """A :class:`~testbed.netbed.NetBed` slowed ``dilation`` times.

    Args:
        ranks (int): ranks (hosts), at least 2.
        rate (str or float): the undilated link rate; the bed's is
            ``rate / dilation``.
        dilation (float): k, at least 1.
        share (float): the undilated rank's share of a core (0 < share <=
            1); each rank gets ``share / dilation``.
        delay (str): the undilated one-way delay (``delay * dilation`` on
            the bed), or None.
        period_us (int): ``cpu.cfs_period_us`` of each rank's cgroup;
            default: the shortest that allows the kernel's 1 ms quota.
        root (str): where the cgroup v1 ``cpu`` controller is mounted.
    """

    def __init__(self, ranks, rate, dilation=1.0, share=0.8, delay=None,
                 period_us=None, root=CPU_ROOT, **kwargs):
        if not dilation >= 1:
            raise ValueError('dilation must be at least 1, got {!r}'
                             .format(dilation))
        if not 0 < share <= 1:
            raise ValueError('share must be in (0, 1], got {!r}'.format(
                share))
        if not cpu_controller_available(root):
            raise NetBedError(
                'no cgroup v1 cpu controller at {} (cpu.cfs_quota_us '
                'missing): mount it (mount -t cgroup -o cpu cpu {}) or run '
                'without dilation'.format(root, root))
        self.dilation = float(dilation)
        self.share = float(share)
        self.undilated = {'rate_bit_per_s': netbed.parse_rate(rate),
                          'delay_s': netbed.parse_delay(delay)}
        d = self.undilated['delay_s']
        super().__init__(ranks, self.undilated['rate_bit_per_s']
                         / self.dilation,
                         delay=None if not d else '{}us'.format(
                             d * self.dilation * 1e6), **kwargs)
        cores = self.share / self.dilation
        if period_us is None:
            period_us = int(math.ceil(MIN_QUOTA_US / cores))
        self.period_us = int(period_us)
        self.quota_us = int(round(self.period_us * cores))
        if self.quota_us < MIN_QUOTA_US:
            raise ValueError(
                'a quota of {} us per {} us period is below the kernel\'s '
                'minimum of {} us: give a period of at least {} us'.format(
                    self.quota_us, self.period_us, MIN_QUOTA_US,
                    int(math.ceil(MIN_QUOTA_US / cores))))
        self.root = root
        self.cgroups = ['{}{}q{}'.format(PREFIX, os.getpid(), r)
                        for r in range(ranks)]
        self.cgroups_made = []

    def __enter__(self):
        remove_stale_cgroups(self.root)
        try:
            for name in self.cgroups:
                path = os.path.join(self.root, name)
                os.mkdir(path)
                self.cgroups_made.append(name)
                with open(os.path.join(path, 'cpu.cfs_period_us'), 'w') as f:
                    f.write(str(self.period_us))
                with open(os.path.join(path, 'cpu.cfs_quota_us'), 'w') as f:
                    f.write(str(self.quota_us))
        except BaseException:
            self._remove_cgroups()
            raise
        try:
            return super().__enter__()
        except BaseException:
            self._remove_cgroups()
            raise

    def close(self):
        try:
            super().close()
        finally:
            self._remove_cgroups()

    def _remove_cgroups(self):
        errors = []
        while self.cgroups_made:
            name = self.cgroups_made.pop()
            path = os.path.join(self.root, name)
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                errors.append('{}: {}'.format(path, e))
        if errors:
            raise NetBedError('could not remove cgroups ({}): a process of '
                              'the job still runs in them; end it, then '
                              'rmdir them'.format('; '.join(errors)))

    def mpi_command(self, cmd, mpiexec=None):
        """As the bed's, each rank entering its cgroup first: outside the
        namespace (``ip netns exec`` mounts a sysfs of its own, without
        the cgroup tree), inherited by everything it starts."""
        line = super().mpi_command(['@RANK@'], mpiexec)
        out, r = [], 0
        for i, word in enumerate(line):
            if word == 'ip' and line[i + 1:i + 3] == ['netns', 'exec']:
                procs = os.path.join(self.root, self.cgroups[r],
                                     'cgroup.procs')
                out += ['sh', '-c', 'echo $$ > "$0" && exec "$@"', procs]
                r += 1
            out += list(cmd) if word == '@RANK@' else [word]
        return out

    def throttled_seconds(self):
        """Seconds each rank's cgroup spent throttled so far (cpu.stat)."""
        out = []
        for name in self.cgroups_made:
            stat = {}
            with open(os.path.join(self.root, name, 'cpu.stat')) as f:
                for line in f:
                    k, v = line.split()
                    stat[k] = int(v)
            out.append(stat.get('throttled_time', 0) * 1e-9)
        return out

    def describe(self):
        d = super().describe()
        d['dilation'] = {
            'k': self.dilation, 'share_undilated': self.share,
            'cpu_quota_us': self.quota_us, 'cpu_period_us': self.period_us,
            'cores_per_rank': self.quota_us / float(self.period_us),
            'cgroups': [os.path.join(self.root, n) for n in self.cgroups],
            'undilated': self.undilated,
            'throttled_s_so_far': self.throttled_seconds()
            if self.cgroups_made else None}
        return d
