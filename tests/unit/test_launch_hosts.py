"""The launcher's host handling without root: host lists, the shrink and
grow rules (pure), and jobs over a stand-in ssh.

The stand-in (``fake_ssh``) runs the remote command on this machine, as
ssh to a host would, and refuses hosts listed in a file: enough to run
``--hosts a:2,b:2`` jobs through Hydra's ssh launcher with real ranks, a
host that stops answering, and one that comes back.  The real thing (sshd
per namespace host, links, faults) is ``tests/netbed/test_hosts.py``.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from chainermn_overlap.launch import _elastic, _hosts, _rank, launcher

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, 'restart_job.py')
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')


# ---------------------------------------------------------------------------
# Host lists

def test_hostfile_formats():
    text = ('# cluster\nnode1:4\nnode2 slots=2\nnode3\n\n'
            'node4:1  # last\n')
    assert _hosts.parse_hosts(text, 'f') == [
        ('node1', 4), ('node2', 2), ('node3', 1), ('node4', 1)]
    assert _hosts.parse_hosts('a:2,b:3', '--hosts') == [('a', 2), ('b', 3)]


@pytest.mark.parametrize('text,match', [
    ('node1:x', 'is not a host'), ('node1:0', 'has 0 slots'),
    ('a:1\na:2', 'listed twice'), ('a b c', 'is not a host')])
def test_bad_host_lists_name_the_line(text, match):
    with pytest.raises(ValueError, match=match):
        _hosts.parse_hosts(text, 'hostfile h.txt')


@pytest.mark.parametrize('name', [
    '-oProxyCommand=touch${IFS}/tmp/x', '-x', 'a;touch', 'a$(touch)',
    'a`b`', 'a|b', 'a&b', "a'b", 'a/b', '-', 'a-', 'a..b', '999.1.2.3',
    '[fd00::1]', 'fd00::1', 'x' * 254])
def test_hostile_or_unusable_names_are_refused_naming_the_line(name):
    text = 'good1:2\n{}:2\n'.format(name)
    with pytest.raises(ValueError) as e:
        _hosts.parse_hosts(text, 'hostfile h.txt')
    assert 'hostfile h.txt line 2' in str(e.value), str(e.value)


def test_names_and_addresses_that_are_hosts():
    text = 'node-01.cluster.example:2\n10.1.2.3\nn_1\nNODE7 slots=3\n'
    assert _hosts.parse_hosts(text, 'f') == [
        ('node-01.cluster.example', 2), ('10.1.2.3', 1), ('n_1', 1),
        ('NODE7', 3)]
    assert 'IPv6' in _hosts.host_problem('[fd00::1]')


def test_hostfile_errors(tmp_path):
    with pytest.raises(ValueError, match='cannot read the hostfile'):
        _hosts.read_hostfile(str(tmp_path / 'missing'))
    empty = tmp_path / 'empty'
    empty.write_text('# nothing\n')
    with pytest.raises(ValueError, match='lists no host'):
        _hosts.read_hostfile(str(empty))


def test_the_rank_parent_run_by_path_reads_config_without_the_package():
    # _rank.py runs by path on hosts that may lack Chainer: it loads the
    # package's config.py (standard library only) beside it, and nothing
    # of the package itself.
    import json
    import subprocess
    import sys
    from chainermn_overlap import config
    from chainermn_overlap.launch import _rank
    script = (
        'import json, runpy, sys\n'
        'g = runpy.run_path({!r}, run_name="not_main")\n'
        'print(json.dumps([g["config"].LAUNCH_ID_ENV, sorted(\n'
        '    m for m in sys.modules\n'
        '    if m.split(".")[0] in ("chainermn_overlap", "chainer",\n'
        '                           "numpy", "mpi4py"))]))\n'
    ).format(_rank.__file__)
    out = subprocess.run([sys.executable, '-c', script], capture_output=True,
                         text=True, timeout=60, cwd='/')
    assert out.returncode == 0, out.stderr
    name, imported = json.loads(out.stdout)
    assert name == config.LAUNCH_ID_ENV
    assert imported == []


def test_allocate_fills_hosts_in_order():
    assert _hosts.allocate([('a', 2), ('b', 2)], 3) == [('a', 2), ('b', 1)]
    assert _hosts.allocate([('a', 2), ('b', 2)], 2) == [('a', 2)]


# ---------------------------------------------------------------------------
# The rules

class _Output(object):
    def __init__(self, deaths=(), events=()):
        self.deaths = list(deaths)
        self.events = list(events)
        self.facts = {}
        self.last_line = None


class _Result(object):
    def __init__(self, size, deaths=(), progressed=False, facts=None):
        self.size = size
        self.output = _Output(deaths)
        self.progressed = progressed
        self.facts = dict(facts or {})
        causes = [d for d in deaths if not d.get('forwarded')]
        if causes:
            self.facts['first_death'] = min(causes, key=lambda d: d['time'])


HOSTS = [('a', 2), ('b', 2)]


def test_plan_leaves_out_hosts_that_do_not_answer():
    policy = _elastic.HostPolicy(4, 1, 1)
    assert policy.plan(HOSTS, {'a': None, 'b': None}) == (HOSTS, None)
    assert policy.plan(HOSTS, {'a': None, 'b': 'refused'}) == (
        [('a', 2)], None)
    strict = _elastic.HostPolicy(4, 4, 1)
    allocation, why = strict.plan(HOSTS, {'a': None, 'b': 'refused'})
    assert allocation is None
    assert '--min-ranks 4' in why and 'b (refused)' in why


def test_a_host_whose_ranks_all_died_is_dropped_then_taken_back():
    policy = _elastic.HostPolicy(4, 1, 1, shrink_after=2)
    dead = [{'rank': 2, 'host': 'b', 'time': 1.0, 'signal': 9},
            {'rank': 3, 'host': 'b', 'time': 1.1, 'signal': 9},
            {'rank': 0, 'host': 'a', 'time': 1.2, 'signal': 15,
             'forwarded': True}]
    assert policy.after(_Result(4, dead), HOSTS) == ''
    assert 'without host b' in policy.after(_Result(4, dead), HOSTS)
    assert policy.plan(HOSTS, {}) == ([('a', 2)], None)
    # Progress: what the shrinking left out is tried again.
    assert policy.after(_Result(2, progressed=True), [('a', 2)]) == ''
    assert policy.plan(HOSTS, {}) == (HOSTS, None)


def test_a_failure_of_one_rank_shrinks_by_one_rank():
    policy = _elastic.HostPolicy(4, 1, 1, shrink_after=1)
    # Rank 3 died; rank 2 on the same host was ended from outside.
    deaths = [{'rank': 3, 'host': 'b', 'time': 1.0, 'exit': 1},
              {'rank': 2, 'host': 'b', 'time': 1.1, 'signal': 15,
               'forwarded': True}]
    assert _elastic.failed_host(_Result(4, deaths), HOSTS) is None
    assert policy.after(_Result(4, deaths), HOSTS).startswith('fewer')
    assert policy.plan(HOSTS, {}) == ([('a', 2), ('b', 1)], None)


def test_a_host_that_vanished_counts_as_the_failure():
    # No record from b at all (its rank parents died too); mpiexec's ssh
    # session to b was closed.
    result = _Result(4, facts={'ssh_closed': ('b',)})
    assert _elastic.failed_host(result, HOSTS) == 'b'


def test_min_hosts_bounds_dropping():
    policy = _elastic.HostPolicy(4, 1, 2, shrink_after=1)
    dead = [{'rank': 2, 'host': 'b', 'time': 1.0, 'signal': 9},
            {'rank': 3, 'host': 'b', 'time': 1.1, 'signal': 9}]
    assert 'without host' not in policy.after(_Result(4, dead), HOSTS)


# ---------------------------------------------------------------------------
# Jobs over the stand-in ssh

FAKE_SSH = r'''#!/bin/sh
# ssh stand-in: skips options, takes the host, runs the rest here.
while [ $# -gt 0 ]; do
    case "$1" in
        -o|-i|-p|-l|-F) shift 2 ;;
        --) shift; break ;;
        -*) shift ;;
        *) break ;;
    esac
done
host="$1"; shift
if grep -qx "$host" "{refused}" 2>/dev/null; then
    echo "ssh: connect to host $host port 22: Connection refused" >&2
    exit 255
fi
exec sh -c "$*"
'''


@pytest.fixture
def fake_ssh(tmp_path):
    refused = tmp_path / 'refused'
    path = tmp_path / 'fake_ssh'
    path.write_text(FAKE_SSH.replace('{refused}', str(refused)))
    path.chmod(0o755)
    return str(path), refused


def _launch(args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    for name in ('CHAINERMN_OVERLAP_RESTART',
                 'CHAINERMN_OVERLAP_PROGRESS_FILE'):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, '-m', 'chainermn_overlap.launch'] + args,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, cwd=ROOT, timeout=timeout)
    return proc.returncode, proc.stdout


def _reference(tmp_path, ranks, stop=None, out='ref.npz'):
    result = str(tmp_path / out)
    cmd = [MPIEXEC, '-n', str(ranks), sys.executable, JOB, '--out',
           str(tmp_path / 'ref_snap'), '--result', result]
    if stop is not None:
        cmd += ['--stop-at', str(stop)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS='1'),
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return result


def _same(a, b):
    for suffix in ('', '.opt.npz'):
        x, y = np.load(a + suffix), np.load(b + suffix)
        assert sorted(x.files) == sorted(y.files)
        for k in x.files:
            assert x[k].tobytes() == y[k].tobytes(), k


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason='needs mpiexec')
def test_hosts_job_restarts_on_the_same_hosts(tmp_path, fake_ssh):
    ssh, _ = fake_ssh
    result = str(tmp_path / 'final.npz')
    code, out = _launch(['--hosts', 'a:2,b:2', '--ssh', ssh, '--backoff',
                         '0.2', '--', JOB, '--out', str(tmp_path / 'snap'),
                         '--result', result, '--fault', 'kill,7,0,3'])
    assert code == 0, out
    assert 'attempt 0: starting 4 rank(s) on a:2,b:2' in out, out
    assert re.search(r'attempt 0 \(4 ranks on a:2,b:2\) ended after [\d.]+ '
                     r's: rank 3 on \S+ \(pid \d+\) was killed by SIGKILL',
                     out), out
    assert 'attempt 1: starting 4 rank(s) on a:2,b:2' in out, out
    _same(result, _reference(tmp_path, 4))


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason='needs mpiexec')
def test_a_host_that_stops_answering_is_left_out(tmp_path, fake_ssh):
    ssh, refused = fake_ssh
    # Host b refuses from the start: the job runs on a alone; without
    # --min-hosts it would not start at all.
    refused.write_text('b\n')
    result = str(tmp_path / 'final.npz')
    base = ['--hosts', 'a:2,b:2', '--ssh', ssh, '--backoff', '0.1']
    job = ['--', JOB, '--out', str(tmp_path / 'snap'), '--result', result]
    code, out = _launch(base + ['--max-restarts', '1'] + job)
    assert code != 0, out
    assert 'host b does not answer: ssh exit 255: ssh: connect to host b ' \
        'port 22: Connection refused' in out, out
    assert 'cannot start: 1 usable host(s) with 2 rank(s), fewer than ' \
        '--min-hosts 1 / --min-ranks 4' in out, out
    assert 'no restarts left' in out and 'Traceback' not in out, out
    code, out = _launch(base + ['--min-hosts', '1'] + job)
    assert code == 0, out
    assert 'attempt 0: starting 2 rank(s) on a:2' in out, out
    _same(result, _reference(tmp_path, 2))


# ---------------------------------------------------------------------------
# Hostile names and what a login shell prints

@pytest.mark.skipif(shutil.which('ssh') is None,
                    reason='needs the ssh client (make test installs it '
                    'with the netbed, which runs first)')
def test_a_hostile_host_name_runs_nothing(tmp_path):
    marker = tmp_path / 'ran'
    hostile = '-oProxyCommand=touch${IFS}' + str(marker)
    # The fault: ssh reads such a name as an option and runs it here.
    subprocess.run(['ssh', '-o', 'BatchMode=yes', hostile, 'true'],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=30)
    assert marker.exists(), 'the negative control did not run the command'
    marker.unlink()
    # A hostfile or a discovery command giving it: refused, line named.
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('localhost:1\n{}:1\n'.format(hostile))
    discovery = 'printf "localhost:1\\n%s:1\\n" "{}"'.format(
        hostile.replace('$', '\\$'))
    for source in (['--hostfile', str(hostfile)],
                   ['--host-discovery', discovery]):
        code, out = _launch(source + ['--', JOB, '--out',
                                      str(tmp_path / 'snap')], timeout=60)
        assert code == 2, out
        assert 'line 2: ' in out and 'is not a host name' in out, out
        assert 'Traceback' not in out and not marker.exists(), out
    # Were one to get past the check, the ssh command reads it as a host.
    ssh = _hosts.Ssh('ssh', 2, str(tmp_path))
    proc = subprocess.run(ssh.command(hostile, ['true']),
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=30)
    assert proc.returncode != 0 and not marker.exists(), proc.stdout


def test_reachability_ignores_what_a_login_shell_prints(tmp_path):
    # A stand-in ssh whose "login shell" prints a banner before the
    # command's output and a message after it.
    fake = tmp_path / 'chatty_ssh'
    fake.write_text(FAKE_SSH.replace('{refused}', str(tmp_path / 'none'))
                    .replace('exec sh -c "$*"',
                             'echo "Welcome to $host"; echo "ended soon"\n'
                             'sh -c "$*"; echo "module: 3 loaded"'))
    fake.chmod(0o755)
    ssh = _hosts.Ssh(str(fake), 2, str(tmp_path))
    verdicts = ssh.end_job(['a', 'b'], 'no-such-job')
    assert verdicts == {'a': None, 'b': None}, verdicts
    assert ssh.names == {'a': socket.gethostname(),
                         'b': socket.gethostname()}
    # A banner alone is no answer.
    assert _hosts._end_answer('ended 0\nWelcome\n') is None
    assert _hosts._end_answer(_rank.END_MARK + '[1]\n') is None


def test_a_session_the_host_closed_is_known_after_mpiexec_is_gone(tmp_path):
    # Every process of host "b" ended at once: the host closes mpiexec's
    # ssh session, ssh says so on stderr and exits 255, and Hydra, which
    # saw its proxy's connection close at the same moment, may be gone
    # already: nobody reads that stderr (a pipe closed before ssh writes).
    fake = tmp_path / 'closing_ssh'
    fake.write_text('#!/bin/sh\nsleep 0.3\n'
                    'echo "Connection to b closed by remote host." >&2\n'
                    'exit 255\n')
    fake.chmod(0o755)
    ssh = _hosts.Ssh(str(fake), 2, str(tmp_path))
    read, write = os.pipe()
    proc = subprocess.Popen([ssh.wrapper, '-x', 'b', 'hydra_pmi_proxy'],
                            stdin=subprocess.DEVNULL, stderr=write)
    os.close(write)
    os.close(read)   # mpiexec is gone: ssh's message reaches nobody
    assert proc.wait(timeout=30) == 255
    # The wrapper's own record says how the session ended.
    sessions = ssh.ended_sessions()
    assert [(x['host'], x['status'], x['closed']) for x in sessions] == [
        ('b', 255, True)], sessions
    assert ssh.ended_sessions() == []   # read once
    # The launcher names the host, and the policy takes it as the host's
    # failure, as when ssh's line reached the output.
    result = _Result(4)
    launcher._closed_sessions(result, HOSTS, sessions)
    assert result.facts['ssh_closed'] == ('b',)
    assert _elastic.failed_host(result, HOSTS) == 'b'
    # A session that ended otherwise (0: the job ended; a keep-alive
    # timeout says nothing of a closed connection) names no host.
    result = _Result(4)
    launcher._closed_sessions(result, HOSTS, [
        {'host': 'a', 'status': 0, 'time': 1.0, 'closed': False},
        {'host': 'b', 'status': 255, 'time': 2.0, 'closed': False}])
    assert 'ssh_closed' not in result.facts
    # The launcher's own ssh (no -x) is ssh itself, as before: no record.
    subprocess.run(ssh.command('a', ['true']), stdin=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=30)
    assert ssh.ended_sessions() == []


def test_death_records_are_matched_to_the_host_as_listed():
    # The hostfile gives addresses; each host answered with its own name.
    allocation = [('10.0.0.1', 2), ('10.0.0.2', 2)]
    names = {'10.0.0.1': 'nodeA', '10.0.0.2': 'nodeB'}
    dead = [{'rank': r, 'host': 'nodeB', 'pid': 10 + r, 'time': 1.0 + r,
             'forwarded': False, 'signal': 9} for r in (2, 3)]
    result = _Result(4, dead)
    # As spelt by the hosts themselves, the records match no listed host.
    assert _elastic.failed_host(result, allocation) is None
    launcher._as_listed(result, allocation, names)
    assert [d['host'] for d in result.output.deaths] == ['10.0.0.2'] * 2
    assert _elastic.failed_host(result, allocation) == '10.0.0.2'
    policy = _elastic.HostPolicy(4, 1, 1, shrink_after=1)
    assert 'without host 10.0.0.2' in policy.after(result, allocation)


class _Proc(object):
    def __init__(self):
        self.signals = []

    def send_signal(self, num):
        self.signals.append(num)


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason='needs mpiexec')
def test_discovery_compares_host_sets_and_bounds_the_changes(tmp_path):
    import signal
    listing = tmp_path / 'listing'
    job = launcher.Launcher(['true'], hosts=[('a', 2), ('b', 2)],
                            host_discovery='cat {}'.format(listing),
                            discovery_interval=0.0, max_resizes=1,
                            min_hosts=1)
    output = _Output(events=[{'event': 'training', 'resize': True}])
    # The same hosts in another order: no change, no stop.
    listing.write_text('b:2\na:2\n')
    proc = _Proc()
    job._discovery_watch([('a', 2), ('b', 2)], 'job:0')(proc, output)
    assert proc.signals == []
    # Another slot count is a change: the job is asked to stop.
    listing.write_text('b:1\na:2\n')
    job._discovery_watch([('a', 2), ('b', 2)], 'job:0')(proc, output)
    assert proc.signals == [signal.SIGUSR1]
    # Once --max-resizes changes were made, the job keeps its hosts.
    job.resizes = 1
    proc = _Proc()
    job._discovery_watch([('a', 2), ('b', 2)], 'job:1')(proc, output)
    assert proc.signals == []


def test_hosts_are_matched_by_the_addresses_they_resolve_to(
        monkeypatch):
    import time
    monkeypatch.setattr(_hosts, '_RESOLVED', {})
    # Two spellings of one machine in one list: refused, naming both.
    with pytest.raises(ValueError, match=r'localhost and 127\.0\.0\.1 are '
                       r'the same host \(both resolve to 127\.0\.0\.1\)'):
        _hosts.one_spelling([('localhost', 2), ('127.0.0.1', 2)])
    # Another spelling of a known host keeps the first one; names that do
    # not resolve are compared as written.
    assert _hosts.one_spelling([('127.0.0.1', 2), ('b', 2)],
                               [('localhost', 2), ('b', 2)]) == [
                                   ('localhost', 2), ('b', 2)]
    assert _hosts.one_spelling([('a', 1), ('b', 1)]) == [('a', 1), ('b', 1)]
    # Discovery spelling a running host another way is no change.
    job = launcher.Launcher(['true'], hosts=[('localhost', 2), ('b', 2)],
                            host_discovery='echo 127.0.0.1:2,b:2',
                            discovery_interval=0.0, min_hosts=1)
    proc = _Proc()
    output = _Output(events=[{'event': 'training', 'resize': True}])
    job._discovery_watch([('localhost', 2), ('b', 2)], 'job:0')(proc, output)
    assert proc.signals == []
    assert job._listed_hosts() == [('localhost', 2), ('b', 2)]
    # A resolver that hangs costs its timeout, then the name stands alone.

    def hang(*args, **kwargs):
        time.sleep(3)
        return [(None, None, None, '', ('127.0.0.1', 0))]
    monkeypatch.setattr(_hosts.socket, 'getaddrinfo', hang)
    t0 = time.monotonic()
    assert _hosts.addresses('slow.example', timeout=0.2) == frozenset()
    assert time.monotonic() - t0 < 1.0


def test_a_host_whose_session_ended_is_reported_after_the_grace():
    from chainermn_overlap.launch._sessions import Sessions
    # Stand-ins for mpiexec's ssh sessions: children of this process
    # whose commands name their hosts.
    sleeper = 'import time; time.sleep(60)'
    procs = {h: subprocess.Popen([sys.executable, '-c', sleeper, h])
             for h in ('hA', 'hB')}
    try:
        sessions = Sessions(['hA', 'hB', 'hC'], grace=5.0)
        assert sessions.lost(os.getpid(), now=0.0) is None
        procs['hB'].kill()
        procs['hB'].wait()
        assert sessions.lost(os.getpid(), now=1.0) is None   # in the grace
        assert sessions.lost(os.getpid(), now=5.9) is None
        assert sessions.lost(os.getpid(), now=6.0) == 'hB'
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_the_reason_names_the_lost_session():
    from chainermn_overlap.launch._result import AttemptResult
    out = _Output(deaths=[{'rank': 0, 'host': 'a', 'pid': 5, 'time': 1.0,
                           'signal': 15, 'forwarded': True}])
    out.facts['session_lost'] = ('b',)
    result = AttemptResult(0, 4, -15, 30.0, out, {}, False, HOSTS)
    reason = result.reason()
    assert "ssh session to host b ended while the job ran on" in reason
    assert 'SIGTERM' not in reason.split(';')[0], reason
    assert _elastic.failed_host(result, HOSTS) == 'b'


def test_a_job_grows_past_its_first_allocation_up_to_max_ranks():
    # -n 6 (--max-ranks) --min-ranks 1: two slots first, six later.
    policy = _elastic.HostPolicy(6, 1, 1)
    assert policy.plan([('a', 2)], {}) == ([('a', 2)], None)
    listed = [('a', 2), ('b', 2), ('c', 4)]
    assert policy.plan(listed, {}) == ([('a', 2), ('b', 2), ('c', 2)], None)


# A stand-in mpiexec that exits (as Hydra does when a proxy's connection
# closes) while its ssh session to h1 is still printing why it ended.
_LOST_MPIEXEC = r'''
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', "import sys, time; time.sleep(1.2); "
                  "sys.stderr.write('Connection to h1 closed by remote "
                  "host.\\n'); sys.exit(255)", 'h1'])
time.sleep(0.8)
sys.stderr.write('[mpiexec@vm] control_cb: assert (!closed) failed\n')
sys.exit(255)
'''

_RUN_ATTEMPT = r'''
import json, os, sys, threading
from chainermn_overlap.launch import _attempt, _procs
_procs.become_subreaper()
_attempt.ORPHAN_GRACE = float(sys.argv[2])
runner = _attempt.AttemptRunner(sys.argv[1], [], 5.0, threading.Event())
result = runner.run(0, 4, [], dict(os.environ),
                    tag='job:0')
result.hosts = [('h0', 2), ('h1', 2)]
sys.stdout.write('RESULT ' + json.dumps(
    {'reason': result.reason(), 'left': sorted(_procs.descendants(
        os.getpid()))}) + '\n')
'''


@pytest.mark.parametrize('grace', [0.0, 2.0])
def test_the_line_of_a_lost_host_outlives_mpiexec(tmp_path, grace):
    fake = tmp_path / 'mpiexec'
    fake.write_text('#!{}\n{}'.format(sys.executable, _LOST_MPIEXEC))
    fake.chmod(0o755)
    script = tmp_path / 'run.py'
    script.write_text(_RUN_ATTEMPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(fake), str(grace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith('RESULT ')]
    assert line, (proc.stdout, proc.stderr)
    result = json.loads(line[-1][len('RESULT '):])
    assert result['left'] == [], result
    lost = 'every process on host h1 ended at once' in result['reason']
    # Without the grace (as before) the launcher's SIGKILL cuts the
    # session's line off and the reason is lost: the fault is real.
    assert lost == (grace > 0), (result, proc.stderr)
