"""The restart loop: attempts, back-off, shrinking and growing back.

:class:`Launcher` runs attempts of one job (see the package docstring)
through :class:`~chainermn_overlap.launch._attempt.AttemptRunner`; which
hosts and how many ranks each attempt gets is
:class:`~chainermn_overlap.launch._elastic.HostPolicy`'s; reaching hosts
is :mod:`chainermn_overlap.launch._hosts`'.
"""
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid

from chainermn_overlap import config
from chainermn_overlap.launch import _hosts
from chainermn_overlap.launch._attempt import AttemptRunner
from chainermn_overlap.launch._elastic import HostPolicy
from chainermn_overlap.launch._procs import become_subreaper
from chainermn_overlap.launch._procs import signal_name as _signal_name
from chainermn_overlap.launch._sessions import Sessions

__all__ = ['Launcher']

logger = logging.getLogger('chainermn_overlap.launch')


class Launcher(object):
    """Runs attempts until one succeeds or the restarts are used up.

    Args:
        command (list of str): what each rank runs (``python script ...``).
        ranks (int): ranks wanted; with ``hosts``, None means every slot.
        max_restarts (int): restarts after failed attempts (a stop at a
            snapshot to change hosts is not one).
        mpiexec (str): the ``mpiexec`` to use.
        min_ranks (int): fewest ranks to shrink to (default: ``ranks``;
            1 when ``min_hosts`` is given).
        backoff (float): seconds before the first restart; doubled after
            each failed attempt, at most ``backoff_max``.
        shrink_after (int): consecutive attempts without progress before
            a smaller one is tried.
        kill_grace (float): seconds between SIGTERM and SIGKILL when ending
            an attempt.
        mpiexec_args (list of str): extra arguments for ``mpiexec``.
        hosts (list of tuple): ``(host, slots)``; None: this machine only.
        ssh (str): the command that reaches a host (hosts mode).
        min_hosts (int): fewest hosts to run on (default 1).
        host_discovery (str): a shell command printing ``host:slots``
            lines, run before each attempt and every
            ``discovery_interval`` seconds during one.
        connect_timeout (float): seconds to reach a host over ssh.
        max_resizes (int): stops at a snapshot to change hosts that
            discovery may ask for; after that the job keeps its hosts
            (a source whose list flaps must not restart it forever).
        session_grace (float): seconds mpiexec may run on after its ssh
            session to a host ended before the attempt is ended (0: never,
            the collective timeout alone ends such an attempt).
    """

    def __init__(self, command, ranks=None, max_restarts=3, mpiexec=None,
                 min_ranks=None, backoff=1.0, backoff_max=60.0,
                 shrink_after=2, kill_grace=5.0, mpiexec_args=(),
                 hosts=None, ssh='ssh', min_hosts=None, host_discovery=None,
                 discovery_interval=10.0, connect_timeout=3.0,
                 max_resizes=10, session_grace=5.0):
        self.hosts, ranks, min_ranks, mpiexec = _resolve(
            hosts, host_discovery, ranks, min_ranks, min_hosts,
            max_restarts, max_resizes, mpiexec)
        self.command = list(command)
        self.ranks = ranks
        self.max_restarts = max_restarts
        self.mpiexec = mpiexec
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.kill_grace = kill_grace
        self.mpiexec_args = list(mpiexec_args)
        self.ssh_command = ssh
        self.host_discovery = host_discovery
        self.discovery_interval = discovery_interval
        self.connect_timeout = connect_timeout
        self.max_resizes = max_resizes
        self.session_grace = session_grace
        self.resizes = 0
        self.policy = HostPolicy(ranks, min_ranks, min_hosts or 1,
                                 shrink_after)
        self.results = []
        self.job_id = '{}-{}'.format(os.getpid(), uuid.uuid4().hex[:12])
        self._stop_signal = None
        self._stop = threading.Event()
        self._runner = AttemptRunner(mpiexec, self.command, kill_grace,
                                     self._stop)
        self._ssh = None
        self._folder = None

    # -- signals ------------------------------------------------------------

    def _on_signal(self, signum, frame):
        if self._stop_signal is None:
            self._stop_signal = signum
            logger.warning('received %s: ending the job; no restart',
                           _signal_name(signum))
        self._stop.set()

    # -- hosts ----------------------------------------------------------------

    def _listed_hosts(self):
        if self.host_discovery:
            try:
                self.hosts = _hosts.one_spelling(
                    _hosts.discover(self.host_discovery), self.hosts or (),
                    'the host discovery output')
            except (RuntimeError, ValueError) as e:
                logger.warning('%s; keeping the hosts found before: %s', e,
                               _hosts.format_hosts(self.hosts))
        return self.hosts

    def _plan(self):
        """(allocation, None) or (None, reason) for the next attempt."""
        hosts = self._listed_hosts()
        verdicts = self._ssh.end_job([h for h, _ in hosts], self.job_id)
        for host, why in sorted(verdicts.items()):
            if why is not None:
                logger.warning('host %s does not answer: %s', host, why)
        return self.policy.plan(hosts, verdicts)

    def _host_args(self, attempt, allocation):
        path = os.path.join(self._folder, 'hosts.{}'.format(attempt))
        with open(path, 'w') as f:
            f.write(''.join('{}:{}\n'.format(h, n) for h, n in allocation))
        return ['-launcher', 'ssh', '-launcher-exec', self._ssh.wrapper,
                '-f', path]

    def _watch(self, allocation, tag):
        """The checks during an attempt on hosts: mpiexec's ssh session to
        each host (:mod:`~chainermn_overlap.launch._sessions`), and the
        discovery command when there is one."""
        sessions = (Sessions([h for h, _ in allocation], self.session_grace)
                    if self.session_grace > 0 else None)
        discovery = (self._discovery_watch(allocation, tag)
                     if self.host_discovery else None)

        def watch(proc, output):
            host = sessions.lost(proc.pid) if sessions else None
            if host is not None:
                logger.warning(
                    'mpiexec\'s ssh session to host %s ended %.0f s ago while '
                    'the job runs on: ending the attempt', host,
                    self.session_grace)
                output.facts.setdefault('session_lost', (host,))
                self._runner.end(proc)
                return
            if discovery is not None:
                discovery(proc, output)
        return watch

    def _discovery_watch(self, allocation, tag):
        """A check of the discovery command during an attempt."""
        state = {'next': time.monotonic() + self.discovery_interval,
                 'asked': False}

        def watch(proc, output):
            if state['asked'] or time.monotonic() < state['next']:
                return
            state['next'] = time.monotonic() + self.discovery_interval
            if not any(e.get('resize') for e in output.events):
                return   # the job cannot stop at a snapshot when asked
            if self.resizes >= self.max_resizes:
                if not state.get('told'):
                    state['told'] = True
                    logger.warning('host discovery: %d change(s) of hosts '
                                   'made (--max-resizes %d); this job keeps '
                                   'its hosts from now on', self.resizes,
                                   self.max_resizes)
                return
            try:
                listed = _hosts.one_spelling(
                    _hosts.discover(self.host_discovery),
                    list(allocation) + list(self.hosts or ()),
                    'the host discovery output')
            except (RuntimeError, ValueError) as e:
                logger.warning('%s', e)
                return
            running = dict(allocation)
            new = [h for h, _ in listed if h not in running
                   and h not in self.policy.dropped]
            verdicts = (self._ssh.end_job(new, self.job_id, keep=tag)
                        if new else {})
            wanted, _ = self.policy.plan(listed, dict(
                verdicts, **{h: None for h in running}))
            # The same hosts and ranks in another order are no change.
            if wanted is None or dict(wanted) == dict(allocation):
                return
            state['asked'] = True
            logger.info('host discovery: %s now (running on %s); asking the '
                        'job to stop at its next snapshot',
                        _hosts.format_hosts(wanted),
                        _hosts.format_hosts(allocation))
            try:
                # mpiexec passes SIGUSR1 on to every rank on every host.
                proc.send_signal(signal.SIGUSR1)
            except OSError:
                pass
        return watch

    # -- one attempt ---------------------------------------------------------

    def _run_attempt(self, attempt, allocation):
        env = dict(os.environ)
        env[config.RESTART_ENV] = str(attempt)
        # Events and death records come back in the output ('-'), from
        # whichever host they are written on.
        env[config.PROGRESS_FILE_ENV] = '-'
        env[config.LAUNCH_DEATHS_ENV] = '-'
        # Records carry this attempt's key: a line the program prints with
        # the same tag is shown as its own, never read as a record.
        env[config.LAUNCH_KEY_ENV] = secrets.token_hex(16)
        env.setdefault(config.ABORT_ON_EXCEPTION_ENV, '1')
        env.pop(config.LAUNCH_ID_ENV, None)
        # For the ranks only: mpiexec must not carry it (see _rank.end_job).
        tag = '{}:{}'.format(self.job_id, attempt)
        args = ['-genv', config.LAUNCH_ID_ENV, tag] + self.mpiexec_args
        if allocation is None:
            return self._runner.run(attempt, self.policy.local_size(),
                                    args, env, tag=tag)
        size = sum(n for _, n in allocation)
        result = self._runner.run(
            attempt, size, self._host_args(attempt, allocation) + args, env,
            watch=self._watch(allocation, tag), tag=tag)
        result.hosts = allocation
        _as_listed(result, allocation, self._ssh.names)
        _closed_sessions(result, allocation, self._ssh.ended_sessions())
        # No rank or proxy of this attempt may survive it on any host.
        verdicts = self._ssh.end_job([h for h, _ in allocation], self.job_id)
        for host, why in sorted(verdicts.items()):
            if why is not None:
                logger.warning('could not end the processes of attempt %d on '
                               '%s (%s): they are ended before that host is '
                               'used again', attempt, host, why)
        return result

    # -- the loop ------------------------------------------------------------

    def run(self):
        """Runs the job; returns the exit status for the launcher."""
        become_subreaper()
        previous = {s: signal.signal(s, self._on_signal)
                    for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.hosts is not None:
                self._folder = tempfile.mkdtemp(prefix='chainermn_overlap-')
                self._ssh = _hosts.Ssh(self.ssh_command,
                                       self.connect_timeout, self._folder)
            return self._loop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)

    def _loop(self):
        delay = self.backoff
        attempt = restarts = 0
        last_end = None
        while True:
            allocation = None
            if self.hosts is not None:
                allocation, why = self._plan()
                if allocation is None:
                    if restarts >= self.max_restarts:
                        logger.error('attempt %d cannot start: %s; no '
                                     'restarts left (--max-restarts %d)',
                                     attempt, why, self.max_restarts)
                        return 1
                    logger.warning('attempt %d cannot start: %s; trying '
                                   'again in %.1f s (restart %d of %d)',
                                   attempt, why, delay, restarts + 1,
                                   self.max_restarts)
                    if self._stop.wait(delay):
                        return 128 + int(self._stop_signal)
                    delay = min(delay * 2, self.backoff_max)
                    restarts += 1
                    continue
            where = (' on ' + _hosts.format_hosts(allocation)
                     if allocation else '')
            logger.info('attempt %d: starting %d rank(s)%s: %s', attempt,
                        sum(n for _, n in allocation) if allocation
                        else self.policy.local_size(), where,
                        ' '.join(self.command))
            result = self._run_attempt(attempt, allocation)
            self.results.append(result)
            _log_recovery(result, last_end)
            last_end = time.time()
            head = 'attempt {} ({} ranks{}) ended after {:.1f} s'.format(
                attempt, result.size, where, result.seconds)
            if self._stop_signal is not None:
                logger.warning('%s by %s to the launcher; not restarting',
                               head, _signal_name(self._stop_signal))
                return 128 + int(self._stop_signal)
            if result.ok:
                logger.info('attempt %d (%d ranks%s) completed successfully '
                            'after %.1f s', attempt, result.size, where,
                            result.seconds)
                return 0
            if result.stopped_to_resize:
                stop = [e for e in result.events
                        if e.get('event') == 'stopping'][-1]
                logger.info('%s: stopped at its snapshot of iteration %s to '
                            'change hosts; restarting now', head,
                            stop.get('iteration'))
                self.policy.after(result, allocation)
                attempt += 1
                self.resizes += 1
                delay = self.backoff
                continue
            status = (result.returncode if result.returncode > 0
                      else 128 - result.returncode)
            alike = result.same_failure_before_mpi()
            if alike is not None:
                last = result.output.last_line
                logger.error(
                    '%s: %s%s; the same failure on every rank, which a '
                    'restart does not change: not restarting, exiting with '
                    '%d', head, alike, ' (last line: {!r})'.format(
                        last[:160]) if last else '', status)
                return status
            if restarts >= self.max_restarts:
                logger.error('%s: %s; no restarts left (--max-restarts %d), '
                             'exiting with %d', head, result.reason(),
                             self.max_restarts, status)
                return status
            smaller = self.policy.after(result, allocation)
            logger.warning(
                '%s: %s; restart %d of %d in %.1f s%s', head,
                result.reason(), restarts + 1, self.max_restarts, delay,
                ' on {} rank(s) ({})'.format(self.policy.local_size(),
                                             smaller)
                if smaller and allocation is None else
                ' ({})'.format(smaller) if smaller else
                ' on {} rank(s)'.format(self.policy.local_size())
                if allocation is None else '')
            if self._stop.wait(delay):
                logger.warning('received %s during the back-off; not '
                               'restarting', _signal_name(self._stop_signal))
                return 128 + int(self._stop_signal)
            delay = (self.backoff if result.progressed
                     else min(delay * 2, self.backoff_max))
            attempt += 1
            restarts += 1


