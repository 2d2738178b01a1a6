"""Exactness of distconv.resize_images against single-process Chainer, and
the alignment check of distconv.concat (U-Net skip connections)."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest

from chainermn_overlap import distconv
from distconv_mpi_helpers import GRIDS_2D, collective_raises, \
    compare_layer, grid


@pytest.fixture
def chainer_resize(monkeypatch):
    """Chainer 7.8.1's resize_images uses ``numpy.float``, which NumPy
    1.24 removed; the reference gets it back for this test only."""
    monkeypatch.setattr(np, 'float', float, raising=False)
    return F.resize_images


# (H, W, out_H, out_W, mode, align_corners): up, down, non-integer factors
RESIZE_CASES = [
    (4, 3, 8, 6, 'bilinear', True),
    (4, 3, 8, 6, 'bilinear', False),
    (5, 4, 7, 9, 'bilinear', True),
    (5, 4, 7, 9, 'bilinear', False),
    (7, 6, 3, 4, 'bilinear', False),
    (3, 5, 1, 9, 'bilinear', True),
    (5, 4, 11, 6, 'nearest', True),
    (6, 7, 4, 3, 'nearest', False),
]


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('case', RESIZE_CASES, ids=str)
def test_resize_images(chainer_resize, shape, case):
    g = grid(shape)
    h, w, oh, ow, mode, ac = case
    x = np.random.RandomState(21).randn(2, 2, h, w).astype(np.float32)
    compare_layer(
        g, x,
        lambda v: chainer_resize(v, (oh, ow), mode=mode, align_corners=ac),
        lambda v: distconv.resize_images(g, v, (oh, ow), mode, ac))


def test_resize_images_fails_as_shipped_without_the_patch():
    """The reason for the fixture: Chainer's own function, as installed."""
    if hasattr(np, 'float'):
        pytest.skip('this NumPy still has numpy.float')
    with pytest.raises(AttributeError):
        F.resize_images(np.zeros((1, 1, 2, 2), np.float32), (4, 4))


class _UNetStep(chainer.Chain):
    """conv -> pool -> up-convolution -> concat with the skip -> conv."""

    def __init__(self, g, outsize):
        super().__init__()
        self.g = g
        with self.init_scope():
            if g is None:
                self.c1 = L.Convolution2D(2, 3, 3, pad=1)
                self.up = L.Deconvolution2D(3, 3, 2, 2, outsize=outsize)
                self.c2 = L.Convolution2D(6, 2, 3, pad=1)
            else:
                self.c1 = distconv.Convolution2D(g, 2, 3, 3, pad=1)
                self.up = distconv.Deconvolution2D(g, 3, 3, 2, 2,
                                                   outsize=outsize)
                self.c2 = distconv.Convolution2D(g, 6, 2, 3, pad=1)

    def forward(self, x):
        skip = F.relu(self.c1(x))
        if self.g is None:
            h = self.up(F.max_pooling_2d(skip, 2, cover_all=False))
            return self.c2(F.concat([skip, h]))
        h = self.up(distconv.max_pooling_2d(self.g, skip, 2, cover_all=False))
        return self.c2(distconv.concat(self.g, [skip, h]))


@pytest.mark.parametrize('shape', [(2, 1), (2, 2), (1, 3), (4, 1)], ids=str)
def test_concat_of_a_skip_connection(shape):
    """Pooling then up-convolution on odd sizes: exact with outsize= the
    encoder's size, an error on every rank without it."""
    g = grid(shape)
    x = np.random.RandomState(22).randn(2, 2, 7, 5).astype(np.float32)
    serial = _UNetStep(None, (7, 5))
    dist = _UNetStep(g, (7, 5))
    dist.copyparams(serial)
    compare_layer(g, x, serial, dist,
                  [(n, p, dict(dist.namedparams())[n])
                   for n, p in serial.namedparams()])
    short = _UNetStep(g, None)  # 7 -> 3 -> 6: one row short
    short.copyparams(serial)
    collective_raises(lambda: short(g.scatter(x)),
                      'input 1 has global spatial size (6, 4)')


def test_concat_needs_the_channel_axis():
    g = grid((2, 1))
    x = g.scatter(np.zeros((1, 2, 4, 4), np.float32))
    collective_raises(lambda: distconv.concat(g, [x, x], axis=2),
                      'axis must be 1 (channels)')
