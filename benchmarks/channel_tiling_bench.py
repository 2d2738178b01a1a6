"""Filter/channel parallelism for late stages, and overlapped tiling on a
link with latency (distconv).

Run (what ``make bench-spatial`` does after the spatial benchmark; the
tiling part needs root for the network test bed)::

    .venv/bin/python -m benchmarks.channel_tiling_bench
    .venv/bin/python -m benchmarks.channel_tiling_bench --quick   # smoke

(a) Late stage (``late``): one ResNet-50 res4 bottleneck (1x1 1024->256,
    3x3 256->256, 1x1 256->1024, batch norm, ReLU, identity shortcut) on a
    14x14 map, batch 1, in one 2-process job. Settings, alternating round
    by round:

    * ``chainer_1p``: plain Chainer links on rank 0 alone, and
      ``distconv_1p``: the example's block on a 1x1 grid of rank 0 alone
      (the other rank sleeps in a barrier meanwhile, so rank 0 has a core
      to itself, as a process of its own would). The baseline of each
      round is the faster of the two.
    * ``twin_1p``: both ranks run the plain block at once, without
      messages: ``2 x chainer_1p / twin_1p`` is the most 2 processes can
      gain on this machine (shared caches and memory bandwidth).
    * ``spatial``: grid (2, 1), halos on a 7-row block.
    * ``filter_channel``: grid (1, 1) with channels=2, the layout of
      ``examples/spatial/train_resnet50_channels.py``: the block takes and
      returns its channel block (as the spatial setting takes and returns
      its row block); conv1 and conv2 ``'channel'`` with their partial
      sums reduce-scattered, conv3 ``'filter'`` gathering conv2's blocks
      (``split_input``), each overlapping its messages with the products
      of the other blocks; ``filter_channel_serial``: the same model with
      ``grid.channel_overlap = False`` (convolution, then collective).
    * ``filter_channel_whole_io``: the plain filter -> channel -> filter
      pairing with whole channels in and out (conv2 allreduced, the output
      gathered), for comparison.

    Per setting: ``steps`` timed forward+backward steps per round, each
    round's steps after an untimed step of the same setting (right after
    another setting the caches hold that setting's data), the median step
    time; speed-ups are medians of per-round ratios to that round's
    baseline. Parameter bytes per process, bytes numpy holds after forward
    (activations kept for backward) and the peak during a step
    (tracemalloc), as ratios to ``distconv_1p``.

(b) Tiling (``tiling``): a stack of 3x3 convolutions (ReLU between) over a
    grid (2, 1), the 2 ranks in separate network namespaces behind a link
    with a one-way delay (``--delays``, default 1, 2, 3 and 5 ms;
    ``testbed/netbed.py``: ``netem`` where the kernel has it, else a
    TAP pair through a relay that holds each frame for the delay, as on
    this kernel), per-process blocks small enough that a
    layer's interior computation is shorter than the delay (measured and
    recorded as ``layer_compute_s``). Settings, alternated round by round:
    layer by layer (distconv layers, overlapped exchange) and ``Tiled`` at
    depth 1, 2, 4 and all. Per setting: step time, exposed exchange time
    per step (seconds blocked in halo waits, forward + backward), exchange
    rounds per step, and the redundant computation tiling costs (cells
    computed over cells owned, summed over layers, and the extra compute
    time that implies at the measured per-layer cost). Then the tuner
    (``distconv.tune`` over ``tuner.depth_candidates``) chooses a depth on
    the same link; its choice and table are recorded. Without root, with
    ``--no-netbed``, or where neither delay method works, the
    tiling part runs over shared memory with the latency added in the
    processes' distconv message layer instead (each exchange completes
    ``delay`` after it is posted; computation in between hides it, as on a
    link), and is labelled so.

Results: ``benchmarks/results/channel_tiling.json``. The machine this was
written on has 2 shared cores: take figures on a quiet machine.
"""
import argparse
import json
import os
import platform
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import distconv_jobs, launch  # noqa: E402

RESULT_TAG = 'RESULT '
MODULE = 'benchmarks.channel_tiling_bench'


