#!/usr/bin/env python
"""ResNet-50 with hybrid sample x spatial parallelism and per-stage layouts.

Quick run (4 processes, tiny width, a few seconds per iteration)::

    .venv/bin/mpiexec -n 4 .venv/bin/python \\
        examples/spatial/train_resnet50_spatial.py --iterations 3 \\
        --insize 128 --width 16
    # the real network at a resolution too large for a small batch:
    .venv/bin/mpiexec -n 4 .venv/bin/python \\
        examples/spatial/train_resnet50_spatial.py --insize 512 --grid 2,2

The per-stage strategy lives in one place (``--spatial-until``, turned
into the ``STRATEGY`` mapping by :func:`make_strategy`): the stem and the
early stages, whose activations are large, run in *spatial layout* (each
image split over the grid, exact halo exchange, batch norm over the global
batch); at the first ``'sample'`` stage the activations are redistributed
by point-to-point messages (:func:`distconv.to_sample_layout`) so that
every process holds whole samples, and later stages run as plain data
parallelism. The processes left over by the grid form sample groups
(e.g. ``--grid 2,1`` at 4 processes: 2 sample groups x 2 spatial).
Parameters are averaged by ChainerMN's multi-node optimizer (or this
package's overlapped one with ``--optimizer overlap``), and the loss uses
``grid.loss_scale`` so the update equals single-process training on the
global batch. With ``--tune`` the grid and the per-stage strategy are not
given but chosen: every grid that fits the process count, combined with
each ``--tune-stages`` cut, is timed for a few steps
(:func:`distconv.tune`) and the fastest is used; rank 0 prints the table.
Data are synthetic; each process creates only its own block
(no process allocates a full-size batch). Rank 0 prints progress and
throughput.
"""
import argparse
import time

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np
from chainer import initializers

from chainermn_overlap import distconv

STAGES = ('stem', 'res2', 'res3', 'res4', 'res5')


def make_strategy(spatial_until):
    """The per-stage layouts: spatial up to ``spatial_until``, then sample.

    Returns:
        dict: stage name -> ``'spatial'`` or ``'sample'``.
    """
    if spatial_until not in STAGES + ('none',):
        raise ValueError('--spatial-until must be one of %s or none, got %r'
                         % (', '.join(STAGES), spatial_until))
    cut = STAGES.index(spatial_until) + 1 if spatial_until != 'none' else 0
    return {s: 'spatial' if i < cut else 'sample'
            for i, s in enumerate(STAGES)}


class Layers(object):
    """Builds the layers of one stage for its layout."""

    def __init__(self, grid, layout):
        self.grid = grid
        self.layout = layout

    def conv(self, cin, cout, ksize, stride=1, pad=0):
        w = initializers.HeNormal()
        if self.layout == 'spatial':
            return distconv.Convolution2D(self.grid, cin, cout, ksize, stride,
                                          pad, nobias=True, initialW=w)
        return L.Convolution2D(cin, cout, ksize, stride, pad, nobias=True,
                               initialW=w)

    def bn(self, size):
        # Global statistics in both layouts (local BN costs accuracy).
        return distconv.BatchNormalization(self.grid, size,
                                           layout=self.layout)

    def max_pool(self, x, ksize, stride, pad):
        if self.layout == 'spatial':
            return distconv.max_pooling_2d(self.grid, x, ksize, stride, pad,
                                           cover_all=False)
        return F.max_pooling_2d(x, ksize, stride, pad, cover_all=False)


