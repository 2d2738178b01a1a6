"""Gradient compression: PowerSGD (low-rank, with error feedback).

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019) replaces the
allreduce of a matrix-shaped gradient ``M`` (n x m; a convolution kernel is
reshaped to ``(out_channels, in_channels * kh * kw)``) by two small ones::

    M += e                      error feedback: what earlier steps dropped
    P = M Q                     n x r, Q from the previous step (warm start)
    allreduce(P); orthogonalise P's columns
    Q = M^T P                   m x r
    allreduce(Q); Q /= ranks
    M' = P Q^T                  the mean gradient's rank-r estimate
    e = M - M'                  kept for the next step

Vectors (biases, batch-normalisation parameters) and matrices too small to
gain travel uncompressed in the first allreduce.  Every rank ends with the
same ``M'`` bit for bit (the reductions hand all ranks the same sums and the
rest is deterministic), so parameters stay identical across ranks.  The
first ``warmup_iterations`` updates reduce exactly, as PyTorch's
``start_powerSGD_iter`` does.

Usage::

    optimizer = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.MomentumSGD(0.1), comm,
        compression=chainermn_overlap.PowerSGD(rank=4, warmup_iterations=100))

The state (error feedback, warm-start ``Q``, the iteration count) is part of
the optimizer's snapshot, so a resumed run equals an uninterrupted one.
"""
import time
import zlib

import numpy

import chainer

from chainermn_overlap import _kernels
from chainermn_overlap.communication import progress

__all__ = ['PowerSGD', 'orthogonalize']


def orthogonalize(p, eps=1e-8):
    """Gram-Schmidt on the columns of ``p`` (n x r), in place."""
    return _kernels.orthogonalize(p, eps)


def matrix_shape(shape):
    """The 2-D view PowerSGD compresses: ``(shape[0], prod(shape[1:]))``."""
    n = int(shape[0])
    m = int(numpy.prod(shape[1:])) if len(shape) > 1 else 1
    return n, m


