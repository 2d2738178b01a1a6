"""The peer benchmark's PyTorch worker: DDP trains ResNets, timed in rounds.

The counterpart of :mod:`benchmarks.harness.trainer` for PyTorch's
``DistributedDataParallel`` (DDP), so that our optimizer and DDP are
measured on the same test bed, in turns.  It runs in a virtual environment
of its own (``make peers-venv``: ``.venv-peers``, with torch's CPU wheel)
and imports neither chainer nor mpi4py nor the package: only torch,
:mod:`benchmarks.harness.torch_models` and :mod:`benchmarks.harness.turns`.  An
MPI process manager (MPICH's ``mpiexec``) starts one process per rank; the
ranks talk through ``torch.distributed``'s gloo backend, not MPI.  Every rank
runs::

    PYTHONPATH=<repository root> .venv-peers/bin/python \\
        -m benchmarks.harness.peers_torch --worker CFG

``CFG`` is a JSON object:

* ``model``: ``'resnet50'`` or ``'resnet18'``
  (:mod:`benchmarks.harness.torch_models`, the twins of our Chainer models);
* ``batch``: images per rank; ``insize``: their side in pixels;
* ``modes``: a list of :data:`MODES` (below);
* ``warmup``: untimed updates of each mode before the first round (at
  least 2 with a PowerSGD mode, see below);
* ``settle``: untimed updates of each mode at the start of every round
  (default 1); ``iterations``: its timed updates per round; ``rounds``;
* ``master_addr``, ``master_port``: rank 0's address and a free port, for
  gloo's rendezvous (``env://``);
* ``ifname`` (optional): the network interface gloo uses
  (``GLOO_SOCKET_IFNAME``); without it gloo picks the interface of the
  host name's address;
* ``bucket_cap_mb`` (optional): DDP's bucket size for ``ddp_fp32`` and
  ``ddp_fp16`` (default: DDP's own, 25 MB after a first bucket of 1 MB;
  ResNet-18 then has 3 buckets).  DDP reduces its first update in one
  bucket and sets its buckets up after it, in the warm-up;
* ``broadcast_buffers`` (optional, default False): whether DDP broadcasts
  rank 0's batch-normalization statistics before every forward pass.  Off
  by default because our optimizer reduces gradients only: so both sides
  put the same traffic on the wire.

Rank and world size come from the process manager (``PMI_RANK`` and
``PMI_SIZE`` under MPICH, Open MPI's variables, or ``RANK`` and
``WORLD_SIZE``; else 0 of 1).  The process group is made only with more
than one rank; so the DDP modes need at least two.

Modes (each keeps one model and one ``SGD(lr=0.01, momentum=0.9)`` for the
whole job; every rank builds the model from the same seed and trains on a
synthetic batch of its own, drawn with seed ``1 + rank``):

* ``alone``: the plain model, no communication (the denominator of
  scalability, measured under the same load as the others);
* ``ddp_fp32``: DDP, gradients averaged in float32;
* ``ddp_fp16``: DDP with ``fp16_compress_hook`` (float16 on the wire);
* ``ddp_powersgd1`` and ``ddp_powersgd4``: DDP with ``powerSGD_hook`` at
  rank 1 and 4 (error feedback, warm start).  Two constraints of the hook
  shape these modes.  PowerSGD starts at its third update
  (``start_powerSGD_iter=2``, the least the hook accepts with error
  feedback; before that it averages plainly), so the warm-up must be at
  least 2 updates for every timed update to be compressed.  And the hook
  issues its second and third all-reduce from a completion callback; on
  gloo, with more than one bucket, those callbacks run in different orders
  on different ranks, the ranks' collectives cross, and gloo fails
  ("Received data size doesn't match expected size").  So these modes put
  the whole model into ONE bucket (``bucket_cap_mb`` of
  :data:`ONE_BUCKET_MB`): their reduction cannot overlap the backward pass
  and starts when it ends.

One update is ``zero_grad``, forward, cross entropy, backward and
``step``.  DDP finishes its reduction inside the backward pass, so nothing
is pending after an update: a round's *tail* is 0.0 (reported, as the
other workers report theirs).  Before each mode's stretch the ranks meet
at a barrier; the modes run in the order of ``modes`` in even rounds and
reversed in odd ones.

Started by a conductor (``CMO_TURNS`` set, :mod:`benchmarks.harness.turns`),
the job takes its warm-up and rounds when told to, and answers as
:mod:`benchmarks.harness.trainer` does (plus ``param_checksums``, each mode's
sum of parameters: equal on all ranks while DDP keeps them in step).
Otherwise it warms up, runs its rounds, and rank 0 prints one line
``TRAINER_RESULT {json}``: for each mode ``round_seconds`` (rank 0's),
``round_seconds_by_rank``, ``tail_seconds``, ``communication_stats``
(None), ``param_checksum`` (rank 0's sum of parameters after the run, in
float64) and ``param_checksum_by_rank``.  For example, at one process::

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv-peers/bin/python \\
        -m benchmarks.harness.peers_torch --worker '{"model": "resnet18",
        "batch": 2, "insize": 32, "modes": ["alone"], "warmup": 1,
        "iterations": 2, "rounds": 2, "master_addr": "127.0.0.1",
        "master_port": 29511}'

and at two, every mode::

    .venv/bin/mpiexec -n 2 env PYTHONPATH=. OMP_NUM_THREADS=1 \\
        .venv-peers/bin/python -m benchmarks.harness.peers_torch --worker
        '{..., "modes": ["alone", "ddp_fp32", "ddp_fp16", "ddp_powersgd1",
        "ddp_powersgd4"], "warmup": 2, ...}'

This module imports torch only inside its functions, so that the
orchestrator, in the main environment, can import its constants.
"""
import json
import os
import sys
import time

