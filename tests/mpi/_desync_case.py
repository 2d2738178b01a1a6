"""A test that fails on one rank only before a collective (run by
tests/unit/test_mpi_run.py, not collected by the suite): the other rank
waits in the collective while the failed one goes on to the next test."""
from mpi4py import MPI


def test_fails_on_the_last_rank_before_a_barrier():
    world = MPI.COMM_WORLD
    assert world.Get_rank() != world.Get_size() - 1, 'the planted failure'
    world.Barrier()


def test_next():
    MPI.COMM_WORLD.Dup().Free()
