#!/usr/bin/env python
"""A 3-D U-Net on volumes split over D, H and W, checked against one process.

Quick runs (each checks the first steps against a single-process Chainer
model trained on the whole batch in the same processes, and fails if the
losses or the parameters differ)::

    .venv/bin/mpiexec -n 1 .venv/bin/python \\
        examples/spatial/train_unet3d_spatial.py --check
    .venv/bin/mpiexec -n 2 .venv/bin/python \\
        examples/spatial/train_unet3d_spatial.py --check
    .venv/bin/mpiexec -n 4 .venv/bin/python \\
        examples/spatial/train_unet3d_spatial.py --check --grid 1,2,2
    # one 160^3 volume: each 16-channel map at full resolution is 262 MB,
    # a quarter of it per process:
    .venv/bin/mpiexec -n 4 .venv/bin/python \\
        examples/spatial/train_unet3d_spatial.py --insize 160 --width 16 \\
        --grid 1,2,2 --iterations 3

Encoder: ``levels`` blocks of two (3^3 convolution, group normalisation,
ReLU) with 2^3 max pooling between them; decoder: 2^3 up-convolutions
(``DeconvolutionND``, ``outsize`` the size of the encoder map it joins,
so odd sizes such as 20 -> 10 -> 5 -> 2 -> 5 work), the skip joined with
``distconv.concat``, and the same blocks; a 1^3 convolution gives the
prediction. The task is learnable voxel regression on synthetic volumes:
the target is whether the local 3^3 mean of the input is positive. Every
layer is spatially partitioned (halos, corners, the up-convolutions'
overlaps and the group statistics over the whole volume included), so
the batch can be one volume. ``--grid tune`` lets ``distconv.tune``
choose the grid among the shapes that fit.
"""
import argparse
import time

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np

from chainermn_overlap import distconv


class UNet3D(chainer.Chain):
    """3-D U-Net; ``grid=None`` builds the single-process Chainer model."""

    def __init__(self, grid, in_channels=1, width=4, levels=3, n_out=1,
                 groups=2):
        super(UNet3D, self).__init__()
        self.grid = grid
        self.levels = levels
        d = grid is not None

        def conv(cin, cout, k=3, pad=1):
            return (distconv.ConvolutionND(grid, 3, cin, cout, k, pad=pad)
                    if d else L.ConvolutionND(3, cin, cout, k, pad=pad))

        def norm(c):
            return (distconv.GroupNormalization(grid, groups, c) if d
                    else L.GroupNormalization(groups, c))

        def up(cin, cout):
            return (distconv.DeconvolutionND(grid, 3, cin, cout, 2, 2) if d
                    else L.DeconvolutionND(3, cin, cout, 2, 2))

        with self.init_scope():
            cin = in_channels
            for i in range(levels):
                c = width * 2 ** i
                setattr(self, 'enc%d_a' % i, conv(cin, c))
                setattr(self, 'enc%d_an' % i, norm(c))
                setattr(self, 'enc%d_b' % i, conv(c, c))
                setattr(self, 'enc%d_bn' % i, norm(c))
                cin = c
            for i in reversed(range(levels - 1)):
                c = width * 2 ** i
                setattr(self, 'up%d' % i, up(cin, c))
                setattr(self, 'dec%d_a' % i, conv(2 * c, c))
                setattr(self, 'dec%d_an' % i, norm(c))
                setattr(self, 'dec%d_b' % i, conv(c, c))
                setattr(self, 'dec%d_bn' % i, norm(c))
                cin = c
            self.head = conv(cin, n_out, 1, 0)

    def _block(self, h, name):
        for part in ('a', 'b'):
            conv = getattr(self, '%s_%s' % (name, part))
            h = F.relu(getattr(self, '%s_%sn' % (name, part))(conv(h)))
        return h

    def _pool(self, h):
        if self.grid is None:
            return F.max_pooling_nd(h, 2, 2, cover_all=False)
        return distconv.max_pooling_nd(self.grid, h, 2, 2, cover_all=False)

    def _join(self, skip, h):
        if self.grid is None:
            return F.concat([skip, h])
        return distconv.concat(self.grid, [skip, h])

    def forward(self, x):
        skips = []
        h = x
        sizes = []
        for i in range(self.levels):
            if i:
                h = self._pool(h)
            sizes.append(self._global_size(h))
            h = self._block(h, 'enc%d' % i)
            skips.append(h)
        for i in reversed(range(self.levels - 1)):
            up = getattr(self, 'up%d' % i)
            up.outsize = sizes[i]  # the encoder's size, odd ones included
            h = self._block(self._join(skips[i], up(h)), 'dec%d' % i)
        return self.head(h)

    def _global_size(self, h):
        if self.grid is None:
            return tuple(h.shape[2:])
        return tuple(self.grid.check_spatial(h, 'UNet3D').spatial_shape)


def parse_grid(text, size):
    if text and text != 'tune':
        return tuple(int(v) for v in text.split(','))
    return {1: (1, 1, 1), 2: (2, 1, 1), 4: (1, 2, 2), 8: (2, 2, 2)}.get(
        size, (size, 1, 1))


