"""Overlapped gradient reduction and spatial parallelism for Chainer/ChainerMN.

``create_overlapped_optimizer`` is a drop-in for
``chainermn.create_multi_node_optimizer`` that reduces gradients layer by
layer, overlapped with backward and the next forward.
``create_double_buffering_optimizer`` overlaps a whole iteration at the price
of one-step-stale gradients (ChainerMN's double buffering, on CPU/MPI).
``PowerSGD`` compresses gradients (low rank, with error feedback).
``distconv`` (a subpackage, imported on demand) partitions activations
spatially.
"""
from chainermn_overlap.abort import disable_abort_on_exception  # NOQA
from chainermn_overlap.abort import enable_abort_on_exception  # NOQA
from chainermn_overlap.compression import PowerSGD  # NOQA
from chainermn_overlap.errors import CollectiveMismatchError  # NOQA
from chainermn_overlap.errors import CommunicationError  # NOQA
from chainermn_overlap.errors import CommunicationTimeout  # NOQA
from chainermn_overlap.errors import FallbackWarning  # NOQA
from chainermn_overlap.errors import StallWarning  # NOQA
from chainermn_overlap.optimizers import create_double_buffering_optimizer  # NOQA
from chainermn_overlap.optimizers import create_overlapped_optimizer  # NOQA
from chainermn_overlap.optimizers import DEFAULT_BUCKET_SIZE  # NOQA
from chainermn_overlap.optimizers import ShardOptions  # NOQA
from chainermn_overlap.optimizers.sharding.rules import register_elementwise  # NOQA

__version__ = '0.1.0'

__all__ = [
    'CollectiveMismatchError',
    'CommunicationError',
    'CommunicationTimeout',
    'DEFAULT_BUCKET_SIZE',
    'FallbackWarning',
    'PowerSGD',
    'ShardOptions',
    'StallWarning',
    'create_double_buffering_optimizer',
    'create_overlapped_optimizer',
    'disable_abort_on_exception',
    'distconv',
    'enable_abort_on_exception',
    'register_elementwise',
]

# CHAINERMN_OVERLAP_ABORT_ON_EXCEPTION=1 installs the abort hook at import.
from chainermn_overlap import abort as _abort  # NOQA
_abort._enable_from_environment()
