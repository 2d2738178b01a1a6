"""Overlapped gradient reduction and spatial parallelism for Chainer/ChainerMN.

``create_overlapped_optimizer`` is a drop-in for
``chainermn.create_multi_node_optimizer`` that reduces gradients layer by
layer, overlapped with backward and the next forward.  ``distconv`` (a
subpackage, imported on demand) partitions activations spatially.
"""
from chainermn_overlap.errors import FallbackWarning  # NOQA
from chainermn_overlap.optimizers import create_overlapped_optimizer  # NOQA
from chainermn_overlap.optimizers import DEFAULT_BUCKET_SIZE  # NOQA

__version__ = '0.1.0'
