"""One attempt: mpiexec started, its output read, its processes ended.

The output of every rank passes through the launcher (mpiexec forwards it
from every host), which copies it to its own stdout/stderr except for two
kinds of line it reads and drops: the death records of the per-rank
parents (:mod:`chainermn_overlap.launch._rank`) and the progress events of
:func:`chainermn_overlap.extensions.auto_snapshot` (``resumed``,
``training``, ``snapshot``, ``stopping``).  Both travel in the output, not
in files, so that they reach the launcher from any host.  Each record is
``TAG[KEY] JSON``, with the attempt's random key (``CHAINERMN_OVERLAP_
LAUNCH_KEY``, set for every rank): a line the program prints with the
tag but not the key, or that is not a JSON object, is the program's own
and shown as it is.
"""
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from chainermn_overlap import config
from chainermn_overlap.extensions.snapshot import PROGRESS_TAG
from chainermn_overlap.launch import _rank
from chainermn_overlap.launch._procs import descendants, kill_all
from chainermn_overlap.launch._result import PATTERNS, AttemptResult

logger = logging.getLogger('chainermn_overlap.launch')

# Seconds the processes an attempt's mpiexec left behind may take to end
# by themselves once it has exited (see AttemptRunner.end).
ORPHAN_GRACE = 2.0


class Output(object):
    """What an attempt's output said: facts, deaths, events, last line."""

    def __init__(self, key=None):
        # The attempt's key (CHAINERMN_OVERLAP_LAUNCH_KEY): a tagged line
        # without it is the program's own, shown and not read.
        self.key = key
        self.facts = {}
        self.deaths = []
        self.events = []
        self.last_line = None
        self._lock = threading.Lock()

    def feed(self, line):
        """Reads one line; returns whether to show it to the user: True,
        False, or the part to show (str) when a record ends a line the
        program had begun without its newline (another rank's output, or
        this one's, glued in front of the record)."""
        with self._lock:
            for tag, into in ((_rank.DEATH_TAG, self.deaths),
                              (PROGRESS_TAG, self.events)):
                at = line.find(tag)
                if at >= 0:
                    rest = line[at + len(tag):]
                    if self.key is not None:
                        mark = '[{}] '.format(self.key)
                        if not rest.startswith(mark):
                            return True   # not one of ours: the user's
                        rest = rest[len(mark):]
                    try:
                        record = json.loads(rest)
                    except ValueError:
                        return True   # cut short (a kill): show it
                    if not _well_formed(tag, record):
                        return True   # not one of ours: the user's line
                    # The launcher's clock: ranks may run on other hosts.
                    record['received'] = time.time()
                    into.append(record)
                    return line[:at] if line[:at].strip() else False
            if line.strip():
                self.last_line = line.strip()
            for key, pattern in PATTERNS:
                m = pattern.search(line)
                if not m:
                    continue
                # The first report of each kind wins.
                if key not in self.facts:
                    self.facts[key] = m.groups()
        return True


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _well_formed(tag, record):
    """Whether ``record`` has the fields the launcher reads of it."""
    if not isinstance(record, dict):
        return False
    if tag == _rank.DEATH_TAG:
        return (isinstance(record.get('rank'), int) and
                isinstance(record.get('pid'), int) and
                _number(record.get('time')) and
                any(_number(record.get(k)) for k in ('signal', 'exit')))
    return isinstance(record.get('event'), str)


def _pump(src, dst, output):
    """Copies ``src`` to ``dst`` line by line, reading the launcher's
    records out of it.  It must not stop before ``src`` ends, whatever the
    job prints (the ranks would block on a full pipe): a line it cannot
    read or write is passed on as it is, or dropped."""
    out = getattr(dst, 'buffer', None)
    for raw in iter(src.readline, b''):
        line = raw.decode('utf-8', 'replace').rstrip('\n')
        try:
            show = output.feed(line)
        except Exception:  # a record we misread: show the line
            logger.debug('could not read the line %r', line, exc_info=True)
            show = True
        if show is False:
            continue
        if show is not True:   # the program's text before a record
            raw = (show + '\n').encode('utf-8', 'replace')
        try:
            if out is not None:
                out.write(raw)
            else:
                dst.write(raw.decode('utf-8', 'replace'))
            dst.flush()
        except (OSError, ValueError, TypeError):
            pass
    src.close()


