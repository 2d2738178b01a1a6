"""The offline GPU flow (benchmarks/gpu_offline.py, gpu_check.sh), small.

The full dry run (the real wheelhouse, Python 3.12, every step that needs
no GPU) takes over a minute: ``make gpu-dry-run``.  Here the same code runs
on a tiny fake wheelhouse, with the network cut: parts cut and joined back,
an environment made from the parts by ``pip install --no-index`` that
shadows the base interpreter's packages and still sees the rest, and the
scripts read for any pip call that could reach an index.
"""
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

from benchmarks import gpu_offline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
CHECK = os.path.join(ROOT, 'benchmarks', 'gpu_check.sh')
PY_VERSION = '%d.%d' % sys.version_info[:2]


def make_wheel(folder, name, version, files):
    """A minimal pure-Python wheel holding ``files`` (path -> text)."""
    dist = '{}-{}.dist-info'.format(name, version)
    path = os.path.join(folder, '{}-{}-py3-none-any.whl'.format(name,
                                                                 version))
    meta = {dist + '/METADATA': 'Metadata-Version: 2.1\nName: {}\n'
            'Version: {}\n'.format(name, version),
            dist + '/WHEEL': 'Wheel-Version: 1.0\nGenerator: test\n'
            'Root-Is-Purelib: true\nTag: py3-none-any\n'}
    entries = dict(files, **meta)
    record = ''.join('{},,\n'.format(n) for n in entries) + \
        dist + '/RECORD,,\n'
    with zipfile.ZipFile(path, 'w') as z:
        for n, text in entries.items():
            z.writestr(n, text)
        z.writestr(dist + '/RECORD', record)
    return path


def offline_environ():
    """os.environ with every route to an index closed."""
    closed = 'http://127.0.0.1:9'
    env = {k: v for k, v in os.environ.items()
           if not k.startswith('PIP_')}
    env.update(PIP_NO_INDEX='1', PIP_CONFIG_FILE=os.devnull,
               http_proxy=closed, https_proxy=closed, HTTP_PROXY=closed,
               HTTPS_PROXY=closed, ALL_PROXY=closed, no_proxy='',
               NO_PROXY='', PYTHONPATH=ROOT)
    return env


# ----------------------------------------------------------------------------
# parts

@pytest.mark.parametrize('sizes, limit', [
    ({'a': 50, 'b': 30, 'c': 20, 'd': 5}, 60),
    ({'big': 250, 'small': 10}, 60),
    ({'x': 60, 'y': 60, 'z': 1}, 60),
])
def test_plan_parts_keeps_every_part_within_its_limit(sizes, limit):
    parts = gpu_offline.plan_parts(sizes, limit)
    assert all(sum(p[3] for p in part) <= limit for part in parts)
    for name, size in sizes.items():
        pieces = sorted((off, n) for part in parts
                        for (nm, _, off, n) in part if nm == name)
        # The pieces tile the file exactly once.
        assert [off for off, _ in pieces] == \
            list(__import__('itertools').accumulate(
                [0] + [n for _, n in pieces[:-1]]))
        assert sum(n for _, n in pieces) == size


def test_a_wheel_larger_than_a_part_is_cut_and_joined_back(tmp_path):
    src = tmp_path / 'src'
    src.mkdir()
    big = src / 'big-1.0-py3-none-any.whl'
    big.write_bytes(os.urandom(2500))
    small = src / 'small-1.0-py3-none-any.whl'
    small.write_bytes(b'x' * 300)
    out = tmp_path / 'wheels'
    manifest = gpu_offline.write_parts([str(big), str(small)], str(out),
                                       1000)
    assert len(manifest['wheels'][big.name]['pieces']) == 3
    for p in manifest['parts']:
        held = sum(os.path.getsize(out / p['part'] / f)
                   for f in os.listdir(out / p['part'])
                   if f != gpu_offline.MANIFEST)
        assert held == p['bytes'] <= 1000
    got = gpu_offline.assemble(str(out), str(tmp_path / 'joined'))
    assert open(got[big.name]['path'], 'rb').read() == big.read_bytes()
    assert open(got[small.name]['path'], 'rb').read() == small.read_bytes()


def test_a_missing_part_is_named_and_a_damaged_wheel_refused(tmp_path):
    src = tmp_path / 'src'
    src.mkdir()
    for name, n in (('a', 700), ('b', 600)):
        (src / '{}-1.0-py3-none-any.whl'.format(name)).write_bytes(
            os.urandom(n))
    out = tmp_path / 'wheels'
    gpu_offline.write_parts(sorted(str(p) for p in src.iterdir()),
                            str(out), 1000)
    moved = tmp_path / 'part2-elsewhere'
    os.rename(out / 'part2', moved)
    with pytest.raises(RuntimeError, match='lacks part2: carry each part'):
        gpu_offline.assemble(str(out), str(tmp_path / 'j1'))
    os.rename(moved, out / 'part2')
    victim = out / 'part1' / 'a-1.0-py3-none-any.whl'
    victim.write_bytes(b'\0' + victim.read_bytes()[1:])
    with pytest.raises(RuntimeError, match='damaged.*carry its part again'):
        gpu_offline.assemble(str(out), str(tmp_path / 'j2'))


# ----------------------------------------------------------------------------
# the environment, offline

