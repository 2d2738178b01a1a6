"""Simulated hosts with real ssh: jobs started the way clusters start them.

:class:`HostBed` builds, on a :class:`~testbed.netbed.NetBed` (namespaces,
a bridge, shaped links), one *login* namespace and ``hosts`` host
namespaces.  Each host

* is a network namespace with its own address (10.213.0.2, .3, ...) and
  name (``h0``, ``h1``, ...; every namespace resolves every name through
  ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over
  ``/etc/hosts``);
* has IPC and UTS namespaces of its own (``unshare --ipc --uts``): its own
  hostname, and no shared memory with the other hosts, so UCX cannot move
  data around the link (``UCX_TLS=tcp,self`` as well);
* runs its own ``sshd`` (openssh-server from the distribution's packages,
  installed by :func:`ensure_ssh` with apt-get), bound to the host's
  address only, with its own host key and pid file.

Everything secret or generated lives in one temporary folder: a throw-away
client key pair, ``authorized_keys``, every host key and a ``known_hosts``
holding them (so ssh checks host keys for real), the sshd configurations,
an ssh wrapper (:attr:`HostBed.ssh`: ``ssh -i KEY -o
UserKnownHostsFile=... -o BatchMode=yes ...``), the hostfile (``h0:2``
lines) and ``shared/``, a folder every host sees (as NFS would be) for
snapshots.  Jobs start in the login namespace (:meth:`HostBed.login`) with
Hydra's ssh launcher, as ``python -m chainermn_overlap.launch --hostfile``
does::

    mpiexec -launcher ssh -launcher-exec SSH -f HOSTFILE -localhost LOGIN \\
        -n 4 python prog.py

(``-localhost`` with the login address: otherwise the remote proxies try
to reach this machine's own hostname, which resolves to 127.0.0.1.)

On exit, on errors and on SIGINT/SIGTERM/SIGHUP the bed stops every sshd,
kills what still runs in its namespaces, removes its ``/etc/netns`` entries
and its temporary folder, then the namespaces; a later bed removes what a
SIGKILLed one left (the owner's pid is in every name).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from testbed import netbed  # noqa: E402
from testbed._system import (  # noqa: E402
    PREFIX, NetBedError, ensure_tools, kill, namespace_pids, owner_pid,
    pid_alive, run, which)

SSH_TOOLS = ('ip', 'tc', 'unshare', 'sshd', 'ssh', 'ssh-keygen')
NETNS_ETC = '/etc/netns'
# What every ssh of the bed passes: our key, our known_hosts, no prompts,
# and keep-alives so that a cut link ends a session within ~9 s instead of
# blocking whoever waits on it (mpiexec's SIGTERM handling does).
SSH_OPTIONS = ('-o', 'BatchMode=yes', '-o', 'StrictHostKeyChecking=yes',
               '-o', 'ConnectTimeout=3', '-o', 'ServerAliveInterval=3',
               '-o', 'ServerAliveCountMax=3', '-o', 'LogLevel=ERROR')
_SSHD_CONFIG = """\
ListenAddress {address}
Port 22
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The key lives in a world-writable temporary folder.
StrictModes no
PrintMotd no
UseDNS no
ClientAliveInterval 3
ClientAliveCountMax 3
MaxStartups 100:30:200
MaxSessions 100
"""

# A login shell that greets on stdout, then runs what ssh was asked to.
_CHATTY = """\
ForceCommand echo "Welcome to {name}: modules loaded"; \
eval "$SSH_ORIGINAL_COMMAND"
"""


def ensure_ssh():
    """Installs openssh-server/-client, iproute2, util-linux if missing.

    Returns:
        str or None: why the bed cannot have ssh hosts here, or None.
    """
    missing = ensure_tools(SSH_TOOLS)
    if missing:
        return ('{} not found and could not be installed (apt-get install '
                'openssh-server openssh-client iproute2 util-linux)'.format(
                    ', '.join(missing)))
    return None


class HostBed(object):
    """A login namespace and ``hosts`` hosts, each with its own sshd.

    Use as a context manager::

        with HostBed(2, slots=2) as bed:
            proc = bed.login(['python', '-m', 'chainermn_overlap.launch',
                              '--hostfile', bed.hostfile, ...])

    Args:
        hosts (int): number of hosts (at least 1).
        slots (int): ranks per host in the hostfile.
        rate (str): link rate of every namespace (tc tbf).
        chatty (tuple of int): hosts whose login shell prints a banner on
            stdout before every command it runs (as a module system's or a
            site's profile does).
    """

    def __init__(self, hosts, slots=1, rate='1gbit', chatty=()):
        if hosts < 1 or hosts > 200:
            raise ValueError('hosts must be between 1 and 200, got {}'
                             .format(hosts))
        self.slots = slots
        self.net = netbed.NetBed(hosts + 1, rate)
        self.login_ns = self.net.namespaces[0]
        self.namespaces = self.net.namespaces[1:]
        self.login_address = self.net.addresses[0]
        self.addresses = self.net.addresses[1:]
        self.names = ['h{}'.format(i) for i in range(hosts)]
        self.chatty = set(chatty)
        self.dir = None
        self.sshd = {}          # host index -> Popen of its sshd
        self._etc = []

    # -- paths -------------------------------------------------------------

    def _path(self, *parts):
        return os.path.join(self.dir, *parts)

    @property
    def ssh(self):
        """The ssh wrapper (an executable) for Hydra and the launcher."""
        return self._path('ssh')

    @property
    def hostfile(self):
        """``h0:SLOTS`` lines, one per host."""
        return self._path('hostfile')

    @property
    def shared(self):
        """A folder every host sees, for snapshots."""
        return self._path('shared')

    def hosts_arg(self, indices=None, slots=None):
        """``h0:2,h1:2`` for ``--hosts`` (every host by default)."""
        indices = range(len(self.names)) if indices is None else indices
        return ','.join('{}:{}'.format(self.names[i], slots or self.slots)
                        for i in indices)

    # -- set-up and tear-down -----------------------------------------------

    def __enter__(self):
        self.net.__enter__()
        try:
            self._remove_stale_etc()
            self.dir = tempfile.mkdtemp(prefix='{}{}hosts-'.format(
                PREFIX, os.getpid()))
            os.makedirs(self.shared)
            self._write_names()
            self._write_keys()
            for i in range(len(self.names)):
                self.start_sshd(i)
            for i in range(len(self.names)):
                self.wait_for_ssh(i)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _remove_stale_etc(self):
        if not os.path.isdir(NETNS_ETC):
            return
        for name in os.listdir(NETNS_ETC):
            pid = owner_pid(name)
            if pid is not None and not pid_alive(pid):
                shutil.rmtree(os.path.join(NETNS_ETC, name),
                              ignore_errors=True)

    def _write_names(self):
        lines = ['127.0.0.1 localhost',
                 '{} login'.format(self.login_address)]
        lines += ['{} {}'.format(a, n)
                  for a, n in zip(self.addresses, self.names)]
        for ns in self.net.namespaces:
            folder = os.path.join(NETNS_ETC, ns)
            os.makedirs(folder, exist_ok=True)
            self._etc.append(folder)
            with open(os.path.join(folder, 'hosts'), 'w') as f:
                f.write('\n'.join(lines) + '\n')
        for ns, name in zip(self.namespaces, self.names):
            with open(os.path.join(NETNS_ETC, ns, 'hostname'), 'w') as f:
                f.write(name + '\n')

    def _write_keys(self):
        keygen = which('ssh-keygen')
        run([keygen, '-q', '-t', 'ed25519', '-N', '', '-f',
             self._path('id_ed25519')])
        shutil.copy(self._path('id_ed25519.pub'),
                    self._path('authorized_keys'))
        known = []
        for i, name in enumerate(self.names):
            key = self._path('host_key_{}'.format(name))
            run([keygen, '-q', '-t', 'ed25519', '-N', '', '-f', key])
            with open(key + '.pub') as f:
                pub = ' '.join(f.read().split()[:2])
            known.append('{},{} {}'.format(name, self.addresses[i], pub))
            with open(self._path('sshd_config_{}'.format(name)), 'w') as f:
                f.write(_SSHD_CONFIG.format(
                    address=self.addresses[i], host_key=key,
                    pid_file=self._path('sshd_{}.pid'.format(name)),
                    authorized_keys=self._path('authorized_keys')))
                if i in self.chatty:
                    f.write(_CHATTY.format(name=name))
        with open(self._path('known_hosts'), 'w') as f:
            f.write('\n'.join(known) + '\n')
        words = [which('ssh'), '-i', self._path('id_ed25519'), '-o',
                 'UserKnownHostsFile=' + self._path('known_hosts')]
        words += list(SSH_OPTIONS)
        with open(self.ssh, 'w') as f:
            f.write('#!/bin/sh\nexec {} "$@"\n'.format(' '.join(words)))
        os.chmod(self.ssh, 0o755)
        with open(self.hostfile, 'w') as f:
            f.write(''.join('{}:{}\n'.format(n, self.slots)
                            for n in self.names))
        # sshd's privilege separation folder.
        os.makedirs('/run/sshd', mode=0o755, exist_ok=True)

    def start_sshd(self, i):
        """Starts host ``i``'s sshd (in its own IPC and UTS namespaces)."""
        name = self.names[i]
        cmd = ['ip', 'netns', 'exec', self.namespaces[i],
               which('unshare'), '--ipc', '--uts', '--', 'sh', '-c',
               'hostname "$0" && exec "$1" -D -e -f "$2"', name,
               which('sshd'), self._path('sshd_config_{}'.format(name))]
        log = open(self._path('sshd_{}.log'.format(name)), 'ab')
        try:
            self.sshd[i] = subprocess.Popen(cmd, stdout=log, stderr=log,
                                            start_new_session=True)
        finally:
            log.close()

    def stop_sshd(self, i):
        """Stops host ``i``'s listening sshd (sessions already open stay).

        Returns:
            int: the pid that was stopped.
        """
        proc = self.sshd.pop(i)
        proc.kill()
        proc.wait()
        return proc.pid

    def wait_for_ssh(self, i, timeout=15.0):
        """Waits until host ``i`` answers over ssh from the login side."""
        deadline = time.monotonic() + timeout
        while True:
            res = self.login_run([self.ssh, self.names[i], 'true'],
                                 timeout=10)
            if res.returncode == 0:
                return
            proc = self.sshd.get(i)
            if proc is not None and proc.poll() is not None:
                raise NetBedError('sshd of {} ended ({}): {}'.format(
                    self.names[i], proc.returncode, self._sshd_log(i)))
            if time.monotonic() > deadline:
                raise NetBedError('{} does not answer over ssh after {:.0f} '
                                  's: {} {}'.format(
                                      self.names[i], timeout,
                                      res.stderr.strip(), self._sshd_log(i)))
            time.sleep(0.1)

    def _sshd_log(self, i):
        try:
            with open(self._path('sshd_{}.log'.format(self.names[i]))) as f:
                return f.read()[-1500:]
        except OSError:
            return ''

    def close(self):
        """Stops every sshd, removes files and namespaces (idempotent)."""
        for i in list(self.sshd):
            self.stop_sshd(i)
        for ns in self.net.namespaces:
            if ns in self.net.created:
                for pid in namespace_pids(ns):
                    kill(pid)
        while self._etc:
            shutil.rmtree(self._etc.pop(), ignore_errors=True)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        self.net.close()

    # -- running ------------------------------------------------------------

    def login_command(self, cmd):
        """``cmd`` as run in the login namespace."""
        return ['ip', 'netns', 'exec', self.login_ns] + list(cmd)

    def login_run(self, cmd, timeout=60):
        """Runs ``cmd`` in the login namespace; returns CompletedProcess."""
        return subprocess.run(self.login_command(cmd),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)

    def login(self, cmd, env=None, **popen):
        """Starts ``cmd`` in the login namespace with the MPI environment.

        Returns:
            subprocess.Popen: in a session of its own.
        """
        full = dict(os.environ)
        full.update(netbed.MPI_ENV)
        full.update(env or {})
        return subprocess.Popen(self.login_command(cmd), env=full,
                                start_new_session=True, **popen)

    def mpiexec_args(self):
        """What mpiexec needs on this bed, for ``--mpiexec-arg``."""
        return ['-localhost', self.login_address]

    def launcher_args(self):
        """``--ssh``/``--mpiexec-arg`` options of the launcher on this bed."""
        out = ['--ssh', self.ssh]
        for a in self.mpiexec_args():
            out.append('--mpiexec-arg=' + a)
        return out

    def host_pids(self, i):
        """Pids in host ``i``'s namespace."""
        return namespace_pids(self.namespaces[i])

    def interface_bytes(self, i):
        """(received, sent) bytes of host ``i``'s eth0."""
        out = run(['ip', '-n', self.namespaces[i], '-s', 'link', 'show',
                   'eth0']).stdout.split('\n')
        rx = out[out.index(next(x for x in out if 'RX:' in x)) + 1].split()
        tx = out[out.index(next(x for x in out if 'TX:' in x)) + 1].split()
        return int(rx[0]), int(tx[0])

    def describe(self):
        """The bed, for results files."""
        return {'hosts': self.names, 'addresses': self.addresses,
                'slots': self.slots, 'login': self.login_address,
                'namespaces': self.namespaces, 'login_namespace':
                self.login_ns, 'net': self.net.describe(),
                'ssh_options': list(SSH_OPTIONS),
                'own_namespaces_per_host': ['net', 'ipc', 'uts']}
