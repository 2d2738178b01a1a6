"""Packing on the GPU equals packing on the CPU (byte for byte): halo
boxes, general regions, and the staging of packed buffers to the host."""
import numpy as np
import pytest

from chainermn_overlap.distconv import _pack
from chainermn_overlap.testing import device

import _gpu_device  # NOQA: E402  (tests/gpu)

DEV = _gpu_device.require()

import test_pack as cpu  # NOQA: E402  (tests/unit/test_pack.py)


@pytest.mark.parametrize('method', ['slice', 'index'])
def test_gpu_pack_unpack_equal_numpy(method):
    xp = device.xp(DEV)
    for case, rank, plan in cpu.PLANS:
        x = cpu.block(plan, rank)
        own0 = cpu.origin(plan.own)
        boxes = [b for _, b in plan.sends]
        want, _ = _pack.pack_regions(np, x, boxes, own0)
        got, _ = _pack.pack_regions(xp, xp.asarray(x), boxes, own0,
                                    method=method)
        assert device.to_host(got).tobytes() == want.tobytes(), case
        back = xp.zeros(x.shape, x.dtype)
        _pack.unpack_regions(xp, got, back, boxes, own0, accumulate=True,
                             method=method)
        ref = _pack.unpack_regions(np, want, np.zeros_like(x), boxes, own0,
                                   accumulate=True)
        np.testing.assert_array_equal(device.to_host(back), ref)


def test_gpu_pinned_staging_round_trip():
    xp = device.xp(DEV)
    st = _pack.PinnedStaging()
    a = xp.arange(1000, dtype=xp.float32)
    host = st.to_host(a)
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, np.arange(1000, dtype=np.float32))
    out = xp.zeros(1000, xp.float32)
    st.to_device(host * 2, out)
    np.testing.assert_array_equal(device.to_host(out), host * 2)


def test_gpu_regions_and_staging_equal_numpy():
    # What redistribution and the channel nodes send: general regions,
    # staged to the host in one transfer per packed buffer.
    xp = device.xp(DEV)
    for shape, sels in cpu.REGION_CASES:
        x = np.random.RandomState(1).randn(*shape).astype(np.float32)
        regions = [_pack.region_of(s, shape) for s in sels]
        want, _ = _pack.pack(np, x, regions)
        buf, pieces = _pack.pack(xp, xp.asarray(x), regions)
        host = _pack.staged(buf, pieces)
        assert all(isinstance(h, np.ndarray) for h in host)
        assert b''.join(h.tobytes() for h in host) == want.tobytes()
        back = xp.zeros(x.shape, x.dtype)
        _pack.unpack(xp, buf, back, regions)
        ref = _pack.unpack(np, want, np.zeros_like(x), regions)
        assert device.to_host(back).tobytes() == ref.tobytes()
        msg = _pack.message(xp, xp.asarray(x), regions[0])
        assert isinstance(msg, np.ndarray)
        assert msg.tobytes() == np.ascontiguousarray(x[sels[0]]).tobytes()
