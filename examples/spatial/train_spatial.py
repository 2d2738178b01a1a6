#!/usr/bin/env python
"""Train a small CNN with spatial parallelism on synthetic large images.

Run it with (from the repository root)::

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/spatial/train_spatial.py
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/spatial/train_spatial.py \
        --grid 4,1 --insize 256 --iterations 5

Each image is split over a grid of processes (2x2 by default at 4
processes; the processes left over form sample groups, as in data
parallelism). Convolutions, batch normalisation and pooling exchange halos
and statistics so the result equals single-process training on the global
batch; global average pooling gives every process of a group the same
features, the classifier runs replicated, and ChainerMN's multi-node
optimizer averages gradients over all processes.

The task: an image of noise contains one square, brighter (label 1) or
darker (label 0) than the background, anywhere in the image (often across
block boundaries).
"""
import argparse
import time

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np

from chainermn_overlap import distconv


class SpatialCNN(chainer.Chain):
    """conv-BN-ReLU-pool, strided conv-BN-ReLU, global pooling, linear."""

    def __init__(self, grid, n_class=2):
        super(SpatialCNN, self).__init__()
        self.grid = grid
        with self.init_scope():
            self.conv1 = distconv.Convolution2D(grid, 1, 8, 5, pad=2)
            self.bn1 = distconv.BatchNormalization(grid, 8)
            self.conv2 = distconv.Convolution2D(grid, 8, 16, 3, stride=2,
                                                pad=1)
            self.bn2 = distconv.BatchNormalization(grid, 16)
            self.fc = L.Linear(16, n_class)

    def forward(self, x):
        g = self.grid
        h = F.relu(self.bn1(self.conv1(x)))  # element-wise: unchanged
        h = distconv.max_pooling_2d(g, h, 4)
        h = F.relu(self.bn2(self.conv2(h)))
        # (N, 16), identical on the processes of a sample group.
        return self.fc(distconv.global_average_pooling(g, h))


def synthetic_batch(rng, noise_rng, n, size, grid):
    """This process's block of a batch of noise images with one square.

    The labels and square positions (a few numbers) are drawn from ``rng``,
    identical on every process; each process draws only the noise of its
    own block, so no process allocates the full-size batch.

    Returns:
        tuple: ``(x_local, t_local)``; label 1 if the square is bright.
    """
    t = rng.randint(0, 2, n).astype(np.int32)
    side = max(size // 8, 2)
    corners = rng.randint(0, size - side, (n, 2))
    lo, hi = grid.sample_range(n)
    (r0, r1), (c0, c1) = grid.block((size, size))
    x = noise_rng.normal(0, 0.5, (hi - lo, 1, r1 - r0, c1 - c0)).astype(
        np.float32)
    for i in range(lo, hi):
        r, c = corners[i]
        # The square's part inside this block (often none).
        a, b = max(r, r0), min(r + side, r1)
        d, e = max(c, c0), min(c + side, c1)
        if a < b and d < e:
            x[i - lo, 0, a - r0:b - r0, d - c0:e - c0] += \
                1.5 if t[i] else -1.5
    return x, t[lo:hi]


def parse_grid(text, size):
    if text:
        return tuple(int(v) for v in text.split(','))
    if size % 4 == 0:
        return (2, 2)
    return (size, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--grid', default='',
                        help='processes per spatial dim, e.g. 2,2 '
                             '(default: 2,2 when the size allows)')
    parser.add_argument('--insize', type=int, default=128)
    parser.add_argument('--batchsize', type=int, default=8,
                        help='global batch size')
    parser.add_argument('--iterations', type=int, default=20)
    parser.add_argument('--lr', type=float, default=0.1)
    args = parser.parse_args()

    comm = chainermn.create_communicator('naive')
    grid = distconv.SpatialGrid(comm, parse_grid(args.grid, comm.size))
    model = SpatialCNN(grid)
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(args.lr), comm)
    optimizer.setup(model)

    # Labels and square positions are drawn identically everywhere (same
    # seed); the noise per process, for its block only.
    rng = np.random.RandomState(0)
    noise_rng = np.random.RandomState(100 + comm.rank)
    if comm.rank == 0:
        print('grid %r, %d sample group(s), images %dx%d, global batch %d'
              % (grid.shape, grid.n_groups, args.insize, args.insize,
                 args.batchsize))
    start = time.time()
    for it in range(args.iterations):
        x_local, t_local = synthetic_batch(rng, noise_rng, args.batchsize,
                                           args.insize, grid)
        y = model(x_local)
        if len(t_local):
            per_sample = F.softmax_cross_entropy(y, t_local, reduce='no')
        else:  # backward is collective: keep a (zero) loss in the graph
            per_sample = F.sum(y, axis=1) * 0
        # Sum of per-sample losses times loss_scale: averaging gradients
        # over all processes then gives the global-batch gradient.
        loss = F.sum(per_sample) * grid.loss_scale(len(t_local))
        model.cleargrads()
        loss.backward()
        optimizer.update()
        mean_loss = comm.allreduce_obj(float(loss.array)) / comm.size
        acc = comm.allreduce_obj(
            float((y.array.argmax(axis=1) == t_local).sum())) \
            / (grid.spatial_size * args.batchsize)
        if comm.rank == 0:
            print('iteration %3d  loss %.4f  accuracy %.2f  (%.2f s)'
                  % (it + 1, mean_loss, acc, time.time() - start))


if __name__ == '__main__':
    main()