# ---------------------------------------------------------------------------
# (a) late stage: spatial vs filter/channel
# ---------------------------------------------------------------------------
def _plain_bottleneck(c, mid):
    """The same block from plain Chainer links (no distconv at all)."""
    import chainer
    import chainer.functions as F
    import chainer.links as L
    from chainer import initializers

    class Plain(chainer.Chain):
        def __init__(self):
            super(Plain, self).__init__()
            he = initializers.HeNormal
            with self.init_scope():
                self.conv1 = L.Convolution2D(c, mid, 1, nobias=True,
                                             initialW=he())
                self.bn1 = L.BatchNormalization(mid)
                self.conv2 = L.Convolution2D(mid, mid, 3, 1, 1, nobias=True,
                                             initialW=he())
                self.bn2 = L.BatchNormalization(mid)
                self.conv3 = L.Convolution2D(mid, c, 1, nobias=True,
                                             initialW=he())
                self.bn3 = L.BatchNormalization(c)

        def forward(self, x):
            h = F.relu(self.bn1(self.conv1(x)))
            h = F.relu(self.bn2(self.conv2(h)))
            return F.relu(self.bn3(self.conv3(h)) + x)

    return Plain()


def _late_models(comm, cfg):
    """{setting: (grid or None, model, input, processes)}.

    Settings with ``processes == 1`` run on rank 0 alone (their grid is
    on ``COMM_SELF``) while the other rank sleeps in a barrier; ``twin``
    runs the plain model on every rank at once, without messages.
    """
    import numpy as np
    from mpi4py import MPI
    from chainermn_overlap import distconv
    from examples.spatial import train_resnet50_channels as rc
    c, mid, n = cfg['channels'], cfg['channels'] // 4, cfg['insize']
    shape = (cfg['batchsize'], c, n, n)
    x = np.random.RandomState(1).randn(*shape).astype(np.float32)
    out = {}
    np.random.seed(0)
    out['twin_1p'] = (None, _plain_bottleneck(c, mid), x, 'twin')
    if comm.rank == 0:
        np.random.seed(0)
        out['chainer_1p'] = (None, _plain_bottleneck(c, mid), x, 1)
        g1 = distconv.SpatialGrid(MPI.COMM_SELF, (1, 1))
        np.random.seed(0)
        out['distconv_1p'] = (
            g1, rc.Bottleneck(rc.SpatialLayers(g1), c, mid, c), x, 1)
    P = comm.size
    gs = distconv.SpatialGrid(comm, (P, 1))
    np.random.seed(0)
    out['spatial'] = (gs, rc.Bottleneck(rc.SpatialLayers(gs), c, mid, c),
                      gs.scatter(x), P)
    gc = distconv.SpatialGrid(comm, (1, 1), channels=P)
    np.random.seed(0)
    # Channel blocks in and out, as inside a stage of the example (like
    # the spatial setting's row blocks); conv3 gathers conv2's blocks.
    block = rc.Bottleneck(rc.ChannelLayers(gc), c, mid, c, channel=True)
    xc = gc.scatter(x, channel_split=True)
    out['filter_channel'] = (gc, block, xc, P)
    # The same model and grid with the channel messages after each
    # convolution instead of overlapped with it (grid.channel_overlap).
    out['filter_channel_serial'] = (gc, block, xc, P)
    # The plain filter -> channel -> filter pairing with whole channels in
    # and out (the output gathered, its gradient reduced).
    np.random.seed(0)
    out['filter_channel_whole_io'] = (
        gc, rc.Bottleneck(rc.ChannelLayers(gc), c, mid, c, channel=True,
                          channel_io='whole'), x, P)
    return out


def _loss(model, x):
    import chainer.functions as F
    return F.sum(model(x))


def _step(model, x):
    loss = _loss(model, x)
    model.cleargrads()
    loss.backward()


