"""The optimizer benchmarks' worker: trains each mode, timed, in rounds.

Every rank of a benchmark job runs :func:`worker` (``python -m
benchmarks.harness.trainer --worker CFG``).  For each mode of ``cfg['modes']``
it builds one model (the same seed everywhere) and one optimizer, warms them up
(``cfg['warmup']`` updates), and keeps them for the whole job.  Then, in
each of ``cfg['rounds']`` rounds, every mode in turn runs
``cfg['settle']`` untimed updates (the machine switches from another
mode's working set) and ``cfg['iterations']`` timed ones, and finishes
what it left pending (``synchronize()``: the *tail*).  The order of modes
alternates between rounds.  Idle optimizers cost nothing (their threads
block), so keeping every mode alive costs only memory, and the warm-up is
paid once per mode rather than once per round.

Modes:

* ``alone``: the actual optimizer, no communication (the denominator of
  scalability, measured under the same load as the others);
* ``blocking``: ChainerMN's ``create_multi_node_optimizer``;
* ``double_buffering``: ``create_double_buffering_optimizer``;
* ``overlap_update`` / ``overlap_forward``: ours with that ``wait``;
* ``overlap_forward_<variant>`` (or ``overlap_update_<variant>``): ours
  with a wire format, compression or sharding of :data:`WIRE_OPTIONS`.

Started by a conductor (:mod:`benchmarks.harness.turns`), the job takes its
rounds when told to, so that another job (another revision, a peer framework)
runs its rounds in between; otherwise it runs its rounds by itself and rank 0
prints the result line.
"""
import os
import sys
import time

from benchmarks.harness import launch, turns

MODULE = 'benchmarks.harness.trainer'
RESULT_TAG = 'TRAINER_RESULT '
STAT_KEYS = ('buckets', 'bytes', 'comm_seconds', 'wait_seconds',
             'compression_seconds')


def _powersgd(rank):
    def options():
        import chainermn_overlap
        # Compressed from the first update after the broadcast: an exact
        # warm-up update's reduction would spill into the first timed
        # iteration (with wait='forward' it is waited for there).
        return {'compression': chainermn_overlap.PowerSGD(
            rank=rank, warmup_iterations=0)}
    return options


# Ours (wait='forward') with fewer bytes on the wire, or sharded.
WIRE_OPTIONS = {
    'overlap_forward_float16': lambda: {'allreduce_grad_dtype': 'float16'},
    'overlap_forward_powersgd1': _powersgd(1),
    'overlap_forward_powersgd2': _powersgd(2),
    'overlap_forward_powersgd4': _powersgd(4),
    'overlap_forward_shard_optimizer': lambda: {'shard': 'optimizer'},
    'overlap_forward_shard_gradients': lambda: {'shard': 'gradients'},
    'overlap_forward_shard_parameters': lambda: {'shard': 'parameters'},
    # Stages 1 and 2 with every update and allgather posted at update().
    'overlap_forward_shard_optimizer_at_update':
        lambda: {'shard': 'optimizer', 'shard_update': 'update'},
    'overlap_forward_shard_gradients_at_update':
        lambda: {'shard': 'gradients', 'shard_update': 'update'},
    # The earlier ways, for A/B runs (set on the optimizer in
    # make_optimizer): the allgather polls in MPI's blocking call; stage 1
    # (and stage 2, below) waits in backward while two buckets wait for
    # their reduce-scatter.
    'overlap_forward_shard_optimizer_polled_throttled':
        lambda: {'shard': 'optimizer'},
    'overlap_forward_shard_gradients_polled': lambda: {'shard': 'gradients'},
    # Stage 2 as before shard_in_flight's default: backward waits while two
    # buckets wait for their reduce-scatter.
    'overlap_forward_shard_gradients_throttled': lambda: {'shard': 'gradients'},
}
# Stage 3 with less memory or no bound than by default: 'lean' (as before
# shard_prefetch: one bucket fetched ahead, two buckets of gradients in
# flight), 'unbounded' (shard_prefetch=None), '_prefetch<N>' (N MiB).
WIRE_OPTIONS.update({
    'overlap_forward_shard_parameters_lean': lambda: {
        'shard': 'parameters', 'shard_prefetch': 0,
        'shard_in_flight': '8MiB'},
    'overlap_forward_shard_parameters_unbounded': lambda: {
        'shard': 'parameters', 'shard_prefetch': None}})
for _n in (16, 32, 64, 128):
    WIRE_OPTIONS['overlap_forward_shard_parameters_prefetch{}'.format(_n)] = (
        lambda n=_n: {'shard': 'parameters', 'shard_prefetch': n << 20})


