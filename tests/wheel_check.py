"""Build the sdist and wheel, install the wheel alone, test what was installed.

Usage (``make test-wheel``, which CI runs after ``make test``)::

    python tests/wheel_check.py [--python python3] [--keep]

Steps, each of which fails the check:

1. ``python -m build`` makes an sdist and a wheel of this checkout.
2. The wheel holds every module of the source package, ``py.typed``, the
   console script, and the compiled C kernels where a C compiler exists
   (the extension is optional: without a compiler the wheel is pure
   numpy and that is said, not failed).
3. A fresh virtual environment (``--python``'s ``venv``) gets the wheel
   (not editable) with its ``mpich`` extra and the test requirements.
4. From a temporary folder holding copies of ``tests/``, ``benchmarks/``,
   ``testbed/`` and ``examples/`` (what the tests import besides the
   package) but not of the package, the interpreter must import
   ``chainermn_overlap`` from that environment's ``site-packages``; then the
   unit tests and one MPI test file at 2 ranks run against it, and
   ``chainermn-overlap-launch --help`` and a 2-rank job through it run from
   the environment's ``bin``.

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
NOT_PACKAGE_TESTS = ['tests/unit/test_docs.py',
                     'tests/unit/test_docs_snippets.py',
                     'tests/unit/test_wheel_check.py']

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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--python', default='python3',
                        help='interpreter whose venv module makes the fresh '
                        'environment (default python3)')
    parser.add_argument('--keep', action='store_true',
                        help='keep the temporary folder (printed)')
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix='cmo_wheel_')
    try:
        dist = os.path.join(tmp, 'dist')
        run([sys.executable, '-m', 'build', '--outdir', dist, ROOT])
        wheels = glob.glob(os.path.join(dist, '*.whl'))
        sdists = glob.glob(os.path.join(dist, '*.tar.gz'))
        if len(wheels) != 1 or len(sdists) != 1:
            raise CheckFailed('expected one wheel and one sdist in %s, got '
                              '%s' % (dist, os.listdir(dist)))
        native = check_wheel(wheels[0])
        print('wheel: %s (%s)' % (os.path.basename(wheels[0]), native))

        venv = os.path.join(tmp, 'venv')
        run([args.python, '-m', 'venv', venv])
        py = os.path.join(venv, 'bin', 'python')
        run([py, '-m', 'pip', 'install', '-q', '--disable-pip-version-check',
             wheels[0] + '[mpich]', '-r',
             os.path.join(ROOT, 'requirements-test.txt')])

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
        for t in NOT_PACKAGE_TESTS:
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
        print('wheel check passed: %s' % os.path.basename(wheels[0]))
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
