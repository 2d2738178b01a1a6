"""A Trainer job with auto_snapshot that injects faults; run by
test_restart.py, normally under the restarting launcher:

    python -m chainermn_overlap.launch -n 2 -- tests/unit/restart_job.py \\
        --out DIR --result final.npz --fault kill,7,0,1

An MLP with dropout is trained on a synthetic dataset scattered over the
ranks, each rank iterating its share with a shuffling SerialIterator (the
global NumPy random state drives both the shuffles and dropout, so an exact
resume must restore it).  At the end rank 0 writes the model and the
optimizer state to ``--result`` (npz) for a bit-for-bit comparison.

``--fault KIND,ITER,ATTEMPT,RANK`` (repeatable): on attempt ATTEMPT
(``CHAINERMN_OVERLAP_RESTART``), rank RANK, in the update that completes
iteration ITER:

* ``kill``: SIGKILL to itself in the middle of backward;
* ``raise``: ``ValueError`` in forward;
* ``hang``: sleeps in forward (the others' watchdog times out);
* ``kill_temp``: while writing the snapshot of iteration ITER, SIGKILL after
  the rank's temporary file is written, before its rename;
* ``hang_snapshot``: while writing the snapshot of iteration ITER, sleeps
  after the rank's temporary file is written (the others wait in the
  snapshot's collective: its timeout must end the job);
* ``kill_manifest``: SIGKILL on rank 0 after every rank's file is in place,
  before the manifest (RANK is ignored);
* ``corrupt``: flips bytes in the newest snapshot's file of rank RANK, then
  raises (so that the restart meets the corrupt file);
* ``truncate``: cuts the newest snapshot's file of rank RANK to half its
  length, then raises (a file system that lost the file's tail);
* ``fill``: fills the snapshot file system (rank 0), so the next snapshot
  cannot be written; the next attempt removes the filler first.

``--lost-node ATTEMPT,SIZE``: from attempt ATTEMPT on, a job of more than
SIZE ranks fails at start (a node that does not come back).
``--soak N,SEED``: kills on attempts 0..N-1 at a random rank, iteration
(1-4 past the resume point) and place (forward, backward, mid-snapshot).
``--sleep S`` paces each forward pass (for faults from outside the job,
tests/netbed/test_hosts.py); ``--log-loss`` prints rank 0's loss every
``--every`` iterations.

Lines printed (for the tests): ``restart_job: inject KIND at iteration I on
rank R attempt A t=T`` before a fault and ``restart_job: training at
iteration I attempt A size S resumed_from F t=T`` after the first update of
each attempt (rank 0).
"""
import argparse
import contextlib
import os
import signal
import sys
import time

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
import chainermn

import chainermn_overlap
import chainermn_overlap.extensions as ext_module
from chainermn_overlap.testing import models


def say(msg):
    sys.stdout.write('restart_job: {}\n'.format(msg))
    sys.stdout.flush()


class MLP(chainer.Chain):
    def __init__(self, hook):
        super().__init__()
        self.hook = hook
        with self.init_scope():
            self.l1 = L.Linear(16, 32)
            self.l2 = L.Linear(32, 32)
            self.l3 = L.Linear(32, 4)

    def forward(self, x):
        h = F.relu(self.l1(x))
        h = self.hook('forward', h)
        h = F.dropout(F.relu(self.l2(h)), 0.2)
        return self.l3(h)