def actual_optimizer(cfg):
    """The optimizer every mode wraps: MomentumSGD, or ``cfg['optimizer']
    == 'adam'``."""
    import chainer
    if cfg.get('optimizer') == 'adam':
        return chainer.optimizers.Adam(alpha=1e-4)
    return chainer.optimizers.MomentumSGD(0.01, 0.9)


def make_optimizer(mode, comm, cfg):
    """The optimizer of ``mode`` (see the module docstring)."""
    import chainermn
    import chainermn_overlap
    from benchmarks.harness import anchor
    from chainermn_overlap.communication import emulated
    actual = actual_optimizer(cfg)
    emu = cfg.get('emulation')
    backend = {}   # the library's default engine
    if emu:
        # The same engine as a real run, timed by the link model.
        backend = {'backend': emulated.configure(
            emu['nodes'], emu['bandwidth_bit_per_s'], emu['latency_s'])}
    if mode == 'alone':
        return actual
    if mode == 'blocking':
        mn_comm = comm
        if emu:
            mn_comm = anchor.EmulatedCommunicator(comm, emulated.LinkModel(
                emu['nodes'], emu['bandwidth_bit_per_s'], emu['latency_s']))
        return chainermn.create_multi_node_optimizer(actual, mn_comm)
    if mode == 'double_buffering':
        return chainermn_overlap.create_double_buffering_optimizer(
            actual, comm, **backend)
    wait = (mode.split('_') + [''])[1]
    options = dict(backend, wait=wait)
    # A variant applies to either wait: overlap_update_powersgd4 is
    # overlap_forward_powersgd4's options with wait='update'.
    variant = mode.replace('overlap_' + wait, 'overlap_forward', 1)
    if (not mode.startswith('overlap_') or wait not in ('forward', 'update')
            or variant != 'overlap_forward' and variant not in WIRE_OPTIONS):
        raise ValueError('unknown benchmark mode {!r}: alone, blocking, '
                         'double_buffering, overlap_forward, overlap_update '
                         'or overlap_<wait>_<variant> with a variant of {}'
                         .format(mode, sorted(v.split('_', 2)[2]
                                              for v in WIRE_OPTIONS)))
    options.update(WIRE_OPTIONS.get(variant, lambda: {})())
    if cfg.get('bucket_size'):
        options['bucket_size'] = cfg['bucket_size']
    trace = cfg.get('trace')
    if trace and mode == cfg.get('trace_mode', 'overlap_forward'):
        options['timeline'] = trace
    opt = chainermn_overlap.create_overlapped_optimizer(actual, comm,
                                                        **options)
    if '_polled' in mode:
        opt._overlap.policy.gather_wait = 'poll'
    if mode.endswith('_throttled'):
        # The policy throttles backward whenever in_flight is a bound.
        opt._overlap.policy.in_flight = (2, 'buckets')
    return opt


def merge_stats(a, b):
    """Communication statistics of two stretches of one mode, summed."""
    if a is None:
        return b
    out = dict(a)
    for k in STAT_KEYS:
        if k in b:
            out[k] = a.get(k, 0) + b[k]
    c = out.get('comm_seconds') or 0
    out['hidden_fraction'] = (1.0 - out['wait_seconds'] / c) if c else None
    return out


class ModeRunner(object):
    """One mode's model and optimizer, kept for the whole job."""

    def __init__(self, mode, comm, cfg, x, t):
        import chainer.functions as F
        from benchmarks.harness import workloads
        self.mode = mode
        self.comm = comm
        self.model = workloads.build_model(cfg['model'])
        self.opt = make_optimizer(mode, comm, cfg)
        self.opt.setup(self.model)
        model = self.model

        def lossfun():
            return F.softmax_cross_entropy(model(x), t)
        self.lossfun = lossfun
        self.stats = None

    def _finish(self):
        # Work still pending (wait='forward', double buffering) belongs to
        # the timed iterations: reported as the round's tail.
        if hasattr(self.opt, 'synchronize'):
            self.opt.synchronize()
        elif hasattr(self.opt, 'wait'):
            self.opt.wait()

    def run(self, untimed, timed):
        """``untimed`` then ``timed`` updates; returns (times, tail)."""
        self.comm.mpi_comm.Barrier()
        for _ in range(untimed):
            self.opt.update(self.lossfun)
        counts = hasattr(self.opt, 'communication_stats')
        times = []
        last = time.perf_counter()
        if counts:
            self.opt.communication_stats(reset=True)
        for _ in range(timed):
            self.opt.update(self.lossfun)
            now = time.perf_counter()
            times.append(now - last)
            last = now
        self._finish()
        tail = time.perf_counter() - last
        if counts and timed:
            self.stats = merge_stats(self.stats,
                                     self.opt.communication_stats())
        return times, tail

    def close(self):
        if hasattr(self.opt, 'close'):
            self.opt.close()


