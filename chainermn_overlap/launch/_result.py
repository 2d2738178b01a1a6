"""How an attempt ended, in one line a person can read.

The launcher scans what the ranks and mpiexec print (MPICH/Hydra's reports,
:mod:`chainermn_overlap.abort`'s line, the watchdog's timeout) and the
per-rank parents' death records, and :class:`AttemptResult` turns these
facts into the reason it logs.
"""
import re

from chainermn_overlap.launch._procs import signal_name as _signal_name

# What ranks and mpiexec write when an attempt fails (MPICH/Hydra and
# chainermn_overlap.abort); used to say why in one line.
PATTERNS = [
    # The message in parentheses: greedy, so one holding ') ' stays whole.
    ('abort', re.compile(r'chainermn_overlap: rank (\d+) raised an uncaught '
                         r'(\w+)(?: \((.*)\))?(?: in a thread)?; calling')),
    ('mpi_abort', re.compile(r'MPI_Abort\(MPI_COMM_WORLD, (\d+)\) - process '
                             r'(\d+)')),
    ('timeout', re.compile(r'rank (\d+): timed out after ([\d.]+ s) waiting '
                           r'for (.{0,80})')),
    ('not_posted', re.compile(r'rank (\d+): has NOT posted it')),
    ('bad_pid', re.compile(r'=\s+PID (\d+) RUNNING AT (\S+)')),
    # ssh of mpiexec to a host's proxy: the host's processes all ended.
    ('ssh_closed', re.compile(r'Connection to (\S+) closed by remote host')),
    ('bad_code', re.compile(r'=\s+EXIT CODE: (\d+)')),
    ('exit_string', re.compile(r'EXIT STRING: (.*)$')),
]


def _cut(text, limit=80):
    text = text.strip()
    return text if len(text) <= limit else text[:limit - 3] + '...'


def _short(text, limit=80):
    return _cut(text.split(' (')[0], limit)


