"""Collectives on plain data without pickle.

mpi4py's lower-case calls pickle their objects, and unpickling what a peer
sent can run code.  These helpers send JSON text or raw array bytes through
byte buffers instead, so nothing received from a peer is ever unpickled.
"""
import json

import numpy


def _default(obj):
    # numpy scalars and dtypes appear in shapes and layer signatures.
    if isinstance(obj, numpy.generic):
        return obj.item()
    return repr(obj)


def _tuplify(obj):
    """JSON arrays back to tuples, so that results compare and hash."""
    if isinstance(obj, list):
        return tuple(_tuplify(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _tuplify(v) for k, v in obj.items()}
    return obj


def _allgather_bytes(mpi_comm, data, wait=None):
    from mpi4py import MPI
    counts = numpy.empty(mpi_comm.Get_size(), dtype=numpy.int64)
    mine = [numpy.array([len(data)], dtype=numpy.int64), MPI.INT64_T]
    if wait is None:
        mpi_comm.Allgather(mine, [counts, MPI.INT64_T])
    else:
        wait([mpi_comm.Iallgather(mine, [counts, MPI.INT64_T])])
    counts = counts.tolist()
    out = numpy.empty(sum(counts), dtype=numpy.uint8)
    displs = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]]).astype(
        numpy.int64).tolist()
    send = [numpy.frombuffer(data, dtype=numpy.uint8), MPI.BYTE]
    recv = [out, counts, displs, MPI.BYTE]
    if wait is None:
        mpi_comm.Allgatherv(send, recv)
    else:
        wait([mpi_comm.Iallgatherv(send, recv)])
    return [out[d:d + c] for d, c in zip(displs, counts)]


def allgather_json(mpi_comm, obj, tuples=False, wait=None):
    """Every rank's ``obj`` (JSON-serialisable), in rank order.

    Args:
        tuples (bool): return JSON arrays as tuples (also for this rank's
            own entry, so that all entries compare alike).
        wait (callable): if given, the non-blocking collectives are posted
            and ``wait(requests)`` waits for them (a bounded wait); else
            the blocking ones are called.
    """
    data = json.dumps(obj, default=_default).encode()
    out = [json.loads(b.tobytes().decode())
           for b in _allgather_bytes(mpi_comm, data, wait)]
    return [_tuplify(o) for o in out] if tuples else out


def bcast_json(mpi_comm, obj, root=0):
    """``obj`` of ``root`` (JSON-serialisable) on every rank."""
    from mpi4py import MPI
    data = (json.dumps(obj, default=_default).encode()
            if mpi_comm.Get_rank() == root else b'')
    n = numpy.array([len(data)], dtype=numpy.int64)
    mpi_comm.Bcast([n, MPI.INT64_T], root=root)
    buf = numpy.empty(int(n[0]), dtype=numpy.uint8)
    if mpi_comm.Get_rank() == root:
        buf[:] = numpy.frombuffer(data, dtype=numpy.uint8)
    mpi_comm.Bcast([buf, MPI.BYTE], root=root)
    return json.loads(buf.tobytes().decode())


def allgather_arrays(mpi_comm, array):
    """Every rank's numpy array (any shape and dtype), in rank order."""
    array = numpy.ascontiguousarray(array)
    metas = allgather_json(mpi_comm, [list(array.shape), array.dtype.str])
    blobs = _allgather_bytes(mpi_comm, array.tobytes())
    return [numpy.frombuffer(b.tobytes(), dtype=numpy.dtype(dt)).reshape(shape)
            for (shape, dt), b in zip(metas, blobs)]
