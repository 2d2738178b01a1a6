"""Fixtures of the GPU suites (``make test-gpu``, under tests/mpi_run.py).

Every module calls :func:`chainermn_overlap.testing.device.require` at
import: without ``CHAINERMN_OVERLAP_TEST_DEVICE`` the whole suite skips with
one line.  The CPU suites' modules are imported from ``tests/mpi`` for
their models and checks.
"""
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ('mpi', os.path.join('mpi', 'distconv'), 'unit'):
    path = os.path.join(os.path.dirname(HERE), sub)
    if path not in sys.path:
        sys.path.insert(0, path)

import _suite_env  # NOQA: E402
from chainermn_overlap.testing import equivalence as eq  # NOQA: E402

_suite_env.configure()


@pytest.fixture(scope='session')
def comm():
    return eq.get_communicator()


@pytest.fixture(scope='module')
def impl():
    return eq.implementation_under_test()


@pytest.fixture(autouse=True)
def _same_random_state_on_every_rank():
    np.random.seed(1234)
    yield
