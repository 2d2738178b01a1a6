"""The parent of one rank, and the clean-up the launcher runs on each host.

Run by path on every host of a job, with this Python (it imports only the
standard library and the package's ``config.py``, loaded by path, which
imports only the standard library too, so that nothing but the interpreter
has to be there)::

    python _rank.py COMMAND...         # under mpiexec: one rank's parent
    python _rank.py --end-job JOB      # over ssh: end a job's processes

As a rank's parent it runs ``COMMAND`` as its child and, when the child ends
abnormally, writes one line to stderr that the launcher reads (and does not
show): which rank, on which host, what killed it or its exit status,
whether the child had initialised MPI, and whether the signal that killed
it came from outside (passed on by this parent: a consequence, not a
cause).  MPICH's process manager names the wrong process when one rank
dies (the first of its list that ended badly, after it killed the others),
hence this record.  The parent then ends the way its child did (the same
signal, or the same exit status), so mpiexec reports the child's end.

Whether MPI was initialised: MPICH's process manager hands each process a
PMI socket (``PMI_FD``) that ``MPI_Init`` talks over first.  The parent
gives its child a socket of its own in its place and copies every byte both
ways; the first byte from the child means ``MPI_Init`` began.

The child dies with its parent (``PR_SET_PDEATHSIG``), so killing the
parent still ends the rank.  Every rank of a job carries ``JOB:ATTEMPT``
in its environment (``CHAINERMN_OVERLAP_LAUNCH_ID``, given with mpiexec's
``-genv`` so that mpiexec itself does not carry it); ``--end-job JOB
[JOB:ATTEMPT]`` SIGKILLs the job's processes on this host (but those of the
attempt named, which is running), and the process manager's proxy that
started them, and prints one line: :data:`END_MARK` and a JSON record of
how many it ended and the host's own name (``socket.gethostname()``, the
name its death records carry).  The launcher looks for that line among
whatever the login shell prints.
"""
import ctypes
import json
import os
import select
import signal
import socket
import sys
import threading
import time

if __package__:
    from chainermn_overlap import config
else:
    # Run by path: the package's config.py (standard library only), loaded
    # from beside this file without importing the package.
    import importlib.util
    _spec = importlib.util.spec_from_file_location(
        '_chainermn_overlap_config', os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            'config.py'))
    config = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(config)

# The tag of a death record on stderr (the launcher reads and drops it).
DEATH_TAG = 'chainermn_overlap.launch: rank ended '
END_FLAG = '--end-job'
END_MARK = 'chainermn_overlap.launch: end-job: '
_PR_SET_PDEATHSIG = 1
# Signals the parent passes on to its rank (SIGUSR1: stop at the next
# snapshot, see chainermn_overlap.extensions).
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


