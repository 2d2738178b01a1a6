"""Collectives on plain data without pickle.

mpi4py's lower-case calls pickle their objects, and unpickling what a peer
sent can run code.  These helpers send JSON text or raw array bytes through
byte buffers instead, so nothing received from a peer is ever unpickled.
"""
import json

import numpy

from chainermn_overlap.communication import blocking


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


def _waiter(wait, what, timeout):
    """``wait(requests)``: the caller's, else a bounded wait (the
    environment's limit, or ``timeout``) naming ``what``."""
    if wait is not None:
        return wait
    return lambda requests: blocking.wait(requests, what, timeout)


def _allgather_bytes(mpi_comm, data, wait=None, what='an allgather',
                     timeout=None):
    from mpi4py import MPI
    wait = _waiter(wait, what, timeout)
    counts = numpy.empty(mpi_comm.Get_size(), dtype=numpy.int64)
    mine = [numpy.array([len(data)], dtype=numpy.int64), MPI.INT64_T]
    wait([mpi_comm.Iallgather(mine, [counts, MPI.INT64_T])])
    counts = counts.tolist()
    out = numpy.empty(sum(counts), dtype=numpy.uint8)
    displs = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]]).astype(
        numpy.int64).tolist()
    send = [numpy.frombuffer(data, dtype=numpy.uint8), MPI.BYTE]
    recv = [out, counts, displs, MPI.BYTE]
    wait([mpi_comm.Iallgatherv(send, recv)])
    return [out[d:d + c] for d, c in zip(displs, counts)]


def allgather_json(mpi_comm, obj, tuples=False, wait=None,
                   what='an allgather of JSON', timeout=None):
    """Every rank's ``obj`` (JSON-serialisable), in rank order.

    Args:
        tuples (bool): return JSON arrays as tuples (also for this rank's
            own entry, so that all entries compare alike).
        wait (callable): ``wait(requests)`` waits for the posted
            collectives; default: :func:`.blocking.wait` with ``timeout``
            (None: the environment's limit), naming ``what``.
    """
    data = json.dumps(obj, default=_default).encode()
    out = [json.loads(b.tobytes().decode())
           for b in _allgather_bytes(mpi_comm, data, wait, what, timeout)]
    return [_tuplify(o) for o in out] if tuples else out


def bcast_json(mpi_comm, obj, root=0, wait=None,
               what='a broadcast of JSON', timeout=None):
    """``obj`` of ``root`` (JSON-serialisable) on every rank (``wait``,
    ``what``, ``timeout``: as :func:`allgather_json`)."""
    from mpi4py import MPI
    wait = _waiter(wait, what, timeout)
    data = (json.dumps(obj, default=_default).encode()
            if mpi_comm.Get_rank() == root else b'')
    n = numpy.array([len(data)], dtype=numpy.int64)
    wait([mpi_comm.Ibcast([n, MPI.INT64_T], root=root)])
    buf = numpy.empty(int(n[0]), dtype=numpy.uint8)
    if mpi_comm.Get_rank() == root:
        buf[:] = numpy.frombuffer(data, dtype=numpy.uint8)
    wait([mpi_comm.Ibcast([buf, MPI.BYTE], root=root)])
    return json.loads(buf.tobytes().decode())


def allgather_arrays(mpi_comm, array, wait=None,
                     what='an allgather of arrays', timeout=None):
    """Every rank's numpy array (any shape and dtype), in rank order
    (``wait``, ``what``, ``timeout``: as :func:`allgather_json`)."""
    array = numpy.ascontiguousarray(array)
    metas = allgather_json(mpi_comm, [list(array.shape), array.dtype.str],
                           wait=wait, what=what, timeout=timeout)
    blobs = _allgather_bytes(mpi_comm, array.tobytes(), wait, what, timeout)
    return [numpy.frombuffer(b.tobytes(), dtype=numpy.dtype(dt)).reshape(shape)
            for (shape, dt), b in zip(metas, blobs)]
