"""Tools of the checkout, not of the installed package (the wheel check
leaves this file out): the Makefile's choice of Python (``tools/python.sh``)
and what git must ignore.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def fake_python(folder, name, version):
    """A ``name`` in ``folder`` that runs this Python, claiming ``version``."""
    path = os.path.join(folder, name)
    with open(path, 'w') as f:
        f.write('#!/bin/sh\n[ "$1" = -c ] && shift && exec %s -c '
                '"import sys; sys.version_info = %r; exec(sys.argv[1])" "$1"\n'
                'exec %s "$@"\n' % (sys.executable, version, sys.executable))
    os.chmod(path, 0o755)


def pick(folder, *args):
    env = {'PATH': folder + ':/usr/bin:/bin', 'HOME': folder}
    return subprocess.run(['sh', os.path.join(ROOT, 'tools', 'python.sh')]
                          + list(args), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=60)


@pytest.fixture
def pythons(tmp_path):
    folder = str(tmp_path)
    for name in ('python3', 'python3.13', 'python3.12', 'python3.11'):
        if os.path.exists('/usr/bin/' + name):
            # One that pick() would find on /usr/bin: the folder's own first.
            fake_python(folder, name, (3, 9, 0))
    return folder


def test_python3_usable_is_taken(pythons):
    fake_python(pythons, 'python3', (3, 12, 1))
    out = pick(pythons, 'find')
    assert out.returncode == 0 and out.stdout.strip() == pythons + '/python3'
    assert out.stderr == ''


def test_an_old_python3_is_passed_over_saying_so(pythons):
    fake_python(pythons, 'python3', (3, 10, 13))
    fake_python(pythons, 'python3.12', (3, 12, 1))
    out = pick(pythons, 'find')
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == pythons + '/python3.12'
    assert out.stderr.strip() == ('python3 is Python 3.10: using %s/python3.12 '
                                  '(Python 3.12)' % pythons)


@pytest.mark.parametrize('version', [(3, 10, 13), (3, 14, 0)])
def test_no_usable_python_stops_in_one_line(pythons, version):
    fake_python(pythons, 'python3', version)
    out = pick(pythons, 'find')
    assert out.returncode == 1 and out.stdout == ''
    lines = out.stderr.strip().splitlines()
    assert lines == ['no Python 3.11, 3.12 or 3.13 found (python3 is Python '
                     '%d.%d): install one and run make '
                     'PYTHON=/path/to/python3.12' % version[:2]]
    named = pick(pythons, 'find', 'python3')
    assert named.returncode == 1
    assert named.stderr.strip().splitlines() == [
        'PYTHON=python3 is Python %d.%d: chainermn_overlap needs Python 3.11, '
        '3.12 or 3.13 (what Chainer 7.8.1 runs on); name one, e.g. make '
        'PYTHON=python3.12' % version[:2]]


def test_a_venv_of_another_python_is_replaced(pythons, tmp_path):
    fake_python(pythons, 'python3.13', (3, 13, 0))
    venv = str(tmp_path / 'venv')
    os.makedirs(venv + '/bin')
    fake_python(venv + '/bin', 'python', (3, 11, 7))
    kept = pick(pythons, 'venv', venv, '')
    assert kept.returncode == 0 and kept.stderr == ''
    assert os.path.exists(venv + '/bin/python')
    # Named, another version: replaced (the new venv is of this Python).
    out = pick(pythons, 'venv', venv, 'python3.13')
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith('replacing %s (Python 3.11) by a venv of '
                                 'Python 3.13' % venv)
    assert os.path.exists(venv + '/pyvenv.cfg')


def test_the_wheelhouse_folders_are_ignored_by_git():
    for path in ('.gpu-wheels/part1/x.whl', '.gpu-env/bin/python',
                 '.gpu-dry-run/tree/x'):
        proc = subprocess.run(['git', 'check-ignore', '-q', path], cwd=ROOT)
        assert proc.returncode == 0, '{} is not git-ignored'.format(path)
