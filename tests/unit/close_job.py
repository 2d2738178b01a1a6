"""A job whose engine is closed while a peer never joins its collective.

    mpiexec -n 2 python tests/unit/close_job.py

Rank 1 posts an allreduce that rank 0 never posts, then closes its engine
(watchdog timeout 3 s): ``close()`` must return within the timeout with a
``StallWarning``, and the exit that follows must end the job (MPI_Abort)
rather than hang in MPI_Finalize.  Rank 0 sleeps meanwhile.
"""
import sys
import time
import warnings

import numpy
from mpi4py import MPI

from chainermn_overlap.communication import backends

world = MPI.COMM_WORLD
engine = backends.get_backend('mpi_thread')(world, timeout=3)
if world.Get_rank() == 1:
    engine.allreduce(numpy.ones(4, numpy.float32), label='never joined')
    sys.stdout.write('rank 1 injects a collective rank 0 never joins\n')
    sys.stdout.flush()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        engine.close()
    sys.stdout.write('rank 1 left close() after {:.1f} s: {}\n'.format(
        time.monotonic() - t0, [str(w.message) for w in caught]))
    sys.stdout.flush()
else:
    time.sleep(120)
