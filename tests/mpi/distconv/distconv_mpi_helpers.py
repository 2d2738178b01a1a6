"""Helpers shared by the distconv MPI tests (collective assertions, grids)."""
import chainer
import numpy as np
import pytest

from chainermn_overlap import distconv
from chainermn_overlap.testing import equivalence as eq

_GRIDS = {}

GRIDS_2D = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (3, 1), (1, 3)]
GRIDS_3D = [(1, 1, 1), (2, 1, 1), (1, 2, 2), (1, 1, 2)]


def comm():
    """The session-wide communicator (the ``comm`` fixture's object).

    A function rather than a fixture: some tests need it at collection time.
    """
    return eq.get_communicator()


def grid(shape):
    """A cached SpatialGrid, or a skip when the size does not fit.

    Grids are created on first use, in test order, which is the same on
    every rank (creation is collective).
    """
    c = comm()
    p = int(np.prod(shape))
    if c.size % p:
        pytest.skip('grid %r does not fit %d processes' % (shape, c.size))
    shape = tuple(shape)
    if shape not in _GRIDS:
        _GRIDS[shape] = distconv.SpatialGrid(c, shape)
    return _GRIDS[shape]


class Checker(object):
    """Collects mismatches and fails on every rank if any rank has one."""

    def __init__(self, rtol=1e-4, atol=1e-5):
        self.errors = []
        self.rtol = rtol
        self.atol = atol

    def close(self, name, got, want, rtol=None, atol=None):
        got = np.asarray(got)
        want = np.asarray(want)
        if got.shape != want.shape:
            self.errors.append('%s: shape %r != %r' % (name, got.shape,
                                                      want.shape))
            return
        try:
            np.testing.assert_allclose(
                got, want, rtol=self.rtol if rtol is None else rtol,
                atol=self.atol if atol is None else atol)
        except AssertionError as e:
            self.errors.append('%s: %s' % (name, str(e)[:600]))

    def true(self, name, cond):
        if not cond:
            self.errors.append(name)

    def done(self):
        all_errors = comm().mpi_comm.allgather(self.errors)
        msgs = ['rank %d: %s' % (r, e) for r, errs in enumerate(all_errors)
                for e in errs]
        assert not msgs, '\n'.join(msgs)


def sum_over_ranks(arr):
    return comm().mpi_comm.allreduce(np.asarray(arr, dtype=np.float64))


def compare_layer(g, x, serial_fn, dist_fn, params=(), seed=0, check=None,
                  rtol=1e-4, atol=1e-5):
    """Runs a layer serially on the global batch and distributed.

    Compares the output, the input gradient and the parameter gradients
    (summed over all processes, which is what the layer contract says)
    for a random upstream gradient.

    Args:
        params: ``(name, serial_param, dist_param)`` triples.
    """
    chk = check or Checker(rtol, atol)
    rng = np.random.RandomState(seed)
    xs = chainer.Variable(x.copy())
    ys = serial_fn(xs)
    gy = rng.randn(*ys.shape).astype(ys.dtype)
    ys.grad = gy.copy()  # some Chainer backwards modify it in place
    ys.backward()
    xd = chainer.Variable(g.scatter(x))
    yd = dist_fn(xd)
    yd.grad = g.scatter(gy)
    yd.backward()
    chk.close('forward', g.gather(yd), ys.array)
    chk.close('input grad', g.gather(xd.grad), xs.grad)
    for name, ps, pd in params:
        grad = pd.grad if pd.grad is not None else np.zeros_like(ps.grad)
        chk.close('grad of ' + name, sum_over_ranks(grad), ps.grad)
    if check is None:
        chk.done()
    return chk


def collective_raises(fn, match):
    """Asserts that ``fn`` raises a ValueError with ``match`` on all ranks."""
    try:
        fn()
    except ValueError as e:
        msg = str(e)
    else:
        msg = None
    msgs = comm().mpi_comm.allgather(msg)
    for r, m in enumerate(msgs):
        assert m is not None, 'rank %d did not raise' % r
        assert match in m, 'rank %d: %r does not contain %r' % (r, m, match)
    return msgs[0]