from benchmarks.harness import turns

MODULE = 'benchmarks.harness.peers_torch'
RESULT_TAG = 'TRAINER_RESULT '
WORKER_FLAG = '--worker'
MODES = ('alone', 'ddp_fp32', 'ddp_fp16', 'ddp_powersgd1', 'ddp_powersgd4')
# PowerSGD's first compressed update is its (POWERSGD_START + 1)-th; 2 is
# the least the hook accepts with error feedback or warm start.
POWERSGD_START = 2
# Larger than any model here (ResNet-50: 102 MB of float32 gradients): one
# bucket, see the module docstring.
ONE_BUCKET_MB = 10000
LEARNING_RATE = 0.01
MOMENTUM = 0.9
N_CLASSES = 1000


def rank_and_size():
    """This process's rank and the world size, from the process manager.

    Returns:
        tuple: (rank, size); (0, 1) when no process manager started it.
    """
    for rank_key, size_key in (('PMI_RANK', 'PMI_SIZE'),
                               ('OMPI_COMM_WORLD_RANK',
                                'OMPI_COMM_WORLD_SIZE'),
                               ('RANK', 'WORLD_SIZE')):
        if rank_key in os.environ and size_key in os.environ:
            return int(os.environ[rank_key]), int(os.environ[size_key])
    return 0, 1


def check_config(cfg, size):
    """Raises ValueError when ``cfg`` cannot run at ``size`` ranks."""
    unknown = [m for m in cfg['modes'] if m not in MODES]
    if unknown:
        raise ValueError('unknown mode(s) {}: the PyTorch worker has {}'
                         .format(unknown, ', '.join(MODES)))
    ddp = [m for m in cfg['modes'] if m != 'alone']
    if ddp and size < 2:
        raise ValueError('mode(s) {} need at least 2 ranks (this job has '
                         '{}): start it under mpiexec -n 2 or more, or '
                         'run only "alone"'.format(ddp, size))
    if (any(m.startswith('ddp_powersgd') for m in cfg['modes'])
            and cfg['warmup'] < POWERSGD_START):
        raise ValueError('warmup={} leaves PowerSGD off in the timed '
                         'updates (it starts after {} updates): set '
                         'warmup to {} or more'.format(
                             cfg['warmup'], POWERSGD_START, POWERSGD_START))


