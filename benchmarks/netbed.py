"""A network test bed: MPI ranks as separate hosts behind a shaped link.

Run (as root)::

    python -m benchmarks.netbed --ranks 2 --rate 400mbit --probe
    python -m benchmarks.netbed --ranks 2 --rate 400mbit [--delay 0.2ms] \\
        [--timeout 600] [--record bed.json] -- python my_mpi_script.py ARGS

Each rank runs in a Linux network namespace of its own, so MPICH sees
separate hosts and must use TCP over the namespaces' interfaces: MPICH's
shared memory is switched off (``MPIR_CVAR_NOLOCAL=1``) and UCX, its
network layer, is limited to TCP on ``eth0`` (``UCX_TLS=tcp,self``,
``UCX_NET_DEVICES=eth0``; without these UCX moves the data through shared
memory at tens of Gbit/s and the shaped link is never used).  Two ranks are joined
by a veth pair; more ranks by one veth pair each to a bridge that lives in a
namespace of its own (a switch).  Every interface that carries rank traffic
is shaped on egress with ``tc`` (a token bucket, ``tbf``, at the link rate;
with ``--delay`` a ``netem`` delay in front of it), in both directions, so
each rank has a full-duplex link of the given rate, as a NIC would.

Everything the bed creates lives inside namespaces it created (names
``cmo<pid>r<rank>`` and ``cmo<pid>sw``), with addresses 10.213.0.<rank+1>/24
on interfaces created there: nothing on the host's own interfaces changes.
The namespaces are removed on exit, on errors, and on SIGINT/SIGTERM/SIGHUP;
namespaces left by a run that was killed with SIGKILL are removed by the next
run (their owner's pid is in their name and no longer alive).

Each rank is pinned to a core of its own with ``taskset`` and runs one BLAS
thread, so a rank's compute speed does not depend on its neighbours; ranks
beyond the number of cores share cores (said in the record).  The launched
command is killed (its whole process group) when it outlives ``--timeout``.

The record (``--record`` or :meth:`NetBed.describe`) holds all of this:
namespaces, addresses, the tc commands and what ``tc qdisc show`` reports,
the pinning and the environment given to MPI.
"""
import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

# Run as a file (not with -m), sys.path starts with benchmarks/ instead of
# the repository root that holds the package: add the root.
if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks import launch  # noqa: E402
# Link rates ("400mbit") and delays ("0.5ms") are read as everywhere in the
# library; parse_rate and parse_delay stay importable from here.
from chainermn_overlap.config import parse_delay  # noqa: E402
from chainermn_overlap.config import parse_rate  # noqa: E402

PREFIX = 'cmo'
SUBNET = '10.213.0'
# Environment for MPICH to talk TCP between namespaces.  The PyPI MPICH
# (ch4 with the ucx and ofi netmods) picks UCX; UCX would use shared memory
# or cross-memory attach between processes of one kernel, and its ofi netmod
# fails to enable a tcp endpoint here ("ep_enable failed"), so: UCX, TCP
# transport only, on the namespace's one routable interface.  Ranks run one
# BLAS thread each (launch.BLAS_ENV): they are pinned to a core each.
MPI_ENV = dict({
    'MPIR_CVAR_CH4_NETMOD': 'ucx',
    # Ranks are on the same kernel: without this MPICH's own shared-memory
    # path would carry the traffic and never touch the shaped link.
    'MPIR_CVAR_NOLOCAL': '1',
    'UCX_TLS': 'tcp,self',
    # lo exists in every namespace but reaches only the rank itself.
    'UCX_NET_DEVICES': 'eth0',
    # UCX's TCP transport moves data in segments (default 8 KB sent, 64 KB
    # received) and needs a progress call per segment, so under a busy core
    # throughput becomes CPU-bound: a 4 MiB allreduce loop at 577 Mbit/s,
    # sharing its core with a compute loop, reached 43-45 MB/s with the
    # defaults and 66-68 MB/s (the link's rate) with 1 MiB segments, at the
    # same slowdown of the compute loop.  Tuning a transport's segment size
    # is what a cluster's MPI set-up does; it applies to every mode alike.
    'UCX_TCP_TX_SEG_SIZE': '1m',
    'UCX_TCP_RX_SEG_SIZE': '1m',
    'FI_PROVIDER': 'tcp',
}, **launch.BLAS_ENV)


