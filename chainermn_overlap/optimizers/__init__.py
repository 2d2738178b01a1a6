"""The multi-node optimizer wrappers (overlapped, double buffering)."""
from chainermn_overlap.optimizers.double_buffering import create_double_buffering_optimizer  # NOQA
from chainermn_overlap.optimizers.overlapped import create_overlapped_optimizer  # NOQA
from chainermn_overlap.optimizers.overlapped import DEFAULT_BUCKET_SIZE  # NOQA

__all__ = ['DEFAULT_BUCKET_SIZE', 'create_double_buffering_optimizer',
           'create_overlapped_optimizer']
