"""Build the sdist and wheel as the README says, install the wheel, test it.

Usage (``make test-wheel``, which CI runs after ``make test``)::

    python tests/wheel_check.py [--python python3] [--keep]

Steps, each of which fails the check:

1. In a copy of the checkout (its tracked and untracked, not ignored
   files), the pages' wheel block (``<!-- test: wheel -->`` in README.md
   and docs/installation.md, which must be the same) runs as typed by bash,
   with a home folder of its own, ``--python``'s folder first on PATH and
   none of make's pip variables: it makes a venv, builds the sdist and the
   wheel with ``python -m build`` and installs the wheel with its ``mpich``
   extra, not editable.
2. The wheel holds every module of the source package, ``py.typed``, the
   console script, and the compiled C kernels where a C compiler exists
   (the extension is optional: without a compiler the wheel is pure
   numpy and that is said, not failed).
3. From a temporary folder holding copies of ``tests/``, ``benchmarks/``,
   ``testbed/`` and ``examples/`` (what the tests import besides the
   package) but not of the package, the interpreter must import
   ``chainermn_overlap`` from that environment's ``site-packages``; then the
   unit tests and one MPI test file at 2 ranks run against it, and
   ``chainermn-overlap-launch --help`` and a 2-rank job through it run from
   the environment's ``bin``.
4. From the same folder, outside the source tree, the examples' documented
   commands run as typed against the installed package (the command tier,
   ``tests/commands``, on its example commands and controls).

The tests of the documentation (``tests/unit/test_docs*.py``) and of this
check (``test_wheel_check.py``) are left out: they test the checkout's pages
and tools, not the package.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACKAGE = 'chainermn_overlap'
MPI_TEST = 'tests/mpi/test_equivalence.py'
# What the tests import or run besides the package: copied beside them.
COPIED_TREES = ('tests', 'benchmarks', 'testbed', 'examples')
# Tests of the checkout (its pages, its Makefile, the wheel check itself),
# not of the installed package: make test runs them.
NOT_PACKAGE_TESTS = ['tests/unit/test_docs*.py',
                     'tests/unit/test_wheel_check.py',
                     'tests/unit/test_checkout_tools.py',
                     'tests/unit/test_bench_layout.py']


def not_package_tests(root=ROOT):
    """The files of ``NOT_PACKAGE_TESTS`` in ``root``, patterns expanded."""
    out = []
    for pattern in NOT_PACKAGE_TESTS:
        out += sorted(os.path.relpath(p, root).replace(os.sep, '/')
                      for p in glob.glob(os.path.join(root, pattern)))
    return out

LAUNCH_JOB = '''\
import os
from mpi4py import MPI
import chainermn_overlap
assert os.environ['CHAINERMN_OVERLAP_RESTART'] == '0'
assert 'site-packages' in chainermn_overlap.__file__, \
    chainermn_overlap.__file__
# One write per line: under PYTHONUNBUFFERED, print() writes the text and
# its newline apart, and the ranks' outputs interleave between the two.
comm = MPI.COMM_WORLD
os.write(1, b'rank %d of %d ran\\n' % (comm.rank, comm.size))
'''


# The command tier's tests that need no page of the checkout: every
# example's docstring commands, and the controls.
EXAMPLE_TIER = ('examples/ or treatment or changed or renamed or made_up or '
                'environment or import_of_the_checkout or timeout')
# make exports these for its own installs; the pages' block must set what
# it needs itself.
MAKE_PIP_VARS = ('PIP_CONSTRAINT', 'PIP_BUILD_CONSTRAINT')


class CheckFailed(Exception):
    pass


def _env():
    # Nothing of the checkout may reach the installed interpreter.
    env = dict(os.environ)
    env.pop('PYTHONPATH', None)
    env.pop('PYTHONHOME', None)
    env.pop('VIRTUAL_ENV', None)
    env.setdefault('OMP_NUM_THREADS', '1')
    env.setdefault('OPENBLAS_NUM_THREADS', '1')
    return env


def run(cmd, cwd=None, capture=False):
    print('+ ' + ' '.join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), text=True,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None)
    if proc.returncode != 0:
        raise CheckFailed('%s exited with %d%s' % (
            ' '.join(cmd), proc.returncode,
            (':\n' + proc.stdout[-4000:]) if capture else ''))
    return proc.stdout


def source_modules():
    """Module paths of the package in the checkout (``pkg/sub/mod.py``)."""
    out = []
    for path in glob.glob(os.path.join(ROOT, PACKAGE, '**', '*.py'),
                          recursive=True):
        out.append(os.path.relpath(path, ROOT).replace(os.sep, '/'))
    return sorted(out)


def has_c_compiler():
    return any(shutil.which(c) for c in ('cc', 'gcc', 'clang'))


def check_wheel(wheel):
    """What the wheel must hold; returns a description of the C kernels."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = ''.join(
            z.read(n).decode() for n in names
            if n.endswith('.dist-info/entry_points.txt'))
    missing = [m for m in source_modules() if m not in names]
    if missing:
        raise CheckFailed('the wheel lacks modules of the package: %s'
                          % ', '.join(missing))
    if PACKAGE + '/py.typed' not in names:
        raise CheckFailed('the wheel lacks %s/py.typed (package data)'
                          % PACKAGE)
    if 'chainermn-overlap-launch = chainermn_overlap.launch:main' \
            not in entry_points:
        raise CheckFailed('the wheel declares no chainermn-overlap-launch '
                          'console script; entry points: %r' % entry_points)
    native = [n for n in names if n.startswith(PACKAGE + '/_native')
              and n.endswith('.so')]
    if native:
        return 'C kernels built: %s' % native[0]
    if has_c_compiler():
        raise CheckFailed('a C compiler is present but the wheel has no '
                          'compiled %s._native: the optional extension '
                          'failed to build (see the build log above)'
                          % PACKAGE)
    return 'no C compiler: the wheel is numpy-only (the extension is optional)'


