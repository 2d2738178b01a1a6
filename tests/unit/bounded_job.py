"""Jobs where one rank fails or stalls between collectives; run by
test_bounded_waits.py.

    mpiexec -n 2 python tests/unit/bounded_job.py SCENARIO

with ``CHAINERMN_OVERLAP_TIMEOUT`` set (3 s in the tests).  Rank 1 produces
the fault and says so (``bounded_job: rank 1 injects ...``); every rank
then prints ``bounded_job: rank R raised TYPE: MESSAGE`` when the library
raised, or ``bounded_job: rank R finished`` when nothing did.

* ``relayout``: a lazily initialised link ran on rank 0 only; on rank 1
  its initializer gives another dtype, so rank 1 fails initialising it in
  the first update's relayout while rank 0 goes on to broadcast it.
* ``exchange-mismatch``: rank 1 runs one more distconv exchange than rank 0
  before the exchange they share (a graph that differs between ranks).
* ``exchange-stall``: rank 1 never posts the distconv exchange rank 0 waits
  for (it sleeps).
* ``split-stall``: rank 1 never comes to the construction of a distconv
  grid's communicators (``Dup``, ``Split``), rank 0 does.
* ``grid-arguments``: rank 1 gives the grid another ``check=``.
* ``grid-bad-argument``: rank 1 gives the grid ``progress_pieces=0``.
"""
import sys
import time

import numpy as np

import chainer
import chainer.links as L
import chainermn
from mpi4py import MPI

import chainermn_overlap
from chainermn_overlap.distconv import _comm

world = MPI.COMM_WORLD
rank = world.Get_rank()


def say(text):
    sys.stdout.write('bounded_job: rank {} {}\n'.format(rank, text))
    sys.stdout.flush()


def relayout():
    comm = chainermn.create_communicator('naive')
    init = chainer.initializers.Normal(
        dtype=np.float16 if rank == 1 else np.float32)
    model = chainer.Sequential(L.Linear(4, 3), L.Linear(None, 2,
                                                        initialW=init))
    if rank == 1:
        say('injects a parameter that initialises as float16')
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(0.1), comm).setup(model)
    x = np.ones((2, 4), np.float32)
    # The lazy link runs on rank 0 only: rank 1 initialises it in the
    # relayout, from rank 0's shape, with its own dtype.
    used = model if rank == 0 else model[0]
    opt.update(lambda: chainer.functions.sum(used(x)))


def exchange(extra):
    comm = world.Dup()
    template = np.zeros(1, np.float32)
    peer = 1 - rank
    if rank == 1:
        if extra:
            say('injects an exchange rank 0 does not run')
            _comm.post_exchange(comm, [(peer, np.ones(8, np.float32))],
                                [(peer, (8,))], template).wait()
        else:
            say('injects a stall: it never posts the exchange')
            time.sleep(30)
    got = _comm.exchange(comm, [(peer, np.full(4, rank, np.float32))],
                         [(peer, (4,))], template)
    say('received {}'.format(got[0].tolist()))


def split_stall():
    from chainermn_overlap.distconv import topology
    if rank == 1:
        say('injects a stall: it never builds the grid')
        time.sleep(30)
    # The grid's communicators (SpatialGrid agrees on its arguments first).
    topology.GridCommunicators(world, topology.GridTopology((2,), 2, rank))


def grid(**options):
    from chainermn_overlap import distconv
    if rank == 1:
        say('injects the grid argument(s) {}'.format(options))
    distconv.SpatialGrid(world, (2,), **(options if rank == 1 else {}))


def main():
    scenario = sys.argv[1]
    try:
        if scenario == 'relayout':
            relayout()
        elif scenario in ('exchange-mismatch', 'exchange-stall'):
            exchange(scenario == 'exchange-mismatch')
        elif scenario == 'split-stall':
            split_stall()
        elif scenario == 'grid-arguments':
            grid(check='always')
        elif scenario == 'grid-bad-argument':
            grid(progress_pieces=0)
        else:
            raise SystemExit('unknown scenario ' + scenario)
    except Exception as e:  # the outcome the test checks, on every rank
        say('raised {}: {}'.format(type(e).__name__, e))
        # Leaves the others the time to raise theirs before this rank's
        # exit (MPI_Abort when a request was given up on) ends the job.
        time.sleep(2)
        return
    say('finished')


if __name__ == '__main__':
    main()
