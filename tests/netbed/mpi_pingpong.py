"""Small-message MPI ping-pong between 2 ranks; rank 0 prints JSON.

Run by tests/netbed/test_netbed_delay.py in the test bed:
``python mpi_pingpong.py COUNT``.
"""
import json
import sys
import time

import numpy
from mpi4py import MPI


def main(count):
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    buf = numpy.zeros(8, dtype=numpy.uint8)
    rtts = []
    for i in range(count + 3):  # the first round trips connect
        t0 = time.perf_counter()
        if rank == 0:
            comm.Send(buf, 1)
            comm.Recv(buf, 1)
        else:
            comm.Recv(buf, 0)
            comm.Send(buf, 0)
        if i >= 3:
            rtts.append(time.perf_counter() - t0)
    if rank == 0:
        print('PINGPONG ' + json.dumps({'rtt_s': rtts}), flush=True)


if __name__ == '__main__':
    main(int(sys.argv[1]))
