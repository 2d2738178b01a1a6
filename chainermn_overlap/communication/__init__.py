"""Everything that decides when and how gradients are communicated."""
from chainermn_overlap.communication.backends import get_backend  # NOQA
from chainermn_overlap.communication.backends import register_backend  # NOQA
from chainermn_overlap.communication.buckets import plan_buckets  # NOQA
from chainermn_overlap.communication import scheduler  # NOQA  (registers mpi_priority)
# Imported for its side effect: registers the 'emulated' backend.
from chainermn_overlap.communication import emulated  # NOQA
