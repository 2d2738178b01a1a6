"""Run an MPI training job and restart it when it ends abnormally.

    python -m chainermn_overlap.launch -n 4 [--max-restarts 3]
        [--min-ranks 2] [--backoff 1] [--mpiexec PATH] -- train.py [ARGS]

Each attempt runs ``mpiexec -n N python SCRIPT ARGS`` (the ``mpiexec``
beside this Python by default) in a session of its own.  When it ends
abnormally -- a rank killed, an exception that aborted the job (the
launcher sets ``CHAINERMN_OVERLAP_ABORT_ON_EXCEPTION=1`` so that one does),
a watchdog timeout -- the launcher logs why in one line, ends and waits for
every remaining process of that attempt, waits a back-off (``--backoff``
seconds, doubled after each failure up to ``--backoff-max``) and starts the
job again, up to ``--max-restarts`` times.  It exits with the status of the
last attempt.  The script resumes by itself with
:func:`chainermn_overlap.extensions.auto_snapshot`.

Every rank sees ``CHAINERMN_OVERLAP_RESTART`` (0 on the first attempt, then
1, 2, ...).  ``CHAINERMN_OVERLAP_PROGRESS_FILE`` names a file where
``auto_snapshot`` records resumes and snapshots: an attempt that failed
without writing a snapshot made no progress.  With ``--min-ranks M`` below
``-n``, after ``--shrink-after`` consecutive attempts without progress the
next attempt runs on one rank fewer, down to ``M`` (what changes then is
described in :mod:`chainermn_overlap.extensions`).

SIGINT (Ctrl-C) and SIGTERM to the launcher end the running attempt (SIGTERM
to its processes, SIGKILL after ``--kill-grace`` seconds) and are never
followed by a restart; the launcher then exits with 128 + the signal.
"""
import argparse
import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ['AttemptResult', 'Launcher', 'main']

logger = logging.getLogger('chainermn_overlap.launch')

RESTART_ENV = 'CHAINERMN_OVERLAP_RESTART'
PROGRESS_ENV = 'CHAINERMN_OVERLAP_PROGRESS_FILE'
ABORT_ENV = 'CHAINERMN_OVERLAP_ABORT_ON_EXCEPTION'

# What ranks and mpiexec write when an attempt fails (MPICH/Hydra and
# chainermn_overlap.abort); used to say why in one line.
_PATTERNS = [
    ('abort', re.compile(r'chainermn_overlap: rank (\d+) raised an uncaught '
                         r'(\w+)')),
    ('mpi_abort', re.compile(r'MPI_Abort\(MPI_COMM_WORLD, (\d+)\) - process '
                             r'(\d+)')),
    ('timeout', re.compile(r'rank (\d+): timed out after ([\d.]+ s) waiting '
                           r'for (.{0,80})')),
    ('not_posted', re.compile(r'rank (\d+): has NOT posted it')),
    ('bad_pid', re.compile(r'=\s+PID (\d+) RUNNING AT (\S+)')),
    ('bad_code', re.compile(r'=\s+EXIT CODE: (\d+)')),
    ('exit_string', re.compile(r'EXIT STRING: (.*)$')),
    ('error_line', re.compile(r'^(?:\[\d+\]\s*)?([A-Za-z_][\w.]*(?:Error|'
                              r'Exception|Timeout|Interrupt)): (.{1,160})')),
]