def _resolve(hosts, host_discovery, ranks, min_ranks, min_hosts,
             max_restarts, max_resizes, mpiexec):
    """The launcher's options checked and completed: returns ``(hosts,
    ranks, min_ranks, mpiexec)``; a ``ValueError`` names a bad one."""
    hosts = list(hosts) if hosts else None
    if host_discovery and hosts is None:
        hosts = _hosts.discover(host_discovery)
    if hosts:
        hosts = _hosts.one_spelling(hosts)
    if ranks is None:
        if hosts is None:
            raise ValueError('launch: give -n RANKS, or hosts with '
                             '--hostfile/--hosts/--host-discovery.')
        ranks = sum(s for _, s in hosts)
    if ranks < 1:
        raise ValueError('launch: -n must be >= 1, got {}.'.format(ranks))
    if min_ranks is None:
        min_ranks = ranks if min_hosts is None else 1
    if not 1 <= min_ranks <= ranks:
        raise ValueError('launch: --min-ranks must be between 1 and -n '
                         '({}), got {}.'.format(ranks, min_ranks))
    if min_hosts is not None and (hosts is None or not 1 <= min_hosts
                                  <= len(hosts)):
        raise ValueError(
            'launch: --min-hosts must be between 1 and the number of '
            'hosts listed ({}), got {}; it needs --hostfile, --hosts or '
            '--host-discovery.'.format(
                len(hosts or ()), min_hosts))
    for flag, value in (('--max-restarts', max_restarts),
                        ('--max-resizes', max_resizes)):
        if value < 0:
            raise ValueError('launch: {} must be >= 0, got {}.'.format(
                flag, value))
    if mpiexec is None:
        mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if not os.path.exists(mpiexec):
        raise ValueError(
            'launch: no mpiexec at {}. Install MPICH into this Python '
            'environment (pip install mpich) or pass --mpiexec PATH.'
            .format(mpiexec))
    return hosts, ranks, min_ranks, mpiexec


