"""The sharding peers' PyTorch worker: ZeRO and FSDP train ResNets, timed.

The counterpart of :mod:`benchmarks.harness.peers_torch` for PyTorch's
sharded training, so that our ``shard=`` stages and PyTorch's are measured
on the same test bed, in turns (:mod:`benchmarks.peers_sharding`).  It runs
in the peer environment (``make peers-venv``: ``.venv-peers``) and imports
only torch, the standard library, :mod:`benchmarks.harness.torch_models`,
:mod:`benchmarks.harness.turns` and :mod:`benchmarks.harness.peers_torch`
(whose rendezvous, batch and DDP set-up it reuses; that module imports only
the same).  Every rank runs::

    PYTHONPATH=<repository root> .venv-peers/bin/python \\
        -m benchmarks.harness.peers_torch_shard --worker CFG

with ``CFG`` as :mod:`benchmarks.harness.peers_torch` reads it (``model``,
``batch``, ``insize``, ``modes``, ``warmup``, ``settle``, ``iterations``,
``rounds``, ``master_addr``, ``master_port``, ``ifname``), ``modes`` from
:data:`MODES`.  Every mode trains the ResNet twin with
``Adam(lr=1e-4)`` and torch's other defaults (betas 0.9 and 0.999, eps
1e-8: what ``chainer.optimizers.Adam(alpha=1e-4)`` uses on our side), so
that optimizer state is 8 bytes per parameter on both sides:

* ``alone``: the plain model, no communication (the denominator of
  scalability);
* ``ddp_adam``: DDP in float32, the unsharded peer (DDP's defaults:
  buckets of 25 MB after a first of 1 MB; buffers not broadcast, as
  :mod:`benchmarks.harness.peers_torch`);
* ``zero1``: DDP and ``ZeroRedundancyOptimizer(optimizer_class=Adam)``
  (stage 1: each rank updates its part of the parameters, then broadcasts
  it; ``parameters_as_bucket_view=False``, its default);
* ``zero1_overlap``: the same with ``overlap_with_ddp=True`` and DDP's
  ``ddp_zero_hook.hook_with_zero_step`` around the all-reduce hook (the
  step runs inside the backward pass);
* ``fsdp2_grad_op`` / ``fsdp2_full``: FSDP2 (``fully_shard``) on every
  residual block, then on the root, over a one-dimensional CPU device mesh;
  the blocks with ``reshard_after_forward=False`` (stage 2) or ``True``
  (stage 3), the root with its default (not resharded: its parameters are
  the first the backward pass needs).  Prefetching: FSDP2's default
  (implicit; no ``set_modules_to_*_prefetch``);
* ``fsdp1_grad_op`` / ``fsdp1_full``: FSDP1 (``FullyShardedDataParallel``,
  ``device_id=cpu``) with ``ShardingStrategy.SHARD_GRAD_OP`` /
  ``FULL_SHARD``, auto-wrapped per residual block (``ModuleWrapPolicy``);
  its defaults otherwise (``backward_prefetch=BACKWARD_PRE``,
  ``forward_prefetch=False``, ``limit_all_gathers=True``,
  ``use_orig_params=False``).

A mode that does not run here (on CPU, over gloo) is a result too: its
exception at build time or in its warm-up is caught on every rank, the
ranks agree on it, its text (``Type: message``) is kept, and the other
modes run on.  ``zero1_overlap`` is one: torch refuses the overlapping
hook on gloo (it "may meet hangs").

Started by a conductor (:mod:`benchmarks.harness.turns`), the job answers
as :mod:`benchmarks.harness.peers_torch`'s does, its warm-up answer with
``errors`` (mode -> text) and its rounds with the modes that run.  Alone,
rank 0 prints ``TRAINER_RESULT {json}`` with those modes and ``errors``.
``param_checksum`` is the sum of every parameter in float64; for FSDP the
sum of each rank's shards, all-reduced, so that every mode's figure is the
whole model's and modes that train the same batches agree.  At two ranks,
tiny::

    .venv/bin/mpiexec -n 2 env PYTHONPATH=. OMP_NUM_THREADS=1 \\
        .venv-peers/bin/python -m benchmarks.harness.peers_torch_shard \\
        --worker '{"model": "resnet18", "batch": 2, "insize": 32,
        "modes": ["alone", "ddp_adam", "zero1", "fsdp2_full"], "warmup": 2,
        "iterations": 1, "rounds": 2, "master_addr": "127.0.0.1",
        "master_port": 29512, "ifname": "lo"}'

**Memory** (``--memory CFG``, one mode ``CFG['mode']`` per pair of
processes): :func:`memory_worker` measures resident memory as
:mod:`benchmarks.peers_sharding` describes (its baseline after two updates
of :func:`tiny_model` in the same mode, unless ``CFG['code_warmup']`` is
false), and rank 0 prints
``MEMORY_RESULT {json}``.  The helpers that read ``/proc/self/status``
(:func:`vm_status`, :func:`reset_peak`) serve our side too, so both sides
measure the same way.

Torch is imported only inside functions, so that the study, in the main
environment, can import the constants and those helpers.
"""
import gc
import json
import sys

