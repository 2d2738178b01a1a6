"""tests/mpi_run.py with tests/mpi/conftest.py: a test that fails on some
ranks only ends the run within the rank skew, naming the test and the
failure, instead of hanging until the launcher's limit."""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CASE = os.path.join('tests', 'mpi', '_desync_case.py')


def _run(skew, timeout):
    env = dict(os.environ, CHAINERMN_OVERLAP_TEST_RANK_SKEW=str(skew))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, os.path.join('tests', 'mpi_run.py'), '-n', '2',
         '--timeout', str(timeout), '--', CASE, '-q'],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        universal_newlines=True, timeout=timeout + 60)
    return proc.returncode, proc.stdout, time.monotonic() - start


def test_a_test_failing_on_one_rank_ends_the_run_naming_it():
    # The fault first: without the check the run hangs to the limit.
    code, out, took = _run(skew=0, timeout=12)
    assert code == 124 and 'timed out' in out, out[-3000:]
    code, out, took = _run(skew=2, timeout=120)
    assert code != 0, out[-3000:]
    assert took < 60, took
    assert 'did not reach the end of' in out, out[-3000:]
    assert '_desync_case.py::test_fails_on_the_last_rank_before_a_barrier' \
        in out, out[-3000:]
    assert 'the planted failure' in out, out[-3000:]