class Job(object):
    """The modes of one job and what they measured, on one rank."""

    def __init__(self, cfg):
        import numpy as np
        import chainermn
        from benchmarks.harness import workloads
        self.cfg = cfg
        self.comm = chainermn.create_communicator('naive')
        rng = np.random.RandomState(1 + self.comm.rank)
        self.x, self.t = workloads.synthetic_batch(rng, cfg['batch'],
                                                   cfg['insize'])
        self.runners = {}
        self.rounds = {m: [] for m in cfg['modes']}
        self.tails = {m: [] for m in cfg['modes']}

    def warmup(self):
        for mode in self.cfg['modes']:
            runner = ModeRunner(mode, self.comm, self.cfg, self.x, self.t)
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

    def stats(self):
        return {m: self.runners[m].stats for m in self.cfg['modes']}

    def close(self):
        for runner in self.runners.values():
            runner.close()


def _debug_logging():
    # CHAINERMN_OVERLAP_BENCH_DEBUG=1: the library's debug records (the
    # shard server's requests and answers among them) on stderr, which a
    # failed job's log keeps.
    if os.environ.get('CHAINERMN_OVERLAP_BENCH_DEBUG'):
        import logging
        logging.basicConfig(
            level=logging.WARNING,
            format='%(relativeCreated)9.1f %(threadName)s %(name)s: '
                   '%(message)s')
        logging.getLogger('chainermn_overlap').setLevel(logging.DEBUG)


def worker(cfg):
    """Runs the job; rank 0 prints the result line (see the module)."""
    _debug_logging()
    job = Job(cfg)
    try:
        if turns.TurnClient.active():
            _conducted(job, turns.TurnClient(job.comm.rank))
        else:
            _alone(job)
    finally:
        job.close()


def _conducted(job, client):
    for cmd in client.commands():
        if cmd['op'] == 'warmup':
            import chainermn_overlap
            job.warmup()
            # Which package ran: an A/B comparison checks each job used
            # its own revision.
            client.answer({'op': 'warmup',
                           'package': chainermn_overlap.__file__,
                           'version': getattr(chainermn_overlap,
                                              '__version__', None)})
        elif cmd['op'] == 'round':
            times = job.round(cmd['round'])
            client.answer({'op': 'round', 'round': cmd['round'],
                           'modes': times, 'stats': job.stats()})
        else:
            raise ValueError('unknown command {!r}'.format(cmd))


def _alone(job):
    job.warmup()
    for r in range(job.cfg['rounds']):
        job.round(r)
    mpi = job.comm.mpi_comm
    out = {'ranks': job.comm.size, 'rounds': job.cfg['rounds'], 'modes': {}}
    stats = job.stats()
    for mode in job.cfg['modes']:
        by_rank = mpi.gather(job.rounds[mode], root=0)
        if job.comm.rank == 0:
            out['modes'][mode] = {
                'round_seconds': job.rounds[mode],
                'round_seconds_by_rank': by_rank,
                'tail_seconds': job.tails[mode],
                'communication_stats': stats[mode]}
    if job.comm.rank == 0:
        launch.emit_result(RESULT_TAG, out)


def result_from_answers(answers, modes):
    """The result of a conducted job from its ranks' round answers.

    Args:
        answers (list): per round, the list of rank answers.
        modes (list): the job's modes.

    Returns:
        dict: as the result line of a job that ran alone.
    """
    out = {'ranks': len(answers[0]) if answers else 0,
           'rounds': len(answers), 'modes': {}}
    for mode in modes:
        by_rank = [[rnd[r]['modes'][mode]['seconds'] for rnd in answers]
                   for r in range(out['ranks'])]
        out['modes'][mode] = {
            'round_seconds': by_rank[0] if by_rank else [],
            'round_seconds_by_rank': by_rank,
            'tail_seconds': [rnd[0]['modes'][mode]['tail_seconds']
                             for rnd in answers],
            'communication_stats': answers[-1][0]['stats'][mode]
            if answers else None}
    return out


def main(argv=None):
    if not launch.dispatch_worker(argv, worker):
        sys.stderr.write('benchmarks.harness.trainer is started by the '
                         'benchmarks (python -m benchmarks overlap, ...)\n')
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
