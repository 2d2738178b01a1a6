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
attempt, so that no rank or proxy survives it on any host.
"""
import os
import re
import shlex
import subprocess
import sys
import threading

from chainermn_overlap.launch import _rank

_LINE = re.compile(r'^([^\s:#]+)(?::(\d+)|\s+slots\s*=\s*(\d+))?\s*$')
# Appended to the user's --ssh command (ssh takes the first value given
# for an option, so the user's own -o options win): no prompts, and
# keep-alives so that a session over a cut link ends within ~15 s instead
# of blocking mpiexec's own shutdown on it.
SSH_OPTIONS = ('-o', 'BatchMode=yes', '-o', 'ServerAliveInterval=5',
               '-o', 'ServerAliveCountMax=3')


def parse_hosts(text, what):
    """``[(host, slots)]`` from lines or ``a:2,b:2``.

    Args:
        text (str): the lines (or comma-separated entries).
        what (str): where they came from, for errors.

    Raises:
        ValueError: a line that is not ``host[:slots]``, slots < 1, or a
            host listed twice.
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


class Ssh(object):
    """Reaches hosts with the user's ssh command.

    Args:
        command (str): the ssh command (words), e.g. ``ssh -p 2222``.
        connect_timeout (float): seconds for a connection to a host.
        folder (str): where to write the wrapper Hydra runs as
            ``-launcher-exec`` (it takes one executable, not words).
    """

    def __init__(self, command, connect_timeout, folder):
        self.words = shlex.split(command)
        if not self.words:
            raise ValueError('launch: --ssh is empty; give the command that '
                             'reaches a host (default: ssh).')
        self.connect_timeout = connect_timeout
        self.wrapper = os.path.join(folder, 'ssh')
        with open(self.wrapper, 'w') as f:
            f.write('#!/bin/sh\nexec {} {} "$@"\n'.format(
                ' '.join(shlex.quote(w) for w in self.words),
                ' '.join(SSH_OPTIONS)))
        os.chmod(self.wrapper, 0o700)

    def command(self, host, remote):
        """The local command that runs ``remote`` (words) on ``host``."""
        return ([self.wrapper, '-o', 'ConnectTimeout={:d}'.format(
            max(1, int(round(self.connect_timeout)))), host]
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
            if proc.returncode == 0 and proc.stdout.startswith('ended'):
                verdicts[host] = None
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