from benchmarks.harness import peers_torch, turns

MODULE = 'benchmarks.harness.peers_torch_shard'
RESULT_TAG = peers_torch.RESULT_TAG
MEMORY_TAG = 'MEMORY_RESULT '
WORKER_FLAG = peers_torch.WORKER_FLAG
MEMORY_FLAG = '--memory'
MODES = ('alone', 'ddp_adam', 'zero1', 'zero1_overlap', 'fsdp2_grad_op',
         'fsdp2_full', 'fsdp1_grad_op', 'fsdp1_full')
# The ZeRO stage each mode is (0: unsharded; None: no communication).
STAGE = {'alone': None, 'ddp_adam': 0, 'zero1': 1, 'zero1_overlap': 1,
         'fsdp2_grad_op': 2, 'fsdp1_grad_op': 2, 'fsdp2_full': 3,
         'fsdp1_full': 3}
# Chainer's Adam(alpha=1e-4) on our side (trainer.actual_optimizer).
LEARNING_RATE = 1e-4
# The settings each mode runs with, for the result: all the peers'
# defaults but those named.
SETTINGS = {
    'alone': 'Adam(lr=1e-4)',
    'ddp_adam': 'DDP defaults (bucket_cap_mb 25, first bucket 1 MB, '
                'gradient_as_bucket_view=False: buckets beside .grad), '
                'broadcast_buffers off',
    'zero1': 'DDP as ddp_adam; ZeroRedundancyOptimizer defaults '
             '(parameters_as_bucket_view=False)',
    'zero1_overlap': 'overlap_with_ddp=True, '
                     'hook_with_zero_step(allreduce_hook)',
    'fsdp2_grad_op': 'fully_shard per block then root, blocks '
                     'reshard_after_forward=False, root default; implicit '
                     'prefetch (default)',
    'fsdp2_full': 'fully_shard per block then root, blocks '
                  'reshard_after_forward=True, root default; implicit '
                  'prefetch (default)',
    'fsdp1_grad_op': 'SHARD_GRAD_OP, ModuleWrapPolicy(residual blocks), '
                     'device_id=cpu; backward_prefetch=BACKWARD_PRE, '
                     'forward_prefetch=False, limit_all_gathers=True '
                     '(defaults)',
    'fsdp1_full': 'FULL_SHARD, ModuleWrapPolicy(residual blocks), '
                  'device_id=cpu; backward_prefetch=BACKWARD_PRE, '
                  'forward_prefetch=False, limit_all_gathers=True '
                  '(defaults)',
}


def check_config(cfg, size):
    """Raises ValueError when ``cfg`` cannot run at ``size`` ranks."""
    unknown = [m for m in cfg['modes'] if m not in MODES]
    if unknown:
        raise ValueError('unknown mode(s) {}: the sharding peer worker has '
                         '{}'.format(unknown, ', '.join(MODES)))
    shared = [m for m in cfg['modes'] if m != 'alone']
    if shared and size < 2:
        raise ValueError('mode(s) {} need at least 2 ranks (this job has '
                         '{}): start it under mpiexec -n 2 or more, or '
                         'run only "alone"'.format(shared, size))


