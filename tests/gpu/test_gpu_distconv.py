"""The distconv exactness suite with blocks on a GPU.

Each layer runs serially with numpy on the global batch (the reference)
and distributed with every process's block and the layer's parameters on
the device; outputs, input gradients and summed parameter gradients must
agree.  Cases and grids are the CPU suite's
(``tests/mpi/distconv/test_distconv_layers.py``); halos are staged through
host memory by the exchange.
"""
import chainer
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from chainermn_overlap.testing import device

import _gpu_device  # NOQA: E402  (tests/gpu)

DEV = _gpu_device.require()

import distconv_mpi_helpers as helpers  # NOQA: E402
import test_distconv_layers as cpu  # NOQA: E402

GRIDS = [(1, 1), (2, 1), (1, 2)]


def compare_on_device(g, x, serial, dist, params):
    chk = helpers.Checker(1e-4, 1e-5)
    rng = np.random.RandomState(0)
    xs = chainer.Variable(x.copy())
    ys = serial(xs)
    gy = rng.randn(*ys.shape).astype(ys.dtype)
    ys.grad = gy.copy()
    ys.backward()
    if isinstance(dist, chainer.Link):
        dist.to_device(DEV)
    xd = chainer.Variable(device.to_device(g.scatter(x), DEV))
    yd = dist(xd)
    chk.true('output on the device', chainer.backend.get_array_module(
        yd.array) is device.xp(DEV))
    yd.grad = device.to_device(g.scatter(gy), DEV)
    yd.backward()
    chk.close('forward', g.gather(device.to_host(yd.array)), ys.array)
    chk.close('input grad', g.gather(device.to_host(xd.grad)), xs.grad)
    for name, ps, pd in params:
        grad = (device.to_host(pd.grad) if pd.grad is not None
                else np.zeros_like(ps.grad))
        chk.close('grad of ' + name, helpers.sum_over_ranks(grad), ps.grad)
    chk.done()


@pytest.mark.parametrize('shape', GRIDS, ids=str)
@pytest.mark.parametrize('case', cpu.CONV2D_CASES, ids=str)
def test_gpu_convolution_2d(shape, case):
    g = helpers.grid(shape)
    h, w, ci, co, k, s, p, d, groups = case
    rng = np.random.RandomState(1)
    x = rng.randn(3, ci, h, w).astype(np.float32)
    serial = L.Convolution2D(ci, co, k, s, p, dilate=d, groups=groups,
                             initialW=rng.randn(co, ci // groups, k, k)
                             .astype(np.float32), initial_bias=0.5)
    dist = distconv.Convolution2D(g, ci, co, k, s, p, dilate=d,
                                  groups=groups)
    dist.copyparams(serial)
    compare_on_device(g, x, serial, dist,
                      [('W', serial.W, dist.W), ('b', serial.b, dist.b)])


@pytest.mark.parametrize('shape', GRIDS, ids=str)
@pytest.mark.parametrize('case', cpu.MAXPOOL_CASES, ids=str)
def test_gpu_max_pooling_2d(shape, case):
    g = helpers.grid(shape)
    h, w, k, s, p, cover_all = case
    # Distinct values, as in the CPU suite (no ties in the argmax).
    x = np.random.RandomState(3).permutation(2 * 2 * h * w).reshape(
        2, 2, h, w).astype(np.float32)
    compare_on_device(
        g, x,
        lambda v: chainer.functions.max_pooling_2d(v, k, s, p,
                                                   cover_all=cover_all),
        lambda v: distconv.max_pooling_2d(g, v, k, s, p,
                                          cover_all=cover_all), [])


@pytest.mark.parametrize('channels', [2, 3])
@pytest.mark.parametrize('overlap', [True, False],
                         ids=['overlapped', 'serial'])
def test_gpu_channel_pair(channels, overlap):
    """split_output 3x3 -> ReLU -> split_input 1x1 on the device (the
    overlapped channel nodes stage their messages through the host)."""
    c = helpers.comm()
    if c.size % channels:
        pytest.skip('%d channel coordinates do not fit %d processes'
                    % (channels, c.size))
    g = distconv.SpatialGrid(c, (1, 1), channels=channels,
                             channel_overlap=overlap)
    rng = np.random.RandomState(12)
    x = rng.randn(2 * g.n_groups, 7, 5, 6).astype(np.float32)
    s1 = L.Convolution2D(7, 5, 3, 1, 1, initialW=rng.randn(5, 7, 3, 3)
                         .astype(np.float32) * 0.3, initial_bias=0.1)
    s2 = L.Convolution2D(5, 6, 1, initialW=rng.randn(6, 5, 1, 1)
                         .astype(np.float32) * 0.3, initial_bias=0.2)
    d1 = distconv.Convolution2D(g, 7, 5, 3, 1, 1, initialW=s1.W.array,
                                initial_bias=0.1, split='channel',
                                split_output=True)
    d2 = distconv.Convolution2D(g, 5, 6, 1, initialW=s2.W.array,
                                initial_bias=0.2, split='filter',
                                split_input=True)
    for link in (s1, s2, d1, d2):
        link.cleargrads()
    xs = chainer.Variable(x.copy())
    ys = s2(chainer.functions.relu(s1(xs)))
    gy = rng.randn(*ys.shape).astype(np.float32)
    ys.grad = gy.copy()
    ys.backward()
    d1.to_device(DEV)
    d2.to_device(DEV)
    xd = chainer.Variable(device.to_device(g.scatter(x, channel_split=True),
                                           DEV))
    before = g.stats['channel_overlapped']
    yd = d2(chainer.functions.relu(d1(xd)))
    yd.grad = device.to_device(g.scatter(gy, channel_split=True), DEV)
    yd.backward()
    chk = helpers.Checker(1e-4, 1e-5)
    chk.true('overlapped nodes ran', g.stats['channel_overlapped'] - before
             == (2 if overlap else 0))
    chk.true('output on the device', chainer.backend.get_array_module(
        yd.array) is device.xp(DEV))
    chk.close('forward', g.gather(device.to_host(yd.array),
                                  channel_split=True), ys.array)
    chk.close('input grad', g.gather(device.to_host(xd.grad),
                                     channel_split=True), xs.grad)
    for name, sl, dl, axis, total in (('W1', s1, d1, 1, 7),
                                      ('W2', s2, d2, 0, 6)):
        lo, hi = g.channel_range(total)
        full = np.zeros(sl.W.shape, np.float32)
        idx = (slice(None),) * axis + (slice(lo, hi),)
        full[idx] = device.to_host(dl.W.grad)
        chk.close(name + ' grad', helpers.sum_over_ranks(full), sl.W.grad)
    chk.done()