_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper():
    """Orphaned processes of an attempt become our children (Linux), so
    that we can wait for each of them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _signal_name(num):
    try:
        return signal.Signals(num).name
    except ValueError:
        return 'signal {}'.format(num)


def _short(text, limit=80):
    text = text.strip().split(' (')[0].strip()
    return text if len(text) <= limit else text[:limit - 3] + '...'


class AttemptResult(object):
    """How one attempt ended."""

    def __init__(self, attempt, size, returncode, seconds, facts, pid_ranks,
                 events, interrupted):
        self.attempt = attempt
        self.size = size
        self.returncode = returncode
        self.seconds = seconds
        self.facts = facts
        self.pid_ranks = pid_ranks
        self.events = events
        self.interrupted = interrupted

    @property
    def ok(self):
        return self.returncode == 0

    @property
    def progressed(self):
        return any(e.get('event') == 'snapshot' for e in self.events)

    def reason(self):
        """One line a person can read: why the attempt ended."""
        if self.ok:
            return 'completed successfully'
        f = self.facts
        parts = []
        if 'abort' in f and 'timeout' in f and \
                f['abort'][1] == 'CommunicationTimeout':
            rank, waited, what = f['timeout']
            parts.append('rank {} raised CommunicationTimeout: the watchdog '
                         'timed out after {} waiting for {}'.format(
                             rank, waited, _short(what)))
        elif 'abort' in f:
            rank, exc = f['abort']
            text = 'rank {} raised {}'.format(rank, exc)
            for name, message in f.get('error_lines', ()):
                if name.split('.')[-1] == exc:
                    text += ' ({})'.format(_short(message))
                    break
            parts.append(text)
        elif 'timeout' in f:
            rank, waited, what = f['timeout']
            parts.append('rank {} timed out after {} waiting for {}'.format(
                rank, waited, _short(what)))
        elif 'mpi_abort' in f:
            code, rank = f['mpi_abort']
            parts.append('rank {} called MPI_Abort({})'.format(rank, code))
        if 'not_posted' in f:
            parts.append('rank {} was stuck (never posted)'.format(
                f['not_posted'][0]))
        death = f.get('first_death')
        if death is not None and 'abort' not in f and 'mpi_abort' not in f:
            who = 'rank {} (pid {})'.format(death['rank'], death['pid'])
            if 'signal' in death:
                parts.append('{} was killed by {}'.format(
                    who, _signal_name(death['signal'])))
            else:
                parts.append('{} exited with code {}'.format(
                    who, death['exit']))
        elif 'bad_pid' in f and 'abort' not in f and 'mpi_abort' not in f:
            pid = int(f['bad_pid'][0])
            rank = self.pid_ranks.get(pid)
            who = 'rank {} (pid {})'.format(rank, pid) if rank is not None \
                else 'a rank (pid {}, rank unknown)'.format(pid)
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
        if not parts:
            parts.append('the job failed (no rank said why)')
        return '{}; {}'.format('; '.join(parts), status)


class Launcher(object):
    """Runs attempts until one succeeds or the restarts are used up.

    Args:
        command (list of str): what each rank runs (``python script ...``).
        ranks (int): ranks of the first attempt.
        max_restarts (int): restarts after the first attempt.
        mpiexec (str): the ``mpiexec`` to use.
        min_ranks (int): fewest ranks to shrink to.
        backoff (float): seconds before the first restart; doubled after
            each failed attempt, at most ``backoff_max``.
        shrink_after (int): consecutive attempts without progress before
            one rank fewer is tried.
        kill_grace (float): seconds between SIGTERM and SIGKILL when ending
            an attempt.
        mpiexec_args (list of str): extra arguments for ``mpiexec``.
    """

    def __init__(self, command, ranks, max_restarts=3, mpiexec=None,
                 min_ranks=None, backoff=1.0, backoff_max=60.0,
                 shrink_after=2, kill_grace=5.0, mpiexec_args=()):
        if ranks < 1:
            raise ValueError('launch: -n must be >= 1, got {}.'.format(ranks))
        min_ranks = ranks if min_ranks is None else min_ranks
        if not 1 <= min_ranks <= ranks:
            raise ValueError('launch: --min-ranks must be between 1 and -n '
                             '({}), got {}.'.format(ranks, min_ranks))
        if max_restarts < 0:
            raise ValueError('launch: --max-restarts must be >= 0, got {}.'
                             .format(max_restarts))
        if mpiexec is None:
            mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
        if not os.path.exists(mpiexec):
            raise ValueError(
                'launch: no mpiexec at {}. Install MPICH into this Python '
                'environment (pip install mpich) or pass --mpiexec PATH.'
                .format(mpiexec))
        self.command = list(command)
        self.ranks = ranks
        self.max_restarts = max_restarts
        self.mpiexec = mpiexec
        self.min_ranks = min_ranks
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.shrink_after = max(1, shrink_after)
        self.kill_grace = kill_grace
        self.mpiexec_args = list(mpiexec_args)
        self.results = []
        self._stop_signal = None
        self._stop = threading.Event()
        self._proc = None

    # -- signals ------------------------------------------------------------

    def _on_signal(self, signum, frame):
        if self._stop_signal is None:
            self._stop_signal = signum
            logger.warning('received %s: ending the job; no restart',
                           _signal_name(signum))
        self._stop.set()

    # -- one attempt ---------------------------------------------------------

    def _run_attempt(self, attempt, size, progress_path):
        env = dict(os.environ)
        env[RESTART_ENV] = str(attempt)
        env[PROGRESS_ENV] = progress_path
        env.setdefault(ABORT_ENV, '1')
        env[DEATHS_ENV] = progress_path + '.deaths'
        # This file, run by path (it imports only the standard library),
        # as each rank's parent: see _rank_main.
        cmd = ([self.mpiexec, '-n', str(size)] + self.mpiexec_args
               + [sys.executable, os.path.abspath(__file__), _RANK_FLAG]
               + self.command)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE,
                                start_new_session=True)
        self._proc = proc
        facts = {}
        pid_ranks = {}
        lock = threading.Lock()

        def pump(src, dst):
            for raw in iter(src.readline, b''):
                try:
                    dst.buffer.write(raw)
                    dst.flush()
                except (OSError, ValueError):
                    pass
                line = raw.decode('utf-8', 'replace').rstrip('\n')
                for key, pattern in _PATTERNS:
                    m = pattern.search(line)
                    if m:
                        with lock:
                            # The first report of each kind wins; error
                            # lines are all kept (a few), to find the one of
                            # the exception that aborted.
                            if key == 'error_line':
                                lines = facts.setdefault('error_lines', [])
                                if len(lines) < 50:
                                    lines.append(m.groups())
                            elif key not in facts:
                                facts[key] = m.groups()
            src.close()

        pumps = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout),
                                  daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, sys.stderr),
                                  daemon=True)]
        for t in pumps:
            t.start()
        interrupted = False
        while proc.poll() is None:
            self._scan_ranks(pid_ranks)
            if self._stop.wait(0.25):
                interrupted = True
                self._end_attempt(proc)
                break
        proc.wait()
        self._end_attempt(proc)
        for t in pumps:
            t.join(timeout=5.0)
        self._proc = None
        deaths = _read_events(env[DEATHS_ENV], None)
        try:
            os.unlink(env[DEATHS_ENV])
        except OSError:
            pass
        if deaths:
            facts['first_death'] = min(deaths, key=lambda d: d['time'])
        return AttemptResult(attempt, size, proc.returncode,
                             time.monotonic() - t0, facts, pid_ranks,
                             _read_events(progress_path, attempt),
                             interrupted)

    @staticmethod
    def _scan_ranks(pid_ranks):
        """Records pid -> MPI rank of the attempt's processes (/proc)."""
        for pid in _descendants(os.getpid()):
            if pid in pid_ranks:
                continue
            try:
                with open('/proc/{}/environ'.format(pid), 'rb') as f:
                    env = f.read().split(b'\0')
            except OSError:
                continue
            for item in env:
                if item.startswith(b'PMI_RANK='):
                    pid_ranks[pid] = int(item[9:])
                    break

    def _end_attempt(self, proc):
        """SIGTERM, then SIGKILL, to the attempt's processes; waits until
        every one of them is gone."""
        me = os.getpid()
        if proc.poll() is None:
            _kill_all(_descendants(me), signal.SIGTERM)
            try:
                proc.wait(timeout=self.kill_grace)
            except subprocess.TimeoutExpired:
                _kill_all(_descendants(me), signal.SIGKILL)
                proc.wait()
        # mpiexec's status is known: from here on, any child may be reaped
        # (orphans of the attempt are re-parented to this process).
        deadline = time.monotonic() + 30.0
        while True:
            _reap()
            members = _descendants(me)
            if not members:
                break
            _kill_all(members, signal.SIGKILL)
            if time.monotonic() > deadline:
                logger.error('processes %s of the attempt survive SIGKILL',
                             members)
                break
            time.sleep(0.05)

    # -- the loop ------------------------------------------------------------

    def run(self):
        """Runs the job; returns the exit status for the launcher."""
        _become_subreaper()
        previous = {s: signal.signal(s, self._on_signal)
                    for s in (signal.SIGINT, signal.SIGTERM)}
        fd, progress_path = tempfile.mkstemp(prefix='chainermn_overlap-',
                                             suffix='.progress')
        os.close(fd)
        try:
            return self._loop(progress_path)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            try:
                os.unlink(progress_path)
            except OSError:
                pass

    def _loop(self, progress_path):
        size = self.ranks
        failures_without_progress = 0
        delay = self.backoff
        attempt = 0
        last_end = None
        while True:
            logger.info('attempt %d: starting %d rank(s): %s', attempt, size,
                        ' '.join(self.command))
            result = self._run_attempt(attempt, size, progress_path)
            self.results.append(result)
            _log_recovery(result, last_end)
            last_end = time.time()
            if self._stop_signal is not None:
                logger.warning('attempt %d ended after %.1f s by %s to the '
                               'launcher; not restarting', attempt,
                               result.seconds,
                               _signal_name(self._stop_signal))
                return 128 + int(self._stop_signal)
            if result.ok:
                logger.info('attempt %d (%d ranks) completed successfully '
                            'after %.1f s', attempt, size, result.seconds)
                return 0
            status = (result.returncode if result.returncode > 0
                      else 128 - result.returncode)
            if attempt >= self.max_restarts:
                logger.error('attempt %d (%d ranks) ended after %.1f s: %s; '
                             'no restarts left (--max-restarts %d), exiting '
                             'with %d', attempt, size, result.seconds,
                             result.reason(), self.max_restarts, status)
                return status
            failures_without_progress = (
                0 if result.progressed else failures_without_progress + 1)
            next_size = size
            if (failures_without_progress >= self.shrink_after
                    and size > self.min_ranks):
                next_size = size - 1
                failures_without_progress = 0
            logger.warning(
                'attempt %d (%d ranks) ended after %.1f s: %s; restart %d of '
                '%d in %.1f s on %d rank(s)%s', attempt, size, result.seconds,
                result.reason(), attempt + 1, self.max_restarts, delay,
                next_size,
                ' (fewer: {} attempt(s) in a row made no progress)'.format(
                    self.shrink_after) if next_size < size else '')
            if self._stop.wait(delay):
                logger.warning('received %s during the back-off; not '
                               'restarting', _signal_name(self._stop_signal))
                return 128 + int(self._stop_signal)
            delay = min(delay * 2, self.backoff_max)
            if result.progressed:
                delay = self.backoff
            size = next_size
            attempt += 1


