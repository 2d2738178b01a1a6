"""The fused C kernels against the numpy expressions they replace."""
import os
import platform
import shutil

import numpy
import pytest

from chainermn_overlap import _kernels

try:
    from chainermn_overlap import _native
except ImportError:
    _native = None


def _cpu_flags():
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('flags'):
                    return set(line.split(':', 1)[1].split())
    except OSError:
        pass
    return set()


CAN_BUILD = (platform.machine() in ('x86_64', 'AMD64')
             and shutil.which('cc') is not None
             and {'avx2', 'fma', 'f16c'} <= _cpu_flags())
needs_native = pytest.mark.skipif(
    not _kernels.native_available(),
    reason='native kernels not built or this CPU lacks AVX2/FMA/F16C')


def test_native_built_where_it_can_be():
    # A failed build is silent (the extension is optional): make it loud on
    # machines that have a compiler and the instructions.
    if not CAN_BUILD:
        pytest.skip('no C compiler or no AVX2/FMA/F16C here')
    assert _native is not None, 'chainermn_overlap._native was not built'
    assert _kernels.native_available()


def _f16_test_values():
    rng = numpy.random.RandomState(0)
    every = numpy.arange(65536, dtype=numpy.uint16).view(numpy.float16)
    finite = every[numpy.isfinite(every)].astype(numpy.float32)
    finite = numpy.unique(finite)
    # Exact ties between neighbouring float16 values (round half to even
    # decides) and the float32 values just above them.
    mids = ((finite[:-1].astype(numpy.float64)
             + finite[1:].astype(numpy.float64)) / 2).astype(numpy.float32)
    above = numpy.nextafter(mids, numpy.float32(numpy.inf))
    wide = (rng.standard_normal(200000)
            * numpy.exp(rng.uniform(-30, 15, 200000))).astype(numpy.float32)
    edges = numpy.array([65504, 65519, 65520, 1e6, -1e6, numpy.inf,
                         -numpy.inf, 0.0, -0.0, 6e-8, 2.98e-8, 3e-8, 1e-30],
                        dtype=numpy.float32)
    return numpy.concatenate([finite, mids, above, wide, edges])


@needs_native
@pytest.mark.parametrize('n', [None, 0, 1, 7, 8, 9, 15, 16, 17, 1001])
def test_f32_to_f16_bits_equal_numpy(n):
    x = _f16_test_values()
    if n is not None:
        x = numpy.ascontiguousarray(x[-n:] if n else x[:0])
    with numpy.errstate(over='ignore'):
        want = x.astype(numpy.float16)
    got = numpy.full(x.size, 7, dtype=numpy.float16)
    _kernels.copy_cast(got, x)
    numpy.testing.assert_array_equal(got.view(numpy.uint16),
                                     want.view(numpy.uint16))


@needs_native
def test_f16_to_f32_every_value():
    every = numpy.arange(65536, dtype=numpy.uint16).view(numpy.float16)
    want = every.astype(numpy.float32)
    got = numpy.empty(every.size, dtype=numpy.float32)
    _kernels.copy_cast(got, every)
    nan = numpy.isnan(want)
    assert (numpy.isnan(got) == nan).all()
    numpy.testing.assert_array_equal(got[~nan].view(numpy.uint32),
                                     want[~nan].view(numpy.uint32))


@needs_native
@pytest.mark.parametrize('scale', [None, 0.5, 1.0 / 3])
@pytest.mark.parametrize('n', [1, 8, 13, 100003])
def test_add_into_bits_equal_numpy(scale, n):
    rng = numpy.random.RandomState(n)
    a = (rng.standard_normal(n) * 3e4).astype(numpy.float16)  # overflows too
    b = (rng.standard_normal(n) * 3e4).astype(numpy.float16)
    acc = numpy.empty(n + 5, dtype=numpy.float32)
    results = []
    for native in (True, False):
        into = a.copy()
        with _kernels.use_native(native), numpy.errstate(over='ignore'):
            _kernels.add_into(into, b, acc, scale)
        results.append(into)
    numpy.testing.assert_array_equal(results[0].view(numpy.uint16),
                                     results[1].view(numpy.uint16))
    # and the numpy path is what it says: one float32 sum, one rounding
    with numpy.errstate(over='ignore'):
        s = a.astype(numpy.float32) + b.astype(numpy.float32)
        if scale is not None:
            s *= numpy.float32(scale)
        want = s.astype(numpy.float16)
    numpy.testing.assert_array_equal(results[1].view(numpy.uint16),
                                     want.view(numpy.uint16))


def test_fallbacks_strided_and_float64():
    # Arrays the kernels do not take go through numpy, with its results.
    x = numpy.arange(40, dtype=numpy.float32)[::2]
    out = numpy.empty(20, dtype=numpy.float16)
    _kernels.copy_cast(out, x)
    numpy.testing.assert_array_equal(out, x.astype(numpy.float16))
    x64 = numpy.linspace(-1, 1, 9)
    out64 = numpy.empty(9, dtype=numpy.float16)
    _kernels.copy_cast(out64, x64)
    numpy.testing.assert_array_equal(out64, x64.astype(numpy.float16))


