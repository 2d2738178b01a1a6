"""The launcher as a user starts it: what it prints and when it restarts.

Small jobs (a few lines of Python, 2 ranks) under ``python -m
chainermn_overlap.launch``: a rank SIGKILLed (the launcher's per-rank parent
must pass the signal on without a traceback of its own), an interpreter
named as the first word after ``--`` (as ``mpiexec`` users write it), and a
job whose every rank fails the same way before MPI is initialised (no
restart can help: the launcher says so and exits at once).
"""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from chainermn_overlap.extensions.snapshot import PROGRESS_TAG

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC),
                                reason='needs mpiexec next to the Python')

# Rank 1 SIGKILLs itself on the first attempt, after MPI is initialised;
# the second attempt succeeds.
KILLED = '''
import os, signal, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
comm.Barrier()
if os.environ["CHAINERMN_OVERLAP_RESTART"] == "0" and comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
comm.Barrier()
sys.stdout.write("job: rank {} done\\n".format(comm.rank))
'''

OK = '''
import sys
from mpi4py import MPI
sys.stdout.write("job: rank {} of {} ran {}\\n".format(
    MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, sys.argv[1:]))
'''


def _env():
    # `python` is this environment's, as in an activated virtualenv.
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get('PATH', ''))
    for name in ('CHAINERMN_OVERLAP_RESTART',
                 'CHAINERMN_OVERLAP_PROGRESS_FILE'):
        env.pop(name, None)
    return env