def volumes(step, batchsize, channels, insize):
    """The global batch of one step and its target (the same everywhere)."""
    rng = np.random.RandomState(1000 + step)
    x = rng.randn(batchsize, channels, insize, insize, insize).astype(
        np.float32)
    mean = F.average_pooling_nd(x[:, :1], 3, 1, 1).array
    return x, (mean > 0).astype(np.float32)


def choose_grid(comm, args, model_args):
    """``--grid tune``: the fastest shape that fits, by ``distconv.tune``."""
    shapes = [s for s in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2),
                          (1, 2, 2), (2, 2, 1), (2, 2, 2)]
              if comm.size % int(np.prod(s)) == 0]
    result = distconv.tune(
        comm, lambda g, _: UNet3D(g, **model_args),
        (args.batchsize, args.channels) + (args.insize,) * 3, shapes,
        iterations=2)
    if comm.rank == 0:
        print(distconv.tuner.format_table(result), flush=True)
    return tuple(result['best'])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--grid', default='',
                   help="processes per (D, H, W), or 'tune'")
    p.add_argument('--insize', type=int, default=20, help='volume edge')
    p.add_argument('--channels', type=int, default=1)
    p.add_argument('--width', type=int, default=4)
    p.add_argument('--levels', type=int, default=3)
    p.add_argument('--batchsize', type=int, default=1,
                   help='global batch size (one volume is enough)')
    p.add_argument('--iterations', type=int, default=3)
    p.add_argument('--check', action='store_true',
                   help='train a single-process model alongside and fail '
                        'unless every step equals it')
    args = p.parse_args(argv)

    comm = chainermn.create_communicator('naive')
    model_args = dict(in_channels=args.channels, width=args.width,
                      levels=args.levels)
    shape = (choose_grid(comm, args, model_args) if args.grid == 'tune'
             else parse_grid(args.grid, comm.size))
    grid = distconv.SpatialGrid(comm, shape)
    np.random.seed(0)  # the same initial parameters on every process
    model = UNet3D(grid, **model_args)
    serial = None
    if args.check:
        serial = UNet3D(None, **model_args)
        serial.copyparams(model)
        opt_s = chainer.optimizers.MomentumSGD(0.01)
        opt_s.setup(serial)
    # A linear update (no Adam): the check compares parameters, and
    # Adam's first step turns rounding-level gradients into full steps.
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.01), comm)
    optimizer.setup(model)
    optimizer.update()  # ChainerMN broadcasts and skips its first update
    lo, hi = grid.sample_range(args.batchsize)
    box = grid.block((args.insize,) * 3)
    sel = (slice(lo, hi), slice(None)) + tuple(slice(a, b) for a, b in box)
    voxels = args.batchsize * args.insize ** 3
    if comm.rank == 0:
        print('grid %r x %d sample group(s), %d^3 volumes x %d channels, '
              'global batch %d, %d levels, width %d'
              % (grid.shape, grid.n_groups, args.insize, args.channels,
                 args.batchsize, args.levels, args.width), flush=True)
    worst = 0.0
    for it in range(args.iterations):
        x, t = volumes(it, args.batchsize, args.channels, args.insize)
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        y = model(x[sel])
        # Each process holds part of the voxels: its share of the global
        # mean, times comm.size because the optimizer averages gradients.
        loss = F.sum((y - t[sel]) ** 2) * (comm.size / voxels)
        model.cleargrads()
        loss.backward()
        optimizer.update()
        comm.mpi_comm.Barrier()
        elapsed = time.perf_counter() - t0
        mean_loss = comm.allreduce_obj(float(loss.array)) / comm.size
        if serial is not None:
            loss_s = F.mean_squared_error(serial(x), t)
            serial.cleargrads()
            loss_s.backward()
            opt_s.update()
            worst = max(worst, abs(mean_loss - float(loss_s.array))
                        / max(abs(float(loss_s.array)), 1e-12))
        if comm.rank == 0:
            print('iteration %3d  loss %.6f  %.2f s  %.2f volumes/s'
                  % (it + 1, mean_loss, elapsed, args.batchsize / elapsed),
                  flush=True)
    if serial is not None:
        return _check(comm, model, serial, worst, args.iterations)
    return 0


def _check(comm, model, serial, loss_diff, steps):
    """Compares with the single-process model on every rank; raises
    SystemExit(1) on every rank unless all agree."""
    got = dict(model.namedparams())
    diff = 0.0
    for name, ps in serial.namedparams():
        a, b = got[name].array, ps.array
        diff = max(diff, float(np.max(np.abs(a - b)))
                   / max(float(np.max(np.abs(b))), 1e-12))
    worst = comm.mpi_comm.allreduce(max(diff, loss_diff), op=max_op())
    ok = worst < 1e-4
    if comm.rank == 0:
        print('check: %s one process after %d steps (largest relative '
              'difference of losses and parameters %.2e)'
              % ('equal to' if ok else 'DIFFERENT FROM', steps, worst),
              flush=True)
    if not ok:
        raise SystemExit(1)
    return 0


def max_op():
    from mpi4py import MPI
    return MPI.MAX


if __name__ == '__main__':
    main()
