"""One attempt: mpiexec started, its output read, its processes ended.

The output of every rank passes through the launcher (mpiexec forwards it
from every host), which copies it to its own stdout/stderr except for two
kinds of line it reads and drops: the death records of the per-rank
parents (:mod:`chainermn_overlap.launch._rank`) and the progress events of
:func:`chainermn_overlap.extensions.auto_snapshot` (``resumed``,
``training``, ``snapshot``, ``stopping``).  Both travel in the output, not
in files, so that they reach the launcher from any host.
"""
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from chainermn_overlap.extensions.snapshot import PROGRESS_TAG
from chainermn_overlap.launch import _rank
from chainermn_overlap.launch._procs import descendants, kill_all, reap
from chainermn_overlap.launch._result import PATTERNS, AttemptResult

logger = logging.getLogger('chainermn_overlap.launch')


class Output(object):
    """What an attempt's output said: facts, deaths, events, last line."""

    def __init__(self):
        self.facts = {}
        self.deaths = []
        self.events = []
        self.last_line = None
        self._lock = threading.Lock()

    def feed(self, line):
        """Reads one line; returns whether to show it to the user."""
        with self._lock:
            for tag, into in ((_rank.DEATH_TAG, self.deaths),
                              (PROGRESS_TAG, self.events)):
                at = line.find(tag)
                if at >= 0:
                    try:
                        record = json.loads(line[at + len(tag):])
                    except ValueError:
                        return True   # cut short (a kill): show it
                    # The launcher's clock: ranks may run on other hosts.
                    record['received'] = time.time()
                    into.append(record)
                    return False
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


def _pump(src, dst, output):
    for raw in iter(src.readline, b''):
        line = raw.decode('utf-8', 'replace').rstrip('\n')
        if output.feed(line):
            try:
                dst.buffer.write(raw)
                dst.flush()
            except (OSError, ValueError):
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

    def run(self, attempt, size, mpiexec_args, env, watch=None):
        """Runs one attempt to its end; returns its AttemptResult.

        Args:
            mpiexec_args (list of str): arguments before the program.
            env (dict): the environment of mpiexec (and so of every rank).
            watch: called about every 0.25 s while the attempt runs, with
                the running Popen and the Output so far.
        """
        # _rank.py, run by path (it imports only the standard library), is
        # each rank's parent.
        cmd = ([self.mpiexec, '-n', str(size)] + list(mpiexec_args)
               + [sys.executable, os.path.abspath(_rank.__file__)]
               + self.command)
        t0 = time.monotonic()
        output = Output()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE,
                                start_new_session=True)
        self.proc = proc
        pid_ranks = {}
        pumps = [threading.Thread(target=_pump, args=(src, dst, output),
                                  daemon=True)
                 for src, dst in ((proc.stdout, sys.stdout),
                                  (proc.stderr, sys.stderr))]
        for t in pumps:
            t.start()
        interrupted = False
        while proc.poll() is None:
            _scan_ranks(pid_ranks)
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

    def end(self, proc):
        """SIGTERM, then SIGKILL, to the attempt's local processes; waits
        until every one of them is gone."""
        me = os.getpid()
        if proc.poll() is None:
            kill_all(descendants(me), signal.SIGTERM)
            try:
                proc.wait(timeout=self.kill_grace)
            except subprocess.TimeoutExpired:
                kill_all(descendants(me), signal.SIGKILL)
                proc.wait()
        # mpiexec's status is known: from here on, any child may be reaped
        # (orphans of the attempt are re-parented to this process).
        deadline = time.monotonic() + 30.0
        while True:
            reap()
            members = descendants(me)
            if not members:
                break
            kill_all(members, signal.SIGKILL)
            if time.monotonic() > deadline:
                logger.error('processes %s of the attempt survive SIGKILL',
                             members)
                break
            time.sleep(0.05)


def _scan_ranks(pid_ranks):
    """Records pid -> MPI rank of the attempt's local processes (/proc)."""
    for pid in descendants(os.getpid()):
        if pid in pid_ranks:
            continue
        for item in _rank.environ(pid) or ():
            if item.startswith(b'PMI_RANK='):
                pid_ranks[pid] = int(item[9:])
                break
