"""Jobs across hosts over ssh, and real faults of a host (testbed/hosts.py).

Two simulated hosts (namespaces with their own sshd, IPC and UTS
namespaces) with 2 slots each; the launcher runs in the login namespace
with ``--hostfile`` and the bed's ssh, and trains
``tests/unit/restart_job.py`` (paced with ``--sleep``) with snapshots in
the bed's shared folder.  Each fault test first shows that the fault
happened (the processes gone, the link down, ssh refused), then what the
launcher said and did, then the result: bit-identical to an uninterrupted
run where the rank count never changed, else equal to a run stopped and
resumed at the same snapshots with the same rank counts (which shows the
resume onto fewer and onto more ranks continues exactly), with the loss
falling.

Needs root, namespaces and openssh-server (installed with apt-get when
missing, as iproute2 is); skipped otherwise, saying why.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from testbed import faults, hosts, jobs
# tests/netbed has no __init__.py: pytest puts it on sys.path (rootdir-based
# "prepend" import mode) and imports test_netbed under this name.
from test_netbed import _WHY_NOT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
JOB = os.path.join(ROOT, 'tests', 'unit', 'restart_job.py')
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')

_WHY_NO_HOSTS = _WHY_NOT or hosts.ensure_ssh()
pytestmark = pytest.mark.skipif(_WHY_NO_HOSTS is not None,
                                reason=str(_WHY_NO_HOSTS))

# 120 iterations, a snapshot every 10; the watchdog at 3 s (the local
# reference runs wait longer: no fault there, and the limit does not change
# the arithmetic, but a loaded machine can stall a rank for 3 s).
STEPS = ['--iterations', '120', '--every', '10']
TRAIN = STEPS + ['--timeout', '3']
PACE = ['--sleep', '0.03', '--log-loss']
ELASTIC = ['--backoff', '0.2', '--min-hosts', '1', '--max-restarts', '5']


_REFERENCES = {}


def reference(tmp_path, pieces):
    """Final npz of local runs: ``[(ranks, stop_at or None)]`` in turn.

    Kept for the module: two tests compare with the same uninterrupted run.
    """
    key = tuple(pieces)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(tmp_path, pieces)
    return _REFERENCES[key]


def _reference(tmp_path, pieces):
    out = str(tmp_path / 'reference.npz')
    for ranks, stop in pieces:
        cmd = [MPIEXEC, '-n', str(ranks), sys.executable, JOB, '--out',
               str(tmp_path / 'ref_snap'), '--result', out] + STEPS + [
                   '--timeout', '120']
        if stop is not None:
            cmd += ['--stop-at', str(stop)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              env=dict(os.environ, OMP_NUM_THREADS='1'),
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:]
    return out


def assert_bit_identical(result, ref):
    for suffix in ('', '.opt.npz'):
        a, b = np.load(ref + suffix), np.load(result + suffix)
        assert sorted(a.files) == sorted(b.files) and a.files
        for k in a.files:
            assert a[k].tobytes() == b[k].tobytes(), (suffix, k)


def start(bed, tmp_path, launcher_args=ELASTIC, job_args=()):
    # Snapshots in the bed's shared folder; the result outlives the bed.
    result = str(tmp_path / 'final.npz')
    job = jobs.HostJob(bed, list(launcher_args), [
        JOB, '--out', os.path.join(bed.shared, 'snap'), '--result',
        result] + TRAIN + PACE + list(job_args))
    return job, result


def ended(text, attempt):
    m = re.search(r'attempt {} \((\d+) ranks on (\S+)\) ended after [\d.]+ '
                  r's: (.*)'.format(attempt), text)
    assert m, text[-5000:]
    return m.group(3)


def assert_loss_falls(text):
    values = [v for _, _, _, v in jobs.losses(text)]
    assert len(values) >= 6, text[-3000:]
    assert np.mean(values[-3:]) < np.mean(values[:3]), values


def recovery(job, fault):
    """Seconds from the fault to the first iteration completed after it."""
    back = jobs.first_training_after(job.text, fault['time'])
    assert back is not None, job.text[-3000:]
    return back - fault['time']


def test_a_job_over_ssh_crosses_the_links(tmp_path):
    with hosts.HostBed(2, slots=2) as bed:
        ns = {}
        for i in (0, 1):
            pid = bed.sshd[i].pid
            ns[i] = {k: os.readlink('/proc/{}/ns/{}'.format(pid, k))
                     for k in ('net', 'ipc', 'uts')}
        mine = {k: os.readlink('/proc/self/ns/{}'.format(k))
                for k in ('net', 'ipc', 'uts')}
        before = [bed.interface_bytes(i) for i in (0, 1)]
        job, result = start(bed, tmp_path, ['--max-restarts', '0'],
                            ['--no-snapshot'])
        code = job.finish(300)
        after = [bed.interface_bytes(i) for i in (0, 1)]
        names = bed.login_run([bed.ssh, 'h1', 'hostname']).stdout.strip()
    text = job.text
    assert code == 0, text[-3000:]
    assert 'starting 4 rank(s) on h0:2,h1:2' in text, text[-3000:]
    # Each host has namespaces of its own (net, IPC, UTS), not ours.
    for k in ('net', 'ipc', 'uts'):
        assert ns[0][k] != ns[1][k] and mine[k] not in (ns[0][k], ns[1][k])
    assert names == 'h1'
    # The gradients crossed each host's link: 120 allreduces of the MLP's
    # 5.6 KB (float32) each way at least.
    for b, a in zip(before, after):
        assert a[0] - b[0] > 120 * 5000 and a[1] - b[1] > 120 * 5000, (b, a)
    assert_bit_identical(result, reference(tmp_path, [(4, None)]))


def test_a_job_from_a_slurm_allocation(tmp_path):
    # No hostfile: the hosts and slots come from Slurm's variables as a
    # batch job sees them (h0 and h1, 2 tasks each).  h1's login shell
    # greets on stdout before every command (the launcher's checks and
    # Hydra's proxy alike): that changes nothing.
    with hosts.HostBed(2, slots=2, chatty=(1,)) as bed:
        result = str(tmp_path / 'final.npz')
        job = jobs.HostJob(
            bed, ['--hosts-from', 'slurm', '--max-restarts', '0'],
            [JOB, '--out', os.path.join(bed.shared, 'snap'), '--result',
             result, '--no-snapshot'] + TRAIN + PACE,
            env={'SLURM_JOB_NODELIST': 'h[0-1]',
                 'SLURM_TASKS_PER_NODE': '2(x2)'}, hostfile=False)
        code = job.finish(300)
    text = job.text
    assert code == 0, text[-3000:]
    assert 'starting 4 rank(s) on h0:2,h1:2' in text, text[-3000:]
    # The banner was there: Hydra passes on what the proxy's shell printed.
    assert 'Welcome to h1: modules loaded' in text, text[-3000:]
    assert 'does not answer' not in text, text[-3000:]
    assert_bit_identical(result, reference(tmp_path, [(4, None)]))


def test_every_process_of_a_host_killed(tmp_path):
    with hosts.HostBed(2, slots=2) as bed:
        job, result = start(bed, tmp_path)
        job.wait_for(r'loss at iteration 20 ')
        fault = faults.kill_host(bed, 1)
        code = job.finish(300)
    text = job.text
    # The fault happened: the ranks of h1 (and their parents, the proxy,
    # the ssh session) are gone.
    assert fault['left'] == [], fault
    assert sum('restart_job.py' in c for c in fault['commands']) >= 2, fault
    assert any('hydra_pmi_proxy' in c for c in fault['commands']), fault
    assert 'every process on host h1 ended at once' in ended(text, 0), text
    # h1 answers again: the job goes on at full size, exactly.
    assert 'attempt 1: starting 4 rank(s) on h0:2,h1:2' in text, text
    assert code == 0, text[-3000:]
    assert 'Traceback' not in _launcher_lines(text), text
    assert_bit_identical(result, reference(tmp_path, [(4, None)]))
    assert recovery(job, fault) < 60


def _launcher_lines(text):
    return '\n'.join(ln for ln in text.splitlines()
                     if 'chainermn_overlap.launch' in ln)


def _cut_and_wait(bed, job, seconds):
    job.wait_for(r'loss at iteration 20 ')
    fault = faults.cut_link(bed, 1)
    try:
        job.wait_for(r'attempt 0 \(4 ranks on h0:2,h1:2\) ended after',
                     timeout=seconds)
        return fault, True
    except AssertionError:
        return fault, False


# The ssh keep-alives (5 s x 3) end a session over a cut link, the
# launcher ends the attempt --session-grace (5 s) later.
SESSION_BOUND = 15 + 5 + 15


def _cut_heal_and_finish(bed, tmp_path, seconds, job_args=()):
    """Cuts h1's link after iteration 20, heals it once attempt 1 starts;
    returns (job, result, fault, whether attempt 0 ended, exit status)."""
    job, result = start(bed, tmp_path, job_args=job_args)
    fault, ended_ = _cut_and_wait(bed, job, seconds=seconds)
    job.wait_for(r'attempt 1: starting')
    faults.heal_link(bed, 1)
    return job, result, fault, ended_, job.finish(300)


def test_a_cut_link_hangs_without_the_watchdog(tmp_path):
    # Negative control: with the watchdog and the launcher's session check
    # off, nothing ends the attempt while the link is down (MPICH, UCX and
    # Hydra do not notice), for longer than the session check takes.
    with hosts.HostBed(2, slots=2) as bed:
        job, _ = start(bed, tmp_path, ['--max-restarts', '0',
                                       '--session-grace', '0'],
                       ['--timeout', '0'])
        fault, ended_ = _cut_and_wait(bed, job, seconds=SESSION_BOUND)
        job.stop()
    assert fault['state'] == 'down' and not fault['reachable'], fault
    assert not ended_, job.text[-3000:]


def test_a_cut_link_ends_the_attempt_by_its_ssh_session(tmp_path):
    # The watchdog off: the end of mpiexec's ssh session to h1 alone ends
    # the attempt, and the job resumes on h0 from its last snapshot.
    with hosts.HostBed(2, slots=2) as bed:
        job, result, fault, ended_, code = _cut_heal_and_finish(
            bed, tmp_path, SESSION_BOUND, ['--timeout', '0'])
    text = job.text
    assert fault['state'] == 'down' and not fault['reachable'], fault
    assert ended_, text[-3000:]
    reason = ended(text, 0)
    assert 'ssh session to host h1 ended while the job ran on' in reason, \
        reason
    assert 'attempt 1: starting 2 rank(s) on h0:2' in text, text[-3000:]
    assert code == 0, text[-3000:]
    end = [t for t, ln in job.lines if 'attempt 0 (4 ranks' in ln][0]
    assert end - fault['time'] < SESSION_BOUND, end - fault['time']
    print('attempt ended {:.1f} s after the cut, by its ssh session'.format(
        end - fault['time']))
    tr = jobs.trainings(text)
    resumed = [f for _, a, _, f, _ in tr if a == 1][0]
    assert_bit_identical(result, reference(tmp_path, [(4, resumed),
                                                      (2, None)]))


def test_a_cut_link_ends_the_attempt_and_the_job_shrinks(tmp_path):
    with hosts.HostBed(2, slots=2) as bed:
        job, result, fault, ended_, code = _cut_heal_and_finish(
            bed, tmp_path, 60)
    text = job.text
    assert fault['state'] == 'down' and not fault['reachable'], fault
    assert ended_, text[-3000:]
    reason = ended(text, 0)
    assert 'raised CommunicationTimeout' in reason and 'on h0' in reason, \
        reason
    assert re.search(r'host h1 does not answer: ssh exit 255: .*timed out',
                     text), text[-3000:]
    assert 'attempt 1: starting 2 rank(s) on h0:2' in text, text[-3000:]
    assert 'written by 4 ranks on 2' in text, text[-3000:]
    assert code == 0, text[-3000:]
    # The attempt ended within the watchdog's 3 s and the abort's own
    # clean-up of the fault.
    end = [t for t, ln in job.lines if 'attempt 0 (4 ranks' in ln][0]
    assert end - fault['time'] < 3 + 20, end - fault['time']
    tr = jobs.trainings(text)
    resumed = [f for _, a, _, f, _ in tr if a == 1][0]
    assert_bit_identical(result, reference(tmp_path, [(4, resumed),
                                                      (2, None)]))
    assert_loss_falls(text)


def test_a_lost_host_is_left_out_then_taken_back_at_the_next_restart(
        tmp_path):
    with hosts.HostBed(2, slots=2) as bed:
        job, result = start(bed, tmp_path)
        job.wait_for(r'loss at iteration 20 ')
        lost = faults.lose_host(bed, 1)
        at, _, _ = job.wait_for(r'loss at iteration \d+ attempt 1 ')
        faults.start_sshd(bed, 1)
        # Progress on h0 alone, then h0's processes die: the restart takes
        # h1 back.
        job.wait_for(r'loss at iteration \d+ attempt 1 ', start=at + 1)
        killed = faults.kill_host(bed, 0)
        code = job.finish(300)
    text = job.text
    assert lost['ssh_rc'] == 255 and 'refused' in lost['ssh_error'], lost
    assert lost['left'] == [] and lost['killed'], lost
    assert killed['left'] == [] and killed['killed'], killed
    assert 'every process on host h1 ended at once' in ended(text, 0)
    assert re.search(r'host h1 does not answer: .*Connection refused', text)
    assert 'attempt 1: starting 2 rank(s) on h0:2' in text, text[-3000:]
    assert 'attempt 2: starting 4 rank(s) on h0:2,h1:2' in text, text[-3000:]
    assert 'written by 2 ranks on 4' in text, text[-3000:]
    assert code == 0, text[-3000:]
    tr = jobs.trainings(text)
    r1 = [f for _, a, _, f, _ in tr if a == 1][0]
    r2 = [f for _, a, _, f, _ in tr if a == 2][0]
    assert_bit_identical(result, reference(tmp_path, [
        (4, r1), (2, r2), (4, None)]))
    assert_loss_falls(text)


def test_host_discovery_grows_the_job_at_its_next_snapshot(tmp_path):
    # Listed: h0 and h1 (4 ranks) of a bed of 3.  h1 is lost: the job goes
    # on with 2 ranks; then h1 answers again and h2 appears in the listing:
    # the job stops at its next snapshot and grows past its first size to
    # 6 ranks (--max-ranks 6), exactly.
    with hosts.HostBed(3, slots=2) as bed:
        listing = os.path.join(bed.dir, 'discovered')
        with open(listing, 'w') as f:
            f.write('h0:2\nh1:2\n')
        job, result = start(bed, tmp_path, ELASTIC + [
            '--max-ranks', '6', '--host-discovery', 'cat ' + listing,
            '--discovery-interval', '1'])
        job.wait_for(r'loss at iteration 20 ')
        lost = faults.lose_host(bed, 1)
        job.wait_for(r'loss at iteration \d+ attempt 1 ')
        # One change only, to the 3 hosts: h1 leaves the listing while its
        # sshd starts again, then h0, h1 and h2 are listed at once.
        _write_listing(listing, 'h0:2\n')
        faults.start_sshd(bed, 1)
        _write_listing(listing, 'h0:2\nh1:2\nh2:2\n')
        code = job.finish(300)
    text = job.text
    assert lost['ssh_rc'] == 255 and lost['left'] == [], lost
    assert 'attempt 0: starting 4 rank(s) on h0:2,h1:2' in text, text[-3000:]
    assert 'attempt 1: starting 2 rank(s) on h0:2' in text, text[-3000:]
    assert re.search(r'host discovery: h0:2,h1:2,h2:2 now \(running on '
                     r'h0:2\); asking the job to stop at its next snapshot',
                     text), text[-3000:]
    m = re.search(r'attempt 1 \(2 ranks on h0:2\) ended after [\d.]+ s: '
                  r'stopped at its snapshot of iteration (\d+) to change '
                  r'hosts', text)
    assert m, text[-3000:]
    stop = int(m.group(1))
    assert 'attempt 2: starting 6 rank(s) on h0:2,h1:2,h2:2' in text, \
        text[-3000:]
    # The stop was not a failure: no restart was used for it.
    assert 'restart 2 of' not in text, text[-3000:]
    assert code == 0, text[-3000:]
    tr = jobs.trainings(text)
    r1 = [f for _, a, _, f, _ in tr if a == 1][0]
    assert [f for _, a, _, f, _ in tr if a == 2] == [stop], tr
    assert [s for _, a, s, _, _ in tr if a == 2] == [6], tr
    assert_bit_identical(result, reference(tmp_path, [
        (4, r1), (2, stop), (6, None)]))
    assert_loss_falls(text)


def _write_listing(path, text):
    with open(path + '.new', 'w') as f:
        f.write(text)
    os.replace(path + '.new', path)
