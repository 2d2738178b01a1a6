"""The launcher's host handling without root: host lists, the shrink and
grow rules (pure), and jobs over a stand-in ssh.

The stand-in (``fake_ssh``) runs the remote command on this machine, as
ssh to a host would, and refuses hosts listed in a file: enough to run
``--hosts a:2,b:2`` jobs through Hydra's ssh launcher with real ranks, a
host that stops answering, and one that comes back.  The real thing (sshd
per namespace host, links, faults) is ``tests/netbed/test_hosts.py``.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from chainermn_overlap.launch import _elastic, _hosts

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


def test_hostfile_errors(tmp_path):
    with pytest.raises(ValueError, match='cannot read the hostfile'):
        _hosts.read_hostfile(str(tmp_path / 'missing'))
    empty = tmp_path / 'empty'
    empty.write_text('# nothing\n')
    with pytest.raises(ValueError, match='lists no host'):
        _hosts.read_hostfile(str(empty))


def test_the_rank_parent_spells_the_variables_of_config():
    # _rank.py imports only the standard library, so it keeps its own
    # copies of the names.
    from chainermn_overlap import config
    from chainermn_overlap.launch import _rank
    assert _rank.JOB_ENV == config.LAUNCH_ID_ENV
    assert _rank.DEATHS_ENV == config.LAUNCH_DEATHS_ENV


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