def late_worker(cfg):
    """Times every setting in one job, settings alternating round by round.

    The 1-process settings run on rank 0 between the 2-process ones (the
    other rank sleeps in a barrier, so rank 0 has a core to itself as a
    process of its own would), so drift on a shared machine hits the
    baseline and the distributed runs alike; speed-ups are medians of
    per-round ratios. Every timed step follows an untimed step of the same
    setting: right after another setting (other communicators, other
    weights) the caches hold that setting's data, which cost a 2-process
    step 0.7-0.9 ms of 10 here.
    """
    import chainermn
    import numpy as np
    comm = chainermn.create_communicator('naive')
    mpi = comm.mpi_comm
    cfg_all = _late_models(comm, cfg)
    names = sorted(mpi.bcast(sorted(cfg_all) if comm.rank == 0 else None))
    steps = cfg['steps']
    times = {k: [] for k in names}

    def configure(name):
        g = cfg_all[name][0] if name in cfg_all else None
        if g is not None and g.channels > 1:
            g.channel_overlap = name != 'filter_channel_serial'

    for name in names:  # warm-up: plans, validation, connections
        procs = cfg_all[name][3] if name in cfg_all else 1
        if procs == 1:
            if comm.rank == 0:
                _step(*cfg_all[name][1:3])
            distconv_jobs.quiet_barrier(mpi)
            continue
        configure(name)
        _step(*cfg_all[name][1:3])
    for r in range(cfg['rounds']):
        # Rotate the order each round: drift on a shared machine hits all.
        for name in names[r % len(names):] + names[:r % len(names)]:
            procs = cfg_all[name][3] if name in cfg_all else 1
            if procs == 1:
                if comm.rank == 0:
                    model, x = cfg_all[name][1:3]
                    _step(model, x)
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        _step(model, x)
                        times[name].append(time.perf_counter() - t0)
                distconv_jobs.quiet_barrier(mpi)
                continue
            configure(name)
            model, x = cfg_all[name][1:3]
            _step(model, x)
            for _ in range(steps):
                mpi.Barrier()
                t0 = time.perf_counter()
                _step(model, x)
                mpi.Barrier()
                times[name].append(time.perf_counter() - t0)
    out = {'processes': comm.size, 'steps_per_round': steps,
           'rounds': cfg['rounds'], 'settings': {}}
    for name in names:
        procs = cfg_all[name][3] if name in cfg_all else 1
        here = name in cfg_all
        if here:
            g, model, x, _ = cfg_all[name]
            configure(name)
            peak, held = distconv_jobs.step_memory(
                model, lambda: _loss(model, x))
            wbytes = sum(p.array.nbytes for p in model.params())
            mine = [peak, held, wbytes]
        else:
            mine = None
        if procs == 1:
            per_rank = [mine]
        else:
            per_rank = mpi.allgather(mine)
        if comm.rank != 0:
            continue
        g = cfg_all[name][0]
        out['settings'][name] = {
            'processes': comm.size if procs != 1 else 1,
            'grid': None if g is None else list(g.shape),
            'channel_axis': None if g is None else g.channels,
            'channel_overlap': None if g is None or g.channels == 1
            else name != 'filter_channel_serial',
            'median_step_s': float(np.median(times[name])),
            'step_s': times[name],
            'param_bytes_per_process': [v[2] for v in per_rank],
            'peak_bytes_per_process': [v[0] for v in per_rank],
            'held_after_forward_bytes_per_process': [v[1] for v in per_rank],
        }
    if comm.rank == 0:
        launch.emit_result(RESULT_TAG, out)


