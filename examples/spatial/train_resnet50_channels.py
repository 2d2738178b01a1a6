#!/usr/bin/env python
"""ResNet-50: early stages spatially split, res4/res5 filter/channel parallel.

Quick run (2 or 4 processes, tiny width)::

    .venv/bin/mpiexec -n 2 .venv/bin/python \\
        examples/spatial/train_resnet50_channels.py --iterations 3 \\
        --insize 64 --width 8 --grid 2,1
    # the real width at 224x224, 2x2 spatial then 4-way channel split:
    .venv/bin/mpiexec -n 4 .venv/bin/python \\
        examples/spatial/train_resnet50_channels.py --insize 224 --grid 2,2

Late ResNet stages have small maps (14x14 and 7x7 at 224x224) and many
channels (1024, 2048): split spatially they would be mostly halo. Here the
stem, res2 and res3 run on a spatial grid (``--grid``), and from
``--channel-from`` on (res4 by default) the same processes form the
channel axis of a second grid, ``SpatialGrid(comm, (1, 1),
channels=prod(grid))``, whose sample groups are the same processes. At
the boundary :func:`distconv.to_replicated` gives every process of a group
the group's whole samples and :func:`distconv.channel_block` keeps its
block of the channels (a slice). Each bottleneck takes and returns that
channel block and runs

    conv1 1x1 split='channel', split_output=True
                              -> partial sums over its input channels,
                                 reduce-scattered: its block of the mid
    BN (channel_split=True), ReLU
    conv2 3x3 split='channel', split_output=True -> likewise
    BN (channel_split=True), ReLU
    conv3 1x1 split='filter', split_input=True
                              -> gathers the mid blocks inside the layer:
                                 its block of the output channels
    BN (channel_split=True) + shortcut (the input block, or a projection
    like conv1), ReLU         -> its block of the output channels

and after the last channel stage one gather_channels gives global
average pooling and the classifier whole channels. Each process holds 1/P
of the weights of res4/res5 (most of ResNet-50's parameters) and computes
1/P of their convolutions and batch normalisations, with two
reduce-scatters and one allgather of the *mid* channels per bottleneck
(backward: their adjoints) and no halo at all. Each of the three runs
inside its convolution, overlapped with the products of the other channel
blocks (``grid.channel_overlap``). The wide (4x mid) tensors
between blocks never cross the channel axis: the plain filter -> channel
-> filter pairing (``Bottleneck(..., channel_io='whole')``) takes whole
channels, so it gathers every block's output and reduces its gradient:
twice the bytes per process (about 600 instead of 300 KB each way for a
14x14 res4 block at batch 1 on 2 processes) and one whole-width copy of
the 3x3's output normalised on every process (compared in
``benchmarks/channel_tiling_bench.py``).

Gradients of the channel blocks must be reduced within their reduction
groups (``distconv.reduction_groups(model)``). ``--optimizer overlap``
(the default where it declares ``SUPPORTS_REDUCTION_GROUPS``) uses
``create_overlapped_optimizer``; ``--optimizer by-hand`` reduces each
gradient as the descriptors say and steps a plain optimizer on every
process. ChainerMN's own multi-node optimizer cannot
train this model (``distconv.check_replicated`` explains why). The loss is
each process's mean over its sample group's samples (the training
convention; ``grid.loss_scale`` keeps it exact for uneven or empty
groups). With ``--tune`` the spatial grid and the cut are chosen by
:func:`distconv.tune` (rank 0 prints the table). Data are synthetic; rank
0 prints progress.
"""
import argparse
import time

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np
from chainer import initializers
from mpi4py import MPI

from chainermn_overlap import distconv

STAGES = ('stem', 'res2', 'res3', 'res4', 'res5')


class SpatialLayers(object):
    """Layers of a spatially split stage."""

    def __init__(self, grid):
        self.grid = grid

    def conv(self, cin, cout, ksize, stride=1, pad=0, split=None,
             split_output=False, split_input=False):
        return distconv.Convolution2D(self.grid, cin, cout, ksize, stride,
                                      pad, nobias=True,
                                      initialW=initializers.HeNormal())

    def bn(self, size, channel_split=False):
        return distconv.BatchNormalization(self.grid, size)