class _PmiRelay(object):
    """Copies the PMI socket's bytes both ways; notes the child's first."""

    def __init__(self):
        self.real = config.pmi_fd()
        self.used = None if self.real is None else False
        self.ours = self.child_end = None
        if self.real is not None:
            self.ours, self.child_end = socket.socketpair()
            self.child_end.set_inheritable(True)

    def in_child(self):
        """In the forked child: the relayed socket becomes ``PMI_FD``."""
        if self.real is None:
            return
        os.environ[config.PMI_FD_ENV] = str(self.child_end.fileno())
        os.close(self.real)
        self.ours.close()

    def start(self):
        """In the parent: starts copying."""
        if self.real is None:
            return
        self.child_end.close()
        threading.Thread(target=self._copy, daemon=True).start()

    def _copy(self):
        mine = self.ours.fileno()
        peer = {mine: self.real, self.real: mine}
        try:
            while True:
                ready, _, _ = select.select([mine, self.real], [], [])
                for fd in ready:
                    data = os.read(fd, 65536)
                    if not data:
                        return
                    if fd == mine:
                        self.used = True
                    _write_all(peer[fd], data)
        except OSError:
            return


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def rank_main(command):
    """Runs one rank's ``command`` as a child; reports an abnormal end.

    Returns:
        int: the child's exit status (when it was not killed by a signal).
    """
    relay = _PmiRelay()
    local = config.local_rank_id()
    if local is not None:
        os.environ[config.LOCAL_RANK_ENV] = local
    pid = os.fork()
    if pid == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() == 1:
                os._exit(1)
            relay.in_child()
            os.execvp(command[0], command)
        except OSError as e:
            os.write(2, '{}: {}\n'.format(command[0], e.strerror).encode())
        finally:
            os._exit(127)
    relay.start()
    forwarded = []

    def forward(num, frame):
        forwarded.append(num)
        try:
            os.kill(pid, num)
        except (ProcessLookupError, PermissionError):
            pass
    # Signals for the rank go to the rank; this parent only waits.
    for sig in _FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and config.launch_deaths():
        record = {'rank': config.pmi_rank(), 'pid': pid,
                  'host': socket.gethostname(), 'time': time.time(),
                  'mpi': relay.used,
                  'forwarded': bool(code < 0 and -code in forwarded)}
        record['signal' if code < 0 else 'exit'] = abs(code)
        try:
            # One write: the process manager must not split the line.
            os.write(2, config.report_line(
                DEATH_TAG, json.dumps(record)).encode())
        except OSError:
            pass
    if code < 0:
        _die_like(-code)
    return code


def _die_like(num):
    """Ends this process by signal ``num``, as the child ended."""
    sys.stdout.flush()
    sys.stderr.flush()
    if num not in _UNCATCHABLE:
        # SIGKILL and SIGSTOP cannot have handlers, hence none to reset.
        signal.signal(num, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [num])
    os.kill(os.getpid(), num)
    # A signal whose default is to be ignored: the shell's convention.
    os._exit(128 + num)


def end_job(job, keep=None, grace=5.0):
    """SIGKILLs this host's processes of job ``job`` and their proxies.

    Args:
        job (str): the job's id; its processes carry ``JOB:ATTEMPT``.
        keep (str): the ``JOB:ATTEMPT`` of a running attempt to spare.

    Returns:
        int: how many processes were ended.
    """
    prefix = '{}={}:'.format(config.LAUNCH_ID_ENV, job).encode()
    spare = (None if keep is None
             else '{}={}'.format(config.LAUNCH_ID_ENV, keep).encode())
    me = os.getpid()
    victims = set()
    for name in os.listdir('/proc'):
        if not name.isdigit() or int(name) == me:
            continue
        env = environ(int(name))
        if env is None:
            continue
        if any(item.startswith(prefix) and item != spare for item in env):
            victims.add(int(name))
            parent = _parent(int(name))
            if parent and _command_name(parent).startswith('hydra_pmi_pro'):
                victims.add(parent)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(
            os.path.exists('/proc/{}'.format(p)) and _command_name(p)
            for p in victims):
        time.sleep(0.02)
    return len(victims)


def environ(pid):
    """The environment of process ``pid`` (``NAME=value`` bytes), or None
    when it is gone or not ours to read."""
    try:
        with open('/proc/{}/environ'.format(pid), 'rb') as f:
            return f.read().split(b'\0')
    except OSError:
        return None


def _parent(pid):
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(')') + 2:].split()[1])


def _command_name(pid):
    """The process's name; '' for one that is gone or a zombie."""
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            stat = f.read()
    except OSError:
        return ''
    if stat[stat.rfind(')') + 2:].split()[0] == 'Z':
        return ''
    return stat[stat.find('(') + 1:stat.rfind(')')]


def main(argv):
    if argv[:1] == [END_FLAG] and len(argv) in (2, 3):
        sys.stdout.write('\n{}{}\n'.format(END_MARK, json.dumps(
            {'ended': end_job(*argv[1:]), 'host': socket.gethostname()})))
        return 0
    if not argv:
        sys.stderr.write('usage: python _rank.py COMMAND... | --end-job '
                         'JOB [JOB:ATTEMPT to spare]\n')
        return 2
    return rank_main(argv)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
