"""Byte movement for distconv: point-to-point exchange and small reductions.

Arrays may be numpy or cupy. Messages are contiguous buffers packed by the
caller (no MPI derived datatypes). Device arrays are staged through host
memory because a CUDA-aware MPI cannot be assumed; the staging happens once
per packed buffer, so it costs one device-host copy per message.
"""
import numpy

from chainer import backend
from mpi4py import MPI

# One tag for every distconv message: each exchange completes before the
# next one starts and MPI keeps messages between a pair in order, so a
# single tag cannot mismatch on the grid's private communicators.
_TAG = 7301


def _is_host(arr):
    return isinstance(arr, numpy.ndarray)


def to_host(arr):
    """Returns a C-contiguous host copy (or view) of ``arr``."""
    if _is_host(arr):
        return numpy.ascontiguousarray(arr)
    return numpy.ascontiguousarray(backend.CpuDevice().send(arr))


def like(host, template):
    """Moves a host array to the device of ``template``."""
    if _is_host(template):
        return host
    return backend.get_device_from_array(template).send(host)


def exchange(mpi_comm, sends, recvs, template):
    """Sends and receives packed buffers with non-blocking point-to-point.

    Args:
        mpi_comm: The mpi4py communicator (the grid's private one).
        sends (list): ``(peer, array)`` pairs; arrays are packed contiguous.
        recvs (list): ``(peer, shape)`` pairs to receive, dtype of template.
        template: An array giving the dtype and device of received buffers.

    Returns:
        list: The received arrays, in the order of ``recvs``, on the device
        of ``template``.
    """
    dtype = template.dtype
    host_recv = [numpy.empty(shape, dtype=dtype) for _, shape in recvs]
    requests = []
    # Receives are posted first so that large messages can land directly in
    # their buffers instead of the unexpected-message queue.
    for (peer, _), buf in zip(recvs, host_recv):
        requests.append(mpi_comm.Irecv([buf, MPI.BYTE], source=peer,
                                       tag=_TAG))
    host_send = []
    for peer, arr in sends:
        buf = to_host(arr)
        host_send.append(buf)  # keep alive until Waitall
        requests.append(mpi_comm.Isend([buf, MPI.BYTE], dest=peer, tag=_TAG))
    MPI.Request.Waitall(requests)
    return [like(buf, template) for buf in host_recv]


def allreduce_sum(mpi_comm, arr, out_dtype=None):
    """Sum-allreduces an array; returns a new array on ``arr``'s device.

    Float inputs are reduced in float64: these reductions are tiny (per
    channel or per sample) and the extra precision keeps sums over many
    processes close to the single-process result.

    Args:
        mpi_comm: The mpi4py communicator.
        arr: The local contribution (numpy or cupy).
        out_dtype: dtype of the result; defaults to ``arr.dtype``.

    Returns:
        The sum over all processes of ``mpi_comm``.
    """
    host = to_host(arr)
    if host.dtype.kind == 'f':
        send, mpi_type = host.astype(numpy.float64), MPI.DOUBLE
    else:
        send, mpi_type = host.astype(numpy.int64), MPI.INT64_T
    out = numpy.empty_like(send)
    mpi_comm.Allreduce([send, mpi_type], [out, mpi_type], op=MPI.SUM)
    dtype = arr.dtype if out_dtype is None else out_dtype
    return like(out.astype(dtype, copy=False), arr)