def late_summary(run):
    """Speed-ups (medians of per-round ratios) and memory ratios.

    The baseline of a round is the faster of the two 1-process settings
    (plain Chainer links, and the distconv model on a 1x1 grid) in that
    round. ``twin_bound`` is what 2 processes could reach on this machine
    at most: 2 x (plain step alone) / (plain step while the other core
    runs the same), per round.
    """
    import numpy as np
    st = run['settings']
    k = run['steps_per_round']

    def rounds(name):
        v = st[name]['step_s']
        return [float(np.median(v[i:i + k])) for i in range(0, len(v), k)]

    base = [min(a, b) for a, b in zip(rounds('chainer_1p'),
                                      rounds('distconv_1p'))]
    out = {'baseline_1p_s': float(np.median(base)),
           'twin_bound': float(np.median(
               [2 * a / b for a, b in zip(rounds('chainer_1p'),
                                          rounds('twin_1p'))])),
           'speedup': {}, 'param_bytes_ratio': {},
           'peak_bytes_ratio': {}, 'held_bytes_ratio': {}}
    ref = st['distconv_1p']
    for name, v in st.items():
        if v['processes'] == 1 or name == 'twin_1p':
            continue
        out['speedup'][name] = float(np.median(
            [a / b for a, b in zip(base, rounds(name))]))
        for key, field in (('param_bytes_ratio', 'param_bytes_per_process'),
                           ('peak_bytes_ratio', 'peak_bytes_per_process'),
                           ('held_bytes_ratio',
                            'held_after_forward_bytes_per_process')):
            out[key][name] = max(v[field]) / max(1, ref[field][0])
    return out


# ---------------------------------------------------------------------------
# (b) tiling over a link with latency
# ---------------------------------------------------------------------------
def _stack(grid, cfg, depth):
    """(callable model, list of convs) of the 3x3 conv stack."""
    import chainer.functions as F
    import numpy as np
    from chainermn_overlap import distconv
    rng = np.random.RandomState(5)
    c = cfg['channels']
    convs = [distconv.Convolution2D(
        grid, c, c, 3, 1, 1, initialW=(rng.randn(c, c, 3, 3) * 0.2)
        .astype(np.float32)) for _ in range(cfg['layers'])]
    if depth == 'layer':
        def run(x):
            h = x
            for conv in convs:
                h = F.relu(conv(h))
            return h
        return run, convs
    layers = []
    for conv in convs:
        layers += [conv, F.relu]
    tiled = distconv.Tiled(grid, layers, depth=depth)
    return tiled, convs


def _redundancy(grid, cfg, depth):
    """Cells computed over cells owned, over the whole stack."""
    import numpy as np
    from chainermn_overlap.distconv import geometry
    from chainermn_overlap.distconv import tiling
    w = tiling.Window((3, 3), (1, 1), (1, 1))
    shape = (cfg['insize'], cfg['insize'])
    n = cfg['layers']
    d = n if depth in (None, 'all') else (1 if depth == 'layer' else depth)
    computed = owned = 0
    for start in range(0, n, d):
        k = min(d, n - start)
        for r in range(grid.spatial_size):
            for lv in tiling.tile_boxes(shape, (w,) * k, grid.shape, r)[1:]:
                computed += int(np.prod(geometry.box_shape(lv['computed'])))
                owned += int(np.prod(geometry.box_shape(lv['owned'])))
    return computed / float(owned)


