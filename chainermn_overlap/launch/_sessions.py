"""A lost host noticed by the end of mpiexec's ssh session to it.

Nothing in MPI notices a cut link: the ranks wait in their collective
until the optimizer's timeout (600 s by default), and mpiexec waits with
them.  But mpiexec reaches each host through an ssh session (Hydra's
``-launcher-exec``, the launcher's wrapper), and the launcher gives those
sessions keep-alives (``ServerAliveInterval=5``, ``ServerAliveCountMax=3``):
over a cut link the session ends within about 15 s.  :class:`Sessions`
watches mpiexec's children, learns which one is the session to which host
(the host is a word of its command), and reports a host whose session
ended while mpiexec still runs ``grace`` seconds later: at a normal end, or
when Hydra ends a failed job, mpiexec exits right after its sessions do.
The launcher then ends the attempt and restarts it; the collective timeout
stays the last resort (a link cut without the session noticing).
"""
import time

from chainermn_overlap.launch._procs import children, command_line


class Sessions(object):
    """mpiexec's sessions to the hosts of one attempt.

    Args:
        hosts (list of str): the attempt's hosts, as listed.
        grace (float): seconds a session may be gone while mpiexec runs.
    """

    def __init__(self, hosts, grace=5.0):
        self.hosts = set(hosts)
        self.grace = grace
        self._pids = {}      # pid -> host
        self._gone = {}      # host -> when its session was first missed

    def lost(self, mpiexec_pid, now=None):
        """A host whose session ended ``grace`` s ago, or None."""
        now = time.monotonic() if now is None else now
        live = set(children(mpiexec_pid))
        for pid in live - set(self._pids):
            host = next((w for w in command_line(pid)
                         if w in self.hosts), None)
            if host is not None:
                self._pids[pid] = host
        for pid, host in self._pids.items():
            if pid not in live:
                self._gone.setdefault(host, now)
        for host, since in sorted(self._gone.items(), key=lambda x: x[1]):
            if now - since >= self.grace:
                return host
        return None
