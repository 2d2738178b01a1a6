"""Low-precision wire (float32 arithmetic) and PowerSGD compression.

Collective tests (``tests/mpi_run.py -n N``).
"""
import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers
import chainermn

import chainermn_overlap
from chainermn_overlap.communication import buckets
from chainermn_overlap.communication import ring
from chainermn_overlap.compression import PowerSGD
from chainermn_overlap.testing import equivalence as eq

TOL = dict(rtol=1e-5, atol=1e-6)


class CNN(chainer.Chain):
    """Convolution kernels and a matrix, all compressible, and biases."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(1, 8, 3, pad=1)
            self.c2 = L.Convolution2D(8, 16, 3, pad=1)
            self.fc = L.Linear(16 * 3 * 3, 3)

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = F.average_pooling_2d(F.relu(self.c2(h)), 2)
        return self.fc(h)


# ---------------------------------------------------------------------------
# The ring allreduce

@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
@pytest.mark.parametrize('n', [0, 1, 3, 7, 1000, 100003])
def test_ring_mean_is_the_mean_and_identical_on_every_rank(comm, dtype, n):
    mpi = comm.mpi_comm
    rng = np.random.RandomState(100 + comm.rank)
    x = rng.standard_normal(n).astype(dtype)
    exact = np.zeros(n)
    mpi.Allreduce(x.astype(np.float64), exact)
    exact /= comm.size
    got = ring.ring_allreduce_mean(mpi, x.copy())
    assert got.dtype == dtype
    # Each partial sum is rounded once to the wire dtype (P - 1 roundings
    # of values up to P * max|x|), then the mean once more.
    eps = np.finfo(dtype).eps
    bound = eps * (comm.size + 1) * max(1.0, float(np.abs(x).max()
                                                   if n else 1.0))
    err = np.abs(got.astype(np.float64) - exact)
    eq.assert_all_ranks(n == 0 or err.max() <= bound,
                        'max error %r > %r' % (err.max() if n else 0, bound))
    same = mpi.allgather(got.tobytes())
    eq.assert_all_ranks(all(s == same[0] for s in same),
                        'ranks hold different bits')
    if comm.size > 1 and n > 0:
        # Negative control: the local data is not already the mean.
        assert not np.array_equal(got, x)


def test_ring_is_as_accurate_as_mpi_float16_sum(comm):
    # Both round each partial sum to float16 once per step; the ring adds
    # in float32 and scales before its last rounding.  Mean errors agree
    # within 25% (measured: 0.98-1.05x at 2-4 ranks).
    if comm.size < 2:
        pytest.skip('needs two ranks')
    mpi = comm.mpi_comm
    from mpi4py import MPI
    rng = np.random.RandomState(7 + comm.rank)
    x = (rng.standard_normal(50000) * 3).astype(np.float16)
    exact = np.zeros(x.size)
    mpi.Allreduce(x.astype(np.float64), exact)
    exact /= comm.size
    theirs = np.empty_like(x)
    mpi.Allreduce(x, theirs, op=MPI.SUM)        # float16 arithmetic
    theirs *= np.float16(1.0 / comm.size)
    ours = ring.ring_allreduce_mean(mpi, x.copy())
    e_ours = np.abs(ours - exact).mean()
    e_theirs = np.abs(theirs.astype(np.float64) - exact).mean()
    eq.assert_all_ranks(e_ours <= e_theirs * 1.25,
                        'mean error ours %g, MPI float16 %g'
                        % (e_ours, e_theirs))


def _train(comm, make, steps=6, wait='forward', model=None, opt=None,
           start=0, sync=True):
    if model is None:
        eq.seed_for_rank(3)
        model = L.Classifier(CNN())
    if opt is None:
        opt = make(chainer.optimizers.MomentumSGD(0.05, 0.9))
        opt.setup(model)
    # Drawn for 16 steps whatever ``steps`` is: a run cut short and its
    # continuation see the same batches.
    batches = eq.make_batches(9, 16, 2, (1, 6, 6), n_classes=3, comm=comm)
    for it in range(start, steps):
        opt.update(model, *batches[it])
    if sync and hasattr(opt, 'synchronize'):
        opt.synchronize()
    return model, opt


def _overlapped(comm, wait='forward', **options):
    return lambda o: chainermn_overlap.create_overlapped_optimizer(
        o, comm, wait=wait, bucket_size=2048, **options)


@pytest.mark.parametrize('wait', ['forward', 'update'])
def test_float16_wire_close_to_chainermn(comm, wait):
    ref, _ = _train(comm, lambda o: chainermn.create_multi_node_optimizer(
        o, comm))
    got, opt = _train(comm, _overlapped(comm, wait,
                                        allreduce_grad_dtype=np.float16))
    stats = opt.communication_stats()
    opt.close()
    # float16 keeps 11 significant bits: ~5e-4 relative per gradient.
    eq.assert_equivalent(got, ref, rtol=1e-2, atol=1e-3)
    eq.assert_all_ranks(stats['buckets'] > 0, repr(stats))


# ---------------------------------------------------------------------------
# PowerSGD: the collective alone

def _bucket(shapes, rng):
    params = [chainer.Parameter(rng.standard_normal(s).astype(np.float32))
              for s in shapes]
    entries, off = [], 0
    for i, p in enumerate(params):
        entries.append(('/p%d' % i, off, p.size))
        off += p.size
    b = buckets.Bucket(0, buckets.BucketPlan(np.dtype(np.float32),
                                             tuple(entries), off), params)
    b.ensure_buffer(np)
    for i, p in enumerate(params):
        b.slot(i)[...] = p.array.reshape(-1)
    return b


SHAPES = [(16, 3, 3, 3), (16,), (40, 30), (2, 2)]


def test_powersgd_bucket_conserves_the_gradient(comm):
    mpi = comm.mpi_comm
    c = PowerSGD(rank=2, warmup_iterations=0)
    rng = np.random.RandomState(20 + comm.rank)
    for step in range(3):
        b = _bucket(SHAPES, rng)
        local = [b.slot(i).copy() for i in range(len(SHAPES))]
        before = {n: e.copy() for n, e in c.errors.items()}
        c.reduce_bucket(mpi, b, SHAPES)
        same = mpi.allgather(b.buffer.tobytes())
        eq.assert_all_ranks(all(s == same[0] for s in same),
                            'ranks hold different estimates')
        for i, (name, shape) in enumerate(zip(b.names, SHAPES)):
            want = local[i].astype(np.float64)
            if name in before:
                want = want + before[name].reshape(-1)
            mean_want = np.zeros_like(want)
            mpi.Allreduce(want, mean_want)
            mean_want /= comm.size
            got = b.slot(i).astype(np.float64)
            if c.compresses(shape):
                # Error feedback keeps what the estimate dropped:
                # estimate + mean error == mean (gradient + old error).
                err = c.errors[name].reshape(-1).astype(np.float64)
                mean_err = np.zeros_like(err)
                mpi.Allreduce(err, mean_err)
                mean_err /= comm.size
                np.testing.assert_allclose(got + mean_err, mean_want,
                                           rtol=1e-4, atol=1e-4)
            else:
                np.testing.assert_allclose(got, mean_want, rtol=1e-5,
                                           atol=1e-6)
    assert c.compresses((16, 3, 3, 3)) and c.compresses((40, 30))
    assert not c.compresses((16,)) and not c.compresses((2, 2))


def test_powersgd_is_exact_on_a_rank_one_mean(comm):
    # Every rank's gradient is u v_r^T: the mean is rank 1, and a rank-1
    # PowerSGD step recovers it (up to rounding).
    mpi = comm.mpi_comm
    u = np.random.RandomState(1).standard_normal((40, 1))
    v = np.random.RandomState(2 + comm.rank).standard_normal((1, 30))
    b = _bucket([(40, 30)], np.random.RandomState(0))
    b.slot(0)[...] = (u @ v).astype(np.float32).reshape(-1)
    mean = np.zeros((40, 30))
    mpi.Allreduce(u @ v, mean)
    mean /= comm.size
    PowerSGD(rank=1, warmup_iterations=0).reduce_bucket(mpi, b, [(40, 30)])
    np.testing.assert_allclose(b.slot(0).reshape(40, 30), mean,
                               rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# PowerSGD in the optimizer

@pytest.mark.parametrize('wait', ['forward', 'update'])
@pytest.mark.parametrize('backend', ['mpi_priority', 'mpi_thread'])
def test_powersgd_warmup_is_exact_then_compresses(comm, wait, backend):
    ref, _ = _train(comm, lambda o: chainermn.create_multi_node_optimizer(
        o, comm))
    # Warm-up longer than the run: exactly ChainerMN.
    got, opt = _train(comm, _overlapped(
        comm, wait, backend=backend,
        compression=PowerSGD(rank=1, warmup_iterations=100)))
    opt.close()
    eq.assert_equivalent(got, ref, **TOL)
    # Compressed after 2 updates: differs from ChainerMN (the control),
    # identical across ranks, fewer bytes, finite.
    c = PowerSGD(rank=1, warmup_iterations=2)
    got, opt = _train(comm, _overlapped(comm, wait, backend=backend,
                                        compression=c))
    stats = opt.communication_stats()
    opt.close()
    eq.assert_different(got, ref, **TOL)
    errors = eq.cross_rank_errors(got)
    eq.assert_all_ranks(not errors, '; '.join(errors))
    eq.assert_all_ranks(c.iterations == 5 and c.compute_seconds > 0,
                        'iterations %d' % c.iterations)
    eq.assert_all_ranks(all(np.isfinite(p.array).all()
                            for p in got.params()), 'non-finite parameters')
    eq.assert_all_ranks(stats['buckets'] > 0, repr(stats))


@pytest.mark.parametrize('wait', ['forward', 'update'])
def test_powersgd_resume_is_bit_exact(comm, wait, tmp_path):
    path = comm.mpi_comm.bcast(str(tmp_path) if comm.rank == 0 else None)
    steps, k = 7, 4

    def make():
        return _overlapped(comm, wait, compression=PowerSGD(
            rank=2, warmup_iterations=1))

    full, opt = _train(comm, make(), steps=steps)
    opt.close()
    part, opt = _train(comm, make(), steps=k)
    snap = '%s/snap.rank%d' % (path, comm.rank)
    serializers.save_npz(snap + '.model.npz', part)
    serializers.save_npz(snap + '.opt.npz', opt)
    opt.close()
    def resume(keep_state):
        eq.seed_for_rank(99)   # different initial parameters: the load counts
        model = L.Classifier(CNN())
        opt = make()(chainer.optimizers.MomentumSGD(0.05, 0.9))
        opt.setup(model)
        serializers.load_npz(snap + '.model.npz', model)
        serializers.load_npz(snap + '.opt.npz', opt)
        if not keep_state:
            opt._overlap.compression.errors.clear()
            opt._overlap.compression.qs.clear()
        resumed, opt = _train(comm, None, steps=steps, model=model, opt=opt,
                              start=k)
        opt.close()
        return [n for (n, a), (_, b) in zip(sorted(full.namedparams()),
                                            sorted(resumed.namedparams()))
                if not np.array_equal(a.array, b.array)]

    differ = resume(keep_state=True)
    eq.assert_all_ranks(not differ, 'differ after resume: %s' % differ)
    # Negative control: without the error feedback and Q it differs.
    eq.assert_all_ranks(resume(keep_state=False), 'the compression state '
                        'made no difference')


def test_powersgd_bad_arguments(comm):
    with pytest.raises(ValueError, match='rank must be a positive'):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match='warmup_iterations'):
        PowerSGD(warmup_iterations=-1)
    with pytest.raises(ValueError, match='too narrow'):
        chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), comm, compression=PowerSGD(),
            allreduce_grad_dtype=np.float16)
    with pytest.raises(TypeError, match='PowerSGD'):
        chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), comm, compression='powersgd')


def test_float16_wire_buckets_default_to_one_chunk(comm):
    # The float16 ring runs a bucket whole: by default its buckets are one
    # ring chunk (4 MiB up to 16 ranks, 256 KiB per rank beyond, at most
    # the float32 bucket) so that an urgent bucket never waits behind a large
    # one; an explicit chunk or bucket_size is kept.
    def size_of(**options):
        opt = chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), comm, **options)
        try:
            return opt._overlap.layout.bucket_size
        finally:
            opt.close()
    assert size_of(allreduce_grad_dtype=np.float16) == \
        min(16 << 20, max(4 << 20, (256 << 10) * comm.size))
    assert size_of(allreduce_grad_dtype=np.float16,
                   chunk_size='1MiB') == 2 ** 20
    assert size_of(allreduce_grad_dtype=np.float16,
                   bucket_size='32MiB') == 32 * 2 ** 20
    assert size_of() == chainermn_overlap.optimizers.overlapped \
        .DEFAULT_BUCKET_SIZE
