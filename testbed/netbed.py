"""A network test bed: MPI ranks as separate hosts behind a shaped link.

Run (as root)::

    python -m testbed.netbed --ranks 2 --rate 400mbit --probe
    python -m testbed.netbed --ranks 2 --rate 400mbit [--delay 0.2ms] \\
        [--timeout 600] [--record bed.json] -- python my_mpi_script.py ARGS

Each rank runs in a Linux network namespace of its own, so MPICH sees
separate hosts and must use TCP over the namespaces' interfaces: MPICH's
shared memory is switched off (``MPIR_CVAR_NOLOCAL=1``) and UCX, its
network layer, is limited to TCP on ``eth0`` (``UCX_TLS=tcp,self``,
``UCX_NET_DEVICES=eth0``; without these UCX moves the data through shared
memory at tens of Gbit/s and the shaped link is never used).  Two ranks are
joined by a veth pair; more ranks by one veth pair each to a bridge that
lives in a namespace of its own (a switch).  Every interface that carries
rank traffic is shaped on egress with ``tc`` (a token bucket, ``tbf``, at
the link rate; with ``--delay`` a ``netem`` delay in front of it), in both
directions, so each rank has a full-duplex link of the given rate, as a NIC
would.

A kernel without ``netem`` (``sch_netem``; checked once, on the first bed
that asks for a delay) gets the delay from a relay instead
(:mod:`testbed.netrelay`): each end of a link is then a TAP interface
rather than a veth end, and one relay process per bed reads every frame
from one TAP, holds it for the delay on a monotonic-clock queue and writes
it into the other, in order, both directions.  The ranks' TCP/IP stacks,
the ``tbf`` shaping and the 1500-byte MTU are as before; TSO super-packets
cross the relay whole.  With a switch (more than 2 ranks) the relay joins
each rank's TAP to a TAP port of the bridge, so, as with ``netem`` on both
ends of every rank's cable, a frame from rank to rank is delayed twice.
``delay_method='netem'`` or ``'relay'`` forces one way.  The bed measures
the round-trip time between ranks 0 and 1 (ICMP echo) once it is up and
reports it with the method in :meth:`NetBed.describe`.

Everything the bed creates lives inside namespaces it created (names
``cmo<pid>r<rank>`` and ``cmo<pid>sw``), with addresses 10.213.0.<rank+1>/24
on interfaces created there: nothing on the host's own interfaces changes.
The namespaces are removed on exit, on errors, and on SIGINT/SIGTERM/SIGHUP;
namespaces left by a run that was killed with SIGKILL are removed by the next
run (their owner's pid is in their name and no longer alive).  The relay is
stopped before the namespaces are removed, and dies with the process that
started it (``PR_SET_PDEATHSIG``).

Each rank is pinned to a core of its own with ``taskset`` and runs one BLAS
thread, so a rank's compute speed does not depend on its neighbours; ranks
beyond the number of cores share cores (said in the record).  The launched
command is killed (its whole process group) when it outlives ``--timeout``.

The record (``--record`` or :meth:`NetBed.describe`) holds all of this:
namespaces, addresses, the tc commands and what ``tc qdisc show`` reports,
the pinning and the environment given to MPI.  The command line lives in
:mod:`testbed.cli`, the allreduce probe in :mod:`testbed.probe`.
"""
import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import time

# Run as a file (not with -m), sys.path starts with testbed/ instead of
# the repository root that holds the package: add the root.
if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

# Link rates ("400mbit") and delays ("0.5ms") are read as everywhere in the
# library; parse_rate and parse_delay stay importable from here.
from chainermn_overlap.config import parse_delay  # noqa: E402,F401
from chainermn_overlap.config import parse_rate  # noqa: E402
from testbed import netrelay  # noqa: E402
# require_root stays importable from here for the benchmarks.
from testbed._system import (  # noqa: E402,F401
    BLAS_ENV, PREFIX, NetBedError, list_namespaces, remove_stale_namespaces,
    require_root)
