"""The wheel check's content rules, on wheels made up here (no build)."""
import os
import sys
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import wheel_check  # NOQA: E402

ENTRY = ('[console_scripts]\n'
         'chainermn-overlap-launch = chainermn_overlap.launch:main\n')


def _wheel(path, drop=(), entry=ENTRY, native=True):
    names = [m for m in wheel_check.source_modules() if m not in drop]
    names.append('chainermn_overlap/py.typed')
    if native:
        names.append('chainermn_overlap/_native.cpython-311-x86_64-linux-'
                     'gnu.so')
    names = [n for n in names if n not in drop]
    with zipfile.ZipFile(path, 'w') as z:
        for n in names:
            z.writestr(n, '')
        z.writestr('chainermn_overlap-0.dist-info/entry_points.txt', entry)
    return str(path)


def test_a_complete_wheel_passes(tmp_path):
    assert wheel_check.check_wheel(_wheel(tmp_path / 'w.whl')).startswith(
        'C kernels built')


@pytest.mark.parametrize('kwargs,match', [
    ({'drop': ['chainermn_overlap/_comm_report.py']}, 'lacks modules'),
    ({'drop': ['chainermn_overlap/py.typed']}, 'py.typed'),
    ({'entry': ''}, 'console script'),
])
def test_what_a_wheel_must_hold(tmp_path, kwargs, match):
    with pytest.raises(wheel_check.CheckFailed, match=match):
        wheel_check.check_wheel(_wheel(tmp_path / 'w.whl', **kwargs))


def test_no_kernels_fails_only_where_a_compiler_exists(tmp_path,
                                                       monkeypatch):
    path = _wheel(tmp_path / 'w.whl', native=False)
    monkeypatch.setattr(wheel_check, 'has_c_compiler', lambda: True)
    with pytest.raises(wheel_check.CheckFailed, match='failed to build'):
        wheel_check.check_wheel(path)
    monkeypatch.setattr(wheel_check, 'has_c_compiler', lambda: False)
    assert 'numpy-only' in wheel_check.check_wheel(path)


def _top_level_imports(path):
    import ast
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split('.')[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 \
                and node.module:
            yield node.module.split('.')[0]


def test_every_source_folder_the_tests_import_is_copied():
    # The installed-wheel run sees only the copied folders: a test that
    # imports another folder of the checkout fails there (a CI run failed
    # this way when the test bed moved to testbed/).
    root = wheel_check.ROOT
    folders = {n for n in os.listdir(root)
               if os.path.isfile(os.path.join(root, n, '__init__.py'))}
    folders.discard(wheel_check.PACKAGE)
    assert folders, 'no source folders found under %s' % root
    used = set()
    for dirpath, _, files in os.walk(os.path.join(root, 'tests')):
        for name in files:
            if name.endswith('.py'):
                used.update(_top_level_imports(os.path.join(dirpath, name)))
    missing = sorted((used & folders) - set(wheel_check.COPIED_TREES))
    assert not missing, (
        'tests import %s, which tests/wheel_check.py does not copy beside '
        'them (COPIED_TREES)' % missing)


def test_no_package_test_reads_the_pages_tools():
    # The installed-wheel run has no docs/ beside the tests: a unit test
    # that imports the pages' extensions must be one the check leaves out
    # (a CI run failed this way on the sharding peers' docs table).
    root = wheel_check.ROOT
    skipped = set(wheel_check.not_package_tests(root))
    assert 'tests/unit/test_docs.py' in skipped
    offenders = []
    for name in sorted(os.listdir(os.path.join(root, 'tests', 'unit'))):
        rel = 'tests/unit/' + name
        if not name.endswith('.py') or rel in skipped:
            continue
        with open(os.path.join(root, rel)) as f:
            if "'_ext'" in f.read():
                offenders.append(rel)
    assert not offenders, (
        '%s import docs/_ext; move those tests to a tests/unit/test_docs*.py '
        'file' % offenders)


def _pages(root, *wheel_blocks):
    os.makedirs(os.path.join(root, 'docs'))
    for name, code in zip(('README.md', 'docs/installation.md'),
                          wheel_blocks):
        with open(os.path.join(root, name), 'w') as f:
            f.write('Install:\n\n<!-- test: wheel -->\n```sh\n%s```\n' % code)


def test_the_pages_wheel_block_is_what_runs(tmp_path):
    block = 'python3 -m venv ~/e\n~/e/bin/pip install "$(ls dist/*.whl)"\n'
    _pages(str(tmp_path), block, block)
    code, where = wheel_check.wheel_block(str(tmp_path))
    assert code == block
    assert where == ['README.md:5', 'docs/installation.md:5']


def test_wheel_blocks_that_differ_are_refused(tmp_path):
    _pages(str(tmp_path), 'pip install a.whl\n', 'pip install b.whl\n')
    with pytest.raises(wheel_check.CheckFailed, match='differ between'):
        wheel_check.wheel_block(str(tmp_path))


def test_the_readme_has_a_wheel_block():
    code, where = wheel_check.wheel_block(wheel_check.ROOT)
    assert 'README.md' in where[0]
    assert 'PIP_BUILD_CONSTRAINT' in code and '[mpich]' in code