class ChannelLayers(SpatialLayers):
    """Layers of a filter/channel-parallel stage (a grid with channels)."""

    def conv(self, cin, cout, ksize, stride=1, pad=0, split='filter',
             split_output=False, split_input=False):
        return distconv.Convolution2D(self.grid, cin, cout, ksize, stride,
                                      pad, nobias=True,
                                      initialW=initializers.HeNormal(),
                                      split=split, split_output=split_output,
                                      split_input=split_input)

    def bn(self, size, channel_split=False):
        return distconv.BatchNormalization(self.grid, size,
                                           channel_split=channel_split)


class Bottleneck(chainer.Chain):
    """1x1 -> 3x3 (stride) -> 1x1, spatial or filter/channel parallel.

    With ``channel`` the block takes and returns this process's channel
    block (``channel_io='split'``, the default, see the module docstring),
    or whole channels on every process (``channel_io='whole'``: conv1
    ``'filter'``, conv2 ``'channel'`` allreduced, bn2 on the whole mid
    channels on every process, conv3 ``'filter'``, then the output
    gathered: the plain filter -> channel -> filter pairing, which moves
    the whole output across the channel axis twice per step; kept for the
    benchmark's comparison).
    """

    def __init__(self, layers, cin, mid, cout, stride=1, channel=False,
                 channel_io='split'):
        super(Bottleneck, self).__init__()
        if channel_io not in ('split', 'whole'):
            raise ValueError("channel_io must be 'split' or 'whole', got %r"
                             % (channel_io,))
        self.grid = layers.grid
        self.channel = channel
        self.split_io = bool(channel and channel_io == 'split')
        # split_io: conv1 (and the projection) reduce-scatter their partial
        # sums over the input's channel blocks; otherwise they are filter
        # parallel on the whole input.
        first = dict(split='channel', split_output=True) if self.split_io \
            else dict(split='filter')
        with self.init_scope():
            self.conv1 = layers.conv(cin, mid, 1, **first)
            self.bn1 = layers.bn(mid, channel_split=channel)
            self.conv2 = layers.conv(mid, mid, 3, stride, 1, split='channel',
                                     split_output=self.split_io)
            self.bn2 = layers.bn(mid, channel_split=self.split_io)
            # split_io: conv3 gathers conv2's blocks itself, overlapping the
            # messages with the products of the blocks already here.
            self.conv3 = layers.conv(mid, cout, 1, split='filter',
                                     split_input=self.split_io)
            self.bn3 = layers.bn(cout, channel_split=channel)
            self.projection = stride != 1 or cin != cout
            if self.projection:
                self.conv_proj = layers.conv(cin, cout, 1, stride, **first)
                self.bn_proj = layers.bn(cout, channel_split=channel)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        if self.projection:
            s = self.bn_proj(self.conv_proj(x))
        elif self.channel and not self.split_io:
            s = distconv.channel_block(self.grid, x)
        else:
            s = x
        h = F.relu(h + s)
        if self.channel and not self.split_io:
            h = distconv.gather_channels(self.grid, h)
        return h


