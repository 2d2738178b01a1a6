"""Parameters that live on part of the processes, and serial <-> distributed.

Reduction groups (for the optimizer):
    A ``split='filter'`` or ``split='channel'`` convolution holds only its
    block of W (and b for ``'filter'``), and ``BatchNormalization(...,
    channel_split=True)`` its block of gamma and beta. Such a parameter has
    a different value on each channel coordinate of the grid, so its
    gradient must be reduced only among the processes holding the same
    block: the processes with the same channel coordinate, over every
    sample group and spatial rank. Each such link declares it:

    * ``link.reduction_groups()`` -> ``{param_name: ReductionGroup}`` for
      its parameters that are not replicated over the whole communicator
      (empty when all are, e.g. ``split='spatial'`` or a grid with
      ``channels=1``);
    * the same object is set on each such parameter as the attribute
      ``param.reduction_group`` (``getattr(param, 'reduction_group',
      None)`` is None for a parameter replicated everywhere);
    * :func:`reduction_groups` walks a whole model: ``{path: group}``
      keyed like ``model.namedparams()``.

    :class:`ReductionGroup` fields:

    * ``key``: hashable, identical on every member and different for
      every other membership: ``('distconv.channel', comm_size, channels,
      spatial_size, channel_rank)``. Two grids with the same key have the
      same members (their communicators are congruent), so an optimizer
      may bucket their parameters together and reduce them over either
      communicator.
    * ``mpi_comm``: an mpi4py communicator of exactly the members, created
      collectively once, in the grid (``grid.mpi_data``); private to
      distconv's grid, so reductions on it never match other traffic.
      Members reduce in the order of ``model.namedparams()``, which is the
      same on every member.
    * ``size``: number of members; ``members``: their ranks in the
      communicator the grid was built on.
    * ``sum_scale``: multiply the *sum* of the members' gradients by this
      (``1 / comm.size``) to get the gradient the single-process model
      would have under the training convention (each process's loss is
      its mean loss over its sample group's samples, as for the replicated
      parameters the optimizer averages over the whole communicator).
      ``mean_scale = size * sum_scale`` (``1 / channels``) is the factor for
      an optimizer that averages over the group instead.

    Why ``1 / comm.size``: every distconv backward is the exact adjoint of
    its forward, so summed over *all* copies a parameter's gradient is the
    gradient of the sum of all processes' losses, which is ``comm.size``
    times the single-process mean loss (see :meth:`SpatialGrid.loss_scale`).
    A replicated parameter's copies are on all processes (the optimizer's
    average divides by ``comm.size``); a channel block's copies are exactly
    the members of its group, so their sum needs the same ``1 /
    comm.size``.

    ChainerMN's own ``create_multi_node_optimizer`` reduces every parameter
    over the whole communicator and cannot honour these groups: with uneven
    blocks the buffers differ in size, with even ones different blocks
    would be averaged. :func:`check_replicated` raises a clear error for a
    model it cannot train.

Serial <-> distributed:
    :func:`load_serial_params` copies a single-process model's parameters
    (and persistent values such as batch normalisation's running
    statistics) into a distributed model, cutting this process's blocks
    where a link holds one (``link.serial_blocks()``);
    :func:`store_serial_params` gathers them back into a single-process
    model on every process. Links are matched by their path
    (``namedlinks()``), so the serial model must have the same structure
    (e.g. a ``chainer.ChainList`` where the distributed model has a
    :class:`~chainermn_overlap.distconv.tiling.Tiled`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import chainer
import numpy

from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import blocking
from chainermn_overlap.distconv import _comm

if TYPE_CHECKING:
    from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['ReductionGroup', 'check_replicated', 'load_serial_params',
           'reduction_groups', 'store_serial_params']


class ReductionGroup(object):
    """Processes among which a parameter's gradient is reduced (see module).

    Attributes:
        key (tuple): Hashable, identical on the members.
        mpi_comm: mpi4py communicator of the members.
        size (int): Number of members.
        members (tuple of int): Their ranks in the grid's communicator.
        sum_scale (float): Factor for the sum of the members' gradients.
        mean_scale (float): Factor for their mean.
    """

    def __init__(self, key, mpi_comm, members, comm_size):
        self.key = key
        self.mpi_comm = mpi_comm
        self.members = tuple(members)
        self.size = len(self.members)
        self.sum_scale = 1.0 / comm_size
        self.mean_scale = self.size / float(comm_size)

    def __repr__(self):
        return 'ReductionGroup(key=%r, size=%d, sum_scale=%g)' % (
            self.key, self.size, self.sum_scale)

    def __eq__(self, other):
        return isinstance(other, ReductionGroup) and other.key == self.key

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self.key)

    # A handle to a communicator: parameters are deep-copied (Link.copy,
    # evaluators) and must keep pointing at the same group.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def channel_group(grid: SpatialGrid) -> ReductionGroup:
    """The reduction group of this process's channel coordinate."""
    rg = getattr(grid, '_reduction_group', None)
    if rg is None:
        c = grid.channel_rank
        members = [grid.world_rank(g, c, s) for g in range(grid.n_groups)
                   for s in range(grid.spatial_size)]
        key = ('distconv.channel', grid.size, grid.channels,
               grid.spatial_size, c)
        rg = ReductionGroup(key, grid.mpi_data, members, grid.size)
        grid._reduction_group = rg
    return rg


