"""The process grid of spatial parallelism and the block layout of tensors."""
from __future__ import annotations

import collections
import hashlib
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import chainer
from chainer import backend
import numpy

from chainermn_overlap import _mpi_json
from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import geometry
from mpi4py import MPI

if TYPE_CHECKING:
    from chainer.types import NdArray

    Input = Union[chainer.Variable, NdArray]

__all__ = ['Layout', 'SpatialGrid', 'axis_names']

_AXIS_NAMES = {1: ('W',), 2: ('H', 'W'), 3: ('D', 'H', 'W')}


def axis_names(ndim: int) -> Tuple[str, ...]:
    """Names of the spatial axes for messages ('H', 'W', ...)."""
    return _AXIS_NAMES.get(ndim, tuple('S%d' % i for i in range(ndim)))


Layout = collections.namedtuple(
    'Layout', ['spatial_shape', 'group_samples', 'channels',
               'channel_counts'], defaults=(None,))
Layout.__doc__ = """Global description of a spatially distributed tensor.

Attributes:
    spatial_shape (tuple of int): Global spatial extent.
    group_samples (list of int): Number of samples held by each sample group.
    channels (int): Number of channels (axis 1): the global count for a
        tensor whose channels are split over the grid's channel axis, the
        common count when they are not, and this process's count when the
        check did not care (``channel_split=None``).
    channel_counts (tuple of int): Channels held at each channel
        coordinate (one entry when the grid has no channel axis).
"""


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
    of every spatial dimension at its grid coordinates; sample groups split the global batch into
    balanced ranges of samples, like data parallelism does.

    A tensor in *spatial layout* has shape ``(N_group, C, *block)`` on each
    process. The block sizes are not stored anywhere: the first time a
    layer sees an input geometry, the processes allgather their local
    shapes (a few integers), derive the global extent and check that the
    blocks match this layout, so wrong inputs raise the same
    :class:`ValueError` on every rank instead of hanging. The result is
    cached per local geometry; later calls only agree on a 64-bit
    fingerprint of the cached layout with one tiny allreduce, and fall back
    to the full check on every rank as soon as any rank misses its cache or
    disagrees (so the guarantee holds, at a fraction of the cost).

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
            ``backward_wait_s`` (time blocked waiting for halo messages, i.e. communication not
            hidden by computation), ``progress_calls``, and, for the
            overlapped path, ``forward_halos``/``backward_halos``
            (exchanges with messages) and ``forward_halos_ready``/
            ``backward_halos_ready`` (those already complete when their
            wait began, i.e. fully hidden).
    """

    def __init__(self, comm: Any, shape: Sequence[int],
                 overlap: bool = True, check: str = 'cached',
                 progress_pieces: int = 4,
                 progress_min_cells: int = 32768,
                 channels: int = 1, channel_overlap: bool = True) -> None:
        mpi_comm = getattr(comm, 'mpi_comm', comm)
        try:
            shape = tuple(int(s) for s in shape)
        except TypeError:
            raise ValueError(
                'distconv.SpatialGrid: shape must be a tuple of process '
                'counts per spatial dimension such as (2, 2), got %r'
                % (shape,))
        if not shape or any(s < 1 for s in shape):
            raise ValueError(
                'distconv.SpatialGrid: shape must be a non-empty tuple of '
                'positive process counts, got %r' % (shape,))
        size = mpi_comm.Get_size()
        if not isinstance(channels, (int, numpy.integer)) or channels < 1:
            raise ValueError(
                'distconv.SpatialGrid: channels must be a positive int (the '
                'number of processes along the channel axis), got %r'
                % (channels,))
        channels = int(channels)
        spatial = geometry.grid_size(shape)
        if channels > 1 and size % (spatial * channels) != 0:
            raise ValueError(
                'distconv.SpatialGrid: grid shape %r with channels=%d needs '
                'a multiple of %d processes (sample groups x channels x '
                'prod(shape)), but the communicator has %d. Choose shape '
                'and channels whose product divides %d.'
                % (shape, channels, spatial * channels, size, size))
        if size % spatial != 0:
            raise ValueError(
                'distconv.SpatialGrid: grid shape %r needs a multiple of %d '
                'processes, but the communicator has %d. Use a grid whose '
                'product divides %d (the quotient is the number of sample '
                'groups), or launch a multiple of %d processes.'
                % (shape, spatial, size, size, spatial))
        self.comm = comm
        self.shape = shape
        self.ndim = len(shape)
        self.size = size
        self.rank = mpi_comm.Get_rank()
        self.spatial_size = spatial
        self.channels = channels
        self.n_groups = size // (spatial * channels)
        self.group = self.rank // (spatial * channels)
        self.channel_rank = (self.rank // spatial) % channels
        self.spatial_rank = self.rank % spatial
        self.coords = geometry.grid_coords(shape, self.spatial_rank)
        if check not in ('cached', 'always'):
            raise ValueError(
                "distconv.SpatialGrid: check must be 'cached' or 'always', "
                'got %r' % (check,))
        self.check = check
        self.overlap = bool(overlap)
        self.channel_overlap = bool(channel_overlap)
        for name, value in (('progress_pieces', progress_pieces),
                            ('progress_min_cells', progress_min_cells)):
            if not isinstance(value, (int, numpy.integer)) or value < 1:
                raise ValueError(
                    'distconv.SpatialGrid: %s must be a positive int, got '
                    '%r' % (name, value))
        self.progress_pieces = int(progress_pieces)
        self.progress_min_cells = int(progress_min_cells)
        self.stats = collections.Counter()
        self._layout_cache = {}
        # Private communicators: distconv's point-to-point messages and
        # reductions can never match messages of the user or of a
        # gradient-communication thread that uses the original communicator.
        self.mpi_world = mpi_comm.Dup()
        self.mpi_spatial = mpi_comm.Split(
            self.group * channels + self.channel_rank, self.spatial_rank)
        self.mpi_channel = mpi_comm.Split(
            self.group * spatial + self.spatial_rank, self.channel_rank)
        self.mpi_data = mpi_comm.Split(
            self.channel_rank, self.group * spatial + self.spatial_rank)

    def __repr__(self):
        if self.channels > 1:
            return 'SpatialGrid(shape=%r, channels=%d, groups=%d, rank=%d)' \
                % (self.shape, self.channels, self.n_groups, self.rank)
        return 'SpatialGrid(shape=%r, groups=%d, rank=%d)' % (
            self.shape, self.n_groups, self.rank)

    def world_rank(self, group: int, channel_rank: int,
                   spatial_rank: int) -> int:
        """Rank in the communicator of grid position (group, c, s)."""
        return ((group * self.channels + channel_rank) * self.spatial_size
                + spatial_rank)

    def channel_range(self, n: int, channel_rank: int = None
                      ) -> geometry.Interval:
        """Channels ``[lo, hi)`` of ``n`` held at a channel coordinate.

        Args:
            n (int): Global number of channels.
            channel_rank (int): The coordinate (default: this process's).
        """
        c = self.channel_rank if channel_rank is None else channel_rank
        return geometry.block_range(n, self.channels, c)

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
    # Layouts
    # ------------------------------------------------------------------
    def sample_range(self, n: int) -> geometry.Interval:
        """Samples ``[lo, hi)`` of a global batch of ``n`` in this group."""
        return geometry.block_range(n, self.n_groups, self.group)

    def block(self, spatial_shape: Sequence[int]) -> geometry.Box:
        """This process's box of a tensor with global ``spatial_shape``."""
        return geometry.block_box(spatial_shape, self.shape, self.coords)

    def _gather_info(self, x, layer, signature):
        arr = x.array if isinstance(x, chainer.Variable) else x
        info = (tuple(int(s) for s in arr.shape), str(arr.dtype), signature)
        return _mpi_json.allgather_json(self.mpi_world, info, tuples=True)

    def _coord_of(self, world_rank):
        """(group, channel_rank, spatial_rank) of a communicator rank."""
        P, C = self.spatial_size, self.channels
        return world_rank // (P * C), (world_rank // P) % C, world_rank % P

    def _check_common(self, infos, layer, channel_split=False):
        """Checks what every layout shares; returns the channel counts.

        Args:
            channel_split: True if the channels are split over the channel
                axis (coordinate ``c`` holds block ``c``), False if every
                process holds the same channels, None if only processes of
                the same channel coordinate must agree (element-wise and
                window operations, which treat channels independently).

        Returns:
            tuple of int: Channels held at each channel coordinate.
        """
        names = axis_names(self.ndim)
        for r, (shape, _, _) in enumerate(infos):
            if len(shape) != 2 + self.ndim:
                raise ValueError(
                    '%s: input must have shape (N, C, %s) to match the %d-D '
                    'grid %r, but rank %d passed shape %r. Use a grid with '
                    'one entry per spatial dimension (e.g. (2, 1, 1) for 3-D '
                    'data).' % (layer, ', '.join(names), self.ndim,
                                self.shape, r, shape))
        sig0 = infos[0][2]
        for r, (_, _, sig) in enumerate(infos):
            if sig != sig0:
                raise ValueError(
                    '%s: arguments differ between processes (rank 0: %r, '
                    'rank %d: %r). Every process must call the layer with '
                    'the same arguments and parameter shapes.'
                    % (layer, sig0, r, sig))
        dtype0 = infos[0][1]
        ch0 = infos[0][0][1]
        C = self.channels
        counts = tuple(infos[self.world_rank(0, c, 0)][0][1]
                       for c in range(C))
        for r, (shape, dtype, _) in enumerate(infos):
            c = self._coord_of(r)[1]
            want = ch0 if channel_split is False else counts[c]
            if dtype != dtype0 or shape[1] != want:
                if C == 1:
                    raise ValueError(
                        '%s: rank 0 passed %d channels of %s but rank %d '
                        'passed %d channels of %s. All processes must hold '
                        'the same channels and dtype.'
                        % (layer, ch0, dtype0, r, shape[1], dtype))
                raise ValueError(
                    '%s: rank %d (channel coordinate %d) passed %d channels '
                    'of %s, but %s holds %d channels of %s. %s'
                    % (layer, r, c, shape[1], dtype,
                       'rank 0' if channel_split is False
                       else 'channel coordinate %d of group 0' % c,
                       want, dtype0,
                       'This layer takes channels that are not split: every '
                       'process must hold all of them (use a layer with '
                       "split='filter' before a split='channel' one, or "
                       'grid.scatter(x, channel_split=False)).'
                       if channel_split is False else
                       'Processes of one channel coordinate must hold the '
                       'same channels and dtype.'))
        if channel_split:
            total = sum(counts)
            expect = tuple(geometry.block_sizes(total, C))
            if counts != expect:
                raise ValueError(
                    '%s: expects channels split over the %d channel '
                    'coordinates, but they hold %r channels, not the '
                    'balanced split %r of %d. Feed it the output of a '
                    "split='filter' layer or grid.scatter(x, "
                    'channel_split=True).' % (layer, C, list(counts),
                                              list(expect), total))
        return counts

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
        return self._cached_check(
            ('spatial', channel_split), x, layer, signature,
            lambda x, layer, sig: self._check_spatial_full(
                x, layer, sig, channel_split))

    def _cached_check(self, kind, x, layer, signature, full):
        """Runs ``full`` unless every rank has this geometry validated.

        The decision is collective: one allreduce (MAX) of ``[miss,
        fingerprint, -fingerprint]`` tells every rank whether all ranks hit
        their cache with the same fingerprint; otherwise all of them run the
        full check (which raises the same error everywhere on bad input).
        ``full`` returns ``(result, summary)``, where ``summary`` describes
        the global layout identically on every rank (it is fingerprinted).
        A local cache hit alone is not enough: the same local block can
        belong to different global layouts, and a rank that skipped the
        check while another ran it would hang in the allgather.
        """
        arr = x.array if isinstance(x, chainer.Variable) else x
        key = (kind, tuple(arr.shape), arr.dtype.str, signature)
        if self.check == 'cached':
            try:
                hit = self._layout_cache.get(key)
            except TypeError:  # an unhashable signature: never cached
                hit, key = None, None
            vote = numpy.array([0, 0, 0], dtype=numpy.int64)
            if hit is None:
                vote[0] = 1
            else:
                vote[1], vote[2] = hit[1], -hit[1]
            agreed = numpy.empty_like(vote)
            self.mpi_world.Allreduce([vote, MPI.INT64_T],
                                     [agreed, MPI.INT64_T], op=MPI.MAX)
            if agreed[0] == 0 and agreed[1] == -agreed[2]:
                self.stats['validate_cached'] += 1
                return hit[0]
        self.stats['validate_full'] += 1
        result, summary = full(x, layer, signature)
        if self.check == 'cached' and key is not None:
            if len(self._layout_cache) >= 4096:
                self._layout_cache.clear()  # bound memory for odd workloads
            digest = hashlib.blake2b(
                repr((kind, summary, arr.dtype.str, signature)).encode(),
                digest_size=8).digest()
            # 62 bits: the negated value fits in int64.
            fp = int.from_bytes(digest, 'little') >> 2
            self._layout_cache[key] = (result, fp)
        return result

    def _check_spatial_full(self, x, layer, signature, channel_split=None):
        infos = self._gather_info(x, layer, signature)
        counts = self._check_common(infos, layer, channel_split)
        names = axis_names(self.ndim)
        P = self.spatial_size
        group_samples = []
        spatial_shape = None
        for g in range(self.n_groups):
            n0 = infos[self.world_rank(g, 0, 0)][0][0]
            for c in range(self.channels):
                ranks = [self.world_rank(g, c, s) for s in range(P)]
                shapes = [infos[r][0] for r in ranks]
                for r, shp in zip(ranks, shapes):
                    if shp[0] != n0:
                        raise ValueError(
                            '%s: ranks %d and %d of sample group %d hold %d '
                            'and %d samples. The processes of a sample group '
                            'must hold the same samples; split a global '
                            'batch with grid.scatter or grid.sample_range.'
                            % (layer, self.world_rank(g, 0, 0), r, g, n0,
                               shp[0]))
                gshape = []
                for d in range(self.ndim):
                    by_coord = {}
                    for s, shp in enumerate(shapes):
                        k = geometry.grid_coords(self.shape, s)[d]
                        size = shp[2 + d]
                        if by_coord.setdefault(k, size) != size:
                            raise ValueError(
                                '%s: processes in the same grid slice along '
                                '%s hold blocks of different size (%d and '
                                '%d, rank %d of group %d). The input is not '
                                'in the block layout of grid %r; create it '
                                'with grid.scatter or distconv layers.' % (
                                    layer, names[d], by_coord[k], size,
                                    ranks[s], g, self.shape))
                    sizes = [by_coord[k] for k in range(self.shape[d])]
                    n = sum(sizes)
                    expect = geometry.block_sizes(n, self.shape[d])
                    if sizes != expect:
                        raise ValueError(
                            '%s: along %s the blocks of group %d have sizes '
                            '%r, but the balanced split of %d over %d '
                            'processes is %r (input spatial sizes disagree '
                            'with the grid layout). Create inputs with '
                            'grid.scatter or distconv layers.'
                            % (layer, names[d], g, sizes, n, self.shape[d],
                               expect))
                    gshape.append(n)
                gshape = tuple(gshape)
                if spatial_shape is None:
                    spatial_shape = gshape
                elif gshape != spatial_shape:
                    raise ValueError(
                        '%s: the global spatial size differs between sample '
                        'groups or channel coordinates (%r in group 0, %r in '
                        'group %d, channel coordinate %d). All samples of a '
                        'batch must have the same spatial size.'
                        % (layer, spatial_shape, gshape, g, c))
            group_samples.append(n0)
        if channel_split:
            channels = sum(counts)
        elif channel_split is False:
            channels = counts[0]
        else:
            channels = counts[self.channel_rank]
        summary = (spatial_shape, group_samples, counts, channel_split)
        layout = Layout(spatial_shape, group_samples, channels, counts)
        return layout, summary

    def check_samples(self, x: Input, layer: str, signature: tuple = ()
                      ) -> Tuple[Tuple[int, ...], List[int]]:
        """Checks a tensor in sample layout (whole samples per process).

        Returns:
            tuple: ``(spatial_shape, counts)`` where ``counts[s]`` is the
            number of samples of spatial rank ``s`` in this group.
        """
        return self._cached_check('samples', x, layer, signature,
                                  self._check_samples_full)

    def _check_samples_full(self, x, layer, signature):
        infos = self._gather_info(x, layer, signature)
        self._check_common(infos, layer, None)
        shape0 = infos[0][0][2:]
        for r, (shape, _, _) in enumerate(infos):
            if shape[2:] != shape0:
                raise ValueError(
                    '%s: whole samples must have the same spatial size on '
                    'every process, but rank 0 has %r and rank %d has %r.'
                    % (layer, shape0, r, shape[2:]))
        P = self.spatial_size
        counts = [infos[self.world_rank(self.group, self.channel_rank, s)
                        ][0][0] for s in range(P)]
        every = tuple(info[0][0] for info in infos)
        return (shape0, counts), (shape0, every)

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
        arr = x.array if isinstance(x, chainer.Variable) else x
        if arr.ndim != 2 + self.ndim:
            raise ValueError(
                'distconv.SpatialGrid.scatter: expected (N, C, %s) for grid '
                '%r, got shape %r.' % (', '.join(axis_names(self.ndim)),
                                       self.shape, arr.shape))
        lo, hi = self.sample_range(arr.shape[0])
        box = self.block(arr.shape[2:])
        ch = slice(*self.channel_range(arr.shape[1])) if channel_split \
            else slice(None)
        sl = (slice(lo, hi), ch) + tuple(slice(a, b) for a, b in box)
        xp = backend.get_array_module(arr)
        return xp.ascontiguousarray(arr[sl])

    def scatter_samples(self, t: Input) -> NdArray:
        """Returns this group's samples of a per-sample array (e.g. labels)."""
        arr = t.array if isinstance(t, chainer.Variable) else t
        lo, hi = self.sample_range(arr.shape[0])
        return arr[lo:hi]

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
        arr = y.array if isinstance(y, chainer.Variable) else y
        layout = self.check_spatial(arr, 'distconv.SpatialGrid.gather',
                                    channel_split=bool(channel_split))
        parts = _mpi_json.allgather_arrays(self.mpi_world, _comm.to_host(arr))
        P = self.spatial_size
        n_total = sum(layout.group_samples)
        out = numpy.zeros((n_total, layout.channels) + layout.spatial_shape,
                          dtype=parts[0].dtype)
        offset = 0
        for g in range(self.n_groups):
            n = layout.group_samples[g]
            for c in range(self.channels):
                if channel_split:
                    ch = slice(*self.channel_range(layout.channels, c))
                elif c and not reduce_copies:
                    continue
                else:
                    ch = slice(None)
                for s in range(P):
                    box = geometry.block_box(
                        layout.spatial_shape, self.shape,
                        geometry.grid_coords(self.shape, s))
                    sl = (slice(offset, offset + n), ch) + tuple(
                        slice(a, b) for a, b in box)
                    part = parts[self.world_rank(g, c, s)]
                    if reduce_copies and not channel_split:
                        out[sl] += part
                    else:
                        out[sl] = part
            offset += n
        return _comm.like(out, arr)

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
        total = int(_comm.allreduce_sum(
            self.mpi_world, numpy.array([n_local], dtype=numpy.int64))[0])
        if total == 0:
            raise ValueError('distconv.SpatialGrid.loss_scale: the global '
                             'batch is empty on every process.')
        return float(self.size) / total