class ResNet50Channels(chainer.Chain):
    """ResNet-50 (v1.5): spatial stages, then filter/channel stages.

    Args:
        grid (distconv.SpatialGrid): 2-D grid of the spatial stages.
        channel_grid (distconv.SpatialGrid): ``(1, 1)`` grid with
            ``channels=grid.spatial_size`` over the same communicator.
        channel_from (str): First filter/channel-parallel stage.
        width (int): Channels of the stem (64 in ResNet-50).
        n_classes (int): Output classes.
    """

    def __init__(self, grid, channel_grid, channel_from='res4', width=64,
                 n_classes=1000):
        super(ResNet50Channels, self).__init__()
        self.grid = grid
        self.channel_grid = channel_grid
        self.cut = STAGES.index(channel_from)
        w = width
        specs = [('res2', 3, w, w, 4 * w, 1),
                 ('res3', 4, 4 * w, 2 * w, 8 * w, 2),
                 ('res4', 6, 8 * w, 4 * w, 16 * w, 2),
                 ('res5', 3, 16 * w, 8 * w, 32 * w, 2)]
        with self.init_scope():
            self.conv1 = distconv.Convolution2D(
                grid, 3, w, 7, 2, 3, nobias=True,
                initialW=initializers.HeNormal())
            self.bn1 = distconv.BatchNormalization(grid, w)
            for i, (name, n, cin, mid, cout, stride) in enumerate(specs, 1):
                channel = i >= self.cut
                lay = ChannelLayers(channel_grid) if channel \
                    else SpatialLayers(grid)
                blocks = [Bottleneck(lay, cin, mid, cout, stride, channel)]
                blocks += [Bottleneck(lay, cout, mid, cout, 1, channel)
                           for _ in range(n - 1)]
                setattr(self, name, chainer.ChainList(*blocks))
            self.fc = L.Linear(32 * w, n_classes)

    def forward(self, x):
        """``x``: this process's spatial block of the group's images."""
        h = F.relu(self.bn1(self.conv1(x)))
        h = distconv.max_pooling_2d(self.grid, h, 3, 2, 1, cover_all=False)
        grid = self.grid
        for i, name in enumerate(STAGES[1:], 1):
            if i == self.cut:
                # The group's whole samples on every process: the channel
                # axis of channel_grid is this group's spatial grid.
                h = distconv.to_replicated(self.grid, h)
                grid = self.channel_grid
                # Each process then holds its channel block: the blocks
                # take and return channel blocks.
                h = distconv.channel_block(grid, h)
            for block in getattr(self, name):
                h = block(h)
        # Whole channels for the classifier (once, after the last stage).
        h = distconv.gather_channels(grid, h)
        h = distconv.global_average_pooling(grid, h)  # (N_group, C)
        return self.fc(h)


def reduce_by_groups(model, comm):
    """Reduces every gradient as distconv's descriptors say.

    Replicated parameters: average over the communicator; channel blocks:
    sum over their reduction group times its ``sum_scale``. Buffers are
    reduced one parameter at a time in ``namedparams`` order, the same on
    every process (a real optimizer buckets them).
    """
    groups = distconv.reduction_groups(model)
    for path, p in sorted(model.namedparams()):
        if p.grad is None:
            p.grad = np.zeros_like(p.array)
        g = np.ascontiguousarray(p.grad)
        out = np.empty_like(g)
        rg = groups.get(path)
        if rg is None:
            comm.mpi_comm.Allreduce(g, out, op=MPI.SUM)
            out *= 1.0 / comm.size
        else:
            rg.mpi_comm.Allreduce(g, out, op=MPI.SUM)
            out *= rg.sum_scale
        p.grad[...] = out


def parse_grid(text, size):
    if text:
        return tuple(int(v) for v in text.split(','))
    return (2, 2) if size % 4 == 0 else (2, 1) if size % 2 == 0 else (1, 1)


