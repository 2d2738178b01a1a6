"""A launcher job on a :class:`~testbed.hosts.HostBed`, watched line by line.

:class:`HostJob` starts ``python -m chainermn_overlap.launch`` in the bed's
login namespace (hostfile, the bed's ssh wrapper, ``-localhost``), reads
its output as it comes with the time each line arrived, and lets a test or
a benchmark wait for a line before it breaks something::

    with HostBed(2, slots=2) as bed:
        job = HostJob(bed, ['--min-hosts', '1'], [JOB, '--out', DIR])
        job.wait_for(r'training at iteration')
        faults.kill_host(bed, 1)
        code = job.finish(timeout=300)
"""
import os
import re
import subprocess
import sys
import threading
import time

from testbed._system import ROOT


class HostJob(object):
    """The launcher on ``bed``, running ``job`` (a script and arguments).

    Args:
        bed (HostBed): the bed.
        launcher_args (list of str): more launcher options.
        job (list of str): the script and its arguments.
        env (dict): more environment for the launcher (and the ranks).
        hostfile (bool): pass the bed's hostfile (else the launcher args
            name the hosts, e.g. ``--hosts-from slurm``).
    """

    def __init__(self, bed, launcher_args, job, env=None, hostfile=True):
        cmd = ([sys.executable, '-m', 'chainermn_overlap.launch']
               + (['--hostfile', bed.hostfile] if hostfile else [])
               + bed.launcher_args()
               + list(launcher_args) + ['--'] + list(job))
        full = {'PYTHONPATH': ROOT + os.pathsep + os.environ.get(
            'PYTHONPATH', ''), 'PYTHONUNBUFFERED': '1'}
        full.update(env or {})
        self.lines = []         # (arrival time, line)
        self._cond = threading.Condition()
        self.proc = bed.login(cmd, env=full, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              universal_newlines=True, cwd=ROOT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in iter(self.proc.stdout.readline, ''):
            with self._cond:
                self.lines.append((time.time(), line.rstrip('\n')))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def text(self):
        with self._cond:
            return '\n'.join(line for _, line in self.lines)

    def wait_for(self, pattern, timeout=120.0, start=0):
        """Waits for a line matching ``pattern`` (from line ``start`` on).

        Returns:
            tuple: ``(index, arrival time, match)``.

        Raises:
            AssertionError: not seen within ``timeout`` or the job ended.
        """
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(start, len(self.lines)):
                    m = rx.search(self.lines[i][1])
                    if m:
                        return i, self.lines[i][0], m
                start = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None
                                 and not self._reader.is_alive()):
                    raise AssertionError(
                        'no line matching {!r} within {:.0f} s; the output '
                        'ends with:\n{}'.format(
                            pattern, timeout, '\n'.join(
                                ln for _, ln in self.lines[-60:])))
                self._cond.wait(min(left, 0.5))

    def finish(self, timeout=600.0):
        """Waits for the launcher to end; returns its exit status.

        Raises:
            AssertionError: still running after ``timeout`` (it is then
            ended with SIGTERM, SIGKILL after 30 s).
        """
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError('the launcher was still running after '
                                 '{:.0f} s; output:\n{}'.format(
                                     timeout, self.text[-8000:]))
        self._reader.join(timeout=10)
        return self.proc.returncode

    def stop(self):
        """SIGTERM to the launcher (it ends the attempt), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# The lines of the training job the tests and the soak run
# (tests/unit/restart_job.py), read back.
TRAINING = re.compile(r'restart_job: training at iteration (\d+) attempt '
                      r'(\d+) size (\d+) resumed_from (\w+) t=([\d.]+)')
LOSS = re.compile(r'restart_job: loss at iteration (\d+) attempt (\d+) size '
                  r'(\d+) = ([\d.]+)')


def trainings(text):
    """``[(iteration, attempt, size, resumed_from or None, t)]``."""
    return [(int(m.group(1)), int(m.group(2)), int(m.group(3)),
             None if m.group(4) == 'None' else int(m.group(4)),
             float(m.group(5))) for m in TRAINING.finditer(text)]


def losses(text):
    """``[(iteration, attempt, size, loss)]`` in the order printed."""
    return [(int(m.group(1)), int(m.group(2)), int(m.group(3)),
             float(m.group(4))) for m in LOSS.finditer(text)]


def first_training_after(text, t):
    """Arrival time of the first training line stamped after ``t``."""
    later = [x[4] for x in trainings(text) if x[4] > t]
    return min(later) if later else None