def describe(error):
    """An exception as the result records it: ``Type: message``."""
    return '{}: {}'.format(type(error).__name__, error)


# ----------------------------------------------------------------------------
# The modes

def _blocks(model):
    """The residual blocks of a ResNet twin, in order."""
    return [block for stage in model.stages for block in stage]


def _fsdp2(model, reshard):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (dist.get_world_size(),))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    # The root at its default: not resharded after forward, since the
    # backward pass starts with its parameters.
    fully_shard(model, mesh=mesh)
    return model


def _fsdp1(model, strategy):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, \
        ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from benchmarks.harness import torch_models
    policy = ModuleWrapPolicy({torch_models.BasicBlock,
                               torch_models.BottleneckBlock})
    return FullyShardedDataParallel(
        model, sharding_strategy=getattr(ShardingStrategy, strategy),
        auto_wrap_policy=policy, device_id=torch.device('cpu'))


def tiny_model():
    """A ResNet of one narrow residual block (25 k parameters): the layer
    types of the twins, to run the code paths of a mode once before the
    memory baseline."""
    import torch
    from torch import nn
    from benchmarks.harness import torch_models
    torch.manual_seed(0)
    return torch_models._ResNet(
        [nn.Sequential(torch_models.BasicBlock(64, 16, 2))], 16,
        peers_torch.N_CLASSES)


def build(mode, cfg):
    """``mode``'s network and optimizer (``cfg['model']`` a twin's name,
    or ``'tiny'``: :func:`tiny_model`).

    Returns:
        tuple: (the network to call, the optimizer, the number of
        parameters of the model before any wrapper sharded it).
    """
    import torch
    from benchmarks.harness import torch_models
    if cfg['model'] == 'tiny':
        model = tiny_model()
    else:
        model = torch_models.build_model(cfg['model'], seed=0)
    model.train()
    nparams = torch_models.size(model)[1]
    if mode == 'alone':
        net = model
    elif mode in ('ddp_adam', 'zero1', 'zero1_overlap'):
        net = peers_torch.wrap('ddp_fp32', model, cfg)
    elif mode.startswith('fsdp2_'):
        net = _fsdp2(model, reshard=mode == 'fsdp2_full')
    elif mode.startswith('fsdp1_'):
        net = _fsdp1(model, 'FULL_SHARD' if mode == 'fsdp1_full'
                     else 'SHARD_GRAD_OP')
    else:
        raise ValueError('unknown mode {!r}: the sharding peer worker has '
                         '{}'.format(mode, ', '.join(MODES)))
    if mode.startswith('zero1'):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        overlap = mode == 'zero1_overlap'
        opt = ZeroRedundancyOptimizer(
            net.parameters(), optimizer_class=torch.optim.Adam,
            overlap_with_ddp=overlap, lr=LEARNING_RATE)
        if overlap:
            from torch.distributed.algorithms.ddp_comm_hooks import (
                ddp_zero_hook, default_hooks)
            net.register_comm_hook(None, ddp_zero_hook.hook_with_zero_step(
                default_hooks.allreduce_hook, net, opt))
    else:
        # FSDP1's flat parameters, FSDP2's sharded ones, or the model's.
        opt = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
    return net, opt, nparams


class ShardRunner(peers_torch.ModeRunner):
    """One mode's network and optimizer, kept for the whole job
    (:class:`benchmarks.harness.peers_torch.ModeRunner`'s updates and
    rounds, with :func:`build`'s modes)."""

    def __init__(self, mode, cfg, x, t, distributed):
        self.mode = mode
        self.distributed = distributed
        self.net, self.opt, self.nparams = build(mode, cfg)
        self.x, self.t = x, t

    def checksum(self):
        """The sum of all parameters in float64, the same on every rank."""
        import torch
        with torch.no_grad():
            if STAGE[self.mode] not in (2, 3):
                return float(sum(p.detach().double().sum()
                                 for p in self.net.parameters()))
            import torch.distributed as dist
            # FSDP holds shards (FSDP2: DTensors; FSDP1: flat parameters
            # padded with zeros): the whole model's sum is their sum over
            # ranks.
            local = sum(float((p.to_local() if hasattr(p, 'to_local')
                               else p).detach().double().sum())
                        for p in self.net.parameters())
            total = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(total)
            return float(total[0])


