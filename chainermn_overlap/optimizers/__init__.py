"""The multi-node optimizer wrappers (overlapped, double buffering)."""
from chainermn_overlap.optimizers.double_buffering import create_double_buffering_optimizer  # NOQA
from chainermn_overlap.optimizers.overlapped import create_overlapped_optimizer  # NOQA
from chainermn_overlap.optimizers.overlapped import DEFAULT_BUCKET_SIZE  # NOQA
from chainermn_overlap.optimizers.sharding.options import ShardOptions  # NOQA

__all__ = ['DEFAULT_BUCKET_SIZE', 'ShardOptions',
           'create_double_buffering_optimizer', 'create_overlapped_optimizer']
