"""Host kernels of the reduction path: fused C where built, numpy otherwise.

numpy 1.x converts float32 <-> float16 in software, one element at a time,
and each numpy expression is a pass over memory.  ``_native`` (a small C
extension built with the package, optional) does these with the CPU's F16C
conversions and fuses the passes PowerSGD makes over each gradient matrix.
Every function here takes the native path only for contiguous numpy arrays
of the dtypes it handles and otherwise runs the numpy (or cupy) expression
it replaces, so callers need not know which ran.

The float16 functions give the same bits either way (round to nearest
even, float32 sums).  The PowerSGD functions sum in another order than
BLAS, so their results differ in the last bits: every rank must run the
same path (``CHAINERMN_OVERLAP_NATIVE`` must agree, as must the CPUs'
support of AVX2/FMA/F16C).
"""
import contextlib

import numpy

import chainer

from chainermn_overlap import config

try:
    from chainermn_overlap import _native
except ImportError:  # built without a C compiler: numpy does the work
    _native = None

__all__ = ['native_available', 'native_enabled', 'use_native', 'copy_cast',
           'add_into', 'ef_project', 'project_t', 'reconstruct', 'orthogonalize']

_F16 = numpy.dtype(numpy.float16)
_F32 = numpy.dtype(numpy.float32)
_enabled = config.resolve_native()


def native_available():
    """Whether the C kernels were built and this CPU can run them."""
    return _native is not None and bool(_native.available)


def native_enabled():
    """Whether the C kernels are used now (available and not switched off)."""
    return _enabled and native_available()


@contextlib.contextmanager
def use_native(enabled):
    """Switches the C kernels on or off within a ``with`` block (tests,
    benchmarks comparing both)."""
    global _enabled
    old, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = old


def _plain(a, dtype):
    return (type(a) is numpy.ndarray and a.dtype == dtype
            and a.flags.c_contiguous)


def copy_cast(dst, src):
    """``dst[...] = src`` (same number of elements; the cast included)."""
    if dst.dtype == src.dtype:
        # The common case (no narrow wire) stays a plain copy.
        dst[...] = src.reshape(dst.shape)
        return
    if native_enabled() and dst.size == src.size:
        if _plain(src, _F32) and _plain(dst, _F16) and dst.flags.writeable:
            _native.f32_to_f16(src, dst)
            return
        if _plain(src, _F16) and _plain(dst, _F32) and dst.flags.writeable:
            _native.f16_to_f32(src, dst)
            return
    dst[...] = src.reshape(dst.shape)


def add_into(into, got, acc, scale=None):
    """``into = (into + got) * scale`` with the arithmetic in ``acc``'s dtype.

    ``acc`` is scratch of at least ``len(into)`` elements (float32 for a
    float16 buffer); ``scale`` None means no multiply.  The result is
    rounded once, to ``into``'s dtype.
    """
    if (native_enabled() and _plain(into, _F16) and _plain(got, _F16)
            and acc.dtype == _F32 and into.flags.writeable):
        _native.add_f16(into, got, into, 1.0 if scale is None else
                        float(scale))
        return
    a = acc[:len(into)]
    numpy.add(into, got, out=a, dtype=acc.dtype)
    if scale is not None:
        a *= acc.dtype.type(scale)
    into[...] = a


def _powersgd_native(mat, q, *others):
    r = q.shape[1]
    return (native_enabled() and _plain(mat, _F32) and mat.ndim == 2
            and mat.flags.writeable and 1 <= r <= _native.max_rank
            and all(o is None or _plain(o, _F32) for o in others))


def ef_project(mat, err, q, p):
    """PowerSGD's first pass: ``mat += err`` (err may be None); ``p = mat q``.

    ``mat`` is n x m, ``q`` m x r, ``p`` n x r (written).
    """
    if _powersgd_native(mat, q, err, p) and (
            err is None or err.shape == mat.shape):
        n, m = mat.shape
        r = q.shape[1]
        _native.ef_project(mat, err, numpy.ascontiguousarray(q.T), p, n, m, r)
        return
    xp = chainer.backend.get_array_module(mat)
    if err is not None:
        mat += xp.asarray(err)
    xp.matmul(mat, q, out=p)


def project_t(mat, p, qt):
    """PowerSGD's second projection, transposed: ``qt = p^T mat`` (r x m).

    One pass over ``mat`` where the fused kernel runs (BLAS reads the
    transposed operand slower here).
    """
    if _powersgd_native(mat, qt.T, p, qt):
        n, m = mat.shape
        _native.project_t(mat, p, qt, n, m, qt.shape[0])
        return
    xp = chainer.backend.get_array_module(mat)
    xp.matmul(p.T, mat, out=qt)


def reconstruct(mat, err, p, qt):
    """PowerSGD's last pass: ``a = p qt; err = mat - a; mat = a``.

    ``qt`` is Q transposed (r x m).

    Returns the error array (``err``, or a new one when ``err`` is None or
    of another array module).
    """
    xp = chainer.backend.get_array_module(mat)
    if err is None or chainer.backend.get_array_module(err) is not xp:
        err = xp.empty_like(mat)
    if _powersgd_native(mat, qt.T, err, p, qt) and err.shape == mat.shape:
        n, m = mat.shape
        _native.reconstruct(mat, err, p, qt, n, m, qt.shape[0])
        return err
    approx = xp.matmul(p, qt)
    xp.subtract(mat, approx, out=err)
    mat[...] = approx
    return err


def orthogonalize(p, eps=1e-8):
    """Gram-Schmidt on the columns of ``p`` (n x r), in place."""
    if native_enabled() and _plain(p, _F32) and p.ndim == 2 \
            and p.flags.writeable:
        _native.orthogonalize(p, p.shape[0], p.shape[1], float(eps))
        return p
    xp = chainer.backend.get_array_module(p)
    for i in range(p.shape[1]):
        col = p[:, i:i + 1]
        col /= xp.sqrt((col * col).sum()) + eps
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest -= col * (col * rest).sum(axis=0, keepdims=True)
    return p
