"""Spatial parallelism for Chainer: samples split over a grid of processes.

Usage::

    from chainermn_overlap import distconv
    grid = distconv.SpatialGrid(comm, (2, 2))
    x_local = grid.scatter(x)            # this process's block
    h = distconv.Convolution2D(grid, 3, 16, 3, pad=1)(x_local)
    h = distconv.max_pooling_2d(grid, F.relu(h), 2)
    feat = distconv.global_average_pooling(grid, h)   # (N_group, C)

Layouts:
    *Spatial layout* (what the layers take and return): each process holds
    all samples of its sample group, restricted to its balanced spatial
    block. *Sample layout*: each process holds whole samples, for layers
    that need them; move between the two with :func:`to_sample_layout` and
    :func:`to_spatial_layout` (point-to-point, exact adjoints of each
    other). Element-wise functions (ReLU, dropout, LRN across channels) are
    used unchanged on local blocks.

Exactness:
    Every operation computes this process's block of exactly what
    single-process Chainer computes on the global batch: it derives the
    global input box its output block reads (padding included), fetches
    the parts owned by any other process (:class:`RegionExchange`), and runs
    the Chainer function without padding on it. Batch normalisation uses
    the statistics of the whole global batch. Every backward is the exact
    adjoint (vector-Jacobian product) of its forward.

Performance:
    * Overlap (``SpatialGrid(comm, shape, overlap=True)``, the default):
      convolutions and poolings post their halo messages, compute the
      interior of their output block (windows inside the owned block) on
      views of the block, then wait and compute the ``2 * ndim`` boundary
      slabs (edges and corners, for 1, 2 or 3 split dimensions). In
      backward the halo gradients are posted before the interior's input
      and weight gradients are computed. ``grid.overlap = False`` selects
      the blocking exchange (needed for double backpropagation). Layers
      whose windows never leave the owned block (1x1 convolutions, aligned
      pooling) exchange nothing.
    * Progress: MPICH (shared memory, UCX, TCP) moves data only inside MPI
      calls, so a message posted before a long numpy computation does not
      move until the wait, and posting early alone hides nothing. The
      interior is therefore computed in up to ``progress_pieces`` pieces
      (default 4; fewer for small layers, see ``progress_min_cells``) with
      an ``MPI_Testall`` between two pieces, in forward and in backward:
      it costs microseconds and needs no extra thread or core.
      ``grid.stats['forward_halos_ready']`` / ``['forward_halos']`` (and
      ``backward_...``) count the exchanges already complete when their
      wait began; ``forward_wait_s``/``backward_wait_s`` the time still
      exposed (``make bench-spatial`` compares the settings).
    * One process per sample group (``prod(shape) == 1``): every layer is
      the plain Chainer call on whole samples (and batch normalisation on a
      single process is Chainer's), so a 1x1 grid costs nothing over
      Chainer and supports double backpropagation.
    * Validation (``check='cached'``, the default): each distinct input
      geometry is validated once with an allgather; later calls agree on a
      fingerprint with one tiny allreduce, and fall back to the full check
      on every rank if any rank disagrees, so bad input still raises the
      same error everywhere. ``grid.stats`` counts paths and validations and
      times the halo waits (``forward_wait_s``, ``backward_wait_s``).
    * Memory: no process allocates a full-size activation; the overlapped
      path does not even copy its block (only thin slabs). Create inputs
      per block (``grid.block``, ``grid.sample_range``), not with
      ``scatter`` of a global batch, on the training path.

Per-stage strategies (hybrid sample x spatial):
    Keep a mapping stage -> ``'spatial'`` or ``'sample'``; run spatial
    stages with these layers, call :func:`to_sample_layout` at the boundary,
    and use plain Chainer layers with
    ``BatchNormalization(grid, size, layout='sample')`` (global statistics)
    afterwards. See ``examples/spatial/train_resnet50_spatial.py``.

Training (what a user must do):
    After ``loss.backward()`` the parameter gradients *summed over all
    processes* are the gradient of the *sum of the processes' losses*
    (spatial ranks hold partial sums over their blocks; replicated layers
    after :func:`global_average_pooling` each hold their copy's gradient,
    which the pooling's adjoint accounts for). A data-parallel optimizer
    over the whole communicator (``chainermn.create_multi_node_optimizer``
    or ``create_overlapped_optimizer``) *averages* gradients, so each
    process's loss must be ``comm.size`` times its share of the global mean
    loss; then no further gradient scaling is needed:

    * equal sample groups: the usual per-process mean loss (e.g.
      ``F.softmax_cross_entropy(y, t_local)``) is right, also when the
      processes of a group all compute the same replicated loss;
    * in general (uneven or empty groups, the last mini-batch, sample
      layout): ``loss = F.sum(per_sample_loss) * grid.loss_scale(n_local)``.

    Because backward is collective, every process must call it, also one
    with no samples: give it a loss connected to the graph, e.g.
    ``F.sum(y) * 0`` (Chainer's softmax cross entropy cannot backpropagate
    an empty batch). Layers after the replication must compute the same on
    every process of a group (same dropout seed), as the copies' gradients
    are summed.

Channel and filter parallelism (``SpatialGrid(comm, shape, channels=C)``):
    Late CNN stages have small maps and many channels, where a spatial
    split is mostly halo. A grid with a channel axis splits channels in
    balanced blocks (:meth:`SpatialGrid.channel_range`) over ``C``
    processes holding the same samples and spatial block (``comm.size =
    groups x C x prod(shape)``). ``Convolution2D(..., split='filter')``
    takes whole channels and returns its block of output channels (it
    holds that block of W and b); ``split='channel'`` takes split channels,
    holds its block of W's input channels, reduces the partial sums over
    the channel axis and returns every output channel (with
    ``split_output=True`` it reduce-scatters them and returns its block of
    the output channels, so that what follows runs on 1/C of them;
    :func:`gather_channels` makes a block whole again, and a ``'filter'``
    layer with ``split_input=True`` gathers its input blocks itself). On a
    grid of whole samples (``prod(shape) == 1``) these two overlap their
    channel messages with the products of the other blocks
    (:mod:`.channel_conv`, ``grid.channel_overlap``). A ``'filter'``
    layer feeds a ``'channel'`` one directly; ``BatchNormalization(grid,
    size, channel_split=True)`` normalises a channel-split tensor with
    global statistics; element-wise functions and poolings work on either.
    A tensor that is not channel split is held whole on every channel
    coordinate, and so is its gradient as per-copy contributions (their
    sum is the gradient, as for the replicated output of
    :func:`global_average_pooling`): the training convention below holds
    unchanged. ``grid.scatter(x, channel_split=...)`` and
    ``grid.gather(y, channel_split=...)`` move blocks in and out.

Parameters on part of the processes (:mod:`.params`):
    Channel blocks of parameters differ between channel coordinates; their
    gradients must be reduced only over the processes holding the same
    block. ``link.reduction_groups()`` / ``param.reduction_group`` /
    :func:`reduction_groups` declare them (a hashable ``key``, the
    members' ``mpi_comm`` and the ``sum_scale`` of ``1 / comm.size``
    applied to the group's sum); see :mod:`chainermn_overlap.distconv.params`.
    ChainerMN's ``create_multi_node_optimizer`` cannot train such a model
    (:func:`check_replicated` says so). :func:`load_serial_params` and
    :func:`store_serial_params` copy a single-process model's parameters
    into the blocks and gather them back.

Overlapped tiling (:class:`Tiled`):
    ``Tiled(grid, layers, depth)`` runs convolutions, poolings, batch
    normalisation and element-wise layers with one halo exchange per
    ``depth`` window layers, computing the overlap redundantly, and returns
    exactly the layer-by-layer result (batch-normalisation statistics
    from owned cells only). On a link with latency it trades message
    rounds for redundant computation; :func:`tuner.depth_candidates` lets
    the tuner choose the depth. See :mod:`chainermn_overlap.distconv.tiling`.

Tuning (:func:`tuner.tune`):
    ``distconv.tune(comm, build_model, input_shape, candidates)`` builds
    the model for each candidate grid shape (or ``{'grid': ..., 'strategy':
    ...}`` mapping), times a few forward/backward steps, and returns the
    fastest with a table of all timings (``tuner.format_table``); the step
    time is the slowest process's, the choice is made from gathered data
    and is the same on every process. Candidates whose grid does not
    divide the process count are recorded as ``'invalid'``.

Encoder-decoder models:
    :func:`deconvolution_nd` (links :class:`Deconvolution2D`,
    :class:`DeconvolutionND`) for any kernel, stride, pad, ``outsize``,
    dilation and groups, :func:`unpooling_nd`, :func:`resize_images` and
    :func:`group_normalization` (:class:`GroupNormalization`, statistics
    over the global volume) compute this process's block exactly;
    :func:`concat` joins skip connections and raises on every process
    where the global sizes (hence the blocks) differ.

Not supported:
    ``return_indices`` of max pooling, BN over other axes, the
    interior-first overlap for resizing (it uses the blocking exchange),
    double backpropagation through batch or group normalisation, and
    spatially splitting a layer with a grid of another dimensionality; grouped
    convolutions with ``split='filter'``/``'channel'``; inside
    :class:`Tiled`, the overlapped (interior-first) exchange (a tile's one
    exchange is blocking) and batch normalisation in sample layout.
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
from chainermn_overlap.distconv.deconvolution import deconvolution_2d  # NOQA
from chainermn_overlap.distconv.deconvolution import deconvolution_nd  # NOQA
from chainermn_overlap.distconv.deconvolution import unpooling_2d  # NOQA
from chainermn_overlap.distconv.deconvolution import unpooling_nd  # NOQA
from chainermn_overlap.distconv.decoder_links import Deconvolution2D  # NOQA
from chainermn_overlap.distconv.decoder_links import DeconvolutionND  # NOQA
from chainermn_overlap.distconv.decoder_links import (  # NOQA
    GroupNormalization)
from chainermn_overlap.distconv.grid import SpatialGrid  # NOQA
from chainermn_overlap.distconv.resize import concat  # NOQA
from chainermn_overlap.distconv.resize import resize_images  # NOQA
from chainermn_overlap.distconv.group_norm import group_normalization  # NOQA
from chainermn_overlap.distconv.links import BatchNormalization  # NOQA
from chainermn_overlap.distconv.links import Convolution2D  # NOQA
from chainermn_overlap.distconv.links import ConvolutionND  # NOQA
from chainermn_overlap.distconv.normalization import (  # NOQA
    batch_normalization)
from chainermn_overlap.distconv.redistribute import sample_share  # NOQA
from chainermn_overlap.distconv.redistribute import to_replicated  # NOQA
from chainermn_overlap.distconv.channels import channel_block  # NOQA
from chainermn_overlap.distconv.channels import gather_channels  # NOQA
from chainermn_overlap.distconv.redistribute import to_sample_layout  # NOQA
from chainermn_overlap.distconv.redistribute import to_spatial_layout  # NOQA
from chainermn_overlap.distconv.params import check_replicated  # NOQA
from chainermn_overlap.distconv.params import load_serial_params  # NOQA
from chainermn_overlap.distconv.params import ReductionGroup  # NOQA
from chainermn_overlap.distconv.params import reduction_groups  # NOQA
from chainermn_overlap.distconv.params import store_serial_params  # NOQA
from chainermn_overlap.distconv.tiling import Tiled  # NOQA
from chainermn_overlap.distconv import geometry  # NOQA
from chainermn_overlap.distconv import tuner  # NOQA
from chainermn_overlap.distconv.tuner import tune  # NOQA

__all__ = [
    'BatchNormalization', 'Convolution2D', 'ConvolutionND',
    'Deconvolution2D', 'DeconvolutionND', 'GroupNormalization',
    'ReductionGroup', 'RegionExchange', 'RegionExchangeAdjoint',
    'SpatialGrid', 'Tiled', 'average_pooling_2d', 'average_pooling_nd',
    'batch_normalization', 'channel_block', 'check_replicated', 'concat',
    'convolution_2d', 'convolution_nd', 'deconvolution_2d',
    'deconvolution_nd', 'gather_channels', 'geometry',
    'global_average_pooling', 'group_normalization', 'load_serial_params',
    'max_pooling_2d', 'max_pooling_nd', 'reduction_groups',
    'region_exchange', 'resize_images', 'sample_share', 'store_serial_params',
    'to_replicated', 'to_sample_layout', 'to_spatial_layout', 'tune',
    'tuner', 'unpooling_2d', 'unpooling_nd',
]
