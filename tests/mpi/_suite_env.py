"""The test suite's own environment variables (the library reads none of
these; ``chainermn_overlap.config`` holds only the library's).

``CHAINERMN_OVERLAP_TEST_OPTIMIZER``
    The optimizer the equivalence suites test: ``overlap`` (default) or
    ``chainermn`` (ChainerMN's own, which validates the harness).
``CHAINERMN_OVERLAP_TEST_SHARD``
    The ``shard=`` the overlapped optimizer under test gets (``optimizer``,
    ``gradients`` or ``parameters``; unset: none), so that the same suites
    check every sharding mode (``tests/tiers.py`` sets it).
``CHAINERMN_OVERLAP_TEST_RANK_SKEW``
    Seconds a rank waits at a test's end for the other ranks to end it too
    before it ends the run (``tests/mpi/conftest.py``; default 300, 0: no
    check).
``CHAINERMN_OVERLAP_LOGDIR``
    The folder ``tests/mpi_run.py`` gives its ranks for their logs (set by
    that launcher itself).
"""
import os

from chainermn_overlap.testing import equivalence

TEST_OPTIMIZER_ENV = 'CHAINERMN_OVERLAP_TEST_OPTIMIZER'
TEST_SHARD_ENV = 'CHAINERMN_OVERLAP_TEST_SHARD'


def configure():
    """Passes the variables to :func:`equivalence.configure`."""
    equivalence.configure(
        optimizer=os.environ.get(TEST_OPTIMIZER_ENV, 'overlap'),
        shard=os.environ.get(TEST_SHARD_ENV) or None)