def parse_fault(text):
    kind, it, attempt, rank = text.split(',')
    return kind, int(it), int(attempt), int(rank)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--out', required=True)
    p.add_argument('--result', required=True)
    p.add_argument('--optimizer', default='overlapped_forward',
                   choices=['overlapped_forward', 'overlapped_update',
                            'double_buffering', 'chainermn'])
    p.add_argument('--shard', default=None,
                   choices=['optimizer', 'gradients', 'parameters'],
                   help="the overlapped optimizer's shard= (sharded "
                   'snapshots)')
    p.add_argument('--shard-unit', default='element',
                   choices=['element', 'parameter'])
    p.add_argument('--clip', type=float, default=None,
                   help='GradientClipping threshold')
    p.add_argument('--whole-snapshots', action='store_true',
                   help='a sharded optimizer writes whole states, as '
                   'before sharded snapshots (a reference for them)')
    p.add_argument('--iterations', type=int, default=24)
    p.add_argument('--stop-at', type=int, default=None,
                   help='end (successfully) after this iteration')
    p.add_argument('--every', type=int, default=4)
    p.add_argument('--keep', type=int, default=2)
    p.add_argument('--samples', type=int, default=96)
    p.add_argument('--batch', type=int, default=4)
    p.add_argument('--no-snapshot', action='store_true')
    p.add_argument('--timeout', default=None)
    p.add_argument('--fault', action='append', default=[], type=parse_fault)
    p.add_argument('--lost-node', default=None)
    p.add_argument('--soak', default=None)
    p.add_argument('--filler', default=None)
    p.add_argument('--sleep', type=float, default=0.0,
                   help='seconds each forward pass pauses (paces a long '
                   'run for faults from outside)')
    p.add_argument('--log-loss', action='store_true',
                   help='rank 0 prints the loss at every snapshot interval')
    args = p.parse_args()
    attempt = int(os.environ.get('CHAINERMN_OVERLAP_RESTART', '0'))

    comm = chainermn.create_communicator('naive')
    if args.lost_node:
        from_attempt, max_size = (int(v) for v in args.lost_node.split(','))
        if attempt >= from_attempt and comm.size > max_size:
            raise RuntimeError(
                'simulated lost node: attempt {} cannot run on {} ranks'
                .format(attempt, comm.size))
    if args.filler and attempt > 0 and comm.rank == 0 and \
            os.path.exists(args.filler):
        os.unlink(args.filler)
        say('removed the filler {}'.format(args.filler))
    comm.mpi_comm.Barrier()

    # The same initial model on every rank; per-rank random streams after.
    np.random.seed(0)
    hold = {'trainer': None}
    faults = list(args.fault)

    snap = None
    if not args.no_snapshot:
        snap = ext_module.auto_snapshot(comm, args.out,
                                        trigger=(args.every, 'iteration'),
                                        keep=args.keep, timeout=args.timeout)

    def current_iteration():
        return hold['trainer'].updater.iteration + 1

    def due(kinds):
        it = current_iteration()
        for f in faults:
            if (f[0] in kinds and f[1] == it and f[2] == attempt
                    and (f[3] == comm.rank or f[0] == 'kill_manifest')):
                return f
        return None

    def announce(kind, it):
        say('inject {} at iteration {} on rank {} attempt {} t={:.6f}'
            .format(kind, it, comm.rank, attempt, time.time()))

    def kill_self():
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(where, h):
        if args.sleep:
            time.sleep(args.sleep)
        f = due(('raise', 'hang', 'corrupt', 'truncate', 'fill'))
        if f is not None:
            announce(f[0], f[1])
            if f[0] == 'raise':
                raise ValueError('injected fault on rank {}'.format(
                    comm.rank))
            if f[0] == 'hang':
                time.sleep(3600)
            if f[0] in ('corrupt', 'truncate'):
                folders = sorted(d for d in os.listdir(args.out)
                                 if d.startswith('snapshot_iter_'))
                path = os.path.join(args.out, folders[-1],
                                    'rank{}.npz'.format(f[3]))
                size = os.path.getsize(path)
                with open(path, 'r+b') as fh:
                    if f[0] == 'truncate':
                        fh.truncate(size // 2)
                    else:
                        fh.seek(size // 2)
                        b = fh.read(8)
                        fh.seek(-len(b), 1)
                        fh.write(bytes(x ^ 0xFF for x in b))
                    fh.flush()
                    os.fsync(fh.fileno())
                say('{} {} ({} -> {} bytes)'.format(
                    'truncated' if f[0] == 'truncate' else 'corrupted',
                    path, size, os.path.getsize(path)))
                raise ValueError('injected fault after damaging a snapshot')
            if f[0] == 'fill':
                st = os.statvfs(args.out)
                free = st.f_bavail * st.f_frsize
                with open(args.filler, 'wb') as fh:
                    # Leave less than one snapshot file.
                    fh.write(b'\0' * max(0, free - 4096))
                say('filled the disk, free now {} bytes'.format(
                    os.statvfs(args.out).f_bavail
                    * os.statvfs(args.out).f_frsize))
        if due(('kill',)) is not None:
            def action():
                announce('kill', current_iteration())
                kill_self()
            h = models.InjectInBackward(action).apply((h,))[0]
        return h

    if snap is not None:
        def fault_point(stage, iteration):
            for f in faults:
                if f[1] != iteration or f[2] != attempt:
                    continue
                if (f[0] == 'hang_snapshot' and stage == 'rank_file_written'
                        and f[3] == comm.rank):
                    announce(f[0], iteration)
                    time.sleep(3600)
                if ((f[0] == 'kill_temp' and stage == 'rank_file_written'
                     and f[3] == comm.rank)
                        or (f[0] == 'kill_manifest'
                            and stage == 'files_written')):
                    announce(f[0], iteration)
                    kill_self()
        snap._fault_point = fault_point

    if args.whole_snapshots:
        from chainermn_overlap.optimizers.sharding import shards
        shards.saving = lambda optimizers: contextlib.nullcontext()
    model = L.Classifier(MLP(hook))
    actual = chainer.optimizers.MomentumSGD(0.05)
    if args.optimizer.startswith('overlapped'):
        opt = chainermn_overlap.create_overlapped_optimizer(
            actual, comm, wait=args.optimizer.split('_')[1],
            bucket_size=2048, timeout=args.timeout, shard=args.shard,
            **({'shard_unit': args.shard_unit} if args.shard else {}))
    elif args.optimizer == 'double_buffering':
        opt = chainermn_overlap.create_double_buffering_optimizer(
            actual, comm, bucket_size=2048, timeout=args.timeout)
    else:
        opt = chainermn.create_multi_node_optimizer(actual, comm)
    opt.setup(model)
    if args.clip:
        # Every step clips: its norm is one more collective (with shard=,
        # an allreduce of the shards' squares in update()).
        opt.add_hook(chainer.optimizer_hooks.GradientClipping(args.clip))

    rng = np.random.RandomState(1)
    xs = rng.randn(args.samples, 16).astype(np.float32)
    ts = rng.randint(0, 4, size=args.samples).astype(np.int32)
    dataset = chainermn.scatter_dataset(
        chainer.datasets.TupleDataset(xs, ts) if comm.rank == 0 else None,
        comm, shuffle=True, seed=3)
    np.random.seed(100 + comm.rank)
    it = chainer.iterators.SerialIterator(dataset, args.batch, shuffle=True)
    updater = training.StandardUpdater(it, opt)
    stop = args.stop_at or args.iterations
    trainer = training.Trainer(updater, (stop, 'iteration'), out=args.out)
    hold['trainer'] = trainer
    if snap is not None:
        trainer.extend(snap)

    if args.soak:
        n_kills, seed = (int(v) for v in args.soak.split(','))
        if attempt < n_kills:
            r = np.random.RandomState(seed * 1000 + attempt)
            plan = {'rank': int(r.randint(comm.size)),
                    'ahead': int(r.randint(1, 5)),
                    'where': ['kill', 'kill', 'kill_temp',
                              'kill_manifest'][r.randint(4)]}
        else:
            plan = None
    else:
        plan = None

    state = {'announced': False}

    @training.make_extension(trigger=(1, 'iteration'), priority=-200)
    def report(trainer):
        if state['announced']:
            return
        state['announced'] = True
        if comm.rank == 0:
            say('training at iteration {} attempt {} size {} resumed_from {} '
                't={:.6f}'.format(trainer.updater.iteration, attempt,
                                  comm.size, snap.resumed_from if snap
                                  else None, time.time()))

    trainer.extend(report)

    if args.log_loss:
        @training.make_extension(trigger=(args.every, 'iteration'),
                                 priority=-200)
        def log_loss(trainer):
            # Only at snapshot iterations (the interval trigger also fires
            # on the first iteration after a resume): a loss line then
            # means that snapshot is complete (this runs after it).
            if comm.rank == 0 and trainer.updater.iteration % args.every \
                    == 0:
                say('loss at iteration {} attempt {} size {} = {:.6f}'.format(
                    trainer.updater.iteration, attempt, comm.size,
                    float(trainer.observation['main/loss'].array)))
        trainer.extend(log_loss)

    if plan is not None:
        # Planned once the resume point is known (after initialize).
        orig_initialize = snap.initialize

        def initialize(trainer):
            orig_initialize(trainer)
            start = snap.resumed_from or 0
            kind = plan['where']
            target = start + plan['ahead']
            if kind != 'kill':
                # Mid-snapshot kills need a snapshot iteration.
                target = (target + args.every - 1) // args.every * args.every
            faults.append((kind, target, attempt, plan['rank']))
        snap.initialize = initialize

    trainer.run()
    if hasattr(opt, 'synchronize'):
        opt.synchronize()
    # Every rank serializes the optimizer (collective with shard=: its
    # states are gathered whole), rank 0 writes what save_npz would.
    opt_state = chainer.serializers.DictionarySerializer()
    opt.serialize(opt_state)
    if comm.rank == 0 and (args.stop_at is None
                           or args.stop_at >= args.iterations):
        chainer.serializers.save_npz(args.result, model)
        np.savez(args.result + '.opt.npz', **opt_state.target)
    if hasattr(opt, 'close'):
        opt.close()
    comm.mpi_comm.Barrier()
    say('rank {} finished at iteration {}'.format(
        comm.rank, trainer.updater.iteration))


if __name__ == '__main__':
    main()
