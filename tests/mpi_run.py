"""Run a pytest suite under ``mpiexec`` at one process count.

Usage::

    python tests/mpi_run.py -n 4 [--timeout 1200] -- tests/mpi [pytest args]

Every rank runs the same pytest session (MPI tests are collective: each test
runs on all ranks at once).  Rank 0 reports to the terminal; the other ranks
write to ``.mpi-logs/np<N>-<pid>/rank<R>.log``, which is printed when that rank
failed (one folder per run, so concurrent runs do not mix).  The exit status is the worst of all ranks; a run that exceeds the
timeout is killed and reported as a failure instead of hanging CI.
"""
import argparse
import os
import signal
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
    logdir = os.path.join(LOGDIR, 'np%d-%d' % (args.n, os.getpid()))
    os.makedirs(logdir, exist_ok=True)
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    cmd = [mpiexec, '-n', str(args.n), sys.executable, os.path.abspath(__file__),
           '--worker', str(args.n)] + pytest_args
    env = dict(os.environ)
    env.setdefault('OMP_NUM_THREADS', '1')
    env.setdefault('OPENBLAS_NUM_THREADS', '1')
    env['CHAINERMN_OVERLAP_LOGDIR'] = logdir
    # A session of its own, so that a hung run can be killed whole without
    # touching other MPI jobs on the machine.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout)
        _show_desynchronised(logdir)
        return code
    except subprocess.TimeoutExpired:
        sys.stdout.write('mpi_run: timed out after %.0f s at -n %d (a hang '
                         'or a too slow test); rank logs in %s\n'
                         % (args.timeout, args.n, logdir))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


def _show_desynchronised(logdir):
    """The logs of ranks that ended the job because the others did not
    end a test with them (tests/mpi/conftest.py): those ranks never reach
    the exit codes' exchange below, which prints the logs of failed ranks."""
    for name in sorted(os.listdir(logdir)):
        path = os.path.join(logdir, name)
        with open(path, errors='replace') as f:
            text = f.read()
        if 'did not reach the end of' in text:
            sys.stdout.write('\n==== %s ====\n%s\n' % (path, text[-20000:]))
    sys.stdout.flush()


def _worker(nprocs, pytest_args):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    logdir = os.environ.get('CHAINERMN_OVERLAP_LOGDIR', LOGDIR)
    log = os.path.join(logdir, 'rank%d.log' % rank)
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
                path = os.path.join(logdir, 'rank%d.log' % r)
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