def copy_tree_without_package(dest):
    for name in COPIED_TREES:
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dest, name),
                        ignore=shutil.ignore_patterns(
                            '__pycache__', 'results', '.mpi-logs'))
    shutil.copy(os.path.join(ROOT, 'pytest.ini'), dest)
    if os.path.exists(os.path.join(dest, PACKAGE)):
        raise CheckFailed('the test folder holds a copy of the package')


def copy_checkout(dest):
    """The checkout as a fresh clone would hold it, with uncommitted work:
    its tracked and untracked files that git does not ignore."""
    names = subprocess.run(
        ['git', 'ls-files', '-z', '--cached', '--others',
         '--exclude-standard'], cwd=ROOT, check=True,
        stdout=subprocess.PIPE).stdout.decode().split('\0')
    for name in filter(None, names):
        src = os.path.join(ROOT, name)
        if not os.path.isfile(src):
            continue            # deleted but not yet committed
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, name))


def wheel_block(root):
    """The pages' wheel block: the same text in each page that has one."""
    sys.path.insert(0, ROOT)
    try:
        from tests import documented
    finally:
        sys.path.remove(ROOT)
    found = [b for b in documented.all_blocks(root) if b.kind == 'wheel']
    if not found:
        raise CheckFailed('no page has a "<!-- test: wheel -->" block: the '
                          'README must say how to install the wheel')
    texts = {b.code for b in found}
    if len(texts) != 1:
        raise CheckFailed('the wheel blocks differ between pages (%s): a '
                          'reader of one page would type another command'
                          % ', '.join(b.where for b in found))
    return found[0].code, ['%s:%d' % (os.path.relpath(b.path, root), b.line)
                           for b in found]


def user_env(home, python):
    env = {k: os.environ[k] for k in ('LANG', 'LC_ALL', 'TMPDIR',
                                      'OPENBLAS_CORETYPE',
                                      'OPENBLAS_L2_SIZE') if k in os.environ}
    env['HOME'] = home
    env['PATH'] = os.pathsep.join([os.path.dirname(shutil.which(python)),
                                   '/usr/local/bin', '/usr/bin', '/bin'])
    # Downloads already made on this machine are reused, not fetched again.
    cache = os.environ.get('PIP_CACHE_DIR') or os.path.expanduser(
        '~/.cache/pip')
    if os.path.isdir(cache):
        env['PIP_CACHE_DIR'] = cache
    return env