from testbed._system import run as _run  # noqa: E402

SUBNET = '10.213.0'
# Environment for MPICH to talk TCP between namespaces.  The PyPI MPICH
# (ch4 with the ucx and ofi netmods) picks UCX; UCX would use shared memory
# or cross-memory attach between processes of one kernel, and its ofi netmod
# fails to enable a tcp endpoint here ("ep_enable failed"), so: UCX, TCP
# transport only, on the namespace's one routable interface.  Ranks run one
# BLAS thread each (BLAS_ENV): they are pinned to a core each.
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
}, **BLAS_ENV)


DELAY_METHODS = ('netem', 'relay')
RELAY = os.path.abspath(netrelay.__file__)
# RTT samples taken when a bed comes up (ICMP echo, rank 0 to rank 1).
RTT_SAMPLES = 10


_NETEM = {}


def netem_available(ns):
    """Whether this kernel has the ``netem`` qdisc (asked once, cached).

    Tries a netem qdisc on ``lo`` of namespace ``ns`` (one of the bed's own)
    and removes it.  "Specified qdisc kind is unknown" means no; any other
    failure is an error.
    """
    if 'netem' not in _NETEM:
        proc = _run(['tc', '-n', ns, 'qdisc', 'add', 'dev', 'lo', 'root',
                     'netem', 'delay', '1ms'], check=False)
        if proc.returncode == 0:
            _run(['tc', '-n', ns, 'qdisc', 'del', 'dev', 'lo', 'root'])
            _NETEM['netem'] = True
        elif 'unknown' in proc.stderr.lower():
            _NETEM['netem'] = False
        else:
            raise NetBedError('could not check for the netem qdisc: {}'
                              .format(proc.stderr.strip()))
    return _NETEM['netem']


def tbf_burst_bytes(rate_bps):
    """Token-bucket depth for a rate: 5 ms worth of data, at least 64 KiB.

    Too small a bucket caps the rate below the configured one (the kernel
    refills at timer granularity and GSO super-packets must fit); too large a
    bucket lets bursts through at the veth's unshaped speed.  400 Mbit/s
    gives 250 kB, the setting measured at 383 Mbit/s allreduce bandwidth.
    """
    return max(64 * 1024, int(rate_bps / 8 * 0.005))


