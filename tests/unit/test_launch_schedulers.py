"""Host lists from Slurm, PBS and LSF allocations (``--hosts-from``):
the range syntax expanded, the counts matched to the hosts, and every
name checked like a hostfile's."""
import os
import subprocess
import sys

import pytest

from chainermn_overlap.launch import _schedulers as sch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize('text,names', [
    ('node01', ['node01']),
    ('node[01-03,07]', ['node01', 'node02', 'node03', 'node07']),
    ('gpu-[8-10],login', ['gpu-8', 'gpu-9', 'gpu-10', 'login']),
    ('n[098-100]', ['n098', 'n099', 'n100']),
    ('r[1-2]n[1-2]', ['r1n1', 'r1n2', 'r2n1', 'r2n2']),
    ('a[1,3],b[2]', ['a1', 'a3', 'b2']),
])
def test_slurm_node_lists_expand_in_order(text, names):
    assert sch.expand_nodelist(text) == names


@pytest.mark.parametrize('text,match', [
    ('node[1-3', 'brackets do not pair'), ('node]1[', 'brackets do not pair'),
    ('node[3-1]', 'is not a range'), ('node[a-b]', 'is not a range'),
    ('n[0-999999]', 'more than 100000 hosts')])
def test_bad_slurm_node_lists(text, match):
    with pytest.raises(ValueError, match=match):
        sch.expand_nodelist(text)


def test_slurm_allocation_with_task_counts():
    env = {'SLURM_JOB_NODELIST': 'node[01-03],big',
           'SLURM_TASKS_PER_NODE': '2(x3),4'}
    assert sch.hosts_from('slurm', env) == [
        ('node01', 2), ('node02', 2), ('node03', 2), ('big', 4)]
    assert sch.hosts_from('auto', env) == sch.hosts_from('slurm', env)
    assert sch.hosts_from('slurm', {'SLURM_NODELIST': 'a,b'}) == [
        ('a', 1), ('b', 1)]
    with pytest.raises(ValueError, match='gives 2 counts for the 4 hosts'):
        sch.hosts_from('slurm', dict(env, SLURM_TASKS_PER_NODE='2(x2)'))
    with pytest.raises(ValueError, match='is not N or N'):
        sch.hosts_from('slurm', dict(env, SLURM_TASKS_PER_NODE='2(3),1'))


def test_pbs_and_lsf_allocations(tmp_path):
    nodefile = tmp_path / 'nodes'
    nodefile.write_text('cn1\ncn1\ncn2\ncn1\ncn2\n')
    assert sch.hosts_from('pbs', {'PBS_NODEFILE': str(nodefile)}) == [
        ('cn1', 3), ('cn2', 2)]
    assert sch.hosts_from('lsf', {'LSB_MCPU_HOSTS': 'hA 4 hB 2'}) == [
        ('hA', 4), ('hB', 2)]
    with pytest.raises(ValueError, match='is not "host N'):
        sch.hosts_from('lsf', {'LSB_MCPU_HOSTS': 'hA 4 hB'})
    with pytest.raises(ValueError, match='cannot read PBS_NODEFILE'):
        sch.hosts_from('pbs', {'PBS_NODEFILE': str(tmp_path / 'none')})


def test_hostile_names_from_a_scheduler_are_refused():
    for env, where in (
            ({'SLURM_JOB_NODELIST': 'ok,-oProxyCommand=x'},
             'SLURM_JOB_NODELIST line 2'),
            ({'LSB_MCPU_HOSTS': 'a;b 1'}, 'LSB_MCPU_HOSTS line 1')):
        with pytest.raises(ValueError, match=where):
            sch.hosts_from('auto', env)


def test_no_allocation_says_what_to_do():
    with pytest.raises(ValueError, match='found no batch allocation'):
        sch.hosts_from('auto', {})
    with pytest.raises(ValueError, match='PBS_NODEFILE is not set'):
        sch.hosts_from('pbs', {})


def test_the_cli_reads_the_allocation_and_names_a_conflict(tmp_path):
    # A Slurm allocation of hosts that do not exist: the launcher lists
    # them and tries to reach them (with a stand-in ssh that refuses all).
    ssh = tmp_path / 'refuse'
    ssh.write_text('#!/bin/sh\necho "ssh: no route" >&2\nexit 255\n')
    ssh.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=ROOT,
               SLURM_JOB_NODELIST='cn[1-2]', SLURM_TASKS_PER_NODE='2(x2)')
    base = [sys.executable, '-m', 'chainermn_overlap.launch']
    proc = subprocess.run(
        base + ['--hosts-from', 'slurm', '--ssh', str(ssh), '--max-restarts',
                '0', os.path.join(HERE, 'restart_job.py')], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout
    assert 'host cn1 does not answer: ssh exit 255: ssh: no route' in \
        proc.stdout and 'cn2 does not answer' in proc.stdout, proc.stdout
    proc = subprocess.run(
        base + ['--hosts-from', 'slurm', '--hosts', 'a:1',
                os.path.join(HERE, 'restart_job.py')],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=60)
    assert proc.returncode == 2 and 'not --hosts and --hosts-from' in \
        proc.stdout and 'Traceback' not in proc.stdout, proc.stdout
