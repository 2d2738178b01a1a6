"""The time-dilated bed (testbed/cpuquota.py): ranks in their CPU quota,
the link slowed, everything removed afterwards.

Needs root, namespaces and the cgroup v1 ``cpu`` controller; skipped
otherwise, with the reason.  Two 2-rank jobs of a second each.
"""
import os
import re
import sys

import pytest

from testbed import cpuquota, netbed

from test_netbed import _WHY_NOT

WHY_NOT = _WHY_NOT or (None if cpuquota.cpu_controller_available() else
                       'no cgroup v1 cpu controller at {}'.format(
                           cpuquota.CPU_ROOT))
needs_quota = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

# Each rank prints its cpu cgroup, then spins for 0.6 s.
SPIN = ("import time\n"
        "cg = [l.split(':', 2)[2].strip() for l in open('/proc/self/cgroup')"
        " if ':cpu,' in l or l.split(':')[1] == 'cpu']\n"
        "print('CGROUP', cg[0] if cg else '?', 'END', flush=True)\n"
        "t = time.time()\n"
        "while time.time() - t < 0.6:\n"
        "    pass\n")


def _cgroups_of(result):
    # Searched in the whole output, not line by line: in one full make test
    # (three lanes, load 8) the line-by-line reading found one rank's line
    # of two, as when two ranks' writes reach mpiexec's output joined.
    return sorted(re.findall(r'CGROUP (\S+) END', result['stdout']))


@needs_quota
def test_ranks_run_in_their_quota_and_everything_goes_away():
    # Negative control: on the plain bed the ranks are in no cgroup of
    # ours, so the check below can fail.
    with netbed.NetBed(2, '100mbit') as bed:
        plain = bed.run_mpi([sys.executable, '-c', SPIN], timeout=120)
    assert plain['returncode'] == 0, plain['stderr'][-2000:]
    found = _cgroups_of(plain)
    assert len(found) == 2 and not any('q' in c for c in found), (
        plain['stdout'][-2000:])

    with cpuquota.DilatedBed(2, '100mbit', dilation=4) as bed:
        made = [os.path.join(cpuquota.CPU_ROOT, n) for n in bed.cgroups]
        assert bed.rate_bps == 25e6
        with open(os.path.join(made[0], 'cpu.cfs_quota_us')) as f:
            assert int(f.read()) == 1000     # 0.8 / 4 of a 5 ms period
        with open(os.path.join(made[0], 'cpu.cfs_period_us')) as f:
            assert int(f.read()) == 5000
        res = bed.run_mpi([sys.executable, '-c', SPIN], timeout=120)
        throttled = bed.throttled_seconds()
        record = bed.describe()['dilation']
    assert res['returncode'] == 0, res['stderr'][-2000:]
    assert _cgroups_of(res) == sorted('/' + n for n in bed.cgroups), (
        res['stdout'][-2000:])
    # Spinning 0.6 s at a fifth of a core: each rank was held back.
    assert all(t > 0 for t in throttled), throttled
    assert record['cores_per_rank'] == pytest.approx(0.2)
    assert not any(os.path.exists(p) for p in made)
    assert not [n for n in netbed.list_namespaces()
                if n.startswith(netbed.PREFIX + str(os.getpid()))]


def test_dilation_arguments_are_checked():
    with pytest.raises(ValueError, match='dilation'):
        cpuquota.DilatedBed(2, '100mbit', dilation=0.5)
    with pytest.raises(ValueError, match='share'):
        cpuquota.DilatedBed(2, '100mbit', share=1.5)
    if WHY_NOT is None:
        with pytest.raises(ValueError, match='at least 5000 us'):
            cpuquota.DilatedBed(2, '100mbit', dilation=4, period_us=2000)