def _agreed_error(job, error):
    """The first rank's error if any rank has one (every rank drops the
    mode alike, so that no rank waits in a collective the others left)."""
    if not job.distributed:
        return error
    import torch.distributed as dist
    every = [None] * job.size
    dist.all_gather_object(every, error)
    return next((e for e in every if e), None)


class ShardJob(object):
    """The modes of one job, what they measured and which failed, on one
    rank."""

    def __init__(self, cfg):
        import torch
        self.cfg = cfg
        self.rank, self.size = peers_torch.rank_and_size()
        check_config(cfg, self.size)
        self.distributed = peers_torch.init_distributed(cfg, self.rank,
                                                        self.size)
        self.x, self.t = peers_torch.synthetic_batch(cfg['batch'],
                                                     cfg['insize'], self.rank)
        self.torch = torch
        self.runners = {}
        self.errors = {}
        self.rounds, self.tails = {}, {}

    @property
    def modes(self):
        """The modes that run (those that did not fail), in order."""
        return [m for m in self.cfg['modes'] if m not in self.errors]

    def warmup(self):
        """Builds every mode and runs its warm-up; keeps what failed."""
        for mode in self.cfg['modes']:
            runner, error = None, None
            try:
                runner = ShardRunner(mode, self.cfg, self.x, self.t,
                                     self.distributed)
                runner.run(self.cfg['warmup'], 0)
            # Broad on purpose: whatever a peer raises on CPU/gloo is the
            # result for that mode, and the other modes still run.
            except Exception as e:  # noqa: B902
                error = describe(e)
            error = _agreed_error(self, error)
            if error and mode == 'alone':
                # Every figure is against it: no result without it.
                raise RuntimeError(
                    'rank {}: the reference mode "alone" failed ({}); fix '
                    'the configuration (model, batch {}, insize {})'.format(
                        self.rank, error, self.cfg['batch'],
                        self.cfg['insize']))
            if error:
                self.errors[mode] = error
            else:
                self.runners[mode] = runner
        self.rounds = {m: [] for m in self.modes}
        self.tails = {m: [] for m in self.modes}

    def round(self, r):
        """Round ``r``: every running mode once; this rank's times."""
        modes = self.modes if r % 2 == 0 else self.modes[::-1]
        out = {}
        for mode in modes:
            times, tail = self.runners[mode].run(self.cfg.get('settle', 1),
                                                 self.cfg['iterations'])
            self.rounds[mode].append(times)
            self.tails[mode].append(tail)
            out[mode] = {'seconds': times, 'tail_seconds': tail}
        return out

    def checksums(self):
        return {m: self.runners[m].checksum() for m in self.modes}

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
    job = ShardJob(cfg)
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
                           'version': job.torch.__version__,
                           'modes': job.modes, 'errors': job.errors})
        elif cmd['op'] == 'round':
            times = job.round(cmd['round'])
            client.answer({'op': 'round', 'round': cmd['round'],
                           'modes': times,
                           'stats': {m: None for m in job.modes},
                           'param_checksums': job.checksums()})
        else:
            raise ValueError('unknown command {!r}'.format(cmd))


def _alone(job):
    job.warmup()
    for r in range(job.cfg['rounds']):
        job.round(r)
    checksums = job.checksums()
    out = {'ranks': job.size, 'rounds': job.cfg['rounds'], 'modes': {},
           'errors': job.errors, 'version': job.torch.__version__}
    for mode in job.modes:
        by_rank = peers_torch._gather(job, job.rounds[mode])
        sums = peers_torch._gather(job, checksums[mode])
        if job.rank == 0:
            out['modes'][mode] = {
                'round_seconds': job.rounds[mode],
                'round_seconds_by_rank': by_rank,
                'tail_seconds': job.tails[mode],
                'communication_stats': None,
                'param_checksum': checksums[mode],
                'param_checksum_by_rank': sums}
    if job.rank == 0:
        _emit(RESULT_TAG, out)


