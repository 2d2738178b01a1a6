"""Says whether auto_snapshot offers to stop when asked (``resize`` of its
``resumed`` event): ``python resize_job.py DIR [thread|own]``; with
``thread`` rank 1 makes the extension on another thread, with ``own`` rank
1's program has its own SIGUSR1 handler (either way rank 1 would not take
the launcher's SIGUSR1)."""
import os
import signal
import sys
import threading

import chainermn

import chainermn_overlap.extensions as ext_module

comm = chainermn.create_communicator('naive')
how = sys.argv[2] if len(sys.argv) > 2 else 'main'
if comm.rank == 1 and how == 'own':
    signal.signal(signal.SIGUSR1, lambda *a: None)
box = []


def make():
    box.append(ext_module.auto_snapshot(comm, sys.argv[1], keep=1))


if comm.rank == 1 and how == 'thread':
    t = threading.Thread(target=make)
    t.start()
    t.join()
else:
    make()
box[0].initialize(None)
sys.stdout.flush()
# Every rank waits for rank 0's event line to be written before any rank
# ends: a rank that ends first (os._exit, no MPI_Finalize) can make the
# process manager end rank 0 before it wrote (seen once in CI: no output).
comm.mpi_comm.Barrier()
os._exit(0)
