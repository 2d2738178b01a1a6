"""Parts of the watchdog that need no peer: option parsing, the
control-message check and the bounded wait on MPI requests (one process)."""
import numpy
import pytest

from chainermn_overlap.communication import watchdog
from chainermn_overlap.errors import CollectiveMismatchError


@pytest.mark.parametrize('value, expected', [
    (None, None), (0, None), (-1, None), (float('inf'), None), ('none', None),
    ('off', None), ('0', None), (3, 3.0), ('2.5', 2.5)])
def test_parse_seconds(value, expected):
    assert watchdog.parse_seconds(value, 'timeout') == expected


@pytest.mark.parametrize('value', ['soon', [1], True, float('nan')])
def test_parse_seconds_rejects(value):
    with pytest.raises(ValueError, match='timeout'):
        watchdog.parse_seconds(value, 'timeout')


def test_timeout_default_and_environment(monkeypatch):
    monkeypatch.delenv(watchdog.TIMEOUT_ENV, raising=False)
    assert watchdog.resolve_timeout(None) == watchdog.DEFAULT_TIMEOUT
    monkeypatch.setenv(watchdog.TIMEOUT_ENV, '0')
    assert watchdog.resolve_timeout(None) is None
    monkeypatch.setenv(watchdog.TIMEOUT_ENV, '12')
    assert watchdog.resolve_timeout(None) == 12.0
    assert watchdog.resolve_timeout(5) == 5.0   # the option wins


def _reduced(messages):
    # What the MAX allreduce of the control messages gives every rank.
    return numpy.maximum.reduce(messages)


def test_control_message_agreement_passes():
    msgs = [watchdog.control_message(False, False, r, 3, 1234, 7)
            for r in range(3)]
    buf = _reduced(msgs)
    assert buf[0] == 0 and buf[1] == 0
    watchdog.check_control(buf, 0, 3)


def test_control_message_names_disagreeing_ranks():
    msgs = [watchdog.control_message(r == 1, False, r, 3, 1234,
                                     8 if r == 2 else 7) for r in range(3)]
    buf = _reduced(msgs)
    assert buf[0] == 1  # the 'changed' flag is still a global OR
    with pytest.raises(CollectiveMismatchError) as e:
        watchdog.check_control(buf, 1, 3)
    msg = str(e.value)
    assert 'rank 1:' in msg
    assert 'ranks [0, 1]: iteration 7; ranks [2]: iteration 8' in msg, msg


def test_wait_requests_is_bounded_and_names_the_operation():
    # A receive nobody sends (one process): the wait warns, times out
    # naming the operation, marks the backend stuck, and counts the request
    # as abandoned (MPI_Abort at exit) until it completes.
    import time
    from mpi4py import MPI
    from chainermn_overlap.errors import CommunicationTimeout, StallWarning

    class Backend(object):
        rank = 0
        marked = []

        def mark_stuck(self, what=None):
            self.marked.append(what)

    comm = MPI.COMM_SELF.Dup()
    req = comm.Irecv(numpy.empty(1), source=0, tag=99)
    dog = watchdog.Watchdog(Backend(), timeout=0.3, stall_warning=0.2)
    t0 = time.monotonic()
    try:
        with pytest.warns(StallWarning, match='rank 0: has waited 0.2 s for '
                          'the test receive'):
            with pytest.raises(CommunicationTimeout, match=(
                    r'^rank 0: timed out after 0\.3 s waiting for the test '
                    r'receive\. nobody sends\. Do this\. ')):
                dog.wait_requests([req], 'the test receive',
                                  detail=lambda: 'nobody sends.',
                                  hint='Do this.')
        assert 0.3 <= time.monotonic() - t0 < 2.0
        assert Backend.marked == ['the test receive']
        assert 'the test receive' in watchdog.abandoned()
    finally:
        req.Cancel()
        req.Wait()
        comm.Free()
    assert 'the test receive' not in watchdog.abandoned()