def mark_split_params(link: chainer.Link, grid: SpatialGrid) -> None:
    """Sets ``param.reduction_group`` on a link's channel-block parameters."""
    for name, rg in link_reduction_groups(link).items():
        getattr(link, name).reduction_group = rg


def link_reduction_groups(link: chainer.Link) -> Dict[str, ReductionGroup]:
    """``{name: ReductionGroup}`` of a distconv link's split parameters."""
    grid = getattr(link, 'grid', None)
    if grid is None or grid.channels == 1:
        return {}
    blocks = link.serial_blocks()
    return {name: channel_group(grid) for name in sorted(blocks)
            if name in link._params}


def reduction_groups(model: chainer.Link) -> Dict[str, ReductionGroup]:
    """Every parameter of ``model`` that is not replicated everywhere.

    Returns:
        dict: ``{path: ReductionGroup}`` with the paths of
        ``model.namedparams()`` (parameters missing from it are replicated
        over the whole communicator).
    """
    out = {}
    for path, link in model.namedlinks():
        fn = getattr(link, 'reduction_groups', None)
        if fn is None:
            continue
        prefix = path.rstrip('/') + '/'
        for name, rg in fn().items():
            out[prefix + name] = rg
    return out


def check_replicated(model: chainer.Link, what: str = 'this optimizer'
                     ) -> None:
    """Raises if ``model`` has parameters that live on part of the processes.

    For optimizers that reduce every gradient over the whole communicator
    (ChainerMN's ``create_multi_node_optimizer``).

    Raises:
        ValueError: Naming the parameters (the same on every process).
    """
    groups = reduction_groups(model)
    if groups:
        raise ValueError(
            'distconv: %s reduces every gradient over the whole '
            'communicator, but %d parameters live on part of the processes '
            '(channel blocks of split=\'filter\'/\'channel\' convolutions '
            'or channel-split batch normalisation: %s). Their gradients '
            'must be reduced within their reduction groups '
            '(distconv.reduction_groups(model)). Train with '
            'chainermn_overlap.create_overlapped_optimizer where it supports '
            'reduction groups, or use a grid with channels=1.'
            % (what, len(groups), ', '.join(sorted(groups)[:6])))


def _pairs(dist_model, serial_model):
    serial = dict(serial_model.namedlinks())
    for path, link in dist_model.namedlinks():
        if path not in serial:
            raise ValueError(
                'distconv: the distributed model has a link %r that the '
                'serial model lacks. Build the serial model with the same '
                'structure (names and nesting; a chainer.ChainList where '
                'the distributed one has a distconv.Tiled).' % path)
        yield path, link, serial[path]


def _own_values(link):
    """Names of a link's own parameters and persistent values, sorted."""
    return sorted(link._params), sorted(link._persistent)


def _check_same(path, name, dist_shape, serial_shape):
    if tuple(dist_shape) != tuple(serial_shape):
        raise ValueError(
            'distconv: %s/%s has shape %r in the distributed model but the '
            'matching value of the serial model has shape %r. The models '
            'must have the same layers and sizes.'
            % (path, name, tuple(dist_shape), tuple(serial_shape)))


