"""What moving gradients costs the compute sharing its core.

Run (as root: it builds the network test bed of ``testbed/netbed.py``)::

    python -m benchmarks.comm_cost --rate 741mbit

Two ranks, each pinned to one core with one BLAS thread, as in
``overlap_bench.py``.  Each rank times a fixed compute loop (a small
convolutional network's forward and backward in Chainer) alone, then while a
second thread reduces 4 MiB buffers back to back over the shaped link, the
way the overlapped optimizer's communication thread does (waiting as the
engines do by default: ``Engine.mpi_wait``).  Variants of that thread: its
normal priority, and ``nice 19``
(it then gets little of the core, so what remains of the slowdown is the
kernel's network work and the copies, not the thread's polling).  Rounds
alternate the variants; medians are reported.

The slowdown of the compute loop while the link runs at full rate, times
the time the link needs per training iteration, bounds the scalability
that any overlap can reach on a core shared with the network.

Writes ``benchmarks/results/comm_cost.json``.
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

# Run as a file (not with -m), sys.path starts with benchmarks/ instead of
# the repository root that holds the package: add the root.
if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import launch  # noqa: E402
from testbed import netbed  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402

RESULT_TAG = 'COMM_COST_RESULT '


def _thread_cpu_seconds(native_id):
    with open('/proc/self/task/{}/stat'.format(native_id)) as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def worker(cfg):
    import numpy as np
    import chainer
    import chainer.functions as F
    import chainer.links as L
    from mpi4py import MPI
    from chainermn_overlap.communication import engine, progress
    mpi_wait = cfg.get('mpi_wait', engine.DEFAULT_MPI_WAIT)
    world = MPI.COMM_WORLD
    comm = world.Dup()

    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.c1 = L.Convolution2D(3, 32, 3, pad=1)
                self.c2 = L.Convolution2D(32, 32, 3, pad=1)
                self.fc = L.Linear(None, 10)

        def forward(self, x):
            h = F.relu(self.c1(x))
            h = F.max_pooling_2d(F.relu(self.c2(h)), 2)
            return self.fc(h)

    np.random.seed(0)
    net = Net()
    x = np.random.rand(8, 3, 64, 64).astype(np.float32)
    t = np.random.randint(0, 10, 8).astype(np.int32)

    def compute(steps):
        t0 = time.perf_counter()
        for _ in range(steps):
            net.cleargrads()
            F.softmax_cross_entropy(net(x), t).backward()
        return time.perf_counter() - t0

    buf = np.ones(cfg['message_bytes'] // 4, dtype=np.float32)
    comm.Allreduce(MPI.IN_PLACE, buf)
    compute(2)
    stats = {}

    def reduce_loop(stop, nice):
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        me = threading.get_native_id()
        c0, t0, n = _thread_cpu_seconds(me), time.perf_counter(), 0
        while True:
            # Both ranks must stop after the same reduction: the stop flag
            # travels in the reduced buffer itself.
            buf[0] = 1.0 if stop.is_set() else 0.0
            # As the engines wait for an allreduce (their default).
            if mpi_wait == 'sleep':
                progress.allreduce(comm, buf)
            else:
                comm.Allreduce(MPI.IN_PLACE, buf)
            n += 1
            if buf[0] > 0:
                break
        dt = time.perf_counter() - t0
        stats['bytes_per_s'] = n * buf.nbytes / dt
        stats['thread_cpu_fraction'] = (_thread_cpu_seconds(me) - c0) / dt

    variants = ['alone', 'reducing', 'reducing_nice19']
    rows = {v: [] for v in variants}
    for r in range(cfg['rounds']):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            world.Barrier()
            stop = threading.Event()
            th = None
            if v != 'alone':
                th = threading.Thread(target=reduce_loop, args=(
                    stop, 19 if v.endswith('nice19') else 0))
                th.start()
                time.sleep(0.2)   # the link is busy before timing starts
            secs = compute(cfg['steps'])
            stop.set()
            if th is not None:
                th.join()
            rows[v].append(dict(stats, compute_seconds=secs))
            stats.clear()
    every = world.gather(rows, root=0)
    if world.Get_rank() == 0:
        launch.emit_result(RESULT_TAG, every)


def summarize(per_rank):
    """Medians over rounds and ranks; slowdowns relative to ``alone``."""
    out = {}
    for v in per_rank[0]:
        rows = [row for rank in per_rank for row in rank[v]]
        d = {'compute_seconds_median': statistics.median(
            r['compute_seconds'] for r in rows)}
        if 'bytes_per_s' in rows[0]:
            d['allreduce_MB_per_s_median'] = statistics.median(
                r['bytes_per_s'] for r in rows) / 1e6
            d['thread_cpu_fraction_median'] = statistics.median(
                r['thread_cpu_fraction'] for r in rows)
        out[v] = d
    base = out['alone']['compute_seconds_median']
    for d in out.values():
        d['slowdown'] = d['compute_seconds_median'] / base - 1.0
    return out


def measure(rate, steps=40, rounds=4):
    """Runs the measurement on a 2-rank bed at ``rate``.

    Returns:
        tuple: ``(summary, bed record, per-rank rows, config)``.
    """
    cfg = {'steps': steps, 'rounds': rounds, 'message_bytes': 4 * 2 ** 20}
    with netbed.NetBed(2, rate) as bed:
        record = bed.describe()
        res = bed.run_mpi(
            launch.worker_command('benchmarks.comm_cost', cfg), timeout=900,
            env=launch.worker_env())
    if res['returncode'] != 0:
        raise RuntimeError('the job failed (exit {}):\n{}\n{}'.format(
            res['returncode'], res['stdout'][-3000:], res['stderr'][-3000:]))
    per_rank = launch.read_result(res['stdout'], RESULT_TAG, 'comm_cost')
    return summarize(per_rank), record, per_rank, cfg


def cost_per_byte(summary):
    """Compute seconds lost per byte of allreduce payload moved.

    The compute loop slowed by ``slowdown`` while the link moved ``R``
    bytes/s: ``slowdown * T`` seconds lost for ``R * T`` bytes.
    """
    d = summary['reducing']
    return d['slowdown'] / (d['allreduce_MB_per_s_median'] * 1e6)


def main(argv=None):
    if launch.dispatch_worker(argv, worker):
        return 0
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rate', default='741mbit')
    p.add_argument('--steps', type=int, default=40,
                   help='compute steps per measurement')
    p.add_argument('--rounds', type=int, default=4)
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'comm_cost.json'))
    args = p.parse_args(argv)
    netbed.require_root()
    machine = machine_description()
    summary, record, per_rank, cfg = measure(args.rate, args.steps,
                                             args.rounds)
    result = {
        'benchmark': 'compute slowdown while the link carries allreduces',
        'config': cfg, 'bed': record, 'summary': summary,
        'raw': per_rank,
        'machine': machine,
    }
    machine['loadavg_at_end'] = os.getloadavg()
    for v, d in summary.items():
        extra = ''
        if 'allreduce_MB_per_s_median' in d:
            extra = ', allreduce {:.1f} MB/s, reducing thread {:.0%} of ' \
                    'a core'.format(d['allreduce_MB_per_s_median'],
                                    d['thread_cpu_fraction_median'])
        print('{:<16} compute {:.3f} s ({:+.1%}){}'.format(
            v, d['compute_seconds_median'], d['slowdown'], extra))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    print('saved ' + args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
