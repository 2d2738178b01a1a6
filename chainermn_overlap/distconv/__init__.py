"""Spatial parallelism for Chainer: samples split over a grid of processes.

Usage::

    from chainermn_overlap import distconv
    grid = distconv.SpatialGrid(comm, (2, 2))
    x_local = grid.scatter(x)            # this process's block
    h = distconv.Convolution2D(grid, 3, 16, 3, pad=1)(x_local)
    h = distconv.max_pooling_2d(grid, F.relu(h), 2)
    feat = distconv.global_average_pooling(grid, h)   # (N_group, C)

Every operation is exact against single-process Chainer on the global batch
(forward and backward). Element-wise functions (ReLU, dropout, ...) are used
unchanged on local blocks. See :meth:`SpatialGrid.loss_scale` for how to
write the loss so that a data-parallel optimizer over the whole
communicator performs the single-process update.
"""
from chainermn_overlap.distconv.exchange import region_exchange  # NOQA
from chainermn_overlap.distconv.exchange import RegionExchange  # NOQA
from chainermn_overlap.distconv.exchange import RegionExchangeAdjoint  # NOQA
from chainermn_overlap.distconv.functions import average_pooling_2d  # NOQA
from chainermn_overlap.distconv.functions import average_pooling_nd  # NOQA
from chainermn_overlap.distconv.functions import convolution_2d  # NOQA
from chainermn_overlap.distconv.functions import convolution_nd  # NOQA
from chainermn_overlap.distconv.functions import global_average_pooling  # NOQA
from chainermn_overlap.distconv.functions import max_pooling_2d  # NOQA
from chainermn_overlap.distconv.functions import max_pooling_nd  # NOQA
from chainermn_overlap.distconv.grid import SpatialGrid  # NOQA
from chainermn_overlap.distconv.links import BatchNormalization  # NOQA
from chainermn_overlap.distconv.links import Convolution2D  # NOQA
from chainermn_overlap.distconv.links import ConvolutionND  # NOQA
from chainermn_overlap.distconv.normalization import batch_normalization  # NOQA
from chainermn_overlap.distconv.redistribute import sample_share  # NOQA
from chainermn_overlap.distconv.redistribute import to_sample_layout  # NOQA
from chainermn_overlap.distconv.redistribute import to_spatial_layout  # NOQA
from chainermn_overlap.distconv import geometry  # NOQA