class Bottleneck(chainer.Chain):
    """1x1 -> 3x3 (stride) -> 1x1 with a projection where shapes change."""

    def __init__(self, layers, cin, mid, cout, stride=1):
        super(Bottleneck, self).__init__()
        with self.init_scope():
            self.conv1 = layers.conv(cin, mid, 1)
            self.bn1 = layers.bn(mid)
            self.conv2 = layers.conv(mid, mid, 3, stride, 1)
            self.bn2 = layers.bn(mid)
            self.conv3 = layers.conv(mid, cout, 1)
            self.bn3 = layers.bn(cout)
            self.projection = stride != 1 or cin != cout
            if self.projection:
                self.conv_proj = layers.conv(cin, cout, 1, stride)
                self.bn_proj = layers.bn(cout)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        s = self.bn_proj(self.conv_proj(x)) if self.projection else x
        return F.relu(h + s)


class ResNet50Spatial(chainer.Chain):
    """ResNet-50 (v1.5) whose stages follow ``strategy``.

    Args:
        grid (distconv.SpatialGrid): A 2-D grid.
        strategy (dict): Stage name -> layout (see :func:`make_strategy`).
        width (int): Channels of the stem (64 in ResNet-50).
        n_classes (int): Output classes.
    """

    def __init__(self, grid, strategy, width=64, n_classes=1000):
        super(ResNet50Spatial, self).__init__()
        self.grid = grid
        self.strategy = strategy
        w = width
        specs = [('res2', 3, w, w, 4 * w, 1),
                 ('res3', 4, 4 * w, 2 * w, 8 * w, 2),
                 ('res4', 6, 8 * w, 4 * w, 16 * w, 2),
                 ('res5', 3, 16 * w, 8 * w, 32 * w, 2)]
        with self.init_scope():
            stem = Layers(grid, strategy['stem'])
            self.conv1 = stem.conv(3, w, 7, 2, 3)
            self.bn1 = stem.bn(w)
            for name, n, cin, mid, cout, stride in specs:
                lay = Layers(grid, strategy[name])
                blocks = [Bottleneck(lay, cin, mid, cout, stride)]
                blocks += [Bottleneck(lay, cout, mid, cout)
                           for _ in range(n - 1)]
                setattr(self, name, chainer.ChainList(*blocks))
            self.fc = L.Linear(32 * w, n_classes)
        self.stem_layers = stem

    def _enter(self, h, current, wanted):
        """Redistributes at a stage boundary where the layout changes."""
        if current == wanted:
            return h
        if wanted == 'sample':
            return distconv.to_sample_layout(self.grid, h)
        return distconv.to_spatial_layout(self.grid, h)

    def forward(self, x):
        """``x``: this process's block of the group's images."""
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.stem_layers.max_pool(h, 3, 2, 1)
        current = self.strategy['stem']
        for name in STAGES[1:]:
            wanted = self.strategy[name]
            h = self._enter(h, current, wanted)
            current = wanted
            for block in getattr(self, name):
                h = block(h)
        if current == 'spatial':
            # (N_group, C), replicated on the group's processes.
            h = distconv.global_average_pooling(self.grid, h)
        else:
            h = F.average(h, axis=(2, 3))
        return self.fc(h), current


def parse_grid(text, size):
    if text:
        return tuple(int(v) for v in text.split(','))
    return (2, 2) if size % 4 == 0 else (2, 1) if size % 2 == 0 else (1, 1)


