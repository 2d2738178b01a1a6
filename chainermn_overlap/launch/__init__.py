"""Run an MPI training job and restart it when it ends abnormally.

    python -m chainermn_overlap.launch -n 4 [--max-restarts 3]
        [--min-ranks 2] [--backoff 1] [--mpiexec PATH] -- train.py [ARGS]
    python -m chainermn_overlap.launch --hostfile HOSTS [-n N]
        [--ssh CMD] [--min-hosts 1] [--host-discovery CMD]
        [--mpiexec-arg=ARG ...] -- train.py [ARGS]

Each attempt runs ``mpiexec -n N python SCRIPT ARGS`` (the ``mpiexec``
beside this Python by default) in a session of its own, each rank under a
small parent (:mod:`~chainermn_overlap.launch._rank`) that reports how it
ended.  When it ends abnormally -- a rank or a host lost, an exception that
aborted the job (the launcher sets ``CHAINERMN_OVERLAP_ABORT_ON_EXCEPTION=1``
so that one does), a watchdog timeout -- the launcher logs why in one line
(naming the rank and its host), ends and waits for every remaining process
of that attempt, waits a back-off (``--backoff`` seconds, doubled after
each failure up to ``--backoff-max``) and starts the job again, up to
``--max-restarts`` times.  It exits with the status of the last attempt.
An attempt whose every rank failed alike before initialising MPI (a
missing module, a wrong path) is not restarted: no restart changes that.
The script resumes by itself with
:func:`chainermn_overlap.extensions.auto_snapshot`.

Across hosts (``--hostfile`` with ``host:slots`` lines, or ``--hosts
a:2,b:2``) the job starts over ssh, through Hydra's ssh launcher (``--ssh``
is both the launcher's own way to reach hosts and mpiexec's
``-launcher-exec``).  Before each attempt every listed host is reached over
ssh (``--connect-timeout``), what is left there of earlier attempts is
ended, and the attempt runs on the hosts that answered; after it, its
processes are ended on every host.  ``--min-hosts``/``--min-ranks`` bound
shrinking; a host that answers again is taken back at the next restart.
With ``--host-discovery CMD`` (a command printing the current ``host:slots``
lines) the launcher also asks a running job to stop at its next snapshot
when the usable hosts change, and restarts it on them at once.  See
``docs/multihost.md``.

Every rank sees ``CHAINERMN_OVERLAP_RESTART`` (0 on the first attempt, then
1, 2, ...).  ``auto_snapshot`` reports resumes and snapshots in the job's
output (``CHAINERMN_OVERLAP_PROGRESS_FILE=-``): an attempt that failed
without writing a snapshot made no progress.  After ``--shrink-after``
consecutive attempts without progress the next attempt runs smaller (see
:mod:`~chainermn_overlap.launch._elastic`: without a host whose failure it
was, else one rank fewer), down to the minimum (what changes then is
described in :mod:`chainermn_overlap.extensions.snapshot`).

SIGINT (Ctrl-C) and SIGTERM to the launcher end the running attempt (SIGTERM
to its processes, SIGKILL after ``--kill-grace`` seconds) and are never
followed by a restart; the launcher then exits with 128 + the signal.

The parts: :mod:`.launcher` (the loop), :mod:`._attempt` (one attempt and
its output), :mod:`._result` (the one-line reasons), :mod:`._elastic`
(which hosts and ranks), :mod:`._hosts` (host lists, ssh, discovery),
:mod:`._rank` (each rank's parent), :mod:`._procs`, :mod:`.cli`.
"""
from chainermn_overlap.launch._result import AttemptResult  # NOQA
from chainermn_overlap.launch.cli import main  # NOQA
from chainermn_overlap.launch.launcher import Launcher  # NOQA

__all__ = ['AttemptResult', 'Launcher', 'main']
