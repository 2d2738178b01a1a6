"""Hosts of a multi-host job: lists, reachability, clean-up, discovery.

A host list is ``[(host, slots), ...]``, read from a hostfile (``host:N``,
``host slots=N`` or ``host`` per line, ``#`` comments, as Hydra and Open
MPI write them), from ``--hosts a:2,b:2``, or from the output of a
``--host-discovery`` command (the same line format, as Horovod's
``--host-discovery-script``).

Before each attempt the launcher reaches every host over ssh with a short
connect timeout and there ends what is left of the job's earlier attempts
(:func:`chainermn_overlap.launch._rank.end_job`): a host that answers is
usable and clean; one that does not is left out of the attempt, with the
reason ssh gave.  After an attempt it does the same on every host of that
attempt, so that no rank or proxy survives it on any host.  The answer
also gives the host's own name, which its ranks' death records carry: the
launcher matches those records to the listed host with it, however the
list spells the host (an address, a short name, a full one).  Lists are
compared by the addresses their names resolve to (:func:`one_spelling`):
two spellings of one machine in a list are refused, and a host that a
later discovery spells another way keeps its first spelling, so that it
is neither a new host nor a second one.

Host names come from files and commands, so they are checked before any
reaches ssh or Hydra: a host name (dot-separated labels of letters, digits,
``-`` and ``_``, none starting with ``-``) or an IPv4 address; and every ssh
command puts ``--`` before the host.  IPv6 addresses are refused with the
reason: Hydra's host list splits ``[fd00::1]:2`` at the first ``:``.
"""
import ipaddress
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time

from chainermn_overlap.launch import _rank

_LINE = re.compile(r'^(\[[^\]\s]*\]|[^\s:#]+)'
                   r'(?::(\d+)|\s+slots\s*=\s*(\d+))?\s*$')
_LABEL = re.compile(r'^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$')
# Appended to the user's --ssh command (ssh takes the first value given
# for an option, so the user's own -o options win), with ConnectTimeout
# (--connect-timeout): no prompts, and keep-alives so that a session over
# a cut link ends within ~15 s instead of blocking mpiexec's own shutdown
# on it.
SSH_OPTIONS = ('-o', 'BatchMode=yes', '-o', 'ServerAliveInterval=5',
               '-o', 'ServerAliveCountMax=3')


def host_problem(name):
    """Why ``name`` is no host name or IPv4 address; None when it is one."""
    if name.startswith('[') or ':' in name:
        return ('an IPv6 address, which Hydra\'s host list cannot hold (it '
                'splits at the first ":"); give a name that resolves to it, '
                'e.g. from /etc/hosts')
    if len(name) > 253:
        return 'longer than the 253 characters of a host name'
    labels = name.split('.')
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            return 'neither a host name nor an IPv4 address'
        return None
    if not all(_LABEL.match(label) for label in labels):
        return ('not a host name: letters, digits, "-" and "_" in labels '
                'separated by ".", none starting or ending with "-"')
    return None


# name -> (when resolved, frozenset of addresses); a name that did not
# resolve is kept too, so that a slow resolver is asked once a minute.
_RESOLVED = {}
_RESOLVED_FOR = 60.0


def addresses(name, timeout=5.0):
    """The addresses ``name`` resolves to (a frozenset of strings), empty
    when it does not resolve within ``timeout`` seconds: a resolver that
    hangs must not hang the launcher."""
    now = time.monotonic()
    cached = _RESOLVED.get(name)
    if cached is not None and now - cached[0] < _RESOLVED_FOR:
        return cached[1]
    found = []

    def resolve():
        try:
            found.extend(info[4][0] for info in socket.getaddrinfo(
                name, None, proto=socket.IPPROTO_TCP))
        except (OSError, UnicodeError):
            pass
    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(timeout)
    result = frozenset(found) if not thread.is_alive() else frozenset()
    _RESOLVED[name] = (now, result)
    return result


def one_spelling(hosts, before=(), what='the host list'):
    """``hosts`` with each host spelled as in ``before`` where both name
    the same machine (the same name, or names that resolve to a common
    address); names that do not resolve are compared as written.

    Raises:
        ValueError: two entries of ``hosts`` are the same machine.
    """
    known = [(h, addresses(h)) for h, _ in before]
    seen = []
    out = []
    for host, slots in hosts:
        mine = addresses(host)
        for other, theirs in seen:
            common = mine & theirs
            if common:
                raise ValueError(
                    'launch: {}: {} and {} are the same host (both resolve '
                    'to {}); list each host once with all its slots.'.format(
                        what, other, host, sorted(common)[0]))
        seen.append((host, mine))
        out.append((next((h for h, a in known if h == host or mine & a),
                         host), slots))
    return out