def init_distributed(cfg, rank, size):
    """Joins the gloo process group when there is more than one rank.

    Returns:
        bool: whether the job is distributed.
    """
    if size < 2:
        return False
    import torch.distributed as dist
    os.environ['MASTER_ADDR'] = str(cfg['master_addr'])
    os.environ['MASTER_PORT'] = str(cfg['master_port'])
    if cfg.get('ifname'):
        os.environ['GLOO_SOCKET_IFNAME'] = cfg['ifname']
    dist.init_process_group('gloo', init_method='env://', rank=rank,
                            world_size=size)
    return True


def synthetic_batch(batch, insize, rank):
    """Uniform images in [0, 1) and labels of 1000 classes, rank's own."""
    import torch
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.rand((batch, 3, insize, insize), generator=gen,
                   dtype=torch.float32)
    t = torch.randint(0, N_CLASSES, (batch,), generator=gen)
    return x, t


def wrap(mode, model, cfg):
    """``model`` as ``mode`` trains it: itself, or DDP with its hook."""
    if mode == 'alone':
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import (
        default_hooks, powerSGD_hook)
    bucket_cap_mb = cfg.get('bucket_cap_mb')   # None: DDP's default
    powersgd = mode.startswith('ddp_powersgd')
    if powersgd:
        bucket_cap_mb = ONE_BUCKET_MB
    net = DDP(model, bucket_cap_mb=bucket_cap_mb,
              forward_sync_buffers=bool(cfg.get('broadcast_buffers',
                                                False)))
    if mode == 'ddp_fp16':
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif powersgd:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(mode[len('ddp_powersgd'):]),
            start_powerSGD_iter=POWERSGD_START, use_error_feedback=True,
            warm_start=True)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif mode != 'ddp_fp32':
        raise ValueError('unknown mode {!r}: the PyTorch worker has {}'
                         .format(mode, ', '.join(MODES)))
    return net


class ModeRunner(object):
    """One mode's model and optimizer, kept for the whole job.

    Args:
        mode (str): one of :data:`MODES`.
        cfg (dict): the job's configuration.
        x, t: this rank's batch.
        distributed (bool): whether ranks meet at barriers.
    """

    def __init__(self, mode, cfg, x, t, distributed):
        import torch
        from benchmarks.harness import torch_models
        self.mode = mode
        self.distributed = distributed
        # The same seed on every rank (DDP would broadcast rank 0's
        # parameters anyway; "alone" needs it for equal work everywhere).
        self.model = torch_models.build_model(cfg['model'], seed=0)
        self.model.train()
        self.net = wrap(mode, self.model, cfg)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE,
                                   momentum=MOMENTUM)
        self.x, self.t = x, t

    def update(self):
        """One training step (DDP has reduced the gradients when backward
        returns)."""
        import torch.nn.functional as F
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.net(self.x), self.t)
        loss.backward()
        self.opt.step()

    def run(self, untimed, timed):
        """``untimed`` then ``timed`` updates; returns (times, tail)."""
        if self.distributed:
            import torch.distributed as dist
            dist.barrier()
        for _ in range(untimed):
            self.update()
        times = []
        last = time.perf_counter()
        for _ in range(timed):
            self.update()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        # Nothing is left pending after an update: DDP waits for its
        # reduction at the end of backward.
        return times, 0.0

    def checksum(self):
        """The sum of all parameters, in float64."""
        import torch
        with torch.no_grad():
            return float(sum(p.detach().double().sum()
                             for p in self.model.parameters()))


