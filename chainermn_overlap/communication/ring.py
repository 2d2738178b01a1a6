"""A mean allreduce for low-precision wire formats, with float32 arithmetic.

MPICH sums float16 element by element in software (about 14x slower per
byte than float32 here).  This allreduce moves the low-precision bytes
itself -- a ring reduce-scatter then a ring allgather, point to point -- and
does every addition in float32, in one pass per step (the fused kernel of
:mod:`chainermn_overlap._kernels`, else ``numpy.add`` with
``dtype=float32``: vectorised, no Python per element).  Partial sums travel
in the wire dtype, so they are rounded once per hop, as MPI's float16 sum
rounds them; the scale by ``1 / size`` is folded into the last addition of
each chunk before its owner rounds it, and the allgather hands every rank
the owner's bits, so all ranks end with the same array, bit for bit.

Each step waits as the engine running it does (``mpi_wait``: MPI's
blocking call, or tests between sleeps, :mod:`.progress`).  Traffic per rank is the ring's ``2 (P-1)/P`` times the
buffer, as MPI's large-message allreduce; the float32 accumulator is one
chunk.
"""
import numpy

from chainermn_overlap import _kernels
from chainermn_overlap.communication import progress

__all__ = ['ring_allreduce_mean', 'chunk_bounds']


def chunk_bounds(n, parts):
    """Offsets of ``parts`` balanced chunks of ``n`` elements (first larger)."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def ring_allreduce_mean(comm, buf, tag=0x52, mpi_wait='sleep'):
    """Replaces ``buf`` (1-D, host memory) by the mean over ``comm``'s ranks.

    Args:
        comm: an ``mpi4py`` communicator (every rank calls with a buffer of
            the same size and dtype).
        buf (numpy.ndarray): contiguous 1-D array; any float dtype (float16
            on the wire is the point).
        tag (int): message tag, distinct from other traffic on ``comm``.
        mpi_wait (str): ``'sleep'`` or ``'poll'``, how each step waits
            (:mod:`.progress`).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return buf
    acc_dtype = numpy.promote_types(buf.dtype, numpy.float32)
    bounds = chunk_bounds(buf.size, size)
    chunk = [buf[bounds[i]:bounds[i + 1]] for i in range(size)]
    longest = max(len(c) for c in chunk)
    recv = numpy.empty(longest, dtype=buf.dtype)
    acc = numpy.empty(longest, dtype=acc_dtype)
    right, left = (rank + 1) % size, (rank - 1) % size
    scale = acc_dtype.type(1.0 / size)
    # Reduce-scatter: at step s rank r sends its partial sum of chunk r - s
    # and adds what it receives to chunk r - s - 1; after P - 1 steps it
    # holds the complete sum of chunk r + 1.
    for s in range(size - 1):
        out = chunk[(rank - s) % size]
        into = chunk[(rank - s - 1) % size]
        got = recv[:len(into)]
        progress.sendrecv(comm, out, right, got, left, tag, mpi_wait)
        # One pass where the fused kernel runs (float16 in, float32 sum).
        _kernels.add_into(into, got, acc, scale if s == size - 2 else None)
    # Allgather: pass the finished chunks around the ring.
    for s in range(size - 1):
        out = chunk[(rank + 1 - s) % size]
        into = chunk[(rank - s) % size]
        progress.sendrecv(comm, out, right, into, left, tag + 1,
                          mpi_wait)
    return buf

