"""Fixtures shared by the MPI tests (run on every rank, see tests/mpi_run.py).

``comm`` is the one session-wide ChainerMN communicator of
:func:`chainermn_overlap.testing.equivalence.get_communicator`; tests that
need it outside a fixture (at collection time, in helpers) call that
function and get the same object.  Creating it is collective: pytest
requests fixtures in test order, which is the same on every rank.
"""
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
