"""Faults of a sharded optimizer's own collectives; run by test_shard_faults.

    mpiexec -n 2 python tests/unit/shard_fault_job.py FAULT [--timeout S]
        [--last-timeout S] [--out DIR] [--replica-sets shared|singletons]
        [--skip-checks none|entry|all] [--shard MODE]

A tiny MLP trained with ``shard=``; FAULT is what goes wrong:

* ``mn_snapshot``: a Trainer with ChainerMN's ``multi_node_snapshot``
  (``replica_sets=[]``: rank 0 alone serializes, every 2 iterations);
  ``--replica-sets singletons`` makes every rank a set of its own (every
  rank serializes: must work).  ``--skip-checks`` turns off the library's
  up-front detections (to reach the bounded gather behind them);
* ``rank0_save``: rank 0 alone calls ``save_npz(path, optimizer)`` at
  iteration 3 (a pattern no check can see up front);
* ``mn_autoload``: ChainerMN v7.8.1's own ``test_multinode_autoload``
  (extensions_tests/test_multi_node_snapshot.py), its optimizer ours
  (``--shard``, ``none`` for the unsharded one) and MNIST replaced by
  random data: ``multi_node_snapshot`` with ``replica_sets=[]`` and
  ``autoload``, called directly, never added to a trainer;
* ``clip``: ``GradientClipping``; the last rank stalls between its backward
  and ``update()`` at iteration 3 (the other waits in the norm allreduce);
* ``decide``: ``shard='parameters'``; the last rank stalls the same way at
  iteration 1, the first update after the skipped one (the other waits in
  the decision of which buckets stay whole);
* ``close``: ``shard='parameters'``; rank 0 hangs in its forward at
  iteration 3 while the last rank raises there and calls ``close()`` in a
  ``finally``;
* ``fetch``: ``shard='parameters'``; the last rank's server never answers
  a fetch (rank 0's first forward after the parameters were released
  waits for it).

Every rank catches what it raises and prints ``shard_fault_job: rank R
raised NAME after S s: MESSAGE`` (S: seconds since the rank started the
iteration of the fault, or since ``trainer.run()`` started), then exits
with status 1; ``shard_fault_job: rank R finished`` when it completed.
"""
import argparse
import os
import sys
import time

import numpy as np

import chainer
import chainer.links as L
from chainer import optimizer_hooks
from chainer import serializers
from chainer import training
from chainer.training import extensions
import chainermn
from chainermn.extensions import multi_node_snapshot

import chainermn_overlap
from chainermn_overlap.optimizers.sharding import server as server_module
from chainermn_overlap.optimizers.sharding import writers
from chainermn_overlap.testing import models

AT = 3


def say(text):
    sys.stdout.write('shard_fault_job: {}\n'.format(text))
    sys.stdout.flush()


class Model(models.MLP):
    """16-32-32-4 ReLU MLP whose forward calls ``hook()`` first."""

    def __init__(self):
        super().__init__(16, 32, 4, n_layers=3)
        self.hook = lambda: None

    def forward(self, x):
        self.hook()
        return super().forward(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('fault', choices=['mn_snapshot', 'rank0_save', 'clip',
                                     'decide', 'close', 'fetch',
                                     'mn_autoload'])
    p.add_argument('--timeout', default=None)
    p.add_argument('--last-timeout', default=None,
                   help="the last rank's timeout (default --timeout): a "
                   'longer one lets the other rank report first')
    p.add_argument('--out', default='.')
    p.add_argument('--replica-sets', default='shared',
                   choices=['shared', 'singletons'])
    p.add_argument('--skip-checks', default='none',
                   choices=['none', 'entry', 'all'])
    p.add_argument('--shard', default='optimizer',
                   choices=['optimizer', 'gradients', 'parameters', 'none'],
                   help='for mn_autoload')
    args = p.parse_args()
    comm = chainermn.create_communicator('naive')
    last = comm.rank == comm.size - 1
    shard = ('parameters' if args.fault in ('decide', 'close', 'fetch')
             else 'optimizer')
    if args.skip_checks in ('entry', 'all'):
        writers.check_extension = lambda *a, **k: None
    if args.skip_checks == 'all':
        writers.check_every_rank_writes = lambda *a, **k: None
    if args.fault == 'mn_autoload':
        run_autoload(args, comm.rank)
        return
    if args.fault == 'fetch' and last:
        # Requests reach this rank and are dropped: never answered.
        server_module.ShardServer._answer = lambda self, *a: None
    np.random.seed(0)
    net = Model()
    model = L.Classifier(net)
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.MomentumSGD(0.01), comm, bucket_size=1024,
        shard=shard, timeout=(args.last_timeout if last and args.last_timeout
                              else args.timeout)).setup(model)
    if args.fault == 'clip':
        opt.add_hook(optimizer_hooks.GradientClipping(1e-3))
    rng = np.random.RandomState(comm.rank)
    data = [(rng.randn(16).astype(np.float32), np.int32(rng.randint(4)))
            for _ in range(64)]
    started = {'at': time.monotonic()}
    try:
        if args.fault == 'mn_snapshot':
            run_trainer(comm, opt, data, args, started)
        else:
            run_loop(comm, model, net, opt, data, args, last, started)
    except Exception as e:  # reported with the rank and the time, then exit
        say('rank {} raised {} after {:.1f} s: {}'.format(
            comm.rank, type(e).__name__, time.monotonic() - started['at'],
            e))
        sys.exit(1)
    opt.synchronize()
    opt.close()
    say('rank {} finished'.format(comm.rank))