def parse_hosts(text, what):
    """``[(host, slots)]`` from lines or ``a:2,b:2``.

    Args:
        text (str): the lines (or comma-separated entries).
        what (str): where they came from, for errors.

    Raises:
        ValueError: a line that is not ``host[:slots]``, a name that is no
            host (see :func:`host_problem`), slots < 1, or a host listed
            twice.
    """
    out = []
    entries = text.replace(',', '\n').splitlines()
    for number, raw in enumerate(entries, 1):
        line = raw.split('#', 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(
                'launch: {} line {}: {!r} is not a host. Write one host per '
                'line as host:SLOTS (e.g. node1:4), "host slots=SLOTS" or '
                'host.'.format(what, number, raw.strip()))
        problem = host_problem(m.group(1))
        if problem:
            raise ValueError(
                'launch: {} line {}: {!r} is {}.'.format(
                    what, number, m.group(1), problem))
        slots = int(m.group(2) or m.group(3) or 1)
        if slots < 1:
            raise ValueError('launch: {} line {}: {} has {} slots; give at '
                             'least 1.'.format(what, number, m.group(1),
                                               slots))
        if any(h == m.group(1) for h, _ in out):
            raise ValueError('launch: {}: host {} is listed twice; list each '
                             'host once with its slot count.'.format(
                                 what, m.group(1)))
        out.append((m.group(1), slots))
    return out


def read_hostfile(path):
    """The host list in file ``path`` (ValueError when unusable)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError('launch: cannot read the hostfile {} ({}).'.format(
            path, e.strerror)) from e
    hosts = parse_hosts(text, 'hostfile {}'.format(path))
    if not hosts:
        raise ValueError('launch: the hostfile {} lists no host.'.format(
            path))
    return hosts


def format_hosts(hosts):
    """``h0:2,h1:2``."""
    return ','.join('{}:{}'.format(h, s) for h, s in hosts)


def allocate(hosts, ranks):
    """Fills the hosts' slots in order with ``ranks`` ranks.

    Returns:
        list of tuple: ``(host, ranks on it)``, hosts with none left out.
    """
    out = []
    left = ranks
    for host, slots in hosts:
        n = min(slots, left)
        if n > 0:
            out.append((host, n))
        left -= n
    return out


# The executable Hydra runs as ``-launcher-exec``, and the launcher too:
# the user's ssh and the launcher's options, then "--" and the host, so
# that no host is ever read as an option.  Its callers are known: Hydra
# calls it as ``ssh -x HOST COMMAND...`` (``-x``, no X11, is the only
# option it gives), the launcher as ``ssh -- HOST COMMAND...``; a word
# that starts with "-" anywhere else is a host, and ssh refuses it.
#
# A session of Hydra's runs ssh as a child, not by exec, so that how it
# ended reaches the launcher whatever mpiexec does: when every process of
# a host ends at once, the host closes the session (ssh's status 255) at
# about the moment Hydra sees its proxy's connection close, and Hydra may
# exit before forwarding ssh's message, or take ssh's pipes with it.  So
# ssh's stderr passes through this wrapper (copied on; a closed stderr
# loses the copy, never ssh), and one JSON line per ended session goes to
# SESSIONS, a file of the launcher's: the host, ssh's status (or -signal),
# the time, and whether ssh said the host closed the connection.  ssh dies
# with its wrapper (PR_SET_PDEATHSIG), as it did when it was the process
# Hydra started; SIGTERM, SIGINT and SIGHUP are passed on.
_WRAPPER = """import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

WORDS = {words!r}
SESSIONS = {sessions!r}
CLOSED = b'closed by remote host'
args = sys.argv[1:]
options = []
while args[:1] == ['-x']:
    options.append(args.pop(0))
if args[:1] == ['--']:
    args.pop(0)
if not args:
    sys.exit('chainermn_overlap.launch ssh: no host given')
command = WORDS + options + ['--'] + args
if not options:   # the launcher's own ssh
    os.execvp(command[0], command)

libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent():
    libc.prctl(1, signal.SIGKILL)


proc = subprocess.Popen(command, stderr=subprocess.PIPE,
                        preexec_fn=die_with_parent)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda n, _: proc.send_signal(n))
said = []


def copy():
    for line in iter(proc.stderr.readline, b''):
        said.append(CLOSED in line)
        try:
            os.write(2, line)
        except OSError:
            pass


reader = threading.Thread(target=copy, daemon=True)
reader.start()
status = proc.wait()
reader.join(5.0)
record = {{'host': args[0], 'status': status, 'time': time.time(),
          'closed': any(said)}}
try:
    fd = os.open(SESSIONS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(record) + '\\n').encode())
    finally:
        os.close(fd)
except OSError:
    pass
