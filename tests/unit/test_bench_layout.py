"""The layout of ``benchmarks/`` and ``testbed/``: no import cycle, no
benchmark module over 600 lines, and one entry point that lists and runs
every study (``python -m benchmarks``)."""
import ast
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
PACKAGES = ('benchmarks', 'testbed')
MAX_LINES = 600


def modules(root=ROOT, packages=PACKAGES):
    """``{dotted name: path}`` of every module of ``packages``."""
    out = {}
    for pkg in packages:
        for folder, dirs, names in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(d for d in dirs if not d.startswith(('.', '_'))
                             and d != 'results')
            rel = os.path.relpath(folder, root).split(os.sep)
            for n in sorted(names):
                if not n.endswith('.py'):
                    continue
                parts = rel + ([] if n == '__init__.py' else [n[:-3]])
                out['.'.join(parts)] = os.path.join(folder, n)
    return out


def _is_package(path):
    return os.path.basename(path) == '__init__.py'


def imports(name, path, known):
    """The modules of ``known`` that module ``name`` imports, anywhere in
    its body (a function's import counts too)."""
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), path)
    here = name if _is_package(path) else name.rpartition('.')[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                up = here.split('.')
                up = up[:len(up) - (node.level - 1)]
                base = '.'.join(up + ([base] if base else []))
            targets = [base] + ['%s.%s' % (base, a.name) for a in node.names]
        else:
            continue
        for t in targets:
            # ``import a.b.c`` imports a, a.b and a.b.c.
            parts = t.split('.')
            for i in range(1, len(parts) + 1):
                m = '.'.join(parts[:i])
                if m in known and m != name:
                    out.add(m)
    return out


def import_graph(root=ROOT, packages=PACKAGES):
    known = modules(root, packages)
    return {n: imports(n, p, known) for n, p in known.items()}


def find_cycle(graph):
    """One import cycle of ``graph`` as a list of names, or None.

    A package's ``__init__`` run by importing one of its modules is not an
    edge of that module: only what a module's own text imports is.
    """
    state = {}
    stack = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle_among_benchmarks_and_testbed():
    graph = import_graph()
    assert 'testbed.cli' in graph and 'benchmarks' in graph
    cycle = find_cycle(graph)
    assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / 'testbed'
    pkg.mkdir()
    (pkg / '__init__.py').write_text('')
    (pkg / 'a.py').write_text('from testbed import b\n')
    (pkg / 'b.py').write_text('def f():\n    from testbed.a import g\n')
    (pkg / 'c.py').write_text('from . import a\n')
    graph = import_graph(str(tmp_path), ('testbed',))
    assert graph['testbed.c'] == {'testbed', 'testbed.a'}
    assert find_cycle(graph) == ['testbed.a', 'testbed.b', 'testbed.a']


def test_no_benchmark_module_is_over_600_lines():
    long = {}
    for name, path in modules(packages=('benchmarks',)).items():
        with open(path, encoding='utf-8') as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[name] = n
    assert not long, long


# ---------------------------------------------------------------------------
# One entry point: python -m benchmarks
# ---------------------------------------------------------------------------

def _benchmarks(*args):
    return subprocess.run([sys.executable, '-m', 'benchmarks'] + list(args),
                          cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=120)


def _studies():
    from benchmarks.harness import registry
    return registry.STUDIES


def test_list_names_every_study_with_a_line():
    proc = _benchmarks('--list')
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == [s for s, _ in _studies()]
    for ln in lines:
        assert len(ln.split(None, 1)) == 2, ln


# One interpreter loads what every study imports (NumPy, Chainer), then
# imports each study in a child forked from it, so that no study's import
# can lean on another's (one fresh interpreter per study cost 5-9 s each).
_IMPORT_EACH = '''
import json, os, sys, traceback
import numpy, chainer
out = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            text = ''
        except BaseException:
            text = traceback.format_exc() or 'failed'
        os.write(w, text.encode())
        os._exit(0)
    os.close(w)
    data = b''
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    out[name] = data.decode() or (
        '' if status == 0 else 'exit status {}'.format(status))
sys.stdout.write(json.dumps(out))
'''


@pytest.fixture(scope='module')
def study_imports():
    modules = [m for _, m in _studies()]
    proc = subprocess.run([sys.executable, '-c', _IMPORT_EACH] + modules,
                          cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize('study,module', _studies(),
                         ids=[s for s, _ in _studies()])
def test_each_listed_study_imports(study, module, study_imports):
    # In a child of an interpreter that imported no other study.
    assert study_imports[module] == '', study_imports[module][-3000:]


def test_the_import_check_reports_a_failing_import():
    proc = subprocess.run(
        [sys.executable, '-c', _IMPORT_EACH, 'json', 'benchmarks.no_such'],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        timeout=300)
    got = json.loads(proc.stdout)
    assert got['json'] == ''
    assert 'No module named' in got['benchmarks.no_such'], got


def test_every_runnable_top_level_module_is_a_listed_study():
    # A module of benchmarks/ with a __main__ block is a study, so --list
    # must show it (the harness's modules are not studies).
    listed = {m for _, m in _studies()}
    unlisted = []
    for name, path in modules(packages=('benchmarks',)).items():
        if name.count('.') != 1 or name.endswith('__main__'):
            continue
        with open(path, encoding='utf-8') as f:
            if "__name__ == '__main__'" in f.read() and name not in listed:
                unlisted.append(name)
    assert not unlisted, unlisted


def test_an_unknown_study_is_exit_2_without_a_traceback():
    proc = _benchmarks('no_such_study', '--quick')
    assert proc.returncode == 2
    assert 'no_such_study' in proc.stderr and '--list' in proc.stderr
    assert 'Traceback' not in proc.stderr + proc.stdout
    assert _benchmarks().returncode == 2
    assert _benchmarks('--bogus').returncode == 2


def test_a_study_gets_its_own_options():
    # The study's own argparse reads the options: --help is its help.
    proc = _benchmarks('overhead', '--help')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('usage: overhead.py')


def _bench_recipes():
    """``{target: [recipe line, ...]}`` of the Makefile's bench-* targets."""
    out, target = {}, None
    with open(os.path.join(ROOT, 'Makefile'), encoding='utf-8') as f:
        for line in f:
            m = re.match(r'^(bench[\w-]*):', line)
            if m:
                target = m.group(1)
                out[target] = []
            elif line.startswith('\t') and target:
                out[target].append(line.strip())
            elif line.strip() and not line.startswith('#'):
                target = None
    return out


def test_every_bench_target_runs_a_listed_study():
    names = {s for s, _ in _studies()}
    recipes = _bench_recipes()
    assert {'bench-overlap', 'bench-spatial', 'bench-ab'} <= set(recipes)
    ran = set()
    for target, lines in recipes.items():
        for line in lines:
            assert '-m benchmarks.' not in line, (target, line)
            for name in re.findall(r'-m benchmarks (\w+)', line):
                assert name in names, (target, name)
                ran.add(target)
    # Every bench-* target with a recipe that runs Python runs a study.
    assert ran == {t for t, lines in recipes.items()
                   if any('-m benchmarks' in ln for ln in lines)}
    assert {'bench-overlap', 'bench-compression', 'bench-accuracy',
            'bench-hosts', 'bench-spatial', 'bench-sharding', 'bench-peers',
            'bench-kernels', 'bench-ab'} <= ran