def run_trainer(comm, opt, data, args, started):
    it = chainer.iterators.SerialIterator(data, 8, shuffle=False)
    updater = training.StandardUpdater(it, opt)
    trainer = training.Trainer(updater, (6, 'iteration'), out=args.out)
    sets = ([] if args.replica_sets == 'shared'
            else [[r] for r in range(comm.size)])
    trainer.extend(multi_node_snapshot(
        comm, extensions.snapshot(filename='snapshot_iter_{.updater.'
                                  'iteration}'), sets),
        trigger=(2, 'iteration'))
    started['at'] = time.monotonic()
    trainer.run()


class AutoloadMLP(chainer.Chain):
    # ChainerMN's test model.
    def __init__(self, n_units, n_out):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(784, n_units)
            self.l2 = L.Linear(n_units, n_units)
            self.l3 = L.Linear(n_units, n_out)

    def forward(self, x):
        h1 = chainer.functions.relu(self.l1(x))
        h2 = chainer.functions.relu(self.l2(h1))
        return self.l3(h2)


def run_autoload(args, rank):
    """ChainerMN's ``test_multinode_autoload`` (see the module docstring)."""
    shard = None if args.shard == 'none' else args.shard
    started = time.monotonic()

    def prepare(n):
        comm = chainermn.create_communicator('naive')
        model = L.Classifier(AutoloadMLP(100, 10))
        optimizer = chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.Adam(), comm, shard=shard,
            timeout=args.timeout)
        optimizer.setup(model)
        if comm.rank == 0:
            rng = np.random.RandomState(0)
            train = [(rng.rand(784).astype(np.float32),
                      np.int32(rng.randint(10))) for _ in range(200)]
        else:
            train = None
        train = chainermn.scatter_dataset(train, comm, shuffle=True)
        train_iter = chainer.iterators.SerialIterator(train, 10)
        updater = training.StandardUpdater(train_iter, optimizer)
        trainer = training.Trainer(updater, out=args.out)
        snapshot = extensions.snapshot(target=updater, autoload=True)
        mn_snapshot = multi_node_snapshot(comm, snapshot, [])
        mn_snapshot.initialize(trainer)
        for _ in range(n):
            updater.update()
        return updater, mn_snapshot, trainer

    try:
        n = 3
        updater0, snapshot, trainer0 = prepare(n)
        assert n == updater0.iteration
        snapshot(trainer0)
        updater, _, _ = prepare(0)
        assert n == updater.iteration
    except Exception as e:  # reported with the rank and the time, then exit
        say('rank {} raised {} after {:.1f} s: {}'.format(
            rank, type(e).__name__, time.monotonic() - started, e))
        sys.exit(1)
    say('rank {} finished'.format(rank))


def run_loop(comm, model, net, opt, data, args, last, started):
    at = 1 if args.fault == 'decide' else AT

    def hang():
        say('rank {} injects a hang at iteration {}'.format(comm.rank, at))
        time.sleep(3600)

    for i in range(8):
        batch = data[8 * i:8 * i + 8]
        x = np.stack([b[0] for b in batch])
        t = np.array([b[1] for b in batch])
        if i == at:
            started['at'] = time.monotonic()
        if args.fault == 'rank0_save' and i == at and comm.rank == 0:
            say('rank 0 saves the optimizer alone at iteration {}'.format(i))
            serializers.save_npz(os.path.join(args.out, 'opt.npz'), opt)
        if args.fault in ('clip', 'decide'):
            loss = model(x, t)
            model.cleargrads()
            loss.backward()
            if last and i == at:
                hang()
            opt.update()
        elif args.fault == 'close' and i == at:
            if comm.rank == 0:
                net.hook = hang
                opt.update(model, x, t)
            try:
                say('rank {} injects an error at iteration {}'.format(
                    comm.rank, at))
                raise ValueError('injected fault on rank {}'.format(
                    comm.rank))
            finally:
                t0 = time.monotonic()
                try:
                    opt.close()
                finally:
                    say('rank {} left close() after {:.1f} s'.format(
                        comm.rank, time.monotonic() - t0))
        else:
            opt.update(model, x, t)


if __name__ == '__main__':
    main()