def _powersgd_pass(native, n, m, r, with_error, seed=0):
    rng = numpy.random.RandomState(seed)
    mat = rng.standard_normal((n, m)).astype(numpy.float32)
    err = (rng.standard_normal((n, m)).astype(numpy.float32)
           if with_error else None)
    q = rng.standard_normal((m, r)).astype(numpy.float32)
    original = mat.copy()
    old_err = None if err is None else err.copy()  # reconstruct overwrites
    with _kernels.use_native(native):
        p = numpy.empty((n, r), dtype=numpy.float32)
        _kernels.ef_project(mat, err, q, p)
        summed = mat.copy()
        _kernels.orthogonalize(p)
        qt = numpy.empty((r, m), dtype=numpy.float32)
        _kernels.project_t(mat, p, qt)
        new_err = _kernels.reconstruct(mat, err, p, qt)
    return original, old_err, summed, p, qt, mat, new_err


SHAPES = [(64, 147, 4), (33, 17, 3), (5, 9, 1), (300, 1001, 16), (8, 8, 2)]


@needs_native
@pytest.mark.parametrize('n,m,r', SHAPES)
@pytest.mark.parametrize('with_error', [True, False])
def test_powersgd_kernels_match_numpy(n, m, r, with_error):
    nat = _powersgd_pass(True, n, m, r, with_error)
    ref = _powersgd_pass(False, n, m, r, with_error)
    names = ['original', 'err', 'mat + err', 'P', 'Q^T', 'estimate', 'error']
    for name, a, b in zip(names, nat, ref):
        if a is None:
            assert b is None
            continue
        scale = max(float(numpy.abs(b).max()), 1e-30)
        err = float(numpy.abs(a - b).max()) / scale
        assert err < 1e-5, (name, err)


@pytest.mark.parametrize('native', [True, False])
@pytest.mark.parametrize('n,m,r', SHAPES)
def test_powersgd_pass_properties(native, n, m, r):
    if native and not _kernels.native_available():
        pytest.skip('native kernels not built')
    original, err, summed, p, qt, est, new_err = _powersgd_pass(
        native, n, m, r, True)
    # error feedback added exactly (one float32 addition)
    numpy.testing.assert_array_equal(summed, original + err)
    # P has orthonormal columns
    numpy.testing.assert_allclose(p.T @ p, numpy.eye(r), atol=2e-5)
    # Q^T = P^T M, estimate = P Q^T, and nothing is lost: estimate + error
    # = M + old error (up to the rounding of one subtraction)
    numpy.testing.assert_allclose(qt, p.T @ summed, rtol=1e-4, atol=1e-4)
    numpy.testing.assert_allclose(est, p @ qt, rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(est + new_err, summed, rtol=1e-6,
                                  atol=1e-5)


@needs_native
def test_native_rejects_wrong_buffers():
    f32 = numpy.zeros(8, dtype=numpy.float32)
    f16 = numpy.zeros(8, dtype=numpy.float16)
    with pytest.raises(TypeError, match='float16'):
        _native.f32_to_f16(f32, f32)
    with pytest.raises(ValueError, match='elements'):
        _native.f32_to_f16(f32, f16[:4])
    with pytest.raises(ValueError, match='r <= 16'):
        _native.ef_project(f32, None, f32, f32, 1, 8, 17)
    with pytest.raises(ValueError, match='overlap'):
        _native.reconstruct(f32, f32, f32[:1], f32, 1, 8, 1)
    ro = numpy.zeros(8, dtype=numpy.float16)
    ro.flags.writeable = False
    with pytest.raises((TypeError, ValueError, BufferError)):
        _native.f32_to_f16(f32, ro)


def test_switch_off_by_environment(monkeypatch):
    from chainermn_overlap import config
    monkeypatch.setenv(config.NATIVE_ENV, '0')
    assert config.resolve_native() is False
    monkeypatch.setenv(config.NATIVE_ENV, '1')
    assert config.resolve_native() is True
    monkeypatch.delenv(config.NATIVE_ENV)
    assert config.resolve_native() is True
    before = _kernels.native_enabled()
    with _kernels.use_native(False):
        assert not _kernels.native_enabled()
    assert _kernels.native_enabled() == before


@needs_native
@pytest.mark.parametrize('r', [1, 2, 3, 4, 8])
@pytest.mark.parametrize('n,m', [(5, 37), (4, 16), (3, 9)])
def test_powersgd_results_do_not_depend_on_row_blocking(r, n, m):
    # ef_project takes two rows at a time and is compiled separately for
    # ranks 1, 2 and 4: each row's sums must still come out in the same
    # order, so the bits equal those of the rows fed one at a time (where
    # no blocking applies).
    rng = numpy.random.RandomState(r * 100 + n)
    mat = rng.standard_normal((n, m)).astype(numpy.float32)
    err = rng.standard_normal((n, m)).astype(numpy.float32)
    qt = rng.standard_normal((r, m)).astype(numpy.float32)
    whole, p = mat.copy(), numpy.empty((n, r), numpy.float32)
    _native.ef_project(whole, err, qt, p, n, m, r)
    for i in range(n):
        row, pi = mat[i:i + 1].copy(), numpy.empty((1, r), numpy.float32)
        _native.ef_project(row, err[i:i + 1].copy(), qt, pi, 1, m, r)
        numpy.testing.assert_array_equal(row, whole[i:i + 1])
        numpy.testing.assert_array_equal(pi, p[i:i + 1])
