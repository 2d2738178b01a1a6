"""The process grid of spatial parallelism and the block layout of tensors.

:class:`SpatialGrid` is the handle every distconv layer takes. It holds the
settings of the window operations (overlap, progress pieces) and the
counters, and composes the parts that do the work: the topology and its
communicators (:mod:`.topology`), the layout checks (:mod:`.layout`, pure,
and :mod:`.layout_check`, collective and cached) and the distribution
helpers (:mod:`.distribution`).
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import chainer
import numpy

from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import blocking
from chainermn_overlap.distconv import distribution
from chainermn_overlap.distconv import geometry
from chainermn_overlap.distconv import layout_check
from chainermn_overlap.distconv.layout import Layout, axis_names
from chainermn_overlap.distconv.topology import GridCommunicators
from chainermn_overlap.distconv.topology import GridTopology

if TYPE_CHECKING:
    from chainer.types import NdArray

    Input = Union[chainer.Variable, NdArray]

__all__ = ['Layout', 'SpatialGrid', 'axis_names']


def _part(part, name):
    """A read-only attribute of the grid read from one of its parts."""
    def get(self):
        return getattr(getattr(self, part), name)
    get.__name__ = name
    return property(get, doc='``%s.%s`` (see the class docstring).'
                    % (part, name))


def _same_on_every_process(mpi_comm, settings):
    """Raises the same ValueError on every process unless all give the
    same ``settings`` (they decide the grid's communicators and which
    collectives its layers run)."""
    every = _mpi_json.allgather_json(mpi_comm, settings,
                                     what="distconv.SpatialGrid's arguments")
    differ = sorted(k for k in settings
                    if any(e[k] != every[0][k] for e in every))
    if differ:
        raise ValueError(
            'distconv.SpatialGrid: the arguments {} differ between processes '
            '({}); give every process the same grid.'.format(
                differ, '; '.join(
                    'process {}: {}'.format(r, ', '.join(
                        '{}={!r}'.format(k, e[k]) for k in differ))
                    for r, e in enumerate(every))))


class SpatialGrid(object):
    """A grid of processes splitting the spatial dimensions of samples.

    The communicator's processes form ``comm.size // (channels *
    prod(shape))`` sample groups of ``channels * prod(shape)`` consecutive
    ranks each; inside a group, ``channels`` channel blocks of
    ``prod(shape)`` consecutive ranks each (rank ``= (group * channels +
    channel_rank) * prod(shape) + spatial_rank``). Channels are split in
    balanced blocks (:func:`geometry.block_range`, the rule of spatial
    blocks: the first ``n % channels`` blocks one larger); a tensor either
    has its channels split (channel coordinate ``c`` holds block ``c``) or
    holds all of them on every channel coordinate (a replicated copy).
    Within a spatial grid, the process with spatial rank ``s`` (row-major
    over ``shape``) owns the balanced block (:func:`geometry.block_range`)
    of every spatial dimension at its grid coordinates; sample groups split
    the global batch into balanced ranges of samples, like data parallelism
    does.

    A tensor in *spatial layout* has shape ``(N_group, C, *block)`` on each
    process. The block sizes are not stored anywhere: layers check their
    input's layout collectively (:meth:`check_spatial`), so wrong inputs
    raise the same :class:`ValueError` on every rank instead of hanging;
    with ``check='cached'`` each geometry is checked in full once and later
    calls only agree on a fingerprint
    (:mod:`~chainermn_overlap.distconv.layout_check`).

    The grid composes three parts, each usable and tested on its own:
    ``topology`` (:class:`~.topology.GridTopology`: ranks, coordinates and
    blocks, pure), ``communicators`` (:class:`~.topology.GridCommunicators`:
    the private mpi4py communicators) and ``layouts``
    (:class:`~.layout_check.LayoutCheck`: the checks with their cache);
    scatter and gather are :mod:`~chainermn_overlap.distconv.distribution`.
    The attributes below read those parts.

    Args:
        comm: A ChainerMN communicator (or an mpi4py communicator). Its size
            must be a multiple of ``prod(shape)``.
        shape (tuple of int): Processes per spatial dimension, e.g. ``(H, W)``
            or ``(D, H, W)``.
        overlap (bool): If True (default), window operations (convolution,
            pooling) compute the interior of their output block while the
            halo is in flight, in forward and in backward. Must be the same
            on every process; it can be changed between iterations through
            the attribute of the same name.
        check (str): ``'cached'`` (default) validates each distinct input
            geometry once and then agrees on a fingerprint; ``'always'``
            runs the full allgather check on every call.
        progress_pieces (int): With ``overlap``, the interior of a window
            operation is computed in up to this many pieces, with an MPI
            progress call (``Testall``) between two pieces, forward and
            backward. MPICH moves data only inside MPI calls, so without
            them (``1``) the halo sits still while the interior is computed
            and nothing is hidden. Default 4.
        progress_min_cells (int): Fewest output values per sample (cells
            times channels, per process) a piece must have; smaller layers
            use fewer pieces, as each piece costs a few Chainer calls.
            Default 32768.
        channels (int): Processes along the channel axis (default 1): the
            processes that hold different channel blocks (or filter
            blocks) of the same samples and spatial block.
        channel_overlap (bool): If True (default), convolutions with
            ``split_output`` or ``split_input`` on a grid of whole samples
            (``prod(shape) == 1``) send each channel block's data as soon
            as it is computed and compute the other blocks meanwhile
            (:mod:`~chainermn_overlap.distconv.channel_conv`); if False
            they run a Chainer convolution and a collective one after the
            other. Same on every process; can be changed between
            iterations through the attribute of the same name.

    Attributes:
        shape (tuple of int): The grid shape.
        ndim (int): Number of spatial dimensions.
        size (int): Number of processes in the communicator.
        rank (int): This process's rank in the communicator.
        spatial_size (int): Processes per spatial grid, ``prod(shape)``.
        channels (int): Processes along the channel axis.
        channel_rank (int): This process's channel coordinate.
        n_groups (int): Number of sample groups.
        group (int): This process's sample group.
        spatial_rank (int): This process's rank inside its spatial grid.
        mpi_spatial: mpi4py communicator of the processes of this spatial
            grid (same sample group and channel coordinate).
        mpi_channel: mpi4py communicator of the channel axis (same sample
            group and spatial rank; rank = channel coordinate).
        mpi_data: mpi4py communicator of every process with this channel
            coordinate (all sample groups and spatial ranks; rank = ``group
            * prod(shape) + spatial_rank``): batch statistics and the
            gradients of channel-split parameters are reduced over it.
        coords (tuple of int): This process's grid coordinates.
        overlap (bool): See the argument.
        channel_overlap (bool): See the argument.
        progress_pieces (int): See the argument; can be changed between
            iterations (the same on every process).
        progress_min_cells (int): See the argument; likewise.
        stats (collections.Counter): Counters and seconds since the last
            ``stats.clear()``: ``validate_full``/``validate_cached`` (layout
            checks), ``exchange_overlapped``/``exchange_blocking``/
            ``exchange_none`` (window operations by path; a grid with one
            process per sample group runs every one directly, counted as
            ``exchange_none``), ``channel_overlapped`` (convolutions run by
            the overlapped channel nodes), ``forward_wait_s``/
            ``backward_wait_s`` (time blocked waiting for halo messages,
            i.e. communication not hidden by computation),
            ``progress_calls``, and, for the overlapped path,
            ``forward_halos``/``backward_halos`` (exchanges with messages)
            and ``forward_halos_ready``/``backward_halos_ready`` (those
            already complete when their wait began, i.e. fully hidden).
    """

    def __init__(self, comm: Any, shape: Sequence[int],
                 overlap: bool = True, check: str = 'cached',
                 progress_pieces: int = 4,
                 progress_min_cells: int = 32768,
                 channels: int = 1, channel_overlap: bool = True) -> None:
        mpi_comm = getattr(comm, 'mpi_comm', comm)
        # A bad argument on some processes only is raised on every one
        # before the grid's first communicator is built (the others would
        # wait in it).
        with blocking.agreement(mpi_comm, 'the checks of distconv.'
                                'SpatialGrid\'s arguments'):
            topology = GridTopology(shape, mpi_comm.Get_size(),
                                    mpi_comm.Get_rank(), channels)
            layout_check.check_mode(check)
            for name, value in (('progress_pieces', progress_pieces),
                                ('progress_min_cells', progress_min_cells)):
                if not isinstance(value, (int, numpy.integer)) or value < 1:
                    raise ValueError(
                        'distconv.SpatialGrid: %s must be a positive int, '
                        'got %r' % (name, value))
        _same_on_every_process(mpi_comm, {
            'shape': list(topology.shape), 'channels': topology.channels,
            'check': check, 'overlap': bool(overlap),
            'channel_overlap': bool(channel_overlap)})
        self.comm = comm
        self.topology = topology
        self.overlap = bool(overlap)
        self.channel_overlap = bool(channel_overlap)
        self.progress_pieces = int(progress_pieces)
        self.progress_min_cells = int(progress_min_cells)
        self.stats = collections.Counter()
        self.communicators = GridCommunicators(mpi_comm, topology)
        self.layouts = layout_check.LayoutCheck(
            topology, self.communicators.world, self.stats, check)

    shape = _part('topology', 'shape')
    ndim = _part('topology', 'ndim')
    size = _part('topology', 'size')
    rank = _part('topology', 'rank')
    spatial_size = _part('topology', 'spatial_size')
    channels = _part('topology', 'channels')
    n_groups = _part('topology', 'n_groups')
    group = _part('topology', 'group')
    channel_rank = _part('topology', 'channel_rank')
    spatial_rank = _part('topology', 'spatial_rank')
    coords = _part('topology', 'coords')
    mpi_world = _part('communicators', 'world')
    mpi_spatial = _part('communicators', 'spatial')
    mpi_channel = _part('communicators', 'channel')
    mpi_data = _part('communicators', 'data')

    @property
    def check(self) -> str:
        """``'cached'`` or ``'always'`` (see the argument); can be changed
        between iterations (the same on every process)."""
        return self.layouts.mode

    @check.setter
    def check(self, value: str) -> None:
        self.layouts.mode = layout_check.check_mode(value)

    def __repr__(self):
        if self.channels > 1:
            return 'SpatialGrid(shape=%r, channels=%d, groups=%d, rank=%d)' \
                % (self.shape, self.channels, self.n_groups, self.rank)
        return 'SpatialGrid(shape=%r, groups=%d, rank=%d)' % (
            self.shape, self.n_groups, self.rank)

    # Links holding a grid get copied (Link.copy, deepcopy in evaluators);
    # the grid is a shared handle to communicators and must not be cloned.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError('distconv.SpatialGrid holds MPI communicators and '
                        'cannot be pickled; rebuild it on each process.')

    # ------------------------------------------------------------------
    # Topology
    # ------------------------------------------------------------------
    def world_rank(self, group: int, channel_rank: int,
                   spatial_rank: int) -> int:
        """Rank in the communicator of grid position (group, c, s)."""
        return self.topology.world_rank(group, channel_rank, spatial_rank)

    def channel_range(self, n: int, channel_rank: int = None
                      ) -> geometry.Interval:
        """Channels ``[lo, hi)`` of ``n`` held at a channel coordinate.

        Args:
            n (int): Global number of channels.
            channel_rank (int): The coordinate (default: this process's).
        """
        return self.topology.channel_range(n, channel_rank)

    def sample_range(self, n: int) -> geometry.Interval:
        """Samples ``[lo, hi)`` of a global batch of ``n`` in this group."""
        return self.topology.sample_range(n)

    def block(self, spatial_shape: Sequence[int]) -> geometry.Box:
        """This process's box of a tensor with global ``spatial_shape``."""
        return self.topology.block(spatial_shape)

    # ------------------------------------------------------------------
    # Layouts
    # ------------------------------------------------------------------
    def check_spatial(self, x: Input, layer: str,
                      signature: tuple = (),
                      channel_split: Optional[bool] = None) -> Layout:
        """Checks that ``x`` is a block of the spatial layout (collective).

        Every process must call this with its block. All processes receive
        the same information, so on bad input all of them raise the same
        error. Cached per geometry (see the class docstring).

        Args:
            x: This process's block, ``(N_group, C, *block)``.
            layer (str): Name used in error messages.
            signature (tuple): Picklable arguments that must agree across
                processes (kernel sizes, parameter shapes, ...).
            channel_split (bool or None): Whether the channels must be
                split over the channel axis (True), held whole everywhere
                (False), or may be either (None: only processes of one
                channel coordinate must agree).

        Returns:
            Layout: The global description of the tensor.

        Raises:
            ValueError: If the blocks do not form the grid's layout.
        """
        return self.layouts.spatial(x, layer, signature, channel_split)

    def check_samples(self, x: Input, layer: str, signature: tuple = ()
                      ) -> Tuple[Tuple[int, ...], List[int]]:
        """Checks a tensor in sample layout (whole samples per process).

        Returns:
            tuple: ``(spatial_shape, counts)`` where ``counts[s]`` is the
            number of samples of spatial rank ``s`` in this group.
        """
        return self.layouts.samples(x, layer, signature)

    # ------------------------------------------------------------------
    # User-facing distribution helpers (not for the training path)
    # ------------------------------------------------------------------
    def scatter(self, x: Input, channel_split: bool = False) -> NdArray:
        """Returns this process's block of a global batch.

        Args:
            x: The global batch ``(N, C, *spatial)``, identical on every
                process (numpy or cupy array, or Variable).
            channel_split (bool): If True, only this process's balanced
                block of the channels (:meth:`channel_range`); else all
                channels.

        Returns:
            A C-contiguous array ``(N_group, C or C_block, *block)`` of this
            process's samples, channels and spatial block.
        """
        return distribution.scatter(self.topology, x, channel_split)

    def scatter_samples(self, t: Input) -> NdArray:
        """Returns this group's samples of a per-sample array (e.g. labels)."""
        return distribution.scatter_samples(self.topology, t)

    def gather(self, y: Input, channel_split: bool = False,
               reduce_copies: bool = False) -> NdArray:
        """Assembles the global tensor from every process's block.

        Collective over the whole communicator. Meant for users and tests:
        it allocates the full tensor on every process.

        Args:
            y: This process's block (array or Variable) in spatial layout.
            channel_split (bool): Whether ``y`` holds this process's block
                of the channels (True) or all of them (False).
            reduce_copies (bool): For a tensor that is not channel split on
                a grid with a channel axis: sum the copies of the channel
                coordinates instead of taking coordinate 0's. The gradient
                of a replicated tensor is held as per-copy contributions
                (see the module docstring), whose sum is the gradient.

        Returns:
            The global array ``(N, C, *spatial)`` on ``y``'s device.
        """
        layout = self.check_spatial(y, 'distconv.SpatialGrid.gather',
                                    channel_split=bool(channel_split))
        return distribution.gather(self.topology, self.mpi_world, y, layout,
                                   channel_split, reduce_copies)

    def loss_scale(self, n_local: int) -> float:
        """Factor turning a sum of per-sample losses into the rank's loss.

        Every distconv operation's backward is the exact adjoint of its
        forward, so after ``loss.backward()`` the parameter gradients summed
        over all processes are the gradient of the *sum of all processes'
        losses*. ``create_multi_node_optimizer`` averages over all
        processes. Hence each process's loss must be ``comm.size`` times its
        share of the global mean loss; with

            ``loss = F.sum(per_sample_losses) * grid.loss_scale(len(t))``

        the update equals the single-process update on the global batch, in
        spatial layout (spatial ranks of a group compute the same loss) as
        in sample layout, also for uneven or empty sample groups. For equal
        sample groups this equals the usual per-process mean loss.

        Collective over the whole communicator.

        Args:
            n_local (int): Number of samples whose losses this process sums.

        Returns:
            float: ``comm.size / sum over processes of n_local``.
        """
        return distribution.loss_scale(self.mpi_world, self.size, n_local)
