from chainermn_overlap.optimizers.overlapped import create_overlapped_optimizer  # NOQA
from chainermn_overlap.optimizers.overlapped import DEFAULT_BUCKET_SIZE  # NOQA
