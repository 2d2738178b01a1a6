"""The distconv studies' shared set-up: their MPI jobs and what a job reads.

Used by :mod:`benchmarks.spatial_bench` and
:mod:`benchmarks.channel_tiling_bench`:

* :func:`mpiexec` and :func:`job_result`: one job of a study's worker on
  this machine, and its tagged result line (or the job's output and exit);
  :func:`bed_job`: the same job on the network test bed, with its record;
* :func:`step_memory`: the bytes numpy holds during one step
  (tracemalloc);
* :func:`quiet_barrier`: a barrier that sleeps, so waiting ranks leave the
  cores to the rank being timed;
* :func:`link_counters`: a namespace's link counters (shaped-link runs),
  and :func:`link_summary`, their sums over steps and ranks;
* :func:`emulate_latency`: a one-way latency added in distconv's message
  layer, where the kernel has no ``netem``; :func:`why_no_netbed`: why
  the test bed cannot run here, if it cannot;
* :class:`TunerModel`: a model ``distconv.tune`` can time and clear.
"""
import os
import shutil
import subprocess
import sys
import time
import tracemalloc

from benchmarks.harness import launch


def mpiexec(n, cmd, timeout):
    """Runs ``cmd`` at ``n`` ranks with the workers' environment; returns
    ``returncode``, ``stdout`` and ``stderr`` (as the test bed's
    ``run_mpi`` does)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    res = subprocess.run([mpiexec, '-n', str(n)] + cmd,
                         env=dict(os.environ, **launch.worker_env()),
                         capture_output=True, text=True, cwd=launch.ROOT,
                         timeout=timeout)
    return {'returncode': res.returncode, 'stdout': res.stdout,
            'stderr': res.stderr}


def bed_job(n, cmd, timeout, rate, delay=None):
    """Runs ``cmd`` at ``n`` ranks on the network test bed.

    Each rank in a network namespace of its own, pinned to a core, MPICH
    over TCP through veth links shaped to ``rate`` (and ``delay`` one way,
    if given): :class:`testbed.netbed.NetBed`.

    Returns:
        tuple: the job's result (as :func:`mpiexec`'s, plus ``seconds``) and
        its record: ``bed`` (``NetBed.describe()``), ``loadavg_before`` and
        ``loadavg_after`` (of this machine, around the bed's life).
    """
    from testbed import netbed
    load_before = os.getloadavg()
    with netbed.NetBed(n, rate, delay=delay) as bed:
        desc = bed.describe()
        res = bed.run_mpi(cmd, timeout=timeout, env=launch.worker_env())
    return res, {'bed': desc, 'loadavg_before': load_before,
                 'loadavg_after': os.getloadavg()}


def job_result(res, tag, what):
    """The result line tagged ``tag`` of a job's output; a job that failed
    or wrote none ends the study (``what failed``), after its output."""
    run = launch.find_result(res['stdout'], tag)
    if res['returncode'] or run is None:
        sys.stderr.write((res['stdout'] or '')[-3000:]
                         + (res['stderr'] or '')[-3000:])
        raise SystemExit('%s failed (exit %s)' % (what, res['returncode']))
    return run


def step_memory(model, lossfun):
    """(peak bytes during a step, bytes held after forward) by numpy.

    ``lossfun()`` runs the forward and returns the loss; then backward.
    """
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    loss = lossfun()
    held = tracemalloc.get_traced_memory()[0] - base
    model.cleargrads()
    loss.backward()
    peak = tracemalloc.get_traced_memory()[1] - base
    del loss
    tracemalloc.stop()
    return peak, held


def quiet_barrier(mpi):
    """A barrier that sleeps instead of spinning.

    MPICH spins in a blocking barrier; while rank 0 times the serial model
    the other ranks would take the cores it needs (2 cores here).
    """
    req = mpi.Ibarrier()
    while not req.Test():
        # 2 ms: wake-ups of the waiting ranks would otherwise steal a
        # measurable share of the 2 cores from the rank timing the serial
        # model (3 waiting ranks at P = 4).
        time.sleep(0.002)


LINK_COUNTERS = ('tx_bytes', 'retrans_segs', 'tail_loss_probes',
                 'rto_timeouts', 'qdisc_dropped')


def link_counters():
    """This network namespace's counters of eth0 (shaped-link runs only).

    Bytes sent, TCP retransmitted segments, of which tail-loss probes
    (sent after a quiet period, not losses), retransmission timeouts and
    packets dropped by the tc qdisc; read from /sys and /proc, which
    ``ip netns exec`` shows per namespace.
    """
    out = {}
    for path in ('/proc/net/snmp', '/proc/net/netstat'):
        with open(path) as f:
            lines = f.read().splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            keys, vals = head.split(), vals.split()
            out.update((keys[0] + k, int(v))
                       for k, v in zip(keys[1:], vals[1:]))
    with open('/sys/class/net/eth0/statistics/tx_bytes') as f:
        tx = int(f.read())
    tc = subprocess.run(['tc', '-s', 'qdisc', 'show', 'dev', 'eth0'],
                        capture_output=True, text=True).stdout
    dropped = sum(int(w.rstrip(',')) for a, w in zip(tc.split(),
                                                     tc.split()[1:])
                  if a == 'dropped')
    return {'tx_bytes': tx, 'retrans_segs': out.get('Tcp:RetransSegs', 0),
            'tail_loss_probes': out.get('TcpExt:TCPLossProbes', 0),
            'rto_timeouts': out.get('TcpExt:TCPTimeouts', 0),
            'qdisc_dropped': dropped}


def link_summary(mpi, counts):
    """:func:`link_counters` differences of one rank's steps (``counts``, a
    list of dicts), summed over steps and ranks, and every rank's median
    bytes sent per step (``median_tx_bytes_per_step_per_rank``).  Collective:
    every rank calls it."""
    import numpy as np
    tot = {k: mpi.allreduce(sum(c[k] for c in counts))
           for k in LINK_COUNTERS if k != 'tx_bytes'}
    tot['median_tx_bytes_per_step_per_rank'] = mpi.allgather(float(
        np.median([c['tx_bytes'] for c in counts])))
    return tot


class LatePending(object):
    """A distconv exchange whose messages complete ``delay`` after posting.

    Emulates a link's one-way latency inside the process when the kernel
    has no ``netem``: tests report the messages
    as in flight until then, and a wait sleeps out the rest, so computation
    between posting and waiting hides latency as it would on a real link.
    """

    def __init__(self, inner, delay):
        self.inner = inner
        self.ready = time.perf_counter() + delay
        self.has_messages = inner.has_messages
        self.n_recv = inner.n_recv

    def _sleep(self):
        left = self.ready - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def test(self):
        done = self.inner.test()
        return done and time.perf_counter() >= self.ready

    @property
    def completed(self):
        return self.inner.completed and time.perf_counter() >= self.ready

    def arrivals(self):
        self._sleep()
        return self.inner.arrivals()

    def wait(self):
        self._sleep()
        return self.inner.wait()

    def wait_flat(self):
        self._sleep()
        return self.inner.wait_flat()


def emulate_latency(delay):
    """Patches distconv's message layer to add ``delay`` s per exchange."""
    from chainermn_overlap.distconv import _comm
    post = _comm.post_exchange

    def late_post(*a, **k):
        pending = post(*a, **k)
        return LatePending(pending, delay) if pending.has_messages \
            else pending
    _comm.post_exchange = late_post


def why_no_netbed():
    """Why the test bed cannot run here (root, iproute2), or None."""
    if os.geteuid() != 0:
        return 'needs root (network namespaces)'
    if not (shutil.which('ip') and shutil.which('tc')):
        return 'needs iproute2 (ip, tc)'
    return None


class TunerModel(object):
    """A model for ``distconv.tune``: a ``Tiled`` stack or a function of
    layers, with ``cleargrads`` whether or not the model has one."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x):
        return self.model(x)

    def cleargrads(self):
        if hasattr(self.model, 'cleargrads'):
            self.model.cleargrads()
