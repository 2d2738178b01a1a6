"""Real faults on a :class:`~testbed.hosts.HostBed`, each one checked.

Every function makes the fault happen and returns a record of what it saw
(pids, link state, the time), so that a test can first show that the fault
really happened:

* :func:`kill_host`: every process of a host but its listening sshd
  SIGKILLed (the ranks, their parents, the MPI proxy, the ssh session), as
  when a node's processes are killed by the kernel; the host answers ssh
  again at once;
* :func:`cut_link` / :func:`heal_link`: the host's interface down / up,
  mid-iteration: TCP neither delivers nor fails, so ranks block in MPI;
* :func:`stop_sshd` / :func:`start_sshd`: the host stops / starts
  answering ssh (sessions already open stay, as when sshd dies);
* :func:`lose_host`: sshd stopped, then every process of the host killed:
  a node that went away and does not come back until :func:`start_sshd`.
"""
import sys
import time

from testbed._system import NetBedError, kill, pid_alive, run


def _wait_gone(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if pid_alive(p) and not _zombie(p)]
        if not left:
            return []
        time.sleep(0.02)
    return left


def _zombie(pid):
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(')') + 2:].split()[0] == 'Z'


def kill_host(bed, i):
    """SIGKILLs every process of host ``i`` except its listening sshd.

    Returns:
        dict: ``time``, ``killed`` (pids), ``left`` (pids still alive:
        none when it worked).
    """
    keep = {bed.sshd[i].pid} if i in bed.sshd else set()
    victims = [p for p in bed.host_pids(i) if p not in keep]
    names = [_cmdline(p) for p in victims]
    t = time.time()
    for p in victims:
        kill(p)
    return {'fault': 'kill_host', 'host': bed.names[i], 'time': t,
            'killed': victims, 'commands': names,
            'left': _wait_gone(victims)}


def _cmdline(pid):
    try:
        with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
            return f.read().replace(b'\0', b' ').decode('utf-8', 'replace')
    except OSError:
        return ''


def _link_state(bed, i):
    out = run(['ip', '-n', bed.namespaces[i], 'link', 'show', 'eth0']).stdout
    return 'up' if ',UP' in out and 'LOWER_UP' in out else 'down'


def cut_link(bed, i):
    """Takes host ``i``'s interface down; checks it is down and silent."""
    t = time.time()
    run(['ip', '-n', bed.namespaces[i], 'link', 'set', 'eth0', 'down'])
    return {'fault': 'cut_link', 'host': bed.names[i], 'time': t,
            'state': _link_state(bed, i),
            'reachable': reachable(bed, i)}


def reachable(bed, i, timeout=1.0):
    """Whether a TCP connection from the login side reaches host ``i``."""
    probe = bed.login_run([sys.executable, '-c', (
        'import socket; socket.create_connection(({!r}, 22), {})').format(
            bed.addresses[i], timeout)], timeout=timeout + 10)
    return probe.returncode == 0


def heal_link(bed, i):
    """Brings host ``i``'s interface back up (and waits for carrier)."""
    run(['ip', '-n', bed.namespaces[i], 'link', 'set', 'eth0', 'up'])
    deadline = time.monotonic() + 10
    while _link_state(bed, i) != 'up':
        if time.monotonic() > deadline:
            raise NetBedError('eth0 of {} did not come back up'.format(
                bed.names[i]))
        time.sleep(0.02)
    return {'fault': 'heal_link', 'host': bed.names[i], 'time': time.time(),
            'state': 'up'}


def stop_sshd(bed, i):
    """Stops host ``i``'s sshd; checks that ssh to it now fails."""
    t = time.time()
    pid = bed.stop_sshd(i)
    probe = bed.login_run([bed.ssh, bed.names[i], 'true'], timeout=20)
    return {'fault': 'stop_sshd', 'host': bed.names[i], 'time': t,
            'sshd_pid': pid, 'ssh_rc': probe.returncode,
            'ssh_error': probe.stderr.strip()[-200:]}


def start_sshd(bed, i):
    """Starts host ``i``'s sshd again and waits until it answers."""
    bed.start_sshd(i)
    bed.wait_for_ssh(i)
    return {'fault': 'start_sshd', 'host': bed.names[i], 'time': time.time()}


def lose_host(bed, i):
    """Host ``i`` goes away: sshd stopped, then all its processes killed."""
    stopped = stop_sshd(bed, i)
    killed = kill_host(bed, i)
    return dict(killed, fault='lose_host', ssh_rc=stopped['ssh_rc'],
                ssh_error=stopped['ssh_error'], time=stopped['time'])