def _emit(tag, obj):
    # One write: under PYTHONUNBUFFERED print() may split the line.
    sys.stdout.write(tag + json.dumps(obj) + '\n')
    sys.stdout.flush()


# ----------------------------------------------------------------------------
# Memory: resident bytes, read the same way on both sides

def parse_status(text):
    """``{field: kB}`` of the ``Vm*`` lines of ``/proc/<pid>/status``."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(':')
        if sep and key.startswith('Vm') and value.split():
            out[key] = int(value.split()[0])
    return out


def vm_status():
    """This process's ``VmRSS``, ``VmHWM``, ... in kB."""
    with open('/proc/self/status') as f:
        return parse_status(f.read())


def reset_peak():
    """Resets ``VmHWM`` to the current ``VmRSS`` (``clear_refs`` 5), so
    that the next read is the peak since now."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')


def activation_bytes(model_name, x):
    """The bytes autograd keeps for the backward pass of one forward pass
    of ``model_name`` on ``x``: the tensors it saves, each storage once,
    the parameters left out (an estimate of the activations' share)."""
    import torch
    from benchmarks.harness import torch_models
    model = torch_models.build_model(model_name, seed=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(seen.values())


def _measure(cfg, rank, distributed, x, t):
    """This rank's raw memory row of ``cfg['mode']`` (kB since the
    baseline; see :mod:`benchmarks.peers_sharding`)."""
    row = {'rank': rank}
    try:
        if cfg.get('code_warmup', True):
            # The mode's code paths once, on a tiny network: what torch
            # maps or allocates once per process (about 50 MB of code
            # pages, kernels and pools) belongs to the baseline, not to the
            # parameters.
            ShardRunner(cfg['mode'], dict(cfg, model='tiny'), x, t,
                        distributed).run(2, 0)
        gc.collect()
        row['base_kb'] = vm_status()['VmRSS']
        runner = ShardRunner(cfg['mode'], cfg, x, t, distributed)
        row['parameters'] = runner.nparams
        runner.run(cfg['warmup'], 0)
        gc.collect()
        row['rss_kb'] = vm_status()['VmRSS']
        reset_peak()
        runner.update()
        row['hwm_kb'] = vm_status()['VmHWM']
        gc.collect()
        row['rss_after_kb'] = vm_status()['VmRSS']
    # Broad on purpose: a peer that does not run here is a row with its
    # error, as in the timed job.
    except Exception as e:  # noqa: B902
        row['error'] = describe(e)
    return row


def memory_worker(cfg):
    """One mode's memory on every rank; rank 0 prints the result line."""
    import torch
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    # Imported before the baseline: code and imports are not the model's.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
    rank, size = peers_torch.rank_and_size()
    check_config(dict(cfg, modes=[cfg['mode']]), size)
    distributed = peers_torch.init_distributed(cfg, rank, size)
    try:
        x, t = peers_torch.synthetic_batch(cfg['batch'], cfg['insize'],
                                           rank)
        row = _measure(cfg, rank, distributed, x, t)
        if cfg.get('activations') and rank == 0:
            row['activation_bytes'] = activation_bytes(cfg['model'], x)
        rows = [row]
        if distributed:
            import torch.distributed as dist
            rows = [None] * size
            dist.all_gather_object(rows, row)
        if rank == 0:
            _emit(MEMORY_TAG, {'mode': cfg['mode'], 'ranks': size,
                               'version': torch.__version__,
                               'rows': rows})
    finally:
        if distributed:
            import torch.distributed as dist
            dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] not in ([WORKER_FLAG], [MEMORY_FLAG]) or len(argv) != 2:
        sys.stderr.write(
            'usage: python -m {} {}|{} CFG_JSON (started by '
            'benchmarks.peers_sharding; see the module docstring)\n'.format(
                MODULE, WORKER_FLAG, MEMORY_FLAG))
        return 2
    cfg = json.loads(argv[1])
    (worker if argv[0] == WORKER_FLAG else memory_worker)(cfg)
    return 0


if __name__ == '__main__':
    sys.exit(main())