class PowerSGD(object):
    """PowerSGD gradient compression for the overlapped optimizer.

    Args:
        rank (int): rank of the approximation (1, 2, 4, ...).  Bytes sent
            per matrix: ``(n + m) * rank`` instead of ``n * m``.
        warmup_iterations (int): exact reductions for this many updates
            first (the error feedback starts after them).
        min_compression (float): compress a matrix only if it shrinks its
            traffic at least this many times; others travel exactly.
        seed (int): seed of the initial ``Q`` (the same on every rank).
    """

    def __init__(self, rank=1, warmup_iterations=10, min_compression=2.0,
                 seed=0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError('PowerSGD rank must be a positive integer, got '
                             '{!r}'.format(rank))
        if (isinstance(warmup_iterations, bool)
                or not isinstance(warmup_iterations, int)
                or warmup_iterations < 0):
            raise ValueError('warmup_iterations must be an integer >= 0, got '
                             '{!r}'.format(warmup_iterations))
        if not min_compression >= 1:
            raise ValueError('min_compression must be >= 1, got {!r}'
                             .format(min_compression))
        self.rank = rank
        self.warmup_iterations = warmup_iterations
        self.min_compression = float(min_compression)
        self.seed = seed
        self.iterations = 0    # updates completed (exact or compressed)
        self.errors = {}       # parameter name -> error feedback (n x m)
        self.qs = {}           # parameter name -> warm-start Q (m x r)
        # CPU seconds of the compression's own arithmetic (thread time:
        # on a core shared with training, wall time would count the other
        # thread's slices too).
        self.compute_seconds = 0.0

    def __repr__(self):
        return 'PowerSGD(rank={}, warmup_iterations={})'.format(
            self.rank, self.warmup_iterations)

    @property
    def active(self):
        """Whether this iteration is compressed (warm-up is over)."""
        return self.iterations >= self.warmup_iterations

    def compresses(self, shape):
        """Whether a parameter of ``shape`` is sent as P and Q."""
        if len(shape) < 2:
            return False
        n, m = matrix_shape(shape)
        r = min(self.rank, n, m)
        return n * m >= self.min_compression * (n + m) * r

    def wire_elements(self, shapes):
        """Elements sent per compressed step for parameters of ``shapes``."""
        total = 0
        for shape in shapes:
            if self.compresses(shape):
                n, m = matrix_shape(shape)
                total += (n + m) * min(self.rank, n, m)
            else:
                total += int(numpy.prod(shape))
        return total

    def initial_q(self, name, m, r, xp, dtype):
        """The first Q of a parameter: the same on every rank."""
        seed = (self.seed * 1000003 + zlib.crc32(name.encode())) % 2 ** 32
        q = numpy.random.RandomState(seed).standard_normal((m, r))
        return orthogonalize(xp.asarray(q.astype(dtype)))

    def step_done(self):
        """Called by the optimizer once per completed update step."""
        self.iterations += 1

    def serialize(self, serializer):
        """Saves/loads the iteration count, error feedback and Q by name."""
        if isinstance(serializer, chainer.serializer.Deserializer):
            # A snapshot taken without compression starts it afresh.
            iterations = _load_optional(serializer, 'iterations')
            self.iterations = 0 if iterations is None else int(iterations)
            names = _decode_names(_load_optional(serializer, 'names'))
            for table, key in ((self.errors, 'error'), (self.qs, 'q')):
                table.clear()
                for k, name in enumerate(names):
                    value = _load_optional(serializer, '{}{}'.format(key, k))
                    if value is not None:
                        table[name] = numpy.array(value)
            return
        serializer('iterations', self.iterations)
        names = sorted(set(self.errors) | set(self.qs))
        serializer('names', numpy.frombuffer(
            '\n'.join(names).encode(), dtype=numpy.uint8).copy())
        cpu = chainer.backend.CpuDevice()
        for table, key in ((self.errors, 'error'), (self.qs, 'q')):
            for k, name in enumerate(names):
                if name in table:
                    serializer('{}{}'.format(key, k), cpu.send(table[name]))

    # ------------------------------------------------------------------
    # The collective (runs on the communication thread)

    def reduce_bucket(self, comm, bucket, shapes, mpi_wait='sleep'):
        """Replaces the bucket's local gradients by the compressed mean.

        Args:
            comm: ``mpi4py`` communicator (the engine's).
            bucket: the fusion bucket; its buffer holds this rank's
                gradients, packed.
            shapes (list): each member's parameter shape, in bucket order.
            mpi_wait (str): how the two allreduces wait (``'sleep'``:
            between tests, leaving the core to training; ``'poll'``: MPI's
            blocking call).
        """

        t0 = time.thread_time()
        size = comm.Get_size()
        buf = bucket.buffer
        xp = chainer.backend.get_array_module(buf)
        dtype = buf.dtype
        compressed, exact = [], []
        for i, (name, shape) in enumerate(zip(bucket.names, shapes)):
            (compressed if self.compresses(shape) else exact).append(
                (i, name, shape))
        # First allreduce: P of each compressed matrix, then the exact ones.
        mats, ps = [], []
        p_elems = 0
        for i, name, shape in compressed:
            n, m = matrix_shape(shape)
            r = min(self.rank, n, m)
            mat = bucket.slot(i).reshape(n, m)
            q = self.qs.get(name)
            q = (self.initial_q(name, m, r, xp, dtype) if q is None
                 else xp.asarray(q))
            mats.append((name, mat, q))
            p_elems += n * r
        exact_elems = sum(bucket.slot(i).size for i, _, _ in exact)
        first = xp.empty(p_elems + exact_elems, dtype=dtype)
        off = 0
        for name, mat, q in mats:
            p = first[off:off + mat.shape[0] * q.shape[1]].reshape(
                mat.shape[0], q.shape[1])
            # Error feedback and the projection, in one pass over mat
            # where the fused kernel runs.
            _kernels.ef_project(mat, self.errors.get(name), q, p)
            ps.append(p)
            off += p.size
        for i, _, _ in exact:
            s = bucket.slot(i)
            first[off:off + s.size] = s
            off += s.size
        self.compute_seconds += time.thread_time() - t0
        progress.allreduce_sum(comm, _host(first), mpi_wait)
        t1 = time.thread_time()
        off = p_elems
        scale = dtype.type(1.0 / size)
        for i, _, _ in exact:
            s = bucket.slot(i)
            xp.multiply(first[off:off + s.size], scale, out=s)
            off += s.size
        # Second allreduce: Q = M^T P with P orthogonalised (sent as Q^T,
        # r x m: the one-pass kernel's layout).
        q_elems = sum(q.size for _, _, q in mats)
        second = xp.empty(q_elems, dtype=dtype)
        qts, off = [], 0
        for (name, mat, q), p in zip(mats, ps):
            orthogonalize(p)
            qt = second[off:off + q.size].reshape(q.shape[1], q.shape[0])
            _kernels.project_t(mat, p, qt)
            qts.append(qt)
            off += q.size
        self.compute_seconds += time.thread_time() - t1
        if q_elems:
            progress.allreduce_sum(comm, _host(second), mpi_wait)
        t2 = time.thread_time()
        for (name, mat, _), p, qt in zip(mats, ps, qts):
            qt *= scale
            # mat becomes P Q^T, the error what it leaves out.
            self.errors[name] = _kernels.reconstruct(
                mat, self.errors.get(name), p, qt)
            self.qs[name] = qt.T.copy()
        self.compute_seconds += time.thread_time() - t2
        return (p_elems + exact_elems + q_elems) * dtype.itemsize


def _host(array):
    if isinstance(array, numpy.ndarray):
        return array
    raise RuntimeError(
        'PowerSGD reduces host (numpy) arrays with MPI; got {} (a GPU '
        'array): use an NCCL engine or move the parameters to the CPU.'
        .format(type(array).__name__))


def _decode_names(raw):
    if raw is None or len(raw) == 0:
        return []
    return bytes(numpy.asarray(raw, dtype=numpy.uint8)).decode().split('\n')


def _load_optional(serializer, key):
    try:
        return serializer(key, None)
    except KeyError:
        return None