def _log_recovery(result, last_end):
    for e in result.events:
        if e.get('event') == 'training' and last_end is not None:
            logger.info('attempt %d training again at iteration %s, %.1f s '
                        'after the previous attempt ended', result.attempt,
                        e.get('iteration'), e['time'] - last_end)
            break


def _read_events(path, attempt):
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue   # a line cut short by a kill
                if attempt is None or e.get('attempt') == attempt:
                    out.append(e)
    except OSError:
        pass
    return out


def _descendants(root):
    """Live (non-zombie) descendants of process ``root``, from /proc.

    MPICH's process manager puts every rank into a session of its own, so
    the attempt's processes are found by parenthood, not by process group;
    orphans are re-parented to the launcher (a child subreaper), so they
    stay in this tree.
    """
    children = {}
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/{}/stat'.format(name)) as f:
                stat = f.read()
        except OSError:
            continue
        # After the command (which may contain spaces): state, ppid.
        rest = stat[stat.rfind(')') + 2:].split()
        if len(rest) >= 2 and rest[0] != 'Z':
            children.setdefault(int(rest[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            out.append(pid)
            todo.append(pid)
    return out


def _kill_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


_RANK_FLAG = '--as-rank'
DEATHS_ENV = 'CHAINERMN_OVERLAP_LAUNCH_DEATHS'
_PR_SET_PDEATHSIG = 1


def _rank_main(command):
    """Runs one rank's ``command`` as a child and reports its abnormal end.

    MPICH's process manager names the wrong process when one rank dies
    (the first of its list that ended badly, after it killed the others),
    so each rank runs under this small parent: when the child dies by a
    signal or exits non-zero, it appends a line to the launcher's deaths
    file first.  The child dies with its parent (PR_SET_PDEATHSIG), so
    killing the parent still ends the rank.
    """
    pid = os.fork()
    if pid == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() == 1:
                os._exit(1)
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    # Signals for the rank go to the rank; this parent only waits.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda num, frame, pid=pid: _kill_all([pid], num))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and os.environ.get(DEATHS_ENV):
        record = {'rank': int(os.environ.get('PMI_RANK', -1)), 'pid': pid,
                  'time': time.time()}
        if code < 0:
            record['signal'] = -code
        else:
            record['exit'] = code
        try:
            with open(os.environ[DEATHS_ENV], 'a') as f:
                f.write(json.dumps(record) + '\n')
        except OSError:
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


def _parser():
    p = argparse.ArgumentParser(
        prog='python -m chainermn_overlap.launch',
        description='Runs an MPI job with mpiexec and restarts it when it '
        'ends abnormally (a rank killed, an exception, a watchdog timeout).',
        epilog='Example: python -m chainermn_overlap.launch -n 4 '
        '--max-restarts 3 -- train.py --epochs 10')
    p.add_argument('-n', '--ranks', type=int, required=True,
                   help='number of ranks (processes)')
    p.add_argument('--max-restarts', type=int, default=3,
                   help='restarts after the first attempt (default 3)')
    p.add_argument('--mpiexec', default=None,
                   help='mpiexec to use (default: the one beside this '
                   'Python)')
    p.add_argument('--min-ranks', type=int, default=None,
                   help='fewest ranks to continue with after attempts '
                   'without progress (default: -n, never fewer)')
    p.add_argument('--shrink-after', type=int, default=2,
                   help='attempts in a row without progress before one rank '
                   'fewer is tried (default 2)')
    p.add_argument('--backoff', type=float, default=1.0,
                   help='seconds before the first restart, doubled after '
                   'each failure without progress (default 1)')
    p.add_argument('--backoff-max', type=float, default=60.0,
                   help='longest back-off in seconds (default 60)')
    p.add_argument('--kill-grace', type=float, default=5.0,
                   help='seconds between SIGTERM and SIGKILL when ending an '
                   'attempt (default 5)')
    p.add_argument('--mpiexec-arg', action='append', default=[],
                   help='an extra argument for mpiexec (repeatable)')
    p.add_argument('--no-python', action='store_true',
                   help='run SCRIPT as an executable, not with this Python')
    p.add_argument('script', help='the training script')
    p.add_argument('args', nargs=argparse.REMAINDER,
                   help='arguments of the script')
    return p


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == _RANK_FLAG:
        return _rank_main(argv[1:])
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr,
            format='%(asctime)s chainermn_overlap.launch: %(message)s')
    script_args = args.args
    if script_args and script_args[0] == '--':
        script_args = script_args[1:]
    command = ([args.script] if args.no_python
               else [sys.executable, args.script]) + script_args
    try:
        launcher = Launcher(
            command, args.ranks, max_restarts=args.max_restarts,
            mpiexec=args.mpiexec, min_ranks=args.min_ranks,
            backoff=args.backoff, backoff_max=args.backoff_max,
            shrink_after=args.shrink_after, kill_grace=args.kill_grace,
            mpiexec_args=args.mpiexec_arg)
    except ValueError as e:
        logger.error('%s', e)
        return 2
    return launcher.run()


if __name__ == '__main__':
    sys.exit(main())
