"""Fixtures shared by the MPI tests (run on every rank, see tests/mpi_run.py).

``comm`` is the one session-wide ChainerMN communicator of
:func:`chainermn_overlap.testing.equivalence.get_communicator`; tests that
need it outside a fixture (at collection time, in helpers) call that
function and get the same object.  Creating it is collective: pytest
requests fixtures in test order, which is the same on every rank.

Every test ends with the ranks agreeing that they all reached its end
(:func:`_ranks_end_each_test_together`, on a communicator of its own), so a
test that fails on some ranks only, leaving the others inside one of its
collectives, ends the run within ``RANK_SKEW_S`` naming the test and this
rank's failure, instead of hanging until the tier's time limit with the
failing rank already in the next test.
"""
import os
import sys
import time

import pytest

import _suite_env
from chainermn_overlap.testing import equivalence as eq

# What the suites test, from the suite's own environment variables.
_suite_env.configure()


@pytest.fixture(scope='session')
def comm():
    """The naive ChainerMN communicator over ``MPI.COMM_WORLD``."""
    return eq.get_communicator()


@pytest.fixture(scope='module')
def impl():
    """The optimizer adapter chosen by ``CHAINERMN_OVERLAP_TEST_OPTIMIZER``
    (:mod:`_suite_env`)."""
    return eq.implementation_under_test()


# Seconds a rank waits at a test's end for the others to end it too: far
# more than any test's spread between ranks (seconds), far less than a
# tier's limit.
RANK_SKEW_S = float(os.environ.get('CHAINERMN_OVERLAP_TEST_RANK_SKEW',
                                   300.0))
MARKER = 'did not reach the end of'


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        item.rank_failure = report.longreprtext


@pytest.fixture(scope='session', autouse=True)
def _end_comm():
    """A communicator of the check's own, made before the first test runs
    (made at a test's end, its collective could pair with one the test left
    other ranks in)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() == 1 or RANK_SKEW_S <= 0:
        return None
    return world.Dup()


@pytest.fixture(autouse=True)
def _ranks_end_each_test_together(request, _end_comm):
    yield
    if _end_comm is None:
        return
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    request_ = _end_comm.Ibarrier()
    start = time.monotonic()
    while not request_.Test():
        waited = time.monotonic() - start
        if waited > RANK_SKEW_S:
            failure = getattr(request.node, 'rank_failure', None)
            # Past pytest's capture: the job ends before pytest reports.
            capture = request.config.pluginmanager.getplugin(
                'capturemanager')
            with capture.global_and_fixture_disabled():
                _say('\nrank {}: the other ranks {} {} within {:.0f} s of '
                     'this rank (a test that fails on some ranks only leaves '
                     'the others in one of its collectives). This rank '
                     '{}\n'.format(world.Get_rank(), MARKER,
                                   request.node.nodeid, RANK_SKEW_S,
                                   'failed it:\n' + failure if failure
                                   else 'passed it.'))
            world.Abort(3)
        # Ranks end a test within microseconds to seconds of each other.
        time.sleep(0 if waited < 1e-3 else 1e-3)


def _say(text):
    sys.stderr.write(text)
    sys.stderr.flush()
