"""Processes of an attempt on the launcher's host: finding and ending them.

The launcher is a child subreaper, so orphans of an attempt stay in its
process tree; they are found by parenthood in ``/proc`` (MPICH's process
manager puts every rank into a session of its own, so process groups do not
hold them).
"""
import ctypes
import os
import signal

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper():
    """Orphaned processes of an attempt become our children (Linux), so
    that we can wait for each of them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def signal_name(num):
    try:
        return signal.Signals(num).name
    except ValueError:
        return 'signal {}'.format(num)


def _children():
    """ppid -> [pid] of the live (non-zombie) processes, from /proc."""
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
    return children


def children(pid):
    """Live children of process ``pid``."""
    return _children().get(pid, [])


def descendants(root):
    """Live (non-zombie) descendants of process ``root``, from /proc.

    MPICH's process manager puts every rank into a session of its own, so
    the attempt's processes are found by parenthood, not by process group;
    orphans are re-parented to the launcher (a child subreaper), so they
    stay in this tree.
    """
    tree = _children()
    out, todo = [], [root]
    while todo:
        for pid in tree.get(todo.pop(), ()):
            out.append(pid)
            todo.append(pid)
    return out


def command_line(pid):
    """The words process ``pid`` was started with ([] when gone)."""
    try:
        with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
            raw = f.read()
    except OSError:
        return []
    return [w.decode('utf-8', 'replace') for w in raw.split(b'\0') if w]


def kill_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
