"""Everything that decides when and how gradients are communicated."""
from chainermn_overlap.communication.buckets import plan_buckets  # NOQA
from chainermn_overlap.communication.engine import Engine  # NOQA
from chainermn_overlap.communication.engine import get_backend  # NOQA
from chainermn_overlap.communication.engine import register_backend  # NOQA
# The engines' modules, as attributes of this package (they register
# nothing: get_backend finds the built-in engines by name; cupy is imported
# only when an 'nccl' engine is built).
from chainermn_overlap.communication import backends  # NOQA
from chainermn_overlap.communication import scheduler  # NOQA
from chainermn_overlap.communication import emulated  # NOQA
from chainermn_overlap.communication import nccl  # NOQA

__all__ = ['Engine', 'get_backend', 'plan_buckets', 'register_backend']
