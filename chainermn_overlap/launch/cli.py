"""The launcher's command line (``python -m chainermn_overlap.launch``)."""
import argparse
import logging
import os
import re
import shutil
import sys

from chainermn_overlap.launch._hosts import parse_hosts, read_hostfile
from chainermn_overlap.launch._schedulers import SOURCES, hosts_from
from chainermn_overlap.launch.launcher import Launcher, logger

__all__ = ['main', 'job_command']

# The first word of a command that is an interpreter, as mpiexec users
# write it (python, python3, python3.11, pypy3, a path to one of these).
_INTERPRETER = re.compile(r'^(?:python|pypy)(?:\d+(?:\.\d+)*)?$')


def job_command(script, args, no_python=False):
    """What each rank runs, from the words after ``--``.

    ``train.py ARGS`` runs with this Python; an interpreter as the first
    word (``python train.py ARGS``) runs as written, as mpiexec would run
    it; ``--no-python`` runs the first word as an executable.

    Raises:
        ValueError: the script (or interpreter) does not exist here.
    """
    if no_python:
        return [script] + list(args)
    if _INTERPRETER.match(os.path.basename(script)):
        if shutil.which(script) is None:
            raise ValueError(
                'launch: the interpreter {!r} (the first word after --) is '
                'not found. Give its full path, or name only the script: '
                '-- train.py ARGS runs it with {}.'.format(
                    script, sys.executable))
        return [script] + list(args)
    if script == '-m':
        return [sys.executable, script] + list(args)
    if not os.path.isfile(script):
        raise ValueError(
            'launch: no such script: {!r} (the first word after --). Give '
            'the path of the training script (-- train.py ARGS), an '
            'interpreter and a script (-- python train.py ARGS), or '
            '--no-python for an executable.'.format(script))
    return [sys.executable, script] + list(args)


