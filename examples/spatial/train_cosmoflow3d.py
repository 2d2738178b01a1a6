#!/usr/bin/env python
"""A CosmoFlow-style 3-D CNN regression on volumes split over D, H and W.

Quick run (4 processes)::

    .venv/bin/mpiexec -n 4 .venv/bin/python \\
        examples/spatial/train_cosmoflow3d.py --iterations 3 --insize 32
    # closer to CosmoFlow (128^3 volumes, 4 channels; slow on CPUs):
    .venv/bin/mpiexec -n 4 .venv/bin/python \\
        examples/spatial/train_cosmoflow3d.py --insize 128 --grid 1,2,2

Five blocks of 3-D convolution (3^3, pad 1) + global batch norm + leaky
ReLU + 2^3 max pooling, all spatially partitioned over a (D, H, W) grid of
processes (corners and edges of the halo included), then global average
pooling and two fully connected layers regressing 4 parameters (mean
squared error). Processes left over by the grid form sample groups. Each
process synthesises only its own block of every volume. Rank 0 prints
progress and throughput.
"""
import argparse
import time

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np

from chainermn_overlap import distconv


class CosmoFlow3D(chainer.Chain):
    """conv3d-BN-leaky ReLU-pool x n_blocks, global pooling, 2 FC layers."""

    def __init__(self, grid, in_channels=4, width=16, n_blocks=5,
                 n_out=4):
        super(CosmoFlow3D, self).__init__()
        self.grid = grid
        self.n_blocks = n_blocks
        with self.init_scope():
            cin = in_channels
            for i in range(n_blocks):
                cout = width * 2 ** min(i, 3)
                setattr(self, 'conv%d' % i,
                        distconv.ConvolutionND(grid, 3, cin, cout, 3, pad=1))
                setattr(self, 'bn%d' % i,
                        distconv.BatchNormalization(grid, cout))
                cin = cout
            self.fc1 = L.Linear(cin, 64)
            self.fc2 = L.Linear(64, n_out)

    def forward(self, x):
        g = self.grid
        h = x
        for i in range(self.n_blocks):
            h = getattr(self, 'bn%d' % i)(getattr(self, 'conv%d' % i)(h))
            h = F.leaky_relu(h, 0.3)
            h = distconv.max_pooling_nd(g, h, 2, 2, cover_all=False)
        h = distconv.global_average_pooling(g, h)  # (N_group, C) replicated
        return self.fc2(F.leaky_relu(self.fc1(h), 0.3))


def parse_grid(text, size):
    if text:
        return tuple(int(v) for v in text.split(','))
    return {1: (1, 1, 1), 2: (2, 1, 1), 4: (1, 2, 2), 8: (2, 2, 2)}.get(
        size, (size, 1, 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--grid', default='', help='processes per (D, H, W)')
    p.add_argument('--insize', type=int, default=32,
                   help='volume edge (128 in CosmoFlow)')
    p.add_argument('--channels', type=int, default=4)
    p.add_argument('--width', type=int, default=8)
    p.add_argument('--batchsize', type=int, default=2,
                   help='global batch size')
    p.add_argument('--iterations', type=int, default=5)
    args = p.parse_args(argv)
    n_blocks = max(1, min(5, int(np.log2(args.insize)) - 1))

    comm = chainermn.create_communicator('naive')
    grid = distconv.SpatialGrid(comm, parse_grid(args.grid, comm.size))
    np.random.seed(0)  # the same initial parameters on every process
    model = CosmoFlow3D(grid, args.channels, args.width, n_blocks)
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.Adam(1e-3), comm)
    optimizer.setup(model)
    lo, hi = grid.sample_range(args.batchsize)
    block = tuple(b - a for a, b in grid.block((args.insize,) * 3))
    data_rng = np.random.RandomState(100 + comm.rank)
    target_rng = np.random.RandomState(5)  # the same targets everywhere
    if comm.rank == 0:
        print('grid %r x %d sample group(s), %d^3 volumes x %d channels, '
              'global batch %d, %d blocks'
              % (grid.shape, grid.n_groups, args.insize, args.channels,
                 args.batchsize, n_blocks))
    times = []
    for it in range(args.iterations):
        x = data_rng.randn(hi - lo, args.channels, *block).astype(np.float32)
        t = target_rng.rand(args.batchsize, 4).astype(np.float32)[lo:hi]
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        y = model(x)
        # The group's processes hold the same (replicated) predictions.
        per_sample = F.sum((y - t) ** 2, axis=1) / 4
        loss = F.sum(per_sample) * grid.loss_scale(len(t))
        model.cleargrads()
        loss.backward()
        optimizer.update()
        comm.mpi_comm.Barrier()
        times.append(time.perf_counter() - t0)
        mean_loss = comm.allreduce_obj(float(loss.array)) / comm.size
        if comm.rank == 0:
            print('iteration %3d  loss %.4f  %.2f s  %.2f volumes/s'
                  % (it + 1, mean_loss, times[-1],
                     args.batchsize / times[-1]), flush=True)
    return times


if __name__ == '__main__':
    main()