if status < 0:
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status)
"""


class Ssh(object):
    """Reaches hosts with the user's ssh command.

    Args:
        command (str): the ssh command (words), e.g. ``ssh -p 2222``.
        connect_timeout (float): seconds for a connection to a host.
        folder (str): where to write the wrapper Hydra runs as
            ``-launcher-exec`` (it takes one executable, not words).

    Attributes:
        names (dict): host as listed -> the name it gave for itself.
    """

    def __init__(self, command, connect_timeout, folder):
        self.words = shlex.split(command)
        if not self.words:
            raise ValueError('launch: --ssh is empty; give the command that '
                             'reaches a host (default: ssh).')
        self.connect_timeout = connect_timeout
        self.names = {}
        # How each of Hydra's sessions ended (see _WRAPPER).
        self.sessions_log = os.path.join(folder, 'sessions.log')
        script = os.path.join(folder, 'ssh.py')
        with open(script, 'w') as f:
            f.write(_WRAPPER.format(words=self.words + list(SSH_OPTIONS) + [
                '-o', 'ConnectTimeout={:d}'.format(
                    max(1, int(round(connect_timeout))))],
                sessions=self.sessions_log))
        self.wrapper = os.path.join(folder, 'ssh')
        with open(self.wrapper, 'w') as f:
            f.write('#!/bin/sh\nexec {} -I -S {} "$@"\n'.format(
                shlex.quote(sys.executable), shlex.quote(script)))
        os.chmod(self.wrapper, 0o700)

    def ended_sessions(self):
        """How Hydra's sessions ended since the last call: a list of
        ``{'host', 'status', 'time', 'closed'}`` (the log is emptied)."""
        try:
            os.rename(self.sessions_log, self.sessions_log + '.read')
        except FileNotFoundError:
            return []
        out = []
        with open(self.sessions_log + '.read') as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if (isinstance(record, dict)
                        and isinstance(record.get('host'), str)
                        and isinstance(record.get('status'), int)
                        and isinstance(record.get('time'), (int, float))):
                    out.append(record)
        os.unlink(self.sessions_log + '.read')
        return out

    def command(self, host, remote):
        """The local command that runs ``remote`` (words) on ``host``."""
        return ([self.wrapper, '--', host]
                + [shlex.quote(w) for w in remote])

    def end_job(self, hosts, job, keep=None):
        """On each host: ends the job's processes; tells who answered.

        Args:
            hosts (list of str): the hosts.
            job (str): the job's id.
            keep (str): ``JOB:ATTEMPT`` of a running attempt to spare.

        Returns:
            dict: host -> None (answered) or the reason it did not.
        """
        remote = [sys.executable, os.path.abspath(_rank.__file__),
                  _rank.END_FLAG, job] + ([keep] if keep else [])
        verdicts = {}

        def one(host):
            try:
                proc = subprocess.run(
                    self.command(host, remote), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    universal_newlines=True,
                    timeout=self.connect_timeout + 15)
            except subprocess.TimeoutExpired:
                verdicts[host] = 'ssh took over {:.0f} s'.format(
                    self.connect_timeout + 15)
                return
            except OSError as e:
                verdicts[host] = 'cannot run ssh ({})'.format(e.strerror)
                return
            answer = _end_answer(proc.stdout)
            if proc.returncode == 0 and answer is not None:
                verdicts[host] = None
                self.names[host] = answer['host']
                return
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln]
            verdicts[host] = 'ssh exit {}: {}'.format(
                proc.returncode, lines[-1][:160] if lines else
                (proc.stdout.strip()[:160] or 'no output'))
        threads = [threading.Thread(target=one, args=(h,), daemon=True)
                   for h in hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return verdicts


def _end_answer(stdout):
    """The record of ``_rank.py --end-job``'s line in ``stdout`` (whatever
    else a login shell printed around it), or None."""
    for line in stdout.splitlines():
        if not line.startswith(_rank.END_MARK):
            continue
        try:
            record = json.loads(line[len(_rank.END_MARK):])
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(
                record.get('ended'), int) and isinstance(
                    record.get('host'), str):
            return record
    return None


def discover(command, timeout=30.0):
    """Runs the discovery command; returns its host list.

    Raises:
        RuntimeError: it failed, timed out, or printed something that is
            not a host list.
    """
    try:
        proc = subprocess.run(command, shell=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError('the host discovery command took over {:.0f} s'
                           .format(timeout)) from e
    if proc.returncode != 0:
        raise RuntimeError('the host discovery command exited with {}: {}'
                           .format(proc.returncode,
                                   proc.stderr.strip()[-200:]))
    try:
        return parse_hosts(proc.stdout, 'the host discovery output')
    except ValueError as e:
        raise RuntimeError(str(e)) from e
