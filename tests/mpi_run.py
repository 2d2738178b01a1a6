"""Run a pytest suite under ``mpiexec`` at one process count.

Usage::

    python tests/mpi_run.py -n 4 [--timeout 1200] -- tests/mpi [pytest args]

Every rank runs the same pytest session (MPI tests are collective: each test
runs on all ranks at once).  Rank 0 reports to the terminal; the other ranks
write to ``.mpi-logs/np<N>-rank<R>.log``, which is printed when that rank
failed.  The exit status is the worst of all ranks; a run that exceeds the
timeout is killed and reported as a failure instead of hanging CI.
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOGDIR = os.path.join(ROOT, '.mpi-logs')


def _launcher(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument('-n', type=int, required=True)
    parser.add_argument('--timeout', type=float, default=1200)
    if '--' in argv:
        i = argv.index('--')
        argv, pytest_args = argv[:i], argv[i + 1:]
    else:
        pytest_args = []
    args = parser.parse_args(argv)
    os.makedirs(LOGDIR, exist_ok=True)
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    cmd = [mpiexec, '-n', str(args.n), sys.executable, os.path.abspath(__file__),
           '--worker', str(args.n)] + pytest_args
    env = dict(os.environ)
    env.setdefault('OMP_NUM_THREADS', '1')
    env.setdefault('OPENBLAS_NUM_THREADS', '1')
    try:
        rc = subprocess.call(cmd, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        sys.stdout.write('mpi_run: timed out after %.0f s at -n %d (a hang '
                         'or a too slow test); see %s\n'
                         % (args.timeout, args.n, LOGDIR))
        subprocess.call(['pkill', '-9', '-f', '--', '--worker %d' % args.n])
        return 124
    return rc


def _worker(nprocs, pytest_args):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    log = os.path.join(LOGDIR, 'np%d-rank%d.log' % (nprocs, rank))
    if rank != 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import pytest
    rc = int(pytest.main(['-p', 'no:cacheprovider'] + pytest_args))
    codes = world.allgather(rc)
    if rank == 0:
        for r, c in enumerate(codes):
            if c not in (0,) and r != 0:
                path = os.path.join(LOGDIR, 'np%d-rank%d.log' % (nprocs, r))
                sys.stdout.write('\n==== rank %d failed (exit %d): %s ====\n'
                                 % (r, c, path))
                with open(path) as f:
                    sys.stdout.write(f.read()[-20000:])
        sys.stdout.flush()
    return max(codes)


if __name__ == '__main__':
    if len(sys.argv) > 2 and sys.argv[1] == '--worker':
        sys.exit(_worker(int(sys.argv[2]), sys.argv[3:]))
    sys.exit(_launcher(sys.argv[1:]))