def tiling_worker(cfg):
    if cfg.get('emulated_delay_s'):
        distconv_jobs.emulate_latency(cfg['emulated_delay_s'])
    import chainer
    import chainer.functions as F
    import chainermn
    import numpy as np
    from chainermn_overlap import distconv
    from chainermn_overlap.distconv import tuner
    comm = chainermn.create_communicator('naive')
    grid = distconv.SpatialGrid(comm, (comm.size, 1))
    shape = (cfg['batchsize'], cfg['channels'], cfg['insize'],
             cfg['insize'])
    x = grid.scatter(np.random.RandomState(2).randn(*shape)
                     .astype(np.float32))
    settings = ['layer', 1, 2, 4, None]
    models = {str(d): _stack(grid, cfg, d)[0] for d in settings}
    names = [str(d) for d in settings]

    def step(model):
        y = model(x)
        loss = F.sum(y)
        if hasattr(model, 'cleargrads'):
            model.cleargrads()
        loss.backward()

    for name in names:
        step(models[name])
    rec = {k: {'step_s': [], 'exposed_s': [], 'rounds': []} for k in names}
    for r in range(cfg['rounds']):
        for name in names[r % len(names):] + names[:r % len(names)]:
            comm.mpi_comm.Barrier()
            before = dict(grid.stats)
            t0 = time.perf_counter()
            step(models[name])
            t = time.perf_counter() - t0
            st = grid.stats
            exposed = sum(st[k] - before.get(k, 0)
                          for k in ('forward_wait_s', 'backward_wait_s'))
            rounds = sum(st[k] - before.get(k, 0)
                         for k in ('exchange_tiled', 'exchange_overlapped',
                                   'exchange_blocking'))
            rec[name]['step_s'].append(t)
            rec[name]['exposed_s'].append(
                float(np.mean(comm.mpi_comm.allgather(exposed))))
            rec[name]['rounds'].append(rounds)
    # One layer's computation on this block, without any message.
    conv = chainer.links.Convolution2D(cfg['channels'], cfg['channels'], 3,
                                       1, 1)
    ts = []
    for _ in range(max(3, cfg['rounds'])):
        t0 = time.perf_counter()
        y = conv(x)
        y.grad = np.ones_like(y.array)
        y.backward()
        ts.append(time.perf_counter() - t0)
    layer_s = float(np.median(ts))
    out = {'processes': comm.size, 'grid': list(grid.shape),
           'global_image': list(shape[2:]),
           'block_per_process': list(x.shape[2:]),
           'layer_compute_s': layer_s, 'settings': {}}
    for name in names:
        depth = None if name == 'None' else (
            'layer' if name == 'layer' else int(name))
        red = _redundancy(grid, cfg, depth)
        out['settings']['all' if name == 'None' else name] = {
            'median_step_s': float(np.median(rec[name]['step_s'])),
            'median_exposed_exchange_s': float(np.median(
                rec[name]['exposed_s'])),
            'exchange_rounds_per_step': rec[name]['rounds'][-1],
            'computed_over_owned_cells': red,
            'redundant_compute_s_estimate': (red - 1) * layer_s
            * cfg['layers'],
            'step_s': rec[name]['step_s']}

    def build(g, cand):
        return distconv_jobs.TunerModel(_stack(g, cfg, cand['depth'])[0])

    result = distconv.tune(comm, build, shape,
                           tuner.depth_candidates((comm.size, 1),
                                                  [1, 2, 4, None]),
                           iterations=max(1, cfg['rounds'] // 2),
                           loss_fn=lambda m, xx: F.sum(m(xx)))
    out['tuner'] = {'best': result['best'],
                    'table': [{'candidate': r['candidate'],
                               'median_s': r['median_s'],
                               'status': r['status']}
                              for r in result['table']]}
    if comm.rank == 0:
        launch.emit_result(RESULT_TAG, out)


# ---------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------
def _result(res, what):
    return distconv_jobs.job_result(res, RESULT_TAG,
                                    'channel_tiling_bench: ' + what)


def _netbed_usable(args):
    if args.no_netbed or (args.quick and not args.netbed):
        return 'not requested (--no-netbed, or --quick without --netbed)'
    return distconv_jobs.why_no_netbed()


def run_late(args):
    cfg = {'insize': args.late_insize, 'channels': args.late_channels,
           'batchsize': 1, 'rounds': args.rounds, 'steps': args.late_steps}
    cmd = launch.worker_command(MODULE, dict(cfg, part='late'))
    run = _result(distconv_jobs.mpiexec(2, cmd, args.timeout), 'late stage')
    summary = late_summary(run)
    sys.stdout.write(json.dumps(summary) + '\n')
    return {'config': cfg, 'run': run, 'summary': summary}


def run_tiling(args):
    cfg = {'insize': args.tile_insize, 'channels': args.tile_channels,
           'layers': args.tile_layers, 'batchsize': 1,
           'rounds': args.rounds}
    cmd = launch.worker_command(MODULE, dict(cfg, part='tiling'))
    why_not = _netbed_usable(args)
    runs = []
    delays = [d.strip() for d in args.delays.split(',') if d.strip()]
    if why_not is None:
        from testbed import netbed
        for delay in delays:
            try:
                with netbed.NetBed(2, args.rate, delay=delay) as bed:
                    desc = bed.describe()
                    res = bed.run_mpi(cmd, timeout=args.timeout,
                                      env=launch.worker_env())
            except netbed.NetBedError as e:
                if 'netem' not in str(e):
                    raise
                why_not = str(e)
                break
            run = _result(res, 'tiling over the test bed at %s' % delay)
            method = desc.get('delay_method') or 'netem'
            run.update(link={'rate': args.rate, 'delay': delay,
                             'delay_s': desc['delay_s'],
                             'delay_method': method,
                             'rtt': desc.get('rtt'),
                             'tc_commands': desc['tc_commands']},
                       label='2 ranks in network namespaces, one-way delay '
                             '%s per link (%s), MPICH over TCP'
                             % (delay, 'netem' if method == 'netem' else
                                'TAP pair through a delaying relay'))
            runs.append(run)
            _report(delay, run)
    if why_not is not None:
        # No netem (or no root): the latency is added in the processes'
        # distconv message layer instead (LatePending), over shared memory.
        from chainermn_overlap.config import parse_delay
        for delay in (delays if not args.quick or args.netbed
                      else delays[:1]):
            c = dict(cfg, part='tiling', emulated_delay_s=parse_delay(delay))
            cmd = launch.worker_command(MODULE, c)
            run = _result(distconv_jobs.mpiexec(2, cmd, args.timeout),
                          'tiling with emulated latency %s' % delay)
            run.update(link={'delay': delay, 'emulated': True},
                       label='shared memory, one-way latency %s emulated '
                             'in the distconv message layer (%s)'
                             % (delay, why_not))
            runs.append(run)
            _report(delay, run)
    return {'config': cfg, 'runs': runs, 'netbed': why_not is None,
            'netbed_skipped_because': why_not}


def _report(delay, run):
    sys.stdout.write(json.dumps({delay: {
        k: [round(v['median_step_s'], 4),
            round(v['median_exposed_exchange_s'], 4)]
        for k, v in run['settings'].items()}, 'tuner': run['tuner']['best']})
        + '\n')


def worker(cfg):
    if cfg['part'] == 'late':
        return late_worker(cfg)
    return tiling_worker(cfg)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if launch.dispatch_worker(argv, worker):
        return None
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--part', default='all', choices=['all', 'late',
                                                     'tiling'])
    p.add_argument('--quick', action='store_true',
                   help='tiny sizes, one round, no test bed: checks that '
                   'the benchmark runs (figures meaningless)')
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--late-insize', type=int, default=14)
    p.add_argument('--late-channels', type=int, default=1024)
    p.add_argument('--late-steps', type=int, default=5,
                   help='timed steps per setting and round (late stage)')
    p.add_argument('--tile-insize', type=int, default=32,
                   help='global image side of the tiling stack (a 16x32 '
                   'block per process at 2 processes)')
    p.add_argument('--tile-channels', type=int, default=8)
    p.add_argument('--tile-layers', type=int, default=8)
    p.add_argument('--delays', default='1ms,2ms,3ms,5ms',
                   help='one-way link delays of the tiling part')
    p.add_argument('--rate', default='1gbit')
    p.add_argument('--no-netbed', action='store_true',
                   help='tiling part over shared memory (no delay)')
    p.add_argument('--netbed', action='store_true',
                   help='with --quick: still run the tiling part over the '
                   'test bed (checks that path)')
    p.add_argument('--timeout', type=float, default=1800)
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'channel_tiling.json'))
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
        args.late_insize, args.late_channels = 6, 32
        args.tile_insize, args.tile_channels, args.tile_layers = 12, 2, 4
        if args.out == p.get_default('out'):
            args.out = os.path.join(launch.RESULTS,
                                    'channel_tiling_quick.json')
    result = {'benchmark': 'distconv: late-stage block spatial vs '
                           'filter/channel parallel; 3x3 conv stack layer '
                           'by layer vs tiled over a link with latency',
              'quick': args.quick,
              'machine': {'platform': platform.platform(),
                          'cpu_count': os.cpu_count()}}
    if args.part in ('all', 'late'):
        result['late'] = run_late(args)
    if args.part in ('all', 'tiling'):
        result['tiling'] = run_tiling(args)
    result['machine']['loadavg_at_end'] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    sys.stdout.write('wrote %s\n' % args.out)
    return result


if __name__ == '__main__':
    main()
