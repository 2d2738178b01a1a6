"""How a benchmark starts its workers and reads their results.

An orchestrator starts copies of its own module as workers (pinned with
``taskset``, under ``mpiexec``, or in the network test bed of
:mod:`testbed.netbed`), gives them their configuration on the command
line, and reads back the one result line that rank 0 prints, tagged so that
whatever MPI or Chainer print around it does not matter.
"""
import json
import os
import subprocess
import sys

# The shared parts live with the test bed (which must not import the
# benchmarks); they stay importable from here.
from testbed._system import BLAS_ENV, ROOT, module_command  # noqa: F401
from testbed._system import child_env as worker_env  # noqa: F401

RESULTS = os.path.join(ROOT, 'benchmarks', 'results')
WORKER_FLAG = '--worker'


def worker_command(module, cfg):
    """Command line of ``module``'s worker for the JSON-able ``cfg``.

    The module's ``main`` hands it to :func:`dispatch_worker`.
    """
    return module_command(module, WORKER_FLAG, json.dumps(cfg))


def dispatch_worker(argv, worker):
    """Calls ``worker(cfg)`` when ``argv`` came from :func:`worker_command`.

    Args:
        argv (list of str): the arguments of ``main``; None: ``sys.argv``.
        worker: the module's worker function, given the decoded ``cfg``.

    Returns:
        bool: whether it did (the caller's ``main`` is then done).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != [WORKER_FLAG]:
        return False
    worker(json.loads(argv[1]))
    return True


def emit_result(tag, obj):
    """Prints a worker's result line: ``tag`` then ``obj`` as JSON."""
    sys.stdout.write(tag + json.dumps(obj) + '\n')
    sys.stdout.flush()


def find_result(stdout, tag):
    """The last result line tagged ``tag`` in ``stdout``, decoded; or None."""
    for line in reversed((stdout or '').splitlines()):
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    return None


def read_result(stdout, tag, what):
    """As :func:`find_result`, but a missing result raises RuntimeError."""
    result = find_result(stdout, tag)
    if result is None:
        raise RuntimeError('{}: the benchmark workers printed no result; '
                           'their output ends with:\n{}'.format(
                               what, (stdout or '')[-3000:]))
    return result


def run_pinned(cmd, what, timeout, core=0):
    """Runs ``cmd`` pinned to ``core`` with one BLAS thread; returns stdout.

    Raises:
        RuntimeError: ``what`` failed, with the end of its stderr.
    """
    proc = subprocess.run(['taskset', '-c', str(core)] + list(cmd),
                          env=dict(os.environ, **worker_env()),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError('{} failed (exit {}):\n{}'.format(
            what, proc.returncode, proc.stderr[-3000:]))
    return proc.stdout