def load_serial_params(grid: SpatialGrid, dist_model: chainer.Link,
                       serial_model: chainer.Link) -> None:
    """Copies a single-process model's values into a distributed model.

    Every parameter and persistent value of ``dist_model`` (distconv links
    and plain links alike) gets the serial model's value, cut to this
    process's block where the link holds one. Local (no communication).

    Args:
        grid (SpatialGrid): The grid (links with a grid of their own use
            theirs).
        dist_model (chainer.Link): The distributed model.
        serial_model (chainer.Link): A single-process model of the same
            structure, initialised (run it once if it is lazy).
    """
    for path, dl, sl in _pairs(dist_model, serial_model):
        blocks = dl.serial_blocks() if hasattr(dl, 'serial_blocks') else {}
        pnames, snames = _own_values(dl)
        for name in pnames:
            sp = getattr(sl, name)
            dp = getattr(dl, name)
            if sp.array is None:
                raise ValueError(
                    'distconv.load_serial_params: %s/%s of the serial model '
                    'is not initialised; run the serial model once first.'
                    % (path, name))
            arr = _cut(_comm.to_host(sp.array), blocks.get(name))
            if dp.array is None:
                dp.initialize(arr.shape)
            _check_same(path, name, dp.array.shape, arr.shape)
            dp.array[...] = _comm.like(arr.astype(dp.array.dtype), dp.array)
        for name in snames:
            sv = getattr(sl, name)
            dv = getattr(dl, name)
            if isinstance(dv, numpy.ndarray) or hasattr(dv, 'device'):
                arr = _cut(_comm.to_host(sv), blocks.get(name))
                _check_same(path, name, dv.shape, arr.shape)
                dv[...] = _comm.like(arr.astype(dv.dtype), dv)
            else:
                setattr(dl, name, sv)


def _cut(arr, block):
    if block is None:
        return arr
    axis, lo, hi = block
    return arr[(slice(None),) * axis + (slice(lo, hi),)]


def _gather_block(grid, arr, block):
    """The whole value from the channel blocks (collective over the axis)."""
    axis = block[0]
    parts = _mpi_json.allgather_arrays(grid.mpi_channel, _comm.to_host(arr))
    return numpy.concatenate(parts, axis=axis)


def store_serial_params(grid: SpatialGrid, dist_model: chainer.Link,
                        serial_model: chainer.Link) -> None:
    """Gathers a distributed model's values into a single-process model.

    The inverse of :func:`load_serial_params`: on every process the serial
    model receives the whole parameters and persistent values (blocks are
    gathered over the grid's channel axis). Collective: every process must
    call it with models of the same structure.

    Args:
        grid (SpatialGrid): The grid (links with a grid of their own use
            theirs).
        dist_model (chainer.Link): The distributed model.
        serial_model (chainer.Link): A single-process model of the same
            structure; lazy parameters are initialised.
    """
    # The checks are local (a model that differs on one process only): a
    # failure is raised on every process, between the gathers.
    what = 'distconv.store_serial_params'
    with blocking.agreement(grid.mpi_world, 'the pairing of ' + what):
        pairs = list(_pairs(dist_model, serial_model))
    values = []   # (serial link, name, whole value, is a parameter)
    for path, dl, sl in pairs:
        blocks = dl.serial_blocks() if hasattr(dl, 'serial_blocks') else {}
        g = getattr(dl, 'grid', grid)
        pnames, snames = _own_values(dl)
        for name in pnames:
            dp = getattr(dl, name)
            if dp.array is None:
                continue
            arr = _comm.to_host(dp.array)
            if name in blocks and g.channels > 1:
                arr = _gather_block(g, arr, blocks[name])
            values.append((path, sl, name, arr, True))
        for name in snames:
            dv = getattr(dl, name)
            if isinstance(dv, numpy.ndarray) or hasattr(dv, 'device'):
                arr = _comm.to_host(dv)
                if name in blocks and g.channels > 1:
                    arr = _gather_block(g, arr, blocks[name])
                values.append((path, sl, name, arr, False))
            else:
                setattr(sl, name, dv)
    with blocking.agreement(grid.mpi_world, 'the checks of ' + what):
        for path, sl, name, arr, is_param in values:
            target = getattr(sl, name)
            if is_param:
                if target.array is None:
                    target.initialize(arr.shape)
                target = target.array
            _check_same(path, name, target.shape, arr.shape)
            target[...] = _comm.like(arr.astype(target.dtype), target)
