"""Helpers for the library's tests: the equivalence harness of the MPI
tests (:mod:`.equivalence`), the small models they share (:mod:`.models`)
and the device the GPU variants run on (:mod:`.device`)."""

__all__ = ['device', 'equivalence', 'models']