class Job(object):
    """The modes of one job and what they measured, on one rank."""

    def __init__(self, cfg):
        import torch
        self.cfg = cfg
        self.rank, self.size = rank_and_size()
        check_config(cfg, self.size)
        self.distributed = init_distributed(cfg, self.rank, self.size)
        self.x, self.t = synthetic_batch(cfg['batch'], cfg['insize'],
                                         self.rank)
        self.torch = torch
        self.runners = {}
        self.rounds = {m: [] for m in cfg['modes']}
        self.tails = {m: [] for m in cfg['modes']}

    def warmup(self):
        """Builds every mode and runs its warm-up updates."""
        for mode in self.cfg['modes']:
            runner = ModeRunner(mode, self.cfg, self.x, self.t,
                                self.distributed)
            runner.run(self.cfg['warmup'], 0)
            self.runners[mode] = runner

    def round(self, r):
        """Round ``r``: every mode once; returns this rank's times."""
        modes = self.cfg['modes'] if r % 2 == 0 else self.cfg['modes'][::-1]
        out = {}
        for mode in modes:
            times, tail = self.runners[mode].run(self.cfg.get('settle', 1),
                                                 self.cfg['iterations'])
            self.rounds[mode].append(times)
            self.tails[mode].append(tail)
            out[mode] = {'seconds': times, 'tail_seconds': tail}
        return out

    def checksums(self):
        return {m: self.runners[m].checksum() for m in self.cfg['modes']}

    def close(self):
        if self.distributed:
            import torch.distributed as dist
            dist.destroy_process_group()


def worker(cfg):
    """Runs the job; rank 0 prints the result line (see the module)."""
    import torch
    # Each rank has one core of its own on the bed: no thread pools.
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    job = Job(cfg)
    try:
        if turns.TurnClient.active():
            _conducted(job, turns.TurnClient(job.rank))
        else:
            _alone(job)
    finally:
        job.close()


def _conducted(job, client):
    for cmd in client.commands():
        if cmd['op'] == 'warmup':
            job.warmup()
            client.answer({'op': 'warmup', 'package': job.torch.__file__,
                           'version': job.torch.__version__})
        elif cmd['op'] == 'round':
            times = job.round(cmd['round'])
            client.answer({'op': 'round', 'round': cmd['round'],
                           'modes': times,
                           'stats': {m: None for m in job.cfg['modes']},
                           'param_checksums': job.checksums()})
        else:
            raise ValueError('unknown command {!r}'.format(cmd))


def _gather(job, obj):
    """Every rank's ``obj`` in rank order on rank 0 (None elsewhere)."""
    if not job.distributed:
        return [obj]
    import torch.distributed as dist
    out = [None] * job.size if job.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _alone(job):
    job.warmup()
    for r in range(job.cfg['rounds']):
        job.round(r)
    checksums = job.checksums()
    out = {'ranks': job.size, 'rounds': job.cfg['rounds'], 'modes': {}}
    for mode in job.cfg['modes']:
        by_rank = _gather(job, job.rounds[mode])
        sums = _gather(job, checksums[mode])
        if job.rank == 0:
            out['modes'][mode] = {
                'round_seconds': job.rounds[mode],
                'round_seconds_by_rank': by_rank,
                'tail_seconds': job.tails[mode],
                'communication_stats': None,
                'param_checksum': checksums[mode],
                'param_checksum_by_rank': sums}
    if job.rank == 0:
        # One write: under PYTHONUNBUFFERED print() may split the line.
        sys.stdout.write(RESULT_TAG + json.dumps(out) + '\n')
        sys.stdout.flush()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != [WORKER_FLAG] or len(argv) != 2:
        sys.stderr.write(
            'usage: python -m {} {} CFG_JSON (started by the peer '
            'benchmark; see the module docstring)\n'.format(
                MODULE, WORKER_FLAG))
        return 2
    worker(json.loads(argv[1]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
