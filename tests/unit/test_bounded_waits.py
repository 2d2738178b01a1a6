"""An error or a stall on one rank between collectives ends every rank.

Each test runs ``mpiexec -n 2 tests/unit/bounded_job.py SCENARIO`` with a
3 s watchdog limit and checks that the fault was produced (rank 1's line),
that every rank that can raise raised the error naming the operation, and
that the job ended within the limit plus 10 s of the fault.  The close()
path is test_faults.test_close_is_bounded_when_a_peer_never_joins; a rank
stuck while a snapshot is written is
test_restart.test_a_rank_stuck_while_a_snapshot_is_written.
"""
import os
import re
import sys
import time

import pytest

from test_faults import MPIEXEC, run_job as _run_faults_job

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, 'bounded_job.py')
TIMEOUT = 3.0
BOUND = TIMEOUT + 10.0

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC),
                                reason='needs mpiexec next to the Python')


def run(scenario, timeout=TIMEOUT, limit=60.0):
    return _run_faults_job(
        scenario, limit=limit, job=JOB,
        env={'CHAINERMN_OVERLAP_TIMEOUT': str(timeout)})


def raised(out, rank):
    found = re.search(r'bounded_job: rank {} raised (\w+): (.*)'.format(rank),
                      out)
    return found.groups() if found else None


def test_relayout_error_on_one_rank_is_raised_on_every_rank():
    # Rank 1 cannot initialise a parameter in the relayout (another dtype)
    # while rank 0 goes on to broadcast it: rank 0 used to wait in that
    # Bcast forever.  Now both raise at once, after one agreement.
    code, out, elapsed = run('relayout')
    assert 'rank 1 injects a parameter' in out, out
    mine = raised(out, 1)
    assert mine and mine[0] == 'ValueError', out
    assert 'initialises as float16 on rank 1' in mine[1], out
    theirs = raised(out, 0)
    assert theirs and theirs[0] == 'ValueError', out
    assert 'failed on rank 1' in theirs[1], out
    assert 'initialises as float16 on rank 1' in theirs[1], out
    assert code is not None and elapsed < BOUND, (elapsed, out)


def test_distconv_exchange_mismatch_without_a_limit_hangs():
    # Negative control: the graphs differ (rank 1 runs one more exchange),
    # and with the watchdog off nothing ends the job.
    code, out, elapsed = run('exchange-mismatch', timeout=0, limit=15.0)
    assert 'rank 1 injects an exchange' in out, out
    assert code is None, (code, elapsed, out)
    assert 'received' not in out, out


def test_distconv_exchange_mismatch_raises_on_every_rank():
    # Each exchange has its own tags: rank 0's exchange does not take rank
    # 1's extra one (which has another size: MPI would have truncated it),
    # and both ranks raise naming the exchange.
    code, out, elapsed = run('exchange-mismatch')
    assert 'rank 1 injects an exchange' in out, out
    for rank in (0, 1):
        error = raised(out, rank)
        assert error and error[0] == 'CommunicationTimeout', out
        assert 'distconv exchange number 0' in error[1], out
        assert 'different graphs' in error[1], out
    assert 'received' not in out, out
    assert code is not None and elapsed < BOUND, (elapsed, out)


@pytest.mark.parametrize('scenario, what', [
    ('exchange-stall', 'distconv exchange number 0'),
    ('split-stall', "the distconv grid's world communicator"),
])
def test_a_stalled_rank_ends_the_job(scenario, what):
    # Rank 1 sleeps (30 s) instead of joining; rank 0 raises naming what it
    # waited for, and its exit ends the job (MPI_Abort) long before rank 1
    # would have come.
    code, out, elapsed = run(scenario)
    assert 'rank 1 injects a stall' in out, out
    error = raised(out, 0)
    assert error and error[0] == 'CommunicationTimeout', out
    assert what in error[1], out
    assert 'timed out after 3.' in error[1], out
    assert 'calling MPI_Abort' in out, out
    assert code is not None and code != 0 and elapsed < BOUND, (elapsed, out)


@pytest.mark.parametrize('scenario, own, others', [
    ('grid-arguments', 'differ between processes', 'differ between '
     "processes (process 0: check='cached'; process 1: check='always')"),
    ('grid-bad-argument', 'progress_pieces must be a positive int',
     'failed on rank 1'),
])
def test_grid_arguments_of_one_rank_raise_on_every_rank(scenario, own,
                                                        others):
    # A distconv grid's arguments decide its communicators and collectives:
    # an argument that is bad or different on rank 1 only is a ValueError
    # on both ranks, before the grid's first communicator is built.
    code, out, elapsed = run(scenario)
    assert 'rank 1 injects the grid argument' in out, out
    mine, theirs = raised(out, 1), raised(out, 0)
    assert mine and mine[0] == 'ValueError' and own in mine[1], out
    assert theirs and theirs[0] == 'ValueError' and others in theirs[1], out
    assert code == 0 and elapsed < BOUND, (elapsed, out)


def test_a_split_that_does_not_return_ends_the_job(monkeypatch):
    # MPI has no non-blocking split: after the bounded meeting it runs
    # under a timer that ends the job.  Here the split is a sleep longer
    # than the limit, and MPI_Abort a recorder.
    from chainermn_overlap import abort
    from chainermn_overlap.communication import blocking
    ended = []
    monkeypatch.setattr(abort, 'abort_job', ended.append)
    assert blocking._guarded(lambda: time.sleep(0.5) or 'made', 'a split',
                             0.1, 'here') == 'made'
    assert ended == ['timed out after 0.1 s in a split (called from here), '
                     'which cannot be interrupted: another rank left after '
                     'the ranks met for it'], ended
    del ended[:]
    assert blocking._guarded(lambda: 'made', 'a split', 0.1, 'here') == \
        'made'
    time.sleep(0.3)
    assert not ended   # returned in time: the timer ended quietly


if __name__ == '__main__':
    sys.exit(pytest.main([__file__]))