class AttemptRunner(object):
    """Starts attempts of one job and ends them.

    Args:
        mpiexec (str): the ``mpiexec`` to use.
        command (list of str): what each rank runs.
        kill_grace (float): seconds between SIGTERM and SIGKILL.
        stop (threading.Event): set when the launcher was told to stop.
    """

    def __init__(self, mpiexec, command, kill_grace, stop):
        self.mpiexec = mpiexec
        self.command = list(command)
        self.kill_grace = kill_grace
        self.stop = stop
        self.proc = None
        self.tag = None
        self._seen = set()

    def run(self, attempt, size, mpiexec_args, env, watch=None, tag=None):
        """Runs one attempt to its end; returns its AttemptResult.

        Args:
            mpiexec_args (list of str): arguments before the program.
            env (dict): the environment of mpiexec (and so of every rank).
            watch: called about every 0.25 s while the attempt runs, with
                the running Popen and the Output so far.
            tag (str): the ``JOB:ATTEMPT`` its ranks carry in their
                environment: with the processes seen under mpiexec, what
                the attempt's orphans are known by when it is ended.
        """
        # _rank.py, run by path (it imports only the standard library), is
        # each rank's parent.
        cmd = ([self.mpiexec, '-n', str(size)] + list(mpiexec_args)
               + [sys.executable, os.path.abspath(_rank.__file__)]
               + self.command)
        t0 = time.monotonic()
        output = Output(config.launch_key(env) or None)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE,
                                start_new_session=True)
        self.proc = proc
        self.tag = tag
        self._seen = set()
        pid_ranks = {}
        pumps = [threading.Thread(target=_pump, args=(src, dst, output),
                                  daemon=True)
                 for src, dst in ((proc.stdout, sys.stdout),
                                  (proc.stderr, sys.stderr))]
        for t in pumps:
            t.start()
        interrupted = False
        while proc.poll() is None:
            self._seen.update(_scan_ranks(proc.pid, pid_ranks))
            if watch is not None:
                watch(proc, output)
            if self.stop.wait(0.25):
                interrupted = True
                break
        self.end(proc)
        for t in pumps:
            t.join(timeout=5.0)
        self.proc = None
        return AttemptResult(attempt, size, proc.returncode,
                             time.monotonic() - t0, output, pid_ranks,
                             interrupted)

    def members(self, proc):
        """The attempt's live local processes: mpiexec's tree, and those
        re-parented to this process (a child subreaper) that were seen in
        it or carry the attempt's tag.  Nothing else of an embedding
        program's is signalled."""
        out = set(descendants(proc.pid))
        if proc.poll() is None:
            out.add(proc.pid)
        tag = None if self.tag is None else '{}={}'.format(
            config.LAUNCH_ID_ENV, self.tag).encode()
        for pid in set(descendants(os.getpid())) - out:
            if pid in self._seen or (tag is not None and tag in (
                    _rank.environ(pid) or ())):
                out.add(pid)
                out.update(descendants(pid))
        return out

    def _reap(self, proc):
        """Reaps the attempt's orphans that ended (only those: never
        ``waitpid(-1)``, which would take an embedding program's)."""
        for pid in list(self._seen):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:   # not ours to reap, or reaped
                done = pid
            if done == pid and not os.path.exists('/proc/{}'.format(pid)):
                self._seen.discard(pid)

    def end(self, proc):
        """SIGTERM, then SIGKILL, to the attempt's local processes; waits
        until every one of them is gone.

        When mpiexec ended by itself, its orphans get ``ORPHAN_GRACE``
        seconds to end on their own first: an ssh session whose host was
        lost prints why (``Connection to H closed by remote host``) just
        after Hydra, which saw the same closed connection, exits, and a
        signal would cut that line off.
        """
        if proc.poll() is None:
            self._seen.update(self.members(proc))
            kill_all(self.members(proc), signal.SIGTERM)
            try:
                proc.wait(timeout=self.kill_grace)
            except subprocess.TimeoutExpired:
                kill_all(self.members(proc), signal.SIGKILL)
                proc.wait()
        else:
            self._seen.update(self.members(proc))
            deadline = time.monotonic() + ORPHAN_GRACE
            while time.monotonic() < deadline:
                self._reap(proc)
                if not self.members(proc):
                    break
                time.sleep(0.05)
        # mpiexec's status is known: its orphans are re-parented to this
        # process, which reaps those of the attempt.
        deadline = time.monotonic() + 30.0
        while True:
            self._reap(proc)
            members = self.members(proc)
            if not members:
                break
            kill_all(members, signal.SIGKILL)
            if time.monotonic() > deadline:
                logger.error('processes %s of the attempt survive SIGKILL',
                             members)
                break
            time.sleep(0.05)


def _scan_ranks(root, pid_ranks):
    """Records pid -> MPI rank of the attempt's local processes (/proc,
    under mpiexec ``root``); returns the processes seen."""
    seen = descendants(root)
    for pid in seen:
        if pid in pid_ranks:
            continue
        for item in _rank.environ(pid) or ():
            if item.startswith(b'PMI_RANK='):
                pid_ranks[pid] = int(item[9:])
                break
    return seen
