"""Jobs that take turns: the rounds of several live jobs, interleaved.

Comparing two things fairly on a noisy machine means measuring them under
the same conditions: on the same bed, at the same link rate, alternately
and many times (ABAB..., the order alternating: ABBA ABBA ...).  Starting a
fresh job for every round would pay MPI start-up, model construction and
warm-up each time; instead every job is started once and its ranks wait,
blocked in a read (no CPU), until the conductor gives them their turn.  So
the revisions of an A/B comparison (:mod:`benchmarks.harness.ab`), or our
optimizer and a peer framework (:mod:`benchmarks.peers_bench`), run side by
side, each with its models built and warmed up once, and never at the same
time.

The protocol (standard library only: a peer's worker, in a virtual
environment of its own, imports this module too): the conductor makes two
FIFOs per rank of each job, ``<job>.<rank>.go`` and ``<job>.<rank>.done``,
in a private folder, and gives each job ``CMO_TURNS=<folder>:<job>`` in its
environment.  A command is one JSON line on every rank's ``go``
(``{"op": "warmup"}``, ``{"op": "round", "round": r}``, ``{"op":
"stop"}``); each rank answers one JSON line on its ``done`` when it has
finished, and is then idle.  A rank uses :class:`TurnClient`; the conductor
:class:`Conductor`.
"""
import json
import os
import select
import shutil
import tempfile
import time

ENV = 'CMO_TURNS'


class TurnError(RuntimeError):
    """A job did not answer its turn (it ended, or ran past the limit)."""


def rank_from_env():
    """This process's MPI rank as the process manager tells it (any MPI:
    MPICH's ``PMI_RANK``, Open MPI's, or a launcher's ``RANK``)."""
    for key in ('PMI_RANK', 'OMPI_COMM_WORLD_RANK', 'RANK'):
        if key in os.environ:
            return int(os.environ[key])
    return 0


class TurnClient(object):
    """A rank's side: the commands given to it, and its answers.

    Args:
        rank (int): this rank (default: from the process manager).
        spec (str): ``<folder>:<job>`` (default: ``$CMO_TURNS``).
    """

    def __init__(self, rank=None, spec=None):
        spec = spec if spec is not None else os.environ[ENV]
        folder, job = spec.rsplit(':', 1)
        rank = rank_from_env() if rank is None else rank
        base = os.path.join(folder, '{}.{}'.format(job, rank))
        # The conductor holds both ends open (read-write), so neither
        # open blocks.
        self._go = open(base + '.go', 'rb', buffering=0)
        self._done = open(base + '.done', 'wb', buffering=0)
        self._pending = b''

    @staticmethod
    def active():
        """Whether this process was started by a conductor."""
        return bool(os.environ.get(ENV))

    def commands(self):
        """Yields each command (a dict) until the conductor says stop."""
        while True:
            while b'\n' not in self._pending:
                data = self._go.read(65536)   # blocks: no CPU while idle
                if not data:
                    return
                self._pending += data
            line, self._pending = self._pending.split(b'\n', 1)
            cmd = json.loads(line.decode())
            if cmd.get('op') == 'stop':
                self.answer({'op': 'stop'})
                return
            yield cmd

    def answer(self, payload):
        """Tells the conductor this rank's turn is over, with ``payload``."""
        self._done.write((json.dumps(payload) + '\n').encode())


class Conductor(object):
    """Gives turns to jobs; use as a context manager.

    Args:
        jobs (dict): job name -> number of ranks.
    """

    def __init__(self, jobs):
        self.jobs = dict(jobs)
        self.folder = tempfile.mkdtemp(prefix='cmo_turns_')
        os.chmod(self.folder, 0o700)
        self._fds = {}
        self._pending = {}
        for job, ranks in self.jobs.items():
            if ':' in job or '/' in job:
                raise ValueError('a job name may not hold ":" or "/": {!r}'
                                 .format(job))
            for r in range(ranks):
                for end in ('go', 'done'):
                    path = os.path.join(self.folder,
                                        '{}.{}.{}'.format(job, r, end))
                    os.mkfifo(path, 0o600)
                    # Read-write: opening never blocks, and the FIFO never
                    # reports end of file while this end is open.
                    self._fds[job, r, end] = os.open(path, os.O_RDWR)
                self._pending[job, r] = b''

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def env(self, job):
        """What job ``job`` needs in its environment."""
        return {ENV: '{}:{}'.format(self.folder, job)}

    def turn(self, job, command, timeout, alive=None):
        """Gives ``job`` the command; waits for every rank's answer.

        Args:
            job (str): the job.
            command (dict): the command (an ``op`` and anything else).
            timeout (float): seconds before :class:`TurnError`.
            alive: called about once a second; returns False (or a
                message) when the job has ended, which raises
                :class:`TurnError` at once.

        Returns:
            list: each rank's answer, in rank order.
        """
        line = (json.dumps(command) + '\n').encode()
        ranks = range(self.jobs[job])
        for r in ranks:
            os.write(self._fds[job, r, 'go'], line)
        answers = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TurnError('job {!r} did not finish {} within {:.0f} s '
                                '(ranks answered: {})'.format(
                                    job, command, timeout, sorted(answers)))
            waiting = {self._fds[job, r, 'done']: r for r in ranks
                       if r not in answers}
            ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in ready:
                r = waiting[fd]
                self._pending[job, r] += os.read(fd, 65536)
                if b'\n' in self._pending[job, r]:
                    text, rest = self._pending[job, r].split(b'\n', 1)
                    self._pending[job, r] = rest
                    answers[r] = json.loads(text.decode())
            if not ready and alive is not None:
                state = alive()
                if state is not True:
                    raise TurnError('job {!r} ended during {}{}'.format(
                        job, command,
                        ': ' + state if isinstance(state, str) else ''))
        return [answers[r] for r in ranks]

    def close(self):
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}
        shutil.rmtree(self.folder, ignore_errors=True)


def alternating(names, rounds):
    """The order of turns in each round: the names, then reversed, ...

    ``alternating(['a', 'b'], 4)`` gives ``[['a', 'b'], ['b', 'a'],
    ['a', 'b'], ['b', 'a']]``: each job goes first as often as the other,
    so neither gains from a machine that drifts within a round.
    """
    names = list(names)
    return [names if r % 2 == 0 else names[::-1] for r in range(rounds)]