def _parser():
    p = argparse.ArgumentParser(
        prog='python -m chainermn_overlap.launch',
        description='Runs an MPI job with mpiexec and restarts it when it '
        'ends abnormally (a rank or host lost, an exception, a watchdog '
        'timeout). On several machines it starts the job over ssh from a '
        'hostfile, leaves out hosts that do not answer, and takes them back '
        'when they do.',
        epilog='Examples: python -m chainermn_overlap.launch -n 4 '
        '--max-restarts 3 -- train.py --epochs 10.  Across machines: '
        'python -m chainermn_overlap.launch --hostfile hosts.txt '
        '--min-hosts 1 --max-restarts 10 -- train.py (hosts.txt: one '
        '"host:slots" line per machine; snapshots in a folder every host '
        'sees).')
    p.add_argument('-n', '--ranks', '--max-ranks', type=int, default=None,
                   help='number of ranks (processes), the most an attempt '
                   'uses: with --min-ranks or --min-hosts a job starts on '
                   'fewer and grows to it as --host-discovery lists more '
                   'slots; with hosts, default every slot first listed')
    hosts = p.add_argument_group(
        'several hosts (over ssh, with Hydra\'s ssh launcher)')
    hosts.add_argument('--hostfile', default=None,
                       help='file with one "host:slots" line per host')
    hosts.add_argument('--hosts', default=None,
                       help='hosts inline: a:2,b:2')
    hosts.add_argument('--hosts-from', default=None,
                       choices=SOURCES + ('auto',),
                       help='hosts of the batch job this runs in: Slurm '
                       '(SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE), PBS '
                       '(PBS_NODEFILE), LSF (LSB_MCPU_HOSTS), or auto: the '
                       'first of these that is set')
    hosts.add_argument('--ssh', default='ssh',
                       help='command that reaches a host, for the '
                       'launcher\'s checks and as mpiexec -launcher-exec '
                       '(default ssh; e.g. "ssh -i KEY -p 2222")')
    hosts.add_argument('--min-hosts', type=int, default=None,
                       help='fewest hosts to continue on (default 1; with '
                       'it, --min-ranks defaults to 1)')
    hosts.add_argument('--host-discovery', default=None, metavar='CMD',
                       help='shell command printing the current "host:slots" '
                       'lines; run before each attempt and every '
                       '--discovery-interval s: when the usable hosts '
                       'change, the job stops at its next snapshot and '
                       'restarts on them')
    hosts.add_argument('--discovery-interval', type=float, default=10.0,
                       help='seconds between discovery runs (default 10)')
    hosts.add_argument('--max-resizes', type=int, default=10,
                       help='changes of hosts that --host-discovery may make '
                       'by stopping the job at a snapshot (default 10); then '
                       'the job keeps its hosts')
    hosts.add_argument('--session-grace', type=float, default=5.0,
                       help='seconds mpiexec may run on after its ssh session '
                       'to a host ended (a lost host or link) before the '
                       'attempt is ended and restarted (default 5; 0: off, '
                       'only the collective timeout ends it)')
    hosts.add_argument('--connect-timeout', type=float, default=3.0,
                       help='seconds to reach a host over ssh (default 3)')
    p.add_argument('--max-restarts', type=int, default=3,
                   help='restarts after failed attempts (default 3)')
    p.add_argument('--mpiexec', default=None,
                   help='mpiexec to use (default: the one beside this '
                   'Python)')
    p.add_argument('--min-ranks', type=int, default=None,
                   help='fewest ranks to continue with after attempts '
                   'without progress (default: -n, never fewer)')
    p.add_argument('--shrink-after', type=int, default=2,
                   help='attempts in a row without progress before a '
                   'smaller one (a host or a rank fewer) is tried '
                   '(default 2)')
    p.add_argument('--backoff', type=float, default=1.0,
                   help='seconds before the first restart, doubled after '
                   'each failure without progress (default 1)')
    p.add_argument('--backoff-max', type=float, default=60.0,
                   help='longest back-off in seconds (default 60)')
    p.add_argument('--kill-grace', type=float, default=5.0,
                   help='seconds between SIGTERM and SIGKILL when ending an '
                   'attempt (default 5)')
    p.add_argument('--mpiexec-arg', action='append', default=[],
                   help='an extra argument for mpiexec (repeatable), e.g. '
                   '--mpiexec-arg=-localhost --mpiexec-arg=ADDR')
    p.add_argument('--no-python', action='store_true',
                   help='run SCRIPT as an executable, not with this Python')
    p.add_argument('script', help='the training script (or an interpreter '
                   'and the script: python train.py)')
    p.add_argument('args', nargs=argparse.REMAINDER,
                   help='arguments of the script')
    return p


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr,
            format='%(asctime)s chainermn_overlap.launch: %(message)s')
    script_args = args.args
    if script_args and script_args[0] == '--':
        script_args = script_args[1:]
    try:
        command = job_command(args.script, script_args, args.no_python)
        launcher = Launcher(
            command, args.ranks, max_restarts=args.max_restarts,
            mpiexec=args.mpiexec, min_ranks=args.min_ranks,
            backoff=args.backoff, backoff_max=args.backoff_max,
            shrink_after=args.shrink_after, kill_grace=args.kill_grace,
            mpiexec_args=args.mpiexec_arg, hosts=_host_list(args),
            ssh=args.ssh, min_hosts=args.min_hosts,
            host_discovery=args.host_discovery,
            discovery_interval=args.discovery_interval,
            max_resizes=args.max_resizes, session_grace=args.session_grace,
            connect_timeout=args.connect_timeout)
    except (ValueError, RuntimeError) as e:
        logger.error('%s', e)
        return 2
    return launcher.run()


def _host_list(args):
    given = [flag for flag, value in (
        ('--hostfile', args.hostfile), ('--hosts', args.hosts),
        ('--hosts-from', args.hosts_from)) if value]
    if len(given) > 1:
        raise ValueError('launch: give one of --hostfile, --hosts and '
                         '--hosts-from, not {}.'.format(' and '.join(given)))
    if args.hosts_from:
        return hosts_from(args.hosts_from)
    if args.hostfile:
        return read_hostfile(args.hostfile)
    if args.hosts:
        hosts = parse_hosts(args.hosts, '--hosts')
        if not hosts:
            raise ValueError('launch: --hosts lists no host; write '
                             'a:2,b:2.')
        return hosts
    return None
