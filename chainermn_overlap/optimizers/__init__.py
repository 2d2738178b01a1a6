from chainermn_overlap.optimizers.overlapped import create_overlapped_optimizer  # NOQA
from chainermn_overlap.optimizers.overlapped import DEFAULT_BUCKET_SIZE  # NOQA
from chainermn_overlap.optimizers.double_buffering import create_double_buffering_optimizer  # NOQA
