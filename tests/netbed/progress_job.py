"""Worker of test_progress.py: CPU used while waiting in an allreduce.

Rank 1 arrives ``LATE`` seconds after rank 0; rank 0 reports the CPU time
its thread used inside the call, with MPICH's blocking ``Allreduce`` and
with :func:`chainermn_overlap.communication.progress.allreduce`, then the
wall and CPU time of an 8 MB allreduce both ways.  Prints one JSON line.
"""
import json
import time

import numpy
from mpi4py import MPI

from chainermn_overlap.communication import progress

LATE = 1.0


def main():
    comm = MPI.COMM_WORLD.Dup()
    small = numpy.ones(1000, dtype=numpy.float32)
    big = numpy.ones(2 * 2 ** 20, dtype=numpy.float32)
    out = {'late_s': LATE}
    for mode in ('blocking', 'progress', 'blocking', 'progress'):
        for name, buf, late in (('late_peer', small, LATE), ('8MB', big, 0)):
            comm.Barrier()
            if comm.rank == 1 and late:
                time.sleep(late)
            c0, w0 = time.thread_time(), time.perf_counter()
            if mode == 'blocking':
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            else:
                progress.allreduce(comm, buf)
            row = out.setdefault('{}_{}'.format(mode, name), [])
            row.append({'wall_s': time.perf_counter() - w0,
                        'cpu_s': time.thread_time() - c0})
    if comm.rank == 0:
        print('PROGRESS_JOB ' + json.dumps(out), flush=True)


if __name__ == '__main__':
    main()