class AttemptResult(object):
    """How one attempt ended.

    Args:
        attempt (int): its number (0 first).
        size (int): its ranks.
        returncode (int): mpiexec's exit status (negative: a signal).
        seconds (float): how long it ran.
        output (Output): what its output said (facts, death records,
            progress events, the last line shown).
        pid_ranks (dict): pid -> rank of the local processes seen.
        interrupted (bool): ended by a signal to the launcher.
        hosts (list of tuple): ``(host, slots)`` it ran on; None: local.
    """

    def __init__(self, attempt, size, returncode, seconds, output,
                 pid_ranks, interrupted, hosts=None):
        self.attempt = attempt
        self.size = size
        self.returncode = returncode
        self.seconds = seconds
        self.output = output
        self.facts = dict(output.facts)
        self.pid_ranks = pid_ranks
        self.interrupted = interrupted
        self.hosts = hosts
        # Deaths by a signal that a parent passed on from outside (the
        # process manager ending the others) are consequences, not causes.
        causes = [d for d in output.deaths if not d.get('forwarded')]
        if causes or output.deaths:
            self.facts['first_death'] = min(causes or output.deaths,
                                            key=lambda d: d['time'])

    @property
    def events(self):
        """Progress events of this attempt, in order."""
        return [e for e in self.output.events
                if e.get('attempt', self.attempt) == self.attempt]

    @property
    def ok(self):
        return self.returncode == 0

    @property
    def progressed(self):
        return any(e.get('event') == 'snapshot' for e in self.events)

    @property
    def stopped_to_resize(self):
        """The job stopped at a snapshot because the launcher asked."""
        return any(e.get('event') == 'stopping' for e in self.events)

    def _on(self, rank):
        """' on HOST' for ``rank`` from the hosts it ran on, or ''."""
        first = 0
        for host, n in self.hosts or ():
            if first <= int(rank) < first + n:
                return ' on {}'.format(host)
            first += n
        return ''

    def same_failure_before_mpi(self):
        """A description when every rank failed alike before MPI_Init.

        Returns:
            str or None: e.g. ``'every rank (2 of 2) exited with code 3
            before initialising MPI'``; None when that is not what
            happened (or cannot be told).
        """
        deaths = self.output.deaths
        if self.ok or len(deaths) != self.size or self.size == 0:
            return None
        if any(d.get('mpi') is not False or d.get('forwarded')
               for d in deaths):
            return None
        ends = {('signal', d['signal']) if 'signal' in d
                else ('exit', d['exit']) for d in deaths}
        if len(ends) != 1:
            return None
        kind, value = ends.pop()
        how = ('was killed by {}'.format(_signal_name(value))
               if kind == 'signal' else 'exited with code {}'.format(value))
        return 'every rank ({} of {}) {} before initialising MPI'.format(
            len(deaths), self.size, how)

    def reason(self):
        """One line a person can read: why the attempt ended."""
        if self.ok:
            return 'completed successfully'
        f = self.facts
        parts = []
        if 'abort' in f and 'timeout' in f and \
                f['abort'][1] == 'CommunicationTimeout':
            rank, waited, what = f['timeout']
            parts.append('rank {}{} raised CommunicationTimeout: the '
                         'watchdog timed out after {} waiting for {}'.format(
                             rank, self._on(rank), waited, _short(what)))
        elif 'abort' in f:
            rank, exc, message = f['abort']
            text = 'rank {}{} raised {}'.format(rank, self._on(rank), exc)
            if message:
                text += ' ({})'.format(_cut(message, 120))
            parts.append(text)
        elif 'timeout' in f:
            rank, waited, what = f['timeout']
            parts.append('rank {}{} timed out after {} waiting for {}'.format(
                rank, self._on(rank), waited, _short(what)))
        elif 'mpi_abort' in f:
            code, rank = f['mpi_abort']
            parts.append('rank {}{} called MPI_Abort({})'.format(
                rank, self._on(rank), code))
        if 'not_posted' in f:
            parts.append('rank {} was stuck (never posted)'.format(
                f['not_posted'][0]))
        death = f.get('first_death')
        if 'session_lost' in f and (death is None or death.get('forwarded')):
            # The launcher ended the others: their deaths are its doing.
            death = None
            parts.append('mpiexec\'s ssh session to host {} ended while the '
                         'job ran on (the host or its link was lost); the '
                         'launcher ended the attempt'.format(
                             f['session_lost'][0]))
        if death is not None and 'abort' not in f and 'mpi_abort' not in f:
            who = 'rank {}{} (pid {})'.format(
                death['rank'], ' on {}'.format(death['host'])
                if self.hosts and death.get('host') else '', death['pid'])
            if 'signal' in death:
                parts.append('{} was killed by {}'.format(
                    who, _signal_name(death['signal'])))
            else:
                parts.append('{} exited with code {}'.format(
                    who, death['exit']))
        elif ('bad_pid' in f and 'abort' not in f and 'mpi_abort' not in f
              and 'session_lost' not in f):
            pid = int(f['bad_pid'][0])
            rank = self.pid_ranks.get(pid)
            where = ' on {}'.format(f['bad_pid'][1]) if self.hosts else ''
            who = 'rank {}{} (pid {})'.format(rank, where, pid) \
                if rank is not None else 'a rank{} (pid {}, rank unknown)' \
                .format(where, pid)
            code = int(f['bad_code'][0]) if 'bad_code' in f else None
            how = f.get('exit_string', [''])[0].strip()
            if code is not None and code in (6, 9, 11, 15) and \
                    'signal' in how.lower():
                parts.append('{} was killed by {}'.format(
                    who, _signal_name(code)))
            elif code is not None:
                parts.append('{} exited with code {}{}'.format(
                    who, code, ' ({})'.format(how) if how else ''))
            else:
                parts.append('{} ended abnormally'.format(who))
        if self.returncode < 0:
            status = 'mpiexec killed by {}'.format(
                _signal_name(-self.returncode))
        else:
            status = 'mpiexec exit code {}'.format(self.returncode)
        lost = f.get('ssh_closed')
        if lost and (death is None or death.get('forwarded')):
            parts.append('every process on host {} ended at once (mpiexec\'s '
                         'ssh session to it was closed by the host)'.format(
                             lost[0]))
        if not parts:
            parts.append('the job failed (no rank said why)')
        return '{}; {}'.format('; '.join(parts), status)
