"""The two collectives of sharding: reduce-scatter to a mean, allgather.

Both move host memory (device arrays are staged, as the engines do) and
wait as their engine does (``mpi_wait``: MPI's blocking call, or the
non-blocking call tested between short sleeps, :mod:`~chainermn_overlap.
communication.progress`).  A narrow wire (float16) is reduced by a ring of
its own with every addition in float32, as the unsharded optimizer's float16
wire is (:mod:`~chainermn_overlap.communication.ring`): MPICH sums float16
element by element in software.

Together they move what one allreduce moves: ``(P-1)/P`` of the bucket
each.
"""
import numpy

from chainermn_overlap import _host
from chainermn_overlap import _kernels
from chainermn_overlap.communication import progress

__all__ = ['allgather', 'reduce_scatter_mean']


def _mpi():
    from mpi4py import MPI
    return MPI


def _ring_reduce_scatter(comm, buf, bounds, scale, mpi_wait, tag=0x53):
    """Rank r's piece of ``buf`` becomes the scaled sum, float32 arithmetic.

    At step s rank r sends its partial sum of piece ``r - s - 1`` and adds
    what it receives into piece ``r - s - 2``; after ``P - 1`` steps it
    holds the complete sum of its own piece ``r``.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    piece = [buf[a:b] for a, b in bounds]
    longest = max(len(p) for p in piece)
    recv = numpy.empty(longest, dtype=buf.dtype)
    acc = numpy.empty(longest, dtype=numpy.promote_types(buf.dtype,
                                                         numpy.float32))
    right, left = (rank + 1) % size, (rank - 1) % size
    for s in range(size - 1):
        out = piece[(rank - s - 1) % size]
        into = piece[(rank - s - 2) % size]
        got = recv[:len(into)]
        progress.sendrecv(comm, out, right, got, left, tag, mpi_wait)
        _kernels.add_into(into, got, acc, scale if s == size - 2 else None)


def reduce_scatter_mean(comm, send, out, bounds, mpi_wait='poll'):
    """``out`` becomes this rank's piece of the mean of ``send`` over ranks.

    Args:
        comm: the engine's communicator.
        send: the bucket (1-D, numpy or cupy); a narrow wire's bucket is
            used as scratch.
        out: this rank's piece (``bounds[rank]`` elements); any float dtype
            (the mean is cast into it).
        bounds: ``(start, stop)`` of every rank's piece, in rank order.
        mpi_wait (str): ``'poll'`` or ``'sleep'``.
    """
    MPI = _mpi()
    size, rank = comm.Get_size(), comm.Get_rank()
    host = _host.to_host(send)
    a, b = bounds[rank]
    scale = host.dtype.type(1.0 / size)
    if host.dtype.itemsize < 4 and size > 1:
        _ring_reduce_scatter(comm, host, bounds, scale, mpi_wait)
        mine = host[a:b]
    else:
        counts = [stop - start for start, stop in bounds]
        mine = numpy.empty(b - a, dtype=host.dtype)
        if mpi_wait == 'sleep' and isinstance(comm, MPI.Comm):
            progress.wait(comm.Ireduce_scatter(host, mine, counts,
                                               op=MPI.SUM))
        else:
            comm.Reduce_scatter(host, mine, counts, op=MPI.SUM)
        if size > 1:
            # The same scale as the unsharded mean (sum, then one multiply).
            mine *= scale
    xp = chainer_xp(out)
    if xp is numpy:
        _kernels.copy_cast(out, mine)
    else:
        out[...] = xp.asarray(mine).astype(out.dtype, copy=False)


def allgather(comm, buf, bounds, mpi_wait='poll'):
    """Every rank's piece of ``buf`` (1-D) from its owner, in place."""
    MPI = _mpi()
    host, finish = _host.stage_to_host(buf)
    counts = [stop - start for start, stop in bounds]
    displs = [start for start, _ in bounds]
    spec = [host, (counts, displs)]
    if mpi_wait == 'sleep' and isinstance(comm, MPI.Comm):
        progress.wait(comm.Iallgatherv(MPI.IN_PLACE, spec))
    else:
        comm.Allgatherv(MPI.IN_PLACE, spec)
    if finish is not None:
        finish()


def chainer_xp(array):
    import chainer
    return chainer.backend.get_array_module(array)