def _as_listed(result, allocation, names):
    """Writes the hosts of ``result``'s death records as the host list
    spells them: a record carries the host's own name, the list may give
    an address or another spelling (``names``: listed -> own name, as each
    host answered before the attempt)."""
    listed = {h for h, _ in allocation}
    own = {}
    for host in listed:
        own.setdefault(names.get(host, host), host)
    for death in result.output.deaths:
        name = death.get('host')
        if name not in listed and name in own:
            death['host'] = own[name]


def _closed_sessions(result, allocation, sessions):
    """Names the host whose ssh session the host itself closed (every
    process there ended at once: killed, or the host went down), from the
    sessions' own ends (:meth:`_hosts.Ssh.ended_sessions`): ssh's message
    reaches the output only when mpiexec lives long enough to forward it.
    The first such session counts; a session the launcher noticed lost
    (``session_lost``) already says which host it was."""
    listed = {h for h, _ in allocation}
    if 'ssh_closed' in result.facts or 'session_lost' in result.facts:
        return
    closed = sorted((s['time'], s['host']) for s in sessions
                    if s['host'] in listed and s['status'] == 255
                    and s.get('closed') is True)
    if closed:
        result.facts['ssh_closed'] = (closed[0][1],)


def _log_recovery(result, last_end):
    for e in result.events:
        if e.get('event') == 'training' and last_end is not None:
            logger.info('attempt %d training again at iteration %s, %.1f s '
                        'after the previous attempt ended', result.attempt,
                        e.get('iteration'), e['received'] - last_end)
            break
