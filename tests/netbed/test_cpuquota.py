"""The time-dilated bed (testbed/cpuquota.py): ranks in their CPU quota,
the link slowed, everything removed afterwards.

Needs root, namespaces and the cgroup v1 ``cpu`` controller; skipped
otherwise, with the reason.  Two 2-rank jobs of a second each.
"""
import os
import sys

import pytest

from testbed import cpuquota, netbed

from test_netbed import _WHY_NOT

WHY_NOT = _WHY_NOT or (None if cpuquota.cpu_controller_available() else
                       'no cgroup v1 cpu controller at {}'.format(
                           cpuquota.CPU_ROOT))
needs_quota = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

# Each rank prints its cpu cgroup, then spins for 0.6 s.
SPIN = ("import os, sys, time\n"
        "cg = [l.split(':', 2)[2].strip() for l in open('/proc/self/cgroup')"
        " if ':cpu,' in l or l.split(':')[1] == 'cpu']\n"
        "with open(os.path.join(sys.argv[1], str(os.getpid())), 'w') as f:\n"
        "    f.write(cg[0] if cg else '?')\n"
        "t = time.time()\n"
        "while time.time() - t < 0.6:\n"
        "    pass\n")


def _cgroups_of(folder):
    # Each rank writes its cgroup to a file of its own: printed, the two
    # ranks' lines reached mpiexec's output cut into each other (twice in
    # full make test runs, under load).
    return sorted(open(os.path.join(folder, n)).read()
                  for n in os.listdir(folder))


@needs_quota
def test_ranks_run_in_their_quota_and_everything_goes_away(tmp_path):
    (tmp_path / 'plain').mkdir()
    (tmp_path / 'dilated').mkdir()
    # Negative control: on the plain bed the ranks are in no cgroup of
    # ours, so the check below can fail.
    with netbed.NetBed(2, '100mbit') as bed:
        plain = bed.run_mpi([sys.executable, '-c', SPIN,
                             str(tmp_path / 'plain')], timeout=120)
    assert plain['returncode'] == 0, plain['stderr'][-2000:]
    found = _cgroups_of(tmp_path / 'plain')
    assert len(found) == 2 and not any('q' in c for c in found), found

    with cpuquota.DilatedBed(2, '100mbit', dilation=4) as bed:
        made = [os.path.join(cpuquota.CPU_ROOT, n) for n in bed.cgroups]
        assert bed.rate_bps == 25e6
        with open(os.path.join(made[0], 'cpu.cfs_quota_us')) as f:
            assert int(f.read()) == 1000     # 0.8 / 4 of a 5 ms period
        with open(os.path.join(made[0], 'cpu.cfs_period_us')) as f:
            assert int(f.read()) == 5000
        res = bed.run_mpi([sys.executable, '-c', SPIN,
                           str(tmp_path / 'dilated')], timeout=120)
        throttled = bed.throttled_seconds()
        record = bed.describe()['dilation']
    assert res['returncode'] == 0, res['stderr'][-2000:]
    found = _cgroups_of(tmp_path / 'dilated')
    assert found == sorted('/' + n for n in bed.cgroups), found
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