def launch(args, limit=90):
    cmd = [sys.executable, '-m', 'chainermn_overlap.launch'] + list(args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=_env(), text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail('the launcher did not end within {} s:\n{}'.format(
            limit, out))
    return proc.returncode, out


def attempts(out):
    return re.findall(r'attempt (\d+): starting', out)


def test_sigkilled_rank_is_reported_without_a_launcher_traceback(tmp_path):
    script = tmp_path / 'killed.py'
    script.write_text(KILLED)
    code, out = launch(['-n', '2', '--backoff', '0.1', '--', str(script)])
    # The fault happened: rank 1 died of SIGKILL on attempt 0.
    assert re.search(r'attempt 0 \(2 ranks\) ended after [\d.]+ s: rank 1 '
                     r'\S*.*killed by SIGKILL', out), out
    assert code == 0 and 'job: rank 1 done' in out, out
    # The per-rank parent died of the same signal: mpiexec saw signal 9,
    # not the exit code 1 of a crashed parent, and nothing printed a
    # traceback.
    assert 'Traceback' not in out and 'OSError' not in out, out
    assert 'mpiexec exit code 9' in out, out


def test_interpreter_as_the_first_word(tmp_path):
    script = tmp_path / 'ok.py'
    script.write_text(OK)
    code, out = launch(['-n', '2', '--', 'python', str(script), '--x', '1'])
    assert code == 0, out
    assert attempts(out) == ['0'], out
    for r in (0, 1):
        assert "job: rank {} of 2 ran ['--x', '1']".format(r) in out, out


def test_the_same_failure_on_every_rank_before_mpi_init_is_not_retried(
        tmp_path):
    # A script that fails before it imports MPI, on every rank alike.
    script = tmp_path / 'broken.py'
    script.write_text('import sys\nsys.stderr.write("broken: no config\\n")\n'
                      'sys.exit(3)\n')
    code, out = launch(['-n', '2', '--max-restarts', '3', '--backoff', '0.1',
                        '--', str(script)])
    assert code == 3, out
    assert attempts(out) == ['0'], out
    assert re.search(r'every rank \(2 of 2\) exited with code 3 before '
                     r'initialising MPI', out), out
    assert 'not restarting' in out and 'broken: no config' in out, out
    assert 'Traceback' not in out, out


def test_a_missing_script_is_refused_before_any_attempt(tmp_path):
    code, out = launch(['-n', '2', '--', str(tmp_path / 'nope.py')])
    assert code == 2, out
    assert 'no such script' in out and 'nope.py' in out, out
    assert attempts(out) == [], out


def test_the_reason_takes_the_message_from_the_abort_line():
    # Four ranks raising at once: mpiexec copies each rank's stderr in the
    # pieces the rank wrote, so a traceback's last line can reach the
    # launcher cut into by another rank's traceback (seen in CI:
    # 'RuntimeError:   File "job.py", line 318, in <module>').  The abort
    # line is one write and carries the message whole.
    from chainermn_overlap.launch._attempt import Output
    from chainermn_overlap.launch._result import AttemptResult
    output = Output()
    for line in [
            'Traceback (most recent call last):',
            'RuntimeError:   File "job.py", line 318, in <module>',
            '  File "job.py", line 120, in main',
            'RuntimeError: simulated lost node: attempt 1 cannot run on 4 '
            'ranks',
            '',
            'chainermn_overlap: rank 2 raised an uncaught RuntimeError '
            '(simulated lost node: attempt 1 cannot run on 4 ranks); '
            'calling MPI_Abort to end every rank of the job.',
            'chainermn_overlap: rank 0 raised an uncaught RuntimeError '
            '(other); calling MPI_Abort to end every rank of the job.']:
        output.feed(line)
    reason = AttemptResult(1, 4, 1, 2.0, output, {}, False).reason()
    assert reason.startswith(
        'rank 2 raised RuntimeError (simulated lost node: attempt 1 cannot '
        'run on 4 ranks)'), reason
    # In a thread, and a message holding parentheses.
    output = Output()
    output.feed('chainermn_overlap: rank 1 raised an uncaught ValueError '
                '(bad (x)) in a thread; calling MPI_Abort to end every rank '
                'of the job.')
    reason = AttemptResult(0, 2, 1, 2.0, output, {}, False).reason()
    assert reason.startswith('rank 1 raised ValueError (bad (x))'), reason


LOCAL = '''
import os, sys
from mpi4py import MPI
sys.stdout.write("job: rank {} local {}\\n".format(
    MPI.COMM_WORLD.rank, os.environ.get("CHAINERMN_OVERLAP_LOCAL_RANK")))
'''


def test_each_rank_gets_its_local_rank(tmp_path):
    script = tmp_path / 'local.py'
    script.write_text(LOCAL)
    code, out = launch(['-n', '3', '--', str(script)])
    assert code == 0, out
    for r in range(3):
        assert 'job: rank {} local {}\n'.format(r, r) in out, out


@pytest.mark.parametrize('how,offered', [
    ('main', True), ('thread', False), ('own', False)])
def test_a_stop_is_offered_only_where_every_rank_takes_the_signal(
        tmp_path, how, offered):
    # SIGUSR1 would kill a rank without the extension's handler: the job
    # offers to stop at a snapshot (resize) only when all took it.
    env = dict(_env(), CHAINERMN_OVERLAP_RESTART='0',
               CHAINERMN_OVERLAP_PROGRESS_FILE='-')
    proc = subprocess.run(
        [MPIEXEC, '-n', '2', sys.executable,
         os.path.join(HERE, 'resize_job.py'), str(tmp_path / 'snap'), how],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, timeout=90)
    assert proc.returncode == 0, proc.stdout
    # Without the launcher's key: 'TAG[] JSON'.
    events = [json.loads(line.split(PROGRESS_TAG + '[] ', 1)[1])
              for line in proc.stdout.splitlines() if PROGRESS_TAG in line]
    assert [e['event'] for e in events] == ['resumed'], proc.stdout
    assert events[0]['resize'] is offered, proc.stdout


ODD = '''
import sys
from mpi4py import MPI
tag = "chainermn_overlap.launch: rank ended "
sys.stdout.write(tag + "[1, 2]\\n" + tag + "null\\n" + tag + "{\\n")
# Records as a program might print them, without the attempt's key: a
# forged death record and a progress event that would stop the job.
sys.stdout.write(tag + '{"rank": 1, "signal": 9, "pid": 1}\\n')
sys.stdout.write('chainermn_overlap.progress: {"event": "stopping"}\\n')
sys.stdout.write("x" * 300000 + "\\n")
sys.stdout.flush()
MPI.COMM_WORLD.Barrier()
sys.stdout.write("job: rank {} done\\n".format(MPI.COMM_WORLD.rank))
'''

EMBED = '''
import subprocess, sys, time
from chainermn_overlap.launch import Launcher
# The embedding program's own child, which the launcher must leave alone.
own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
code = Launcher([sys.executable, sys.argv[1]], 2, max_restarts=0).run()
time.sleep(0.5)
sys.stdout.write("embed: launcher {} own child {}\\n".format(
    code, "alive" if own.poll() is None else "ended %s" % own.returncode))
own.kill()
'''


def test_odd_output_and_an_embedding_program(tmp_path):
    # Lines with the launcher's tag that are not its records, and a very
    # long line: shown as they are, the pumps go on, the job ends.
    script = tmp_path / 'odd.py'
    script.write_text(ODD)
    embed = tmp_path / 'embed.py'
    embed.write_text(EMBED)
    proc = subprocess.run([sys.executable, str(embed), str(script)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=_env(), timeout=90)
    out = proc.stdout
    assert 'embed: launcher 0 own child alive' in out, out[-3000:]
    for r in (0, 1):
        assert 'job: rank {} done'.format(r) in out, out[-3000:]
    # mpiexec forwards each rank's output in chunks, so one rank's long line
    # may be cut by the other's lines (CI saw it under load): every byte of
    # both ranks' long lines must still be shown, none lost or cut short.
    assert 'rank ended [1, 2]' in out, out[-3000:]
    assert sum(len(run) for run in re.findall('x{1000,}', out)) == \
        2 * 300000, [len(run) for run in re.findall('x+', out)]
    # Not read as records (no key): shown, and the job ended as it did.
    assert 'rank ended {"rank": 1, "signal": 9' in out, out[-3000:]
    assert 'chainermn_overlap.progress: {"event": "stopping"}' in out, \
        out[-3000:]
    assert 'Traceback' not in out, out[-3000:]


def test_a_record_is_read_only_with_the_key_and_its_fields():
    from chainermn_overlap.launch import _rank
    from chainermn_overlap.launch._attempt import Output
    output = Output('k1')
    good = '{"rank": 1, "pid": 7, "time": 1.5, "signal": 9}'
    # The attempt's key and every field: read, not shown.
    assert output.feed(_rank.DEATH_TAG + '[k1] ' + good) is False
    assert [d['rank'] for d in output.deaths] == [1]
    # Another key, no key, or a field missing: the program's line, shown.
    for line in (_rank.DEATH_TAG + '[k2] ' + good, _rank.DEATH_TAG + good,
                 _rank.DEATH_TAG + '[k1] {"rank": 1, "pid": 7}',
                 PROGRESS_TAG + '[k1] {"attempt": 0}'):
        assert output.feed(line) is True, line
    assert len(output.deaths) == 1 and output.events == []
    assert output.feed(PROGRESS_TAG + '[k1] {"event": "training"}') is False
    assert [e['event'] for e in output.events] == ['training']
    # A line the program began without its newline, the record glued on:
    # the record is read, the program's text shown.
    assert output.feed('epoch 3 ' + PROGRESS_TAG +
                       '[k1] {"event": "snapshot"}') == 'epoch 3 '
    assert [e['event'] for e in output.events] == ['training', 'snapshot']