def tune_strategy(comm, args):
    """Times the grid x strategy candidates; returns the fastest.

    Returns:
        tuple: (grid shape, strategy mapping), the same on every process.
    """
    stages = [s.strip() for s in args.tune_stages.split(',') if s.strip()]
    for s in stages:
        make_strategy(s)  # a clear error for a bad stage name
    # With one process per sample group every stage is plain Chainer
    # whatever the strategy: one candidate suffices there.
    candidates = [{'grid': list(g), 'spatial_until': s}
                  for g in distconv.tuner.candidate_grids(comm.size, 2)
                  for s in (stages if g[0] * g[1] > 1 else stages[:1])]

    def build(grid, cand):
        np.random.seed(0)
        return ResNet50Spatial(grid, make_strategy(cand['spatial_until']),
                               args.width)

    result = distconv.tune(
        comm, build, (args.batchsize, 3, args.insize, args.insize),
        candidates, iterations=args.tune_iterations,
        grid_kwargs={'overlap': not args.no_overlap})
    if comm.rank == 0:
        print(distconv.tuner.format_table(result), flush=True)
    best = result['best']
    return tuple(best['grid']), make_strategy(best['spatial_until'])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--grid', default='', help='processes per (H, W), e.g. '
                   '2,2 (default 2,2 when the process count allows)')
    p.add_argument('--spatial-until', default='res3',
                   help='last stage in spatial layout: stem, res2, res3, '
                   'res4, res5 or none (default res3)')
    p.add_argument('--insize', type=int, default=128)
    p.add_argument('--batchsize', type=int, default=4,
                   help='global batch size')
    p.add_argument('--width', type=int, default=64,
                   help='stem channels (64 = ResNet-50; smaller is quicker)')
    p.add_argument('--iterations', type=int, default=5)
    p.add_argument('--optimizer', default='multi_node',
                   choices=['multi_node', 'overlap'])
    p.add_argument('--no-overlap', action='store_true',
                   help='blocking halo exchanges (for comparison)')
    p.add_argument('--tune', action='store_true',
                   help='time every grid x --tune-stages candidate for a '
                   'few steps and train with the fastest (ignores --grid '
                   'and --spatial-until)')
    p.add_argument('--tune-stages', default='stem,res2,res3',
                   help='--spatial-until values to try with --tune')
    p.add_argument('--tune-iterations', type=int, default=2)
    args = p.parse_args(argv)

    comm = chainermn.create_communicator('naive')
    if args.tune:
        grid_shape, strategy = tune_strategy(comm, args)
    else:
        grid_shape = parse_grid(args.grid, comm.size)
        strategy = make_strategy(args.spatial_until)
    grid = distconv.SpatialGrid(comm, grid_shape,
                                overlap=not args.no_overlap)
    np.random.seed(0)  # the same initial parameters on every process
    model = ResNet50Spatial(grid, strategy, args.width)
    base = chainer.optimizers.MomentumSGD(0.01)
    if args.optimizer == 'overlap':
        from chainermn_overlap import create_overlapped_optimizer
        optimizer = create_overlapped_optimizer(base, comm)
    else:
        optimizer = chainermn.create_multi_node_optimizer(base, comm)
    optimizer.setup(model)

    lo, hi = grid.sample_range(args.batchsize)
    box = grid.block((args.insize, args.insize))
    block = tuple(b - a for a, b in box)
    data_rng = np.random.RandomState(1000 + comm.rank)
    label_rng = np.random.RandomState(7)  # the same labels everywhere
    if comm.rank == 0:
        print('grid %r x %d sample group(s), %dx%d images, global batch %d, '
              'strategy %s, overlap %s' % (
                  grid.shape, grid.n_groups, args.insize, args.insize,
                  args.batchsize, strategy, grid.overlap))
    times = []
    for it in range(args.iterations):
        # Only this process's block: a real loader reads just that region.
        x = data_rng.randn(hi - lo, 3, *block).astype(np.float32)
        t_all = label_rng.randint(0, 1000, args.batchsize).astype(np.int32)
        t = t_all[lo:hi]
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        y, layout = model(x)
        if layout == 'sample':
            a, b = distconv.sample_share(grid, hi - lo)
            t = t[a:b]
        if len(t):
            per_sample = F.softmax_cross_entropy(y, t, reduce='no')
        else:  # backward is collective: keep a (zero) loss in the graph
            per_sample = F.sum(y, axis=1) * 0
        loss = F.sum(per_sample) * grid.loss_scale(len(t))
        model.cleargrads()
        loss.backward()
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
        print('median %.2f s/iteration, %.2f images/s (after the first)'
              % (np.median(times[1:]), args.batchsize / np.median(times[1:])))
    return times


if __name__ == '__main__':
    main()
