"""What every part of the test bed needs from the system.

Running commands, finding the bed's namespaces (and removing those of beds
whose owner died), the root check, installing missing tools from the
distribution's packages, and the environment of processes the bed starts.
Standard library only: nothing here imports the library or the benchmarks.
"""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = 'cmo'
# One BLAS thread per process: each rank is pinned to a core of its own, and
# a BLAS with a thread per core would make the ranks fight over the cores.
BLAS_ENV = {'OMP_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1',
            'MKL_NUM_THREADS': '1'}
# Tool -> Debian package that ships it.
PACKAGES = {'ip': 'iproute2', 'tc': 'iproute2', 'taskset': 'util-linux',
            'unshare': 'util-linux', 'sshd': 'openssh-server',
            'ssh': 'openssh-client', 'ssh-keygen': 'openssh-client'}
# Where Debian puts sshd (not on every PATH).
SSHD_PATHS = ('/usr/sbin/sshd', '/sbin/sshd')


class NetBedError(RuntimeError):
    """The test bed could not be set up or a command in it failed."""


def run(cmd, check=True, timeout=None):
    """Runs ``cmd``; returns the CompletedProcess (text, captured).

    Raises:
        NetBedError: ``check`` and a non-zero exit, with its stderr.
    """
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise NetBedError('command took over {:.0f} s: {}'.format(
            timeout, ' '.join(cmd))) from e
    if check and proc.returncode != 0:
        raise NetBedError('command failed ({}): {}\n{}'.format(
            proc.returncode, ' '.join(cmd), proc.stderr.strip()))
    return proc


def pid_alive(pid):
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces():
    """Names of the network namespaces on this machine."""
    out = run(['ip', 'netns', 'list'], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def owner_pid(name):
    """The pid in the name of a namespace (or folder) of a bed, or None."""
    m = re.fullmatch(PREFIX + r'(\d+)(?:r\d+|sw|hosts.*)', name)
    return int(m.group(1)) if m else None


def remove_stale_namespaces():
    """Removes namespaces of earlier beds whose owning process is gone."""
    removed = []
    for ns in list_namespaces():
        pid = owner_pid(ns)
        if pid is not None and not pid_alive(pid):
            # Processes left inside (an sshd of a multi-host bed) first.
            for p in namespace_pids(ns):
                kill(p)
            run(['ip', 'netns', 'del', ns], check=False)
            removed.append(ns)
    return removed


def namespace_pids(ns):
    """Pids of the processes in network namespace ``ns``."""
    out = run(['ip', 'netns', 'pids', ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill(pid, sig=9):
    """Sends ``sig`` to ``pid``; a process already gone is no error."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def require_root(tools=('ip', 'tc', 'taskset')):
    """Exits with a plain message when not root, or when ``tools`` miss."""
    if os.geteuid() != 0:
        sys.stderr.write(
            'netbed: needs root: it creates network namespaces, veth pairs '
            'and tc qdiscs. Run it as root (e.g. sudo {} ...).\n'
            .format(os.path.basename(sys.executable)))
        sys.exit(2)
    missing = [t for t in tools if which(t) is None]
    if missing:
        sys.stderr.write(
            'netbed: {} not found. Install them: apt-get update && apt-get '
            'install -y {}\n'.format(', '.join(missing), ' '.join(sorted(
                {PACKAGES.get(t, t) for t in missing}))))
        sys.exit(2)


def which(tool):
    """Path of ``tool`` (sshd also where Debian keeps it), or None."""
    found = shutil.which(tool)
    if found is None and tool == 'sshd':
        found = next((p for p in SSHD_PATHS if os.access(p, os.X_OK)), None)
    return found


def ensure_tools(tools, timeout=600):
    """Installs the packages of missing ``tools`` with apt-get (as root).

    The bed's set-up: ``ip``/``tc`` (iproute2) and, for hosts with ssh,
    ``sshd`` (openssh-server) come from the distribution's packages.

    Returns:
        list of str: the tools still missing afterwards (none on success).
    """
    missing = [t for t in tools if which(t) is None]
    if not missing or os.geteuid() != 0 or shutil.which('apt-get') is None:
        return missing
    env = dict(os.environ, DEBIAN_FRONTEND='noninteractive')
    packages = sorted({PACKAGES.get(t, t) for t in missing})
    for cmd in (['apt-get', 'update', '-qq'],
                ['apt-get', 'install', '-y', '-qq', '--no-install-recommends']
                + packages):
        try:
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            break
    return [t for t in tools if which(t) is None]


def module_command(module, *args):
    """``python -m module ARGS`` with this interpreter."""
    return [sys.executable, '-m', module] + [str(a) for a in args]


def child_env():
    """What a process started by the bed needs on top of its environment.

    One BLAS thread, and the repository root first on ``PYTHONPATH``: a
    worker runs as ``python -m testbed.X`` (or ``benchmarks.X``) in the
    current directory, which need not be the root.
    """
    old = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
           if p]
    return dict(BLAS_ENV, PYTHONPATH=os.pathsep.join([ROOT] + old))