def test_env_installs_offline_shadows_the_base_and_sees_the_rest(tmp_path):
    import pytest as base_pytest
    src = tmp_path / 'src'
    src.mkdir()
    # A package with a start-up file, as this package's wheel has one.
    make_wheel(str(src), 'fakegpu_pkg', '1.0', {
        'fakegpu_pkg/__init__.py': 'VALUE = 42\n',
        'fakegpu_pkg-startup.pth':
            'import os; os.environ["FAKEGPU_PTH_RAN"] = "1"\n'})
    # 'always': shadows the base's numpy (as 1.26.4 shadows the image's 2).
    make_wheel(str(src), 'numpy', '99.0', {
        'numpy/__init__.py': '__version__ = "99.0"\n'})
    # 'if_missing' and the base has pytest: left out.
    make_wheel(str(src), 'pytest', '0.0.1', {'pytest.py': 'BAD = 1\n'})
    out = tmp_path / 'wheels'
    gpu_offline.write_parts(sorted(str(p) for p in src.iterdir()), str(out),
                            1 << 20, python=PY_VERSION)
    env_dir = tmp_path / 'env'
    report = tmp_path / 'r.json'
    cmd = [sys.executable, '-m', 'benchmarks.gpu_offline', 'env', '--wheels',
           str(out), '--env', str(env_dir), '--base-python', sys.executable,
           '--json', str(report)]
    if os.geteuid() == 0 and subprocess.run(
            ['unshare', '-n', 'true'], capture_output=True).returncode == 0:
        cmd = ['unshare', '-n'] + cmd  # no network at all
    proc = subprocess.run(cmd, cwd=ROOT, env=offline_environ(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.load(open(report))['env']
    assert rec['ok'] and '--no-index' in rec['pip'].split()
    assert rec['skipped_image_has_them'] == ['pytest-0.0.1-py3-none-any.whl']
    probe = ('import os, fakegpu_pkg, numpy, pytest; print(fakegpu_pkg.VALUE,'
             ' numpy.__version__, pytest.__version__, '
             'os.environ.get("FAKEGPU_PTH_RAN"))')
    got = subprocess.run([str(env_dir / 'bin' / 'python'), '-c', probe],
                         capture_output=True, text=True, cwd=str(tmp_path),
                         env={k: v for k, v in offline_environ().items()
                              if k != 'PYTHONPATH'}, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ['42', '99.0', base_pytest.__version__, '1']


def test_env_refuses_a_python_the_wheels_are_not_for(tmp_path):
    src = tmp_path / 'src'
    src.mkdir()
    make_wheel(str(src), 'fakegpu_pkg', '1.0', {'fakegpu_pkg.py': ''})
    out = tmp_path / 'wheels'
    gpu_offline.write_parts([str(p) for p in src.iterdir()], str(out),
                            1 << 20, python='2.7')
    proc = subprocess.run(
        [sys.executable, '-m', 'benchmarks.gpu_offline', 'env', '--wheels',
         str(out), '--env', str(tmp_path / 'env')], cwd=ROOT,
        env=offline_environ(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert 'the wheelhouse is for Python 2.7' in proc.stdout


# ----------------------------------------------------------------------------
# the scripts, read

def offline_problems(script_text, offline_source):
    """What in the check script (and gpu_offline's pip call) could reach
    an index: a list of problems, empty when none."""
    text = re.sub(r'\\\n', ' ', script_text)
    lines = [ln for ln in text.splitlines()
             if not ln.lstrip().startswith('#')]
    joined = '\n'.join(lines)
    problems = ['pip install without --no-index: ' + ln for ln in lines
                if re.search(r'\bpip3?\b', ln)
                and re.search(r'\b(install|download|wheel)\b', ln)
                and '--no-index' not in ln]
    if re.search(r'\bmake\s+(venv|test-gpu)\b', joined):
        problems.append('runs make venv / make test-gpu (pip from PyPI)')
    if re.search(r'gpu_bench\S*\s+install\b', joined):
        problems.append('runs gpu_bench install (pip from PyPI)')
    if 'export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null' not in joined:
        problems.append('does not export PIP_NO_INDEX=1 PIP_CONFIG_FILE')
    unset = [ln for ln in lines if ln.lstrip().startswith('unset ')]
    missing = [v for v in gpu_offline.PIP_INDEX_VARS
               if not unset or v not in unset[0].split()]
    if missing:
        problems.append('leaves {} set'.format(missing))
    calls = re.findall(r"\[py, '-m', 'pip', 'install'[^\]]*\]",
                       offline_source)
    if not calls or any("'--no-index'" not in c for c in calls):
        problems.append('gpu_offline pip call without --no-index: '
                        '{}'.format(calls))
    return problems


def test_gpu_check_never_reaches_a_registry():
    src = open(gpu_offline.__file__).read()
    assert offline_problems(open(CHECK).read(), src) == []


def test_the_registry_check_can_fail():
    # Negative control: the same check on altered copies finds each fault.
    script, src = open(CHECK).read(), open(gpu_offline.__file__).read()
    bad = script + '\n"$PY" -m pip install -q cupy-cuda13x\n'
    assert any('without --no-index' in p for p in offline_problems(bad, src))
    bad = script.replace('--env "$ENV_DIR"', '--env "$ENV_DIR"; make venv')
    assert any('make venv' in p for p in offline_problems(bad, src))
    bad = script.replace(' PIP_FIND_LINKS', '')
    assert any('PIP_FIND_LINKS' in p for p in offline_problems(bad, src))
    bad = src.replace("'install', '--no-index',", "'install',")
    assert any('gpu_offline pip call' in p
               for p in offline_problems(script, bad))
