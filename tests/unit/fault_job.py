"""A small training job that injects one fault; run by test_faults.py.

    mpiexec -n 2 python tests/unit/fault_job.py FAULT [--no-abort-hook]
        [--timeout S] [--stall-warning S] [--iterations N] [--at K]

FAULT is what the last rank does at iteration ``--at``:

* ``none``: nothing (the job must succeed);
* ``raise``: raises ``ValueError`` in the middle of its forward pass;
* ``kill``: sends itself SIGKILL in the middle of its backward pass (the
  first buckets are already posted, so the others are inside collectives);
* ``hang``: sleeps for an hour in its forward pass (a rank stuck in Python
  code: alive, its threads answer, but it never posts its buckets);
* ``stall``: sleeps ``--stall-seconds`` in its forward pass, then goes on.

Every rank prints ``fault_job: rank R finished`` when training completed.
"""
import argparse
import os
import signal
import sys
import time

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn

import chainermn_overlap
from chainermn_overlap.testing import models


class MLP(models.MLP):
    """The shared MLP (16-32-32-4, ReLU) with a fault between l1 and l2."""

    def __init__(self, fault=None):
        super().__init__(16, 32, 4, n_layers=3)
        self.fault = fault

    def forward(self, x):
        h = F.relu(self.l1(x))
        if self.fault is not None:
            where, action = self.fault
            if where == 'forward':
                action()
            else:
                # Between l2's and l1's backward: l3's and l2's buckets are
                # posted when the fault fires.
                h = models.InjectInBackward(action).apply((h,))[0]
        h = F.relu(self.l2(h))
        return self.l3(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('fault', choices=['none', 'raise', 'kill', 'hang',
                                     'stall'])
    p.add_argument('--no-abort-hook', action='store_true')
    p.add_argument('--timeout', default=None)
    p.add_argument('--stall-warning', default=None)
    p.add_argument('--stall-seconds', type=float, default=4.0)
    p.add_argument('--iterations', type=int, default=12)
    p.add_argument('--at', type=int, default=5)
    p.add_argument('--optimizer', default='overlapped',
                   choices=['overlapped', 'double_buffering'])
    args = p.parse_args()
    if not args.no_abort_hook:
        chainermn_overlap.enable_abort_on_exception()

    comm = chainermn.create_communicator('naive')
    faulty = comm.rank == comm.size - 1
    state = {'it': 0}

    def inject():
        if not faulty or state['it'] != args.at:
            return
        sys.stdout.write('fault_job: rank {} injects {} at iteration {}\n'
                         .format(comm.rank, args.fault, args.at))
        sys.stdout.flush()
        if args.fault == 'raise':
            raise ValueError('injected fault on rank {}'.format(comm.rank))
        if args.fault == 'kill':
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fault == 'hang':
            time.sleep(3600)
        if args.fault == 'stall':
            time.sleep(args.stall_seconds)

    where = 'backward' if args.fault == 'kill' else 'forward'
    model = L.Classifier(MLP((where, inject)))
    create = (chainermn_overlap.create_overlapped_optimizer
              if args.optimizer == 'overlapped'
              else chainermn_overlap.create_double_buffering_optimizer)
    opt = create(
        chainer.optimizers.MomentumSGD(0.01), comm,
        bucket_size=2048, timeout=args.timeout,
        stall_warning=args.stall_warning).setup(model)
    rng = np.random.RandomState(comm.rank)
    for it in range(args.iterations):
        state['it'] = it
        x = rng.randn(8, 16).astype(np.float32)
        t = rng.randint(0, 4, size=8).astype(np.int32)
        opt.update(model, x, t)
    opt.synchronize()
    opt.close()
    sys.stdout.write('fault_job: rank {} finished\n'.format(comm.rank))
    sys.stdout.flush()


if __name__ == '__main__':
    main()
