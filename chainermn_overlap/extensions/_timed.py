"""auto_snapshot's collectives, with a time limit.

Writing and choosing a snapshot takes a few collectives (barriers, every
rank's verdict gathered, rank 0's broadcast).  A rank whose peer's host or
link is gone would wait in a blocking call forever: over TCP a cut link
neither delivers nor fails.  These post the non-blocking form and poll it
(polling is also what makes it progress), and raise
:class:`~chainermn_overlap.CommunicationTimeout` after the limit: the same
limit as the optimizer's watchdog (``timeout=``, else
``CHAINERMN_OVERLAP_TIMEOUT``, else 600 s), so that one setting ends an
attempt whichever collective a failure caught the job in.  Data is JSON in
byte buffers, never pickled (as in :mod:`chainermn_overlap._mpi_json`).
"""
import json
import time

import numpy

from chainermn_overlap.errors import CommunicationTimeout

_MAX_SLEEP = 0.005


class TimedCollectives(object):
    """Barrier, allgather and broadcast of JSON data, each with a limit.

    Args:
        mpi_comm: an mpi4py communicator.
        timeout (float or None): seconds; None waits without a limit.
    """

    def __init__(self, mpi_comm, timeout):
        self.comm = mpi_comm
        self.timeout = timeout
        self.rank = mpi_comm.Get_rank()

    def _wait(self, requests, what):
        from mpi4py import MPI
        start = time.monotonic()
        sleep = 1e-5
        while not MPI.Request.Testall(requests):
            waited = time.monotonic() - start
            if self.timeout is not None and waited > self.timeout:
                raise CommunicationTimeout(
                    'rank {}: timed out after {:.1f} s waiting for {} (a '
                    'collective of auto_snapshot). Another rank has not '
                    'joined it: its host or the network between ranks '
                    'failed, or it was killed, is stuck, or much slower. '
                    'The limit is the optimizer\'s watchdog timeout '
                    '(timeout= of auto_snapshot, else '
                    'CHAINERMN_OVERLAP_TIMEOUT); raise it if the job is '
                    'merely slow.'.format(self.rank, waited, what))
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP)

    def barrier(self, what):
        self._wait([self.comm.Ibarrier()], what)

    def allgather_json(self, obj, what):
        """Every rank's ``obj`` (JSON-serialisable), in rank order."""
        from mpi4py import MPI
        data = numpy.frombuffer(json.dumps(obj).encode(), dtype=numpy.uint8)
        counts = numpy.empty(self.comm.Get_size(), dtype=numpy.int64)
        mine = numpy.array([data.size], dtype=numpy.int64)
        self._wait([self.comm.Iallgather([mine, MPI.INT64_T],
                                         [counts, MPI.INT64_T])], what)
        counts = counts.tolist()
        displs = [sum(counts[:i]) for i in range(len(counts))]
        out = numpy.empty(sum(counts), dtype=numpy.uint8)
        self._wait([self.comm.Iallgatherv(
            [data, MPI.BYTE], [out, counts, displs, MPI.BYTE])], what)
        return [json.loads(out[d:d + c].tobytes().decode())
                for d, c in zip(displs, counts)]

    def bcast_json(self, obj, what, root=0):
        """``obj`` of ``root`` (JSON-serialisable) on every rank."""
        from mpi4py import MPI
        data = (json.dumps(obj).encode() if self.rank == root else b'')
        n = numpy.array([len(data)], dtype=numpy.int64)
        self._wait([self.comm.Ibcast([n, MPI.INT64_T], root=root)], what)
        buf = numpy.empty(int(n[0]), dtype=numpy.uint8)
        if self.rank == root:
            buf[:] = numpy.frombuffer(data, dtype=numpy.uint8)
        self._wait([self.comm.Ibcast([buf, MPI.BYTE], root=root)], what)
        return json.loads(buf.tobytes().decode())