class NetBedError(RuntimeError):
    """The test bed could not be set up or a command in it failed."""


def tbf_burst_bytes(rate_bps):
    """Token-bucket depth for a rate: 5 ms worth of data, at least 64 KiB.

    Too small a bucket caps the rate below the configured one (the kernel
    refills at timer granularity and GSO super-packets must fit); too large a
    bucket lets bursts through at the veth's unshaped speed.  400 Mbit/s
    gives 250 kB, the setting measured at 383 Mbit/s allreduce bandwidth.
    """
    return max(64 * 1024, int(rate_bps / 8 * 0.005))


def require_root():
    """Exits with a plain message when not root, or when ``ip``/``tc`` miss."""
    if os.geteuid() != 0:
        sys.stderr.write(
            'netbed: needs root: it creates network namespaces, veth pairs and '
            'tc qdiscs. Run it as root (e.g. sudo {} ...).\n'
            .format(os.path.basename(sys.executable)))
        sys.exit(2)
    missing = [t for t in ('ip', 'tc', 'taskset') if shutil.which(t) is None]
    if missing:
        sys.stderr.write(
            'netbed: {} not found. Install them: apt-get update && apt-get '
            'install -y iproute2 util-linux\n'.format(', '.join(missing)))
        sys.exit(2)


def _run(cmd, check=True):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)
    if check and proc.returncode != 0:
        raise NetBedError('command failed ({}): {}\n{}'.format(
            proc.returncode, ' '.join(cmd), proc.stderr.strip()))
    return proc


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces():
    """Names of the network namespaces on this machine."""
    out = _run(['ip', 'netns', 'list'], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale_namespaces():
    """Removes namespaces of earlier beds whose owning process is gone."""
    removed = []
    for ns in list_namespaces():
        m = re.fullmatch(PREFIX + r'(\d+)(?:r\d+|sw)', ns)
        if m and not _pid_alive(int(m.group(1))):
            _run(['ip', 'netns', 'del', ns], check=False)
            removed.append(ns)
    return removed


class NetBed(object):
    """Namespaces, links and shaping for ``ranks`` MPI ranks.

    Use as a context manager; the namespaces exist inside the ``with``
    block only::

        with NetBed(2, rate='400mbit') as bed:
            result = bed.run_mpi([sys.executable, 'x.py'], timeout=300)

    Args:
        ranks (int): number of ranks (hosts), at least 2.
        rate (str or float): link rate per rank and direction (tc tbf).
        delay (str): optional one-way delay added by netem, e.g. ``'0.5ms'``.
        cores (list of int): cores to pin the ranks to, in rank order;
            default: the cores this process may run on.
    """

    def __init__(self, ranks, rate, delay=None, cores=None):
        if ranks < 2:
            raise ValueError('a test bed needs at least 2 ranks, got {}'
                             .format(ranks))
        if ranks > 250:
            raise ValueError('at most 250 ranks fit the /24 subnet')
        self.ranks = ranks
        self.rate_bps = parse_rate(rate)
        self.delay_s = parse_delay(delay)
        self.cores = list(cores) if cores is not None else sorted(
            os.sched_getaffinity(0))
        tag = '{}{}'.format(PREFIX, os.getpid())
        self.namespaces = ['{}r{}'.format(tag, r) for r in range(ranks)]
        self.switch = '{}sw'.format(tag) if ranks > 2 else None
        self.addresses = ['{}.{}'.format(SUBNET, r + 1) for r in range(ranks)]
        self.tc_commands = []
        self.created = []
        self.stale_removed = []
        self._old_handlers = {}

    # -- set-up and tear-down ----------------------------------------------

    def __enter__(self):
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            self.stale_removed = remove_stale_namespaces()
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _install_signal_handlers(self):
        def handler(signum, frame):
            # Turn the signal into an exception so that every ``finally``
            # (and __exit__) on the way up runs and removes the namespaces.
            self.close()
            raise KeyboardInterrupt('netbed: signal {}'.format(signum))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: rely on finally only
                pass

    def _restore_signal_handlers(self):
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    def _netns_add(self, name):
        _run(['ip', 'netns', 'add', name])
        self.created.append(name)
        _run(['ip', '-n', name, 'link', 'set', 'lo', 'up'])

    def _shape(self, ns, dev):
        rate = '{}bit'.format(int(self.rate_bps))
        burst = tbf_burst_bytes(self.rate_bps)
        base = ['tc', '-n', ns, 'qdisc', 'add', 'dev', dev]
        if self.delay_s:
            cmds = [base + ['root', 'handle', '1:', 'netem', 'delay',
                            '{}us'.format(int(round(self.delay_s * 1e6)))],
                    base + ['parent', '1:', 'handle', '10:', 'tbf', 'rate',
                            rate, 'burst', str(burst), 'latency', '50ms']]
        else:
            cmds = [base + ['root', 'tbf', 'rate', rate, 'burst', str(burst),
                            'latency', '50ms']]
        for c in cmds:
            try:
                _run(c)
            except NetBedError as e:
                if 'netem' in c and 'unknown' in str(e):
                    raise NetBedError(
                        'this kernel has no netem qdisc (module sch_netem), '
                        'so --delay cannot be emulated here; run without '
                        '--delay or on a kernel with sch_netem') from e
                raise
            self.tc_commands.append(' '.join(c))

    def _create(self):
        for ns in self.namespaces:
            self._netns_add(ns)
        if self.switch is None:
            a, b = self.namespaces
            # Created directly inside the namespaces: no interface ever
            # appears in the host's namespace, and both ends can be eth0.
            _run(['ip', 'link', 'add', 'eth0', 'netns', a, 'type', 'veth',
                  'peer', 'name', 'eth0', 'netns', b])
        else:
            sw = self.switch
            self._netns_add(sw)
            _run(['ip', '-n', sw, 'link', 'add', 'br0', 'type', 'bridge'])
            _run(['ip', '-n', sw, 'link', 'set', 'br0', 'up'])
            for r, ns in enumerate(self.namespaces):
                port = 'p{}'.format(r)
                _run(['ip', 'link', 'add', 'eth0', 'netns', ns, 'type',
                      'veth', 'peer', 'name', port, 'netns', sw])
                _run(['ip', '-n', sw, 'link', 'set', port, 'master', 'br0'])
                _run(['ip', '-n', sw, 'link', 'set', port, 'up'])
                # The switch port's egress is the rank's download direction.
                self._shape(sw, port)
        for ns, addr in zip(self.namespaces, self.addresses):
            _run(['ip', '-n', ns, 'addr', 'add', addr + '/24', 'dev', 'eth0'])
            _run(['ip', '-n', ns, 'link', 'set', 'eth0', 'up'])
            self._shape(ns, 'eth0')
        self._wait_until_running()

    def _wait_until_running(self, timeout=10.0):
        # A veth reports carrier a moment after 'up'; UCX skips a device
        # that is not running yet and then finds no route to its peers.
        deadline = time.time() + timeout
        pending = list(self.namespaces)
        while pending:
            pending = [ns for ns in pending if 'LOWER_UP' not in _run(
                ['ip', '-n', ns, 'link', 'show', 'eth0']).stdout]
            if pending and time.time() > deadline:
                raise NetBedError(
                    'eth0 in {} did not come up within {:.0f} s'.format(
                        ', '.join(pending), timeout))
            if pending:
                time.sleep(0.02)

    def close(self):
        """Removes every namespace this bed created (idempotent)."""
        errors = []
        while self.created:
            ns = self.created.pop()
            proc = _run(['ip', 'netns', 'del', ns], check=False)
            if proc.returncode != 0 and ns in list_namespaces():
                errors.append('{}: {}'.format(ns, proc.stderr.strip()))
        self._restore_signal_handlers()
        if errors:
            raise NetBedError(
                'could not remove namespaces ({}); remove them with '
                '"ip netns del NAME"'.format('; '.join(errors)))

    # -- running ------------------------------------------------------------

    def pinning(self):
        """Core of each rank (ranks share cores when there are too few)."""
        return [self.cores[r % len(self.cores)] for r in range(self.ranks)]

    def mpi_command(self, cmd, mpiexec=None):
        """The MPMD ``mpiexec`` line that starts ``cmd`` in every namespace."""
        mpiexec = mpiexec or os.path.join(os.path.dirname(sys.executable),
                                          'mpiexec')
        line = [mpiexec]
        for r, (ns, core) in enumerate(zip(self.namespaces, self.pinning())):
            if r:
                line.append(':')
            line += ['-n', '1', 'ip', 'netns', 'exec', ns,
                     'taskset', '-c', str(core)] + list(cmd)
        return line

    def run_mpi(self, cmd, timeout, env=None, mpiexec=None, capture=True):
        """Runs ``cmd`` as one rank per namespace; returns a result dict.

        Args:
            cmd (list of str): the program of every rank.
            timeout (float): seconds; then the whole process group is killed
                and ``returncode`` is 124.
            env (dict): extra environment (on top of :data:`MPI_ENV`).
            mpiexec (str): path of MPICH's mpiexec (default: next to
                ``sys.executable``).
            capture (bool): capture stdout/stderr (else inherit them).

        Returns:
            dict: ``returncode``, ``seconds``, ``stdout``, ``stderr``,
            ``command``.
        """
        full_env = dict(os.environ)
        full_env.update(MPI_ENV)
        full_env.update(env or {})
        line = self.mpi_command(cmd, mpiexec)
        out = subprocess.PIPE if capture else None
        t0 = time.time()
        # A session of its own: on a timeout or a signal the launcher, the
        # proxies and every rank are killed as one group.
        proc = subprocess.Popen(line, env=full_env, stdout=out, stderr=out,
                                universal_newlines=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            rc = 124
            stderr = (stderr or '') + (
                '\nnetbed: killed after the time limit of {:.0f} s'
                .format(timeout))
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return {'returncode': rc, 'seconds': time.time() - t0,
                'stdout': stdout, 'stderr': stderr, 'command': line}

    def describe(self):
        """Everything about the bed, for results files."""
        qdiscs = {}
        for ns in self.namespaces + ([self.switch] if self.switch else []):
            if ns in self.created:
                qdiscs[ns] = _run(['tc', '-n', ns, 'qdisc', 'show'],
                                  check=False).stdout.strip().splitlines()
        return {
            'ranks': self.ranks,
            'topology': 'bridge' if self.switch else 'veth pair',
            'rate_bit_per_s': self.rate_bps,
            'delay_s': self.delay_s,
            'tbf_burst_bytes': tbf_burst_bytes(self.rate_bps),
            'namespaces': self.namespaces,
            'switch_namespace': self.switch,
            'addresses': self.addresses,
            'tc_commands': list(self.tc_commands),
            'qdiscs': qdiscs,
            'pinning': {'tool': 'taskset', 'cores': self.pinning(),
                        'shared_cores': self.ranks > len(self.cores),
                        'blas_threads': 1},
            'mpi_env': dict(MPI_ENV),
        }


# ----------------------------------------------------------------------------
# Probe: allreduce bandwidth across the bed (runs inside the namespaces).

def probe_worker(nbytes, repeats):
    """Measures allreduce time of ``nbytes``; rank 0 prints one JSON line."""
    import numpy
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    buf = numpy.ones(nbytes // 4, dtype=numpy.float32)
    comm.Allreduce(MPI.IN_PLACE, buf[:1024])  # connect
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        times.append(time.perf_counter() - t0)
    n = comm.Get_size()
    # The first 1024 elements took part in the connecting allreduce too.
    ok = bool(numpy.all(buf[1024:] == float(n) ** repeats))
    addrs = comm.gather(_eth0_address(), root=0)
    if comm.Get_rank() == 0:
        best = min(times)
        print(json.dumps({
            'probe': 'allreduce', 'bytes': nbytes, 'ranks': n,
            'seconds': times, 'correct': ok, 'addresses': addrs,
            # Bytes a rank sends per direction in a ring allreduce.
            'wire_bytes_per_rank': 2.0 * (n - 1) / n * nbytes,
            'algbw_bit_per_s': nbytes * 8 / best,
            'busbw_bit_per_s': 2.0 * (n - 1) / n * nbytes * 8 / best}))
        sys.stdout.flush()


def _eth0_address():
    try:
        out = _run(['ip', '-4', '-o', 'addr', 'show', 'dev', 'eth0'],
                   check=False).stdout
        m = re.search(r'inet (\S+)/', out)
        return m.group(1) if m else None
    except OSError:
        return None


def probe(bed, nbytes=8 * 2 ** 20, repeats=3, timeout=120):
    """Runs the allreduce probe on ``bed``; returns its JSON record."""
    res = bed.run_mpi(launch.module_command('benchmarks.netbed',
                                            '--probe-worker', nbytes,
                                            repeats),
                      timeout=timeout, env=launch.worker_env())
    if res['returncode'] != 0:
        raise NetBedError('the allreduce probe failed (exit {}):\n{}\n{}'
                          .format(res['returncode'], res['stdout'][-3000:],
                                  res['stderr'][-3000:]))
    lines = [ln for ln in res['stdout'].splitlines()
             if ln.startswith('{"probe"')]
    if not lines:
        raise NetBedError('the probe printed no result:\n' + res['stdout'])
    return json.loads(lines[-1])


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ['--probe-worker']:
        probe_worker(int(argv[1]), int(argv[2]))
        return 0
    cmd = []
    if '--' in argv:
        i = argv.index('--')
        argv, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(
        description='Run an MPI program with one rank per network namespace '
                    'over a tc-shaped link (needs root).')
    p.add_argument('--ranks', type=int, default=2)
    p.add_argument('--rate', default='400mbit',
                   help='link rate per rank and direction (tc tbf)')
    p.add_argument('--delay', default=None,
                   help='one-way netem delay, e.g. 0.2ms (default: none)')
    p.add_argument('--timeout', type=float, default=600,
                   help='seconds before the MPI job is killed')
    p.add_argument('--probe', action='store_true',
                   help='measure allreduce bandwidth instead of running CMD')
    p.add_argument('--probe-bytes', type=int, default=16 * 2 ** 20)
    p.add_argument('--record', default=None,
                   help='write the bed description (and probe) as JSON')
    args = p.parse_args(argv)
    if not cmd and not args.probe:
        p.error('give --probe or a command after --')
    require_root()
    try:
        return _main(args, cmd)
    except KeyboardInterrupt:
        sys.stderr.write('netbed: interrupted; its namespaces were removed\n')
        return 130
    except NetBedError as e:
        sys.stderr.write('netbed: {}\n'.format(e))
        return 1


def _main(args, cmd):
    record = {}
    with NetBed(args.ranks, args.rate, args.delay) as bed:
        record['bed'] = bed.describe()
        print('netbed: {} ranks, {} at {:.0f} Mbit/s{}, namespaces {}, '
              'pinned to cores {}'.format(
                  bed.ranks, record['bed']['topology'], bed.rate_bps / 1e6,
                  ', delay {:g} ms'.format(bed.delay_s * 1e3)
                  if bed.delay_s else '', ' '.join(bed.namespaces),
                  bed.pinning()))
        if args.probe:
            pr = probe(bed, args.probe_bytes, timeout=args.timeout)
            record['probe'] = pr
            print('netbed: allreduce of {:.1f} MB: {:.0f} Mbit/s (bus '
                  'bandwidth, configured {:.0f} Mbit/s)'.format(
                      pr['bytes'] / 1e6, pr['busbw_bit_per_s'] / 1e6,
                      bed.rate_bps / 1e6))
            rc = 0
        else:
            res = bed.run_mpi(cmd, timeout=args.timeout, capture=False)
            record['run'] = {k: res[k] for k in ('returncode', 'seconds',
                                                 'command')}
            rc = res['returncode']
    record['namespaces_left'] = [n for n in list_namespaces()
                                 if n in record['bed']['namespaces']]
    if args.record:
        with open(args.record, 'w') as f:
            json.dump(record, f, indent=2)
    return rc


if __name__ == '__main__':
    sys.exit(main())
