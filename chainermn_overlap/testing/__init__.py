"""Helpers for the library's tests: the equivalence harness of the MPI
tests (:mod:`.equivalence`) and the small models they share
(:mod:`.models`)."""

__all__ = ['equivalence', 'models']