def install_as_the_readme_says(tmp, python):
    """Runs the pages' wheel block in a copy of the checkout.

    Returns:
        tuple: (the venv's python, the wheel, the sdist).
    """
    checkout = os.path.join(tmp, 'checkout')
    home = os.path.join(tmp, 'home')
    os.makedirs(home)
    copy_checkout(checkout)
    code, where = wheel_block(checkout)
    print('+ the wheel block of %s, in a copy of the checkout:\n%s'
          % (', '.join(where), code), flush=True)
    env = user_env(home, python)
    for k in MAKE_PIP_VARS:
        env.pop(k, None)
    proc = subprocess.run(['bash', '-euo', 'pipefail', '-c', code],
                          cwd=checkout, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise CheckFailed('the wheel block of %s exited with %d'
                          % (where[0], proc.returncode))
    venvs = [os.path.join(home, d) for d in os.listdir(home)
             if os.path.exists(os.path.join(home, d, 'bin', 'python'))]
    if len(venvs) != 1:
        raise CheckFailed('the wheel block made %d environments in its home '
                          'folder, expected one: %s' % (len(venvs), venvs))
    dist = os.path.join(checkout, 'dist')
    wheels = glob.glob(os.path.join(dist, '*.whl'))
    sdists = glob.glob(os.path.join(dist, '*.tar.gz'))
    if len(wheels) != 1 or len(sdists) != 1:
        raise CheckFailed('expected one wheel and one sdist in %s, got %s'
                          % (dist, os.listdir(dist)))
    return os.path.join(venvs[0], 'bin', 'python'), wheels[0], sdists[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--python', default='python3',
                        help='interpreter the wheel block finds as python3 '
                        '(default python3)')
    parser.add_argument('--keep', action='store_true',
                        help='keep the temporary folder (printed)')
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix='cmo_wheel_')
    try:
        py, wheel, _ = install_as_the_readme_says(tmp, args.python)
        native = check_wheel(wheel)
        print('wheel: %s (%s)' % (os.path.basename(wheel), native))
        venv = os.path.dirname(os.path.dirname(py))
        run([py, '-m', 'pip', 'install', '-q', '--disable-pip-version-check',
             '-r', os.path.join(ROOT, 'requirements-test.txt')])

        src = os.path.join(tmp, 'src')
        os.makedirs(src)
        copy_tree_without_package(src)
        where = run([py, '-I', '-c', 'import chainermn_overlap as m; '
                     'print(m.__file__, m.__version__)'],
                    cwd=src, capture=True).split()
        site = os.path.join(venv, 'lib')
        if not os.path.abspath(where[0]).startswith(site) or \
                'site-packages' not in where[0]:
            raise CheckFailed('chainermn_overlap was imported from %s, not '
                              'from the fresh environment' % where[0])
        print('installed package: %s, version %s' % (where[0], where[1]))

        ignore = []
        for t in not_package_tests(src):
            ignore += ['--ignore', t]
        run([py, '-I', '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
             'tests/unit'] + ignore, cwd=src)
        run([py, '-I', 'tests/mpi_run.py', '-n', '2', '--', MPI_TEST, '-q'],
            cwd=src)

        launch = os.path.join(venv, 'bin', 'chainermn-overlap-launch')
        text = run([launch, '--help'], cwd=src, capture=True)
        if '--max-restarts' not in text:
            raise CheckFailed('chainermn-overlap-launch --help does not '
                              'describe the launcher:\n' + text)
        job = os.path.join(tmp, 'job.py')
        with open(job, 'w') as f:
            f.write(LAUNCH_JOB)
        text = run([launch, '-n', '2', '--max-restarts', '0', job],
                   cwd=tmp, capture=True)
        ran = re.findall(r'^rank (\d) of 2 ran$', text, re.M)
        if sorted(ran) != ['0', '1']:
            raise CheckFailed('the 2-rank job through the console script '
                              'did not run on both ranks:\n' + text)

        # The examples as documented, from outside the source tree: the
        # docstrings' ".venv/bin/..." name this environment.
        os.symlink(venv, os.path.join(src, '.venv'))
        run([py, '-I', '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
             'tests/commands', '-k', EXAMPLE_TIER], cwd=src)
        print('wheel check passed: %s' % os.path.basename(wheel))
        return 0
    except CheckFailed as e:
        print('wheel check FAILED: %s' % e, flush=True)
        return 1
    finally:
        if args.keep:
            print('kept %s' % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main())
