"""``exchange.crop``: a basic-slice crop whose gradient is one slice
assignment (Chainer's ``get_item`` accumulates with ``numpy.add.at``)."""
import chainer
import chainer.functions as F
import numpy as np
import pytest

from chainermn_overlap.distconv import exchange


@pytest.mark.parametrize('slices', [
    (Ellipsis, slice(1, 4), slice(0, 5)),
    (Ellipsis, slice(2, 2), slice(0, 5)),        # empty
    (slice(None), slice(1, 3), slice(0, 6), slice(3, 7)),
], ids=str)
def test_crop_matches_get_item(slices):
    rng = np.random.RandomState(0)
    x = rng.randn(2, 3, 6, 7).astype(np.float32)
    a = chainer.Variable(x.copy())
    b = chainer.Variable(x.copy())
    ya = exchange.crop(a, slices)
    yb = F.get_item(b, slices)
    np.testing.assert_array_equal(ya.array, yb.array)
    gy = rng.randn(*ya.shape).astype(np.float32)
    # Two crops of one input: their gradients add up.
    (F.sum(ya * gy) + F.sum(exchange.crop(a, slices))).backward()
    (F.sum(yb * gy) + F.sum(F.get_item(b, slices))).backward()
    np.testing.assert_array_equal(a.grad, b.grad)
    assert np.abs(a.grad).sum() > 0 or ya.size == 0


def test_crop_double_backprop_matches_get_item():
    rng = np.random.RandomState(1)
    x = rng.randn(1, 2, 5, 5).astype(np.float32)
    sl = (Ellipsis, slice(1, 4), slice(0, 3))
    out = []
    for f in (exchange.crop, F.get_item):
        v = chainer.Variable(x.copy())
        y = f(v, sl)
        gx, = chainer.grad([F.sum(y * y * y)], [v],
                           enable_double_backprop=True)
        F.sum(gx * gx).backward()
        out.append((gx.array, v.grad))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-6)
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-6)
    assert np.abs(out[0][1]).sum() > 0