class NetBed(object):
    """Namespaces, links and shaping for ``ranks`` MPI ranks.

    Use as a context manager; the namespaces exist inside the ``with``
    block only::

        with NetBed(2, rate='400mbit') as bed:
            result = bed.run_mpi([sys.executable, 'x.py'], timeout=300)

    Args:
        ranks (int): number of ranks (hosts), at least 2.
        rate (str or float): link rate per rank and direction (tc tbf).
        delay (str): optional one-way delay per link, e.g. ``'0.5ms'``.
        cores (list of int): cores to pin the ranks to, in rank order;
            default: the cores this process may run on.
        delay_method (str): ``'netem'`` or ``'relay'`` (see the module);
            default: netem where the kernel has it, else the relay.
    """

    def __init__(self, ranks, rate, delay=None, cores=None,
                 delay_method=None):
        if ranks < 2:
            raise ValueError('a test bed needs at least 2 ranks, got {}'
                             .format(ranks))
        if ranks > 250:
            raise ValueError('at most 250 ranks fit the /24 subnet')
        self.ranks = ranks
        self.rate_bps = parse_rate(rate)
        self.delay_s = parse_delay(delay)
        if delay_method not in (None,) + DELAY_METHODS:
            raise ValueError('delay_method must be one of {} or None, got {!r}'
                             .format(DELAY_METHODS, delay_method))
        self.requested_method = delay_method
        # Set in _create: 'netem', 'relay', or None (no delay asked for).
        self.delay_method = None
        self.relay = None
        self._relay_pairs = []
        self.relay_ready = None
        self.relay_stats = None
        self.rtt = None
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
        self._held_signals = None

    # -- set-up and tear-down ----------------------------------------------

    def __enter__(self):
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            self.stale_removed = remove_stale_namespaces()
            self._create()
            self.rtt = self.measure_rtt()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _install_signal_handlers(self):
        def handler(signum, frame):
            if self._held_signals is not None:  # see start_mpi
                self._held_signals.append(signum)
                return
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
        if self.delay_s and self.delay_method == 'netem':
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
                        'so the delay cannot come from netem here; let the '
                        'bed choose (delay_method=None, the default: the '
                        'relay of testbed/netrelay.py), or run on a '
                        'kernel with sch_netem') from e
                raise
            self.tc_commands.append(' '.join(c))

    def _choose_delay_method(self):
        if not self.delay_s:
            return None
        if self.requested_method is not None:
            return self.requested_method
        return 'netem' if netem_available(self.namespaces[0]) else 'relay'

    def _create(self):
        for ns in self.namespaces:
            self._netns_add(ns)
        self.delay_method = self._choose_delay_method()
        if self.delay_method == 'relay':
            self._create_relayed()
        elif self.switch is None:
            a, b = self.namespaces
            # Created directly inside the namespaces: no interface ever
            # appears in the host's namespace, and both ends can be eth0.
            _run(['ip', 'link', 'add', 'eth0', 'netns', a, 'type', 'veth',
                  'peer', 'name', 'eth0', 'netns', b])
        else:
            sw = self._make_switch()
            for r, ns in enumerate(self.namespaces):
                port = 'p{}'.format(r)
                _run(['ip', 'link', 'add', 'eth0', 'netns', ns, 'type',
                      'veth', 'peer', 'name', port, 'netns', sw])
                self._attach_port(port)
        for ns, addr in zip(self.namespaces, self.addresses):
            _run(['ip', '-n', ns, 'addr', 'add', addr + '/24', 'dev', 'eth0'])
            _run(['ip', '-n', ns, 'link', 'set', 'eth0', 'up'])
            self._shape(ns, 'eth0')
        if self.delay_method == 'relay':
            self._start_relay()
        self._wait_until_running()

    def _make_switch(self):
        """The switch namespace with its bridge, up; returns its name."""
        sw = self.switch
        self._netns_add(sw)
        _run(['ip', '-n', sw, 'link', 'add', 'br0', 'type', 'bridge'])
        _run(['ip', '-n', sw, 'link', 'set', 'br0', 'up'])
        return sw

    def _attach_port(self, port):
        """Puts a switch-side interface on the bridge, up and shaped."""
        sw = self.switch
        _run(['ip', '-n', sw, 'link', 'set', port, 'master', 'br0'])
        _run(['ip', '-n', sw, 'link', 'set', port, 'up'])
        # The switch port's egress is the rank's download direction.
        self._shape(sw, port)

    # -- the relay (a delay without netem) ---------------------------------

    def _tap(self, ns, dev):
        _run(['ip', '-n', ns, 'tuntap', 'add', 'dev', dev, 'mode', 'tap'])

    def _create_relayed(self):
        """TAP interfaces where veth ends would be; the relay joins them."""
        if not os.path.exists('/dev/net/tun'):
            raise NetBedError(
                'this kernel has no netem qdisc, and the relay that delays '
                'frames instead needs /dev/net/tun, which is missing (kernel '
                'CONFIG_TUN; in a container, pass the device through). Run '
                'without a delay or on a kernel with sch_netem')
        self._relay_pairs = []
        for ns in self.namespaces:
            self._tap(ns, 'eth0')
        if self.switch is None:
            a, b = self.namespaces
            self._relay_pairs.append('{}:eth0={}:eth0'.format(a, b))
            return
        sw = self._make_switch()
        for r, ns in enumerate(self.namespaces):
            port = 'p{}'.format(r)
            self._tap(sw, port)
            self._attach_port(port)
            self._relay_pairs.append('{}:eth0={}:{}'.format(ns, sw, port))

    def _start_relay(self, timeout=10.0):
        cmd = [sys.executable, RELAY, '--delay', repr(self.delay_s)]
        for pair in self._relay_pairs:
            cmd += ['--pair', pair]
        # A session of its own: Ctrl-C in a terminal reaches the bed, which
        # stops the relay after the job, not the relay first.
        self.relay = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE,
                                      universal_newlines=True,
                                      start_new_session=True)
        sel = selectors.DefaultSelector()
        sel.register(self.relay.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        line = self.relay.stdout.readline() if ready else ''
        if not line.startswith(netrelay.READY):
            err = self._stop_relay()
            raise NetBedError(
                'this kernel has no netem qdisc, and the relay that delays '
                'frames instead did not start ({}): {}'.format(
                    'exit {}'.format(self.relay.returncode)
                    if self.relay.returncode is not None else 'no answer '
                    'within {:.0f} s'.format(timeout), (line + err).strip()))
        self.relay_ready = json.loads(line[len(netrelay.READY):])

    def _stop_relay(self):
        """Stops the relay; keeps its statistics; returns its stderr."""
        proc = self.relay
        if proc is None:
            return ''
        if proc.poll() is None:
            proc.terminate()
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        for line in (out or '').splitlines():
            if line.startswith(netrelay.STATS):
                self.relay_stats = json.loads(line[len(netrelay.STATS):])
        return err or ''

    def relay_cpu_seconds(self):
        """CPU seconds (user + system) the relay has used so far, or None."""
        if self.relay is None:
            return None
        if self.relay.poll() is not None:
            st = self.relay_stats or {}
            return (st.get('cpu_user_s', 0.0) + st.get('cpu_system_s', 0.0)
                    if st else None)
        try:
            with open('/proc/{}/stat'.format(self.relay.pid)) as f:
                fields = f.read().rsplit(')', 1)[1].split()
        except OSError:
            return None
        # utime and stime: fields 14 and 15 of stat(5), counted from 1.
        return (int(fields[11]) + int(fields[12])) / os.sysconf(
            'SC_CLK_TCK')

    def measure_rtt(self, count=RTT_SAMPLES, timeout=10.0):
        """ICMP round trips rank 0 -> rank 1: dict of seconds."""
        cmd = ['ip', 'netns', 'exec', self.namespaces[0], sys.executable,
               RELAY, '--ping', self.addresses[1], '--count', str(count)]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE,
                                  universal_newlines=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise NetBedError('measuring the round-trip time took over '
                              '{:.0f} s: the link is broken'.format(
                                  timeout)) from e
        if proc.returncode != 0:
            raise NetBedError('no ICMP echo across the link from {} to {}: '
                              '{}'.format(self.addresses[0], self.addresses[1],
                                          proc.stderr.strip()))
        rtts = json.loads(proc.stdout)['rtt_s']
        return {'method': 'ICMP echo, {} to {}'.format(*self.addresses[:2]),
                'samples_s': rtts, 'min_s': min(rtts),
                'median_s': sorted(rtts)[len(rtts) // 2],
                'max_s': max(rtts)}

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
        """Stops the relay, removes every namespace (idempotent)."""
        errors = []
        if self.relay is not None and self.relay.returncode is None:
            err = self._stop_relay()
            if self.relay_stats is None and err.strip():
                errors.append('relay: ' + err.strip()[-500:])
        # A signal can land while "ip netns add" runs, before the name is
        # in self.created: every namespace bearing one of this bed's names
        # is removed too (a later close, once that child is reaped, finds
        # what an earlier one could not yet see).
        owned = self.namespaces + ([self.switch] if self.switch else [])
        present = set(list_namespaces())
        self.created.extend(ns for ns in owned
                            if ns in present and ns not in self.created)
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

    def start_mpi(self, cmd, env=None, mpiexec=None, stdout=None,
                  stderr=None):
        """Starts ``cmd`` as one rank per namespace; returns the Popen.

        The job runs in a session of its own: :meth:`stop_mpi` kills the
        launcher, the proxies and every rank as one group.  Several jobs
        may run on one bed at once (they share its links and cores).

        Args:
            cmd (list of str): the program of every rank.
            env (dict): extra environment (on top of :data:`MPI_ENV`).
            mpiexec (str): path of MPICH's mpiexec (default: next to
                ``sys.executable``).
            stdout, stderr: as for ``subprocess.Popen``.
        """
        full_env = dict(os.environ)
        full_env.update(MPI_ENV)
        full_env.update(env or {})
        line = self.mpi_command(cmd, mpiexec)
        # A signal raised inside Popen, after the fork, would leave the job
        # running with no one to kill it: the bed's handler holds signals
        # back until Popen returns (a signal mask would not do: BLAS's
        # threads would take them, and the job would inherit it).
        self._held_signals = []
        try:
            proc = subprocess.Popen(line, env=full_env, stdout=stdout,
                                    stderr=stderr, universal_newlines=True,
                                    start_new_session=True)
        finally:
            held, self._held_signals = self._held_signals, None
        if held:
            self.stop_mpi(proc)
            raise KeyboardInterrupt('netbed: signal {}'.format(held[0]))
        return proc

    @staticmethod
    def stop_mpi(proc):
        """Kills a :meth:`start_mpi` job's session; its exit status."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return proc.returncode

    def run_mpi(self, cmd, timeout, env=None, mpiexec=None, capture=True):
        """Runs ``cmd`` as one rank per namespace; returns a result dict.

        Args:
            cmd, env, mpiexec: as for :meth:`start_mpi`.
            timeout (float): seconds; then the whole process group is killed
                and ``returncode`` is 124.
            capture (bool): capture stdout/stderr (else inherit them).

        Returns:
            dict: ``returncode``, ``seconds``, ``stdout``, ``stderr``,
            ``command``.
        """
        out = subprocess.PIPE if capture else None
        t0 = time.time()
        proc = self.start_mpi(cmd, env, mpiexec, stdout=out, stderr=out)
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
                'stdout': stdout, 'stderr': stderr,
                'command': list(proc.args)}

    def describe(self):
        """Everything about the bed, for results files."""
        qdiscs = {}
        for ns in self.namespaces + ([self.switch] if self.switch else []):
            if ns in self.created:
                qdiscs[ns] = _run(['tc', '-n', ns, 'qdisc', 'show'],
                                  check=False).stdout.strip().splitlines()
        return {
            'ranks': self.ranks,
            'topology': ('bridge' if self.switch else 'veth pair')
            if self.delay_method != 'relay' else
            ('bridge, TAP ports joined to the ranks by the relay'
             if self.switch else 'TAP pair joined by the relay'),
            'rate_bit_per_s': self.rate_bps,
            'delay_s': self.delay_s,
            # How the delay is made: 'netem', 'relay' or None (no delay).
            'delay_method': self.delay_method,
            'netem_available': _NETEM.get('netem'),
            'rtt': self.rtt,
            'relay': None if self.relay is None else {
                'program': RELAY, 'pid': self.relay.pid,
                'command': list(self.relay.args),
                'sched': (self.relay_ready or {}).get('sched'),
                'pairs': list(self._relay_pairs),
                'cpu_seconds_so_far': self.relay_cpu_seconds(),
                'link': 'TAP (vnet header, TSO) <-> relay <-> TAP'},
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


if __name__ == '__main__':
    # ``python -m testbed.netbed`` is the command line of testbed.cli, run
    # by name: cli imports this module, and this one does not import cli.
    import runpy
    runpy.run_module('testbed.cli', run_name='__main__')
