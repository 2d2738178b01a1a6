"""Largest difference between distconv's encoder-decoder layers and
single-process Chainer, per operation, over the cases of the MPI tests.

    .venv/bin/mpiexec -n 2 .venv/bin/python tools/decoder_diffs.py
    .venv/bin/mpiexec -n 4 .venv/bin/python tools/decoder_diffs.py

For each case and each grid that fits the process count it runs the layer
on the global batch in one process and split over the grid, and compares
the output, the input gradient and the parameter gradients (summed over
the processes). Rank 0 prints, per operation, the largest absolute
difference and the largest relative one (``max |a - b| / max |b|``).
"""
import sys

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np

import chainermn
from chainermn_overlap import distconv

sys.path.insert(0, 'tests/mpi/distconv')
from test_distconv_decoder import (DECONV2D_CASES, DECONV3D_CASES,  # noqa
                                   GN_CASES, UNPOOL_CASES)
from test_distconv_resize import RESIZE_CASES  # noqa
from distconv_mpi_helpers import GRIDS_2D, GRIDS_3D  # noqa

COMM = chainermn.create_communicator('naive')
_GRIDS = {}
WORST = {}


def grids(shapes):
    for shape in shapes:
        if COMM.size % int(np.prod(shape)) == 0:
            if shape not in _GRIDS:
                _GRIDS[shape] = distconv.SpatialGrid(COMM, shape)
            yield _GRIDS[shape]


def record(op, got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError('%s: shape %r != %r' % (op, got.shape, want.shape))
    if not want.size:
        return
    d = float(np.max(np.abs(got - want)))
    r = d / max(float(np.max(np.abs(want))), 1e-30)
    a0, r0 = WORST.get(op, (0.0, 0.0))
    WORST[op] = (max(a0, d), max(r0, r))


def compare(op, g, x, serial_fn, dist_fn, params=()):
    rng = np.random.RandomState(0)
    xs = chainer.Variable(x.copy())
    ys = serial_fn(xs)
    gy = rng.randn(*ys.shape).astype(ys.dtype)
    ys.grad = gy.copy()
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = dist_fn(xd)
    yd.grad = g.scatter(gy)
    yd.backward()
    record(op, g.gather(yd), ys.array)
    record(op, g.gather(xd.grad), xs.grad)
    for ps, pd in params:
        grad = pd.grad if pd.grad is not None else np.zeros_like(ps.grad)
        record(op, COMM.mpi_comm.allreduce(np.asarray(grad, np.float64)),
               ps.grad)


def deconvolution():
    for case in DECONV2D_CASES:
        h, w, ci, co, k, s, p, outsize, d, groups = case
        for g in grids(GRIDS_2D):
            rng = np.random.RandomState(11)
            x = rng.randn(2, ci, h, w).astype(np.float32)
            serial = L.Deconvolution2D(
                ci, co, k, s, p, outsize=outsize,
                initialW=rng.randn(ci, co // groups, k, k).astype(np.float32),
                initial_bias=0.5, dilate=d, groups=groups)
            dist = distconv.Deconvolution2D(g, ci, co, k, s, p,
                                            outsize=outsize, dilate=d,
                                            groups=groups)
            dist.copyparams(serial)
            compare('deconvolution', g, x, serial, dist,
                    [(serial.W, dist.W), (serial.b, dist.b)])
    for dd, h, w, k, s, p, outsize in DECONV3D_CASES:
        for g in grids(GRIDS_3D):
            x = np.random.RandomState(12).randn(2, 2, dd, h, w).astype(
                np.float32)
            serial = L.DeconvolutionND(3, 2, 3, k, s, p, outsize=outsize)
            dist = distconv.DeconvolutionND(g, 3, 2, 3, k, s, p,
                                            outsize=outsize)
            dist.copyparams(serial)
            compare('deconvolution', g, x, serial, dist,
                    [(serial.W, dist.W), (serial.b, dist.b)])


def unpooling():
    for h, w, k, s, p, outsize, cover_all in UNPOOL_CASES:
        for g in grids(GRIDS_2D):
            x = np.random.RandomState(14).randn(2, 2, h, w).astype(
                np.float32)
            compare('unpooling', g, x,
                    lambda v: F.unpooling_2d(v, k, s, p, outsize, cover_all),
                    lambda v, g=g: distconv.unpooling_2d(
                        g, v, k, s, p, outsize, cover_all))


def resize():
    np.float = float  # Chainer 7.8.1's reference needs it (NumPy >= 1.24)
    for h, w, oh, ow, mode, ac in RESIZE_CASES:
        for g in grids(GRIDS_2D):
            x = np.random.RandomState(21).randn(2, 2, h, w).astype(
                np.float32)
            compare('resize_images ' + mode, g, x,
                    lambda v: F.resize_images(v, (oh, ow), mode=mode,
                                              align_corners=ac),
                    lambda v, g=g: distconv.resize_images(
                        g, v, (oh, ow), mode, ac))


def group_norm():
    for n, c, groups, sp in GN_CASES:
        for g in grids(GRIDS_2D if len(sp) == 2 else GRIDS_3D):
            rng = np.random.RandomState(16)
            x = (rng.randn(n, c, *sp) * 2 + 3).astype(np.float32)
            init_g = rng.rand(c).astype(np.float32) + 0.5
            init_b = rng.randn(c).astype(np.float32)
            serial = L.GroupNormalization(groups, c, initial_gamma=init_g,
                                          initial_beta=init_b)
            dist = distconv.GroupNormalization(g, groups, c,
                                               initial_gamma=init_g,
                                               initial_beta=init_b)
            compare('group_normalization', g, x, serial, dist,
                    [(serial.gamma, dist.gamma), (serial.beta, dist.beta)])


def main():
    np.random.seed(1234)  # the same default initial weights on every rank
    deconvolution()
    unpooling()
    resize()
    group_norm()
    if COMM.rank == 0:
        for op in sorted(WORST):
            a, r = WORST[op]
            print('%-28s max abs %.2e  max rel %.2e  (%d processes)'
                  % (op, a, r, COMM.size))


if __name__ == '__main__':
    main()