def tune(comm, args):
    """Times spatial grid x ``--channel-from`` cut candidates; the fastest.

    Each candidate's late stages use a channel axis of ``prod(grid)``
    processes; a (1, 1) grid means plain data parallelism throughout.

    Returns:
        tuple: (grid shape, channel_from), the same on every process.
    """
    cuts = [s.strip() for s in args.tune_cuts.split(',') if s.strip()]
    candidates = [{'grid': list(g), 'channel_from': c}
                  for g in distconv.tuner.candidate_grids(comm.size, 2)
                  for c in (cuts if g[0] * g[1] > 1 else cuts[:1])]

    def build(grid, cand):
        cgrid = distconv.SpatialGrid(comm, (1, 1),
                                     channels=grid.spatial_size)
        np.random.seed(0)
        return ResNet50Channels(grid, cgrid, cand['channel_from'],
                                args.width)

    result = distconv.tune(
        comm, build, (args.batchsize, 3, args.insize, args.insize),
        candidates, iterations=args.tune_iterations)
    if comm.rank == 0:
        print(distconv.tuner.format_table(result), flush=True)
    return tuple(result['best']['grid']), result['best']['channel_from']


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--grid', default='', help='processes per (H, W) of the '
                   'spatial stages, e.g. 2,1; the channel axis of the late '
                   'stages has prod(grid) processes')
    p.add_argument('--channel-from', default='res4',
                   choices=['res2', 'res3', 'res4', 'res5'],
                   help='first filter/channel-parallel stage')
    p.add_argument('--insize', type=int, default=128)
    p.add_argument('--batchsize', type=int, default=4,
                   help='global batch size')
    p.add_argument('--width', type=int, default=64,
                   help='stem channels (64 = ResNet-50; smaller is quicker)')
    p.add_argument('--iterations', type=int, default=5)
    p.add_argument('--optimizer', default='auto',
                   choices=['auto', 'overlap', 'by-hand'],
                   help='auto: overlap if it supports reduction groups, '
                   'else by-hand')
    p.add_argument('--tune', action='store_true',
                   help='time every spatial grid x --tune-cuts candidate '
                   'and train with the fastest (ignores --grid and '
                   '--channel-from)')
    p.add_argument('--tune-cuts', default='res4,res5',
                   help='--channel-from values to try with --tune')
    p.add_argument('--tune-iterations', type=int, default=2)
    args = p.parse_args(argv)

    comm = chainermn.create_communicator('naive')
    if args.tune:
        shape, args.channel_from = tune(comm, args)
    else:
        shape = parse_grid(args.grid, comm.size)
    grid = distconv.SpatialGrid(comm, shape)
    channel_grid = distconv.SpatialGrid(comm, (1, 1),
                                        channels=grid.spatial_size)
    np.random.seed(0)  # the same initial parameters on every process
    model = ResNet50Channels(grid, channel_grid, args.channel_from,
                             args.width)
    base = chainer.optimizers.MomentumSGD(0.01)
    from chainermn_overlap.optimizers import overlapped
    supports = getattr(overlapped, 'SUPPORTS_REDUCTION_GROUPS', False)
    choice = args.optimizer
    if choice == 'auto':
        choice = 'overlap' if supports else 'by-hand'
    if choice == 'overlap':
        if not supports:
            raise RuntimeError(
                'create_overlapped_optimizer does not declare '
                'SUPPORTS_REDUCTION_GROUPS yet, so it would average the '
                'channel blocks of res4/res5 over every process. Use '
                '--optimizer by-hand until it does.')
        from chainermn_overlap import create_overlapped_optimizer
        optimizer = create_overlapped_optimizer(base, comm)
    else:
        optimizer = base
    optimizer.setup(model)

    lo, hi = grid.sample_range(args.batchsize)
    block = tuple(b - a for a, b in grid.block((args.insize, args.insize)))
    data_rng = np.random.RandomState(1000 + comm.rank)
    label_rng = np.random.RandomState(7)  # the same labels everywhere
    n_split = sum(int(np.prod(p.shape)) for p in model.params()
                  if getattr(p, 'reduction_group', None) is not None)
    n_all = sum(int(np.prod(p.shape)) for p in model.params())
    if comm.rank == 0:
        print('spatial grid %r x %d sample group(s) until %s, then %d-way '
              'filter/channel; %dx%d images, global batch %d; this process '
              'holds %.1f M of the parameters (%.1f M split), optimizer %s'
              % (grid.shape, grid.n_groups, args.channel_from,
                 channel_grid.channels, args.insize, args.insize,
                 args.batchsize, n_all / 1e6, n_split / 1e6, choice),
              flush=True)
    times = []
    for it in range(args.iterations):
        x = data_rng.randn(hi - lo, 3, *block).astype(np.float32)
        t = label_rng.randint(0, 1000, args.batchsize).astype(np.int32)[
            lo:hi]
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        y = model(x)
        if len(t):
            per_sample = F.softmax_cross_entropy(y, t, reduce='no')
        else:  # backward is collective: keep a (zero) loss in the graph
            per_sample = F.sum(y, axis=1) * 0
        # The group's mean loss for equal sample groups; exact for any.
        loss = F.sum(per_sample) * grid.loss_scale(len(t))
        model.cleargrads()
        loss.backward()
        if choice == 'by-hand':
            reduce_by_groups(model, comm)
        optimizer.update()
        comm.mpi_comm.Barrier()
        times.append(time.perf_counter() - t0)
        mean_loss = comm.allreduce_obj(float(loss.array)) / comm.size
        if comm.rank == 0:
            print('iteration %3d  loss %.3f  %.2f s  %.2f images/s'
                  % (it + 1, mean_loss, times[-1],
                     args.batchsize / times[-1]), flush=True)
    if hasattr(optimizer, 'synchronize'):
        optimizer.synchronize()
    if comm.rank == 0 and len(times) > 1:
        print('median %.2f s/iteration (after the first)'
              % np.median(times[1:]))
    return times


if __name__ == '__main__':
    main()
