"""Parts of the watchdog that need no peer: option parsing, the
control-message check and the bounded wait on MPI requests (one process)."""
import numpy
import pytest

from chainermn_overlap import config
from chainermn_overlap.communication import watchdog
from chainermn_overlap.errors import CollectiveMismatchError


@pytest.mark.parametrize('value, expected', [
    (None, None), (0, None), (-1, None), (float('inf'), None), ('none', None),
    ('off', None), ('0', None), (3, 3.0), ('2.5', 2.5)])
def test_parse_seconds(value, expected):
    assert config.parse_seconds(value, 'timeout') == expected


@pytest.mark.parametrize('value', ['soon', [1], True, float('nan')])
def test_parse_seconds_rejects(value):
    with pytest.raises(ValueError, match='timeout'):
        config.parse_seconds(value, 'timeout')


def test_timeout_default_and_environment(monkeypatch):
    monkeypatch.delenv(config.TIMEOUT_ENV, raising=False)
    assert config.resolve_timeout(None) == config.DEFAULT_TIMEOUT
    monkeypatch.setenv(config.TIMEOUT_ENV, '0')
    assert config.resolve_timeout(None) is None
    monkeypatch.setenv(config.TIMEOUT_ENV, '12')
    assert config.resolve_timeout(None) == 12.0
    assert config.resolve_timeout(5) == 5.0   # the option wins


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


def test_main_thread_location_names_it_and_leaves_the_collector_alone(
        monkeypatch):
    # The stall inspector's thread reads where the main thread is.  It used
    # to turn the collector off and on around sys._current_frames(), which
    # could turn it back on behind a main thread that had turned it off.
    import gc
    import threading
    import time

    def touched(*args):
        raise AssertionError('the collector was switched from a thread')
    monkeypatch.setattr(gc, 'disable', touched)
    monkeypatch.setattr(gc, 'enable', touched)
    done = threading.Event()
    got = []

    def probe():
        time.sleep(0.2)
        try:
            got.append(watchdog.main_thread_location())
        except AssertionError as e:
            got.append(e)
        done.set()

    def main_thread_waits_here():
        done.wait(10)

    thread = threading.Thread(target=probe)
    thread.start()
    main_thread_waits_here()
    thread.join()
    assert isinstance(got[0], str), got
    assert 'in main_thread_waits_here' in got[0], got
    assert got[0].count(' <- ') == 2


def test_location_in_a_dump_of_several_threads():
    dump = ('Thread 0x00007f0000000002 (most recent call first):\n'
            '  File "/x/other.py", line 9 in spin\n\n'
            'Current thread 0x00007f0000000001 (most recent call first):\n'
            '  File "/x/a.py", line 3 in inner\n'
            '  File "/x/b.py", line 30 in outer\n'
            '  File "/x/c.py", line 1 in <module>\n')
    assert watchdog._location_in_dump(dump, 0x7f0000000001, 2) == (
        'a.py:3 in inner <- b.py:30 in outer')
    assert watchdog._location_in_dump(dump, 0x7f0000000002, 3) == (
        'other.py:9 in spin')
    assert watchdog._location_in_dump(dump, 5, 3) == 'unknown'


def test_a_long_stall_report_still_decodes():
    # A report over the reply's size used to be cut as bytes, which did not
    # decode: that rank then read as "no answer".  The negative control
    # shows the cut text is undecodable indeed.
    import json
    info = {'rank': 1, 'posted': 41, 'last_posted': 'bucket 3',
            'comm_thread': 'in ' + 'x' * 5000, 'main_thread': 'y' * 3000}
    cut = json.dumps(info).encode()[:watchdog._REPLY_BYTES - 8]
    with pytest.raises(ValueError):
        json.loads(cut.decode())
    got = watchdog.StallInspector._decode(
        watchdog.StallInspector._encode(info))
    assert got['rank'] == 1 and got['posted'] == 41
    assert got['last_posted'] == 'bucket 3'
    assert got['comm_thread'].startswith('in xxx')
    huge = dict(info, **{'k%d' % i: 'v' * 150 for i in range(40)})
    got = watchdog.StallInspector._decode(
        watchdog.StallInspector._encode(huge))
    assert got == {'rank': 1, 'posted': 41,
                   'comm_thread': '(report too long to send)'}


def test_no_assert_in_library_code():
    # Under python -O an assert disappears: none may guard control flow.
    import ast
    import os
    package = os.path.dirname(os.path.dirname(os.path.abspath(
        watchdog.__file__)))
    found = []
    for folder, _, files in os.walk(package):
        if os.path.basename(folder) == 'testing':
            continue   # helpers of the test suite
        for name in files:
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                found += ['{}:{}'.format(os.path.relpath(path, package),
                                         node.lineno)
                          for node in ast.walk(tree)
                          if isinstance(node, ast.Assert)]
    assert not found, found
