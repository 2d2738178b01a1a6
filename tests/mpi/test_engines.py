"""What every progress engine gets from the engine base, on every engine.

Run at any size (``tests/mpi_run.py -n N``).  Each test runs on
``'mpi_thread'`` (first-in-first-out) and ``'mpi_priority'`` (chunked,
reordered), constructed the same way: ``Engine(mpi_comm, timeout=...,
stall_warning=..., debug=..., **policy_options)``.

* The debug sequence check: a rank that posts a different collective is
  named, and ``CollectiveMismatchError`` is raised on every rank instead of
  a silent wrong sum or a hang.  The negative control shows that without
  the check the same mismatched post goes unnoticed.
* Current-operation tracking for stall reports and timeouts, and the stall
  report itself naming a rank that has not posted.
* The failure latch: after an error in the communication thread, the
  pending and later handles fail, naming the rank and the reduction.

Faults are produced through the constructor's ``comm=`` (a wrapper of the
engine's duplicated communicator that holds or fails the data reductions)
or by the ranks posting different things on purpose.
"""
import re
import threading
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import chainermn_overlap
from chainermn_overlap.communication import backends
from chainermn_overlap.communication import emulated
from chainermn_overlap.communication import engine as engine_module

ENGINES = ['mpi_thread', 'mpi_priority']
# Small chunks, so that the priority engine splits the test arrays.
POLICY = {'mpi_thread': {}, 'mpi_priority': {'chunk_bytes': 8}}

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
LAST = SIZE - 1

needs_two = pytest.mark.skipif(SIZE < 2, reason='needs two ranks to differ')


def make(name, comm=None, **options):
    """``name``'s engine on the world, as the optimizer makes it."""
    options = dict(dict(POLICY[name], timeout=60), **options)
    return backends.get_backend(name)(WORLD, comm=comm, **options)


def on_every_rank(ok):
    return all(WORLD.allgather(bool(ok)))


def expected_sum(n):
    # Rank r contributes r + 1 everywhere.
    return np.full(n, SIZE * (SIZE + 1) / 2.0, dtype=np.float32)


class ScriptedComm(object):
    """An engine's communicator whose data reductions (float32) first run
    ``before()``: wait for a gate, or raise.  Everything else, including
    the engines' control exchanges and debug checks, passes through."""

    def __init__(self, comm, before):
        self._comm = comm
        self._before = before

    def Allreduce(self, sendbuf, recvbuf, op=None):
        if getattr(recvbuf, 'dtype', None) == np.float32:
            self._before()
        self._comm.Allreduce(sendbuf, recvbuf, op=op)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def wait_until(predicate, seconds=20.0):
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, 'condition not reached in time'
        time.sleep(0.01)


# ---------------------------------------------------------------------------
# The debug sequence check
# ---------------------------------------------------------------------------

@needs_two
@pytest.mark.parametrize('name', ENGINES)
def test_a_mismatched_post_goes_unnoticed_without_the_check(name):
    # Negative control: the last rank posts another reduction of the same
    # size.  Without debug mode the engine reduces unrelated data together
    # and reports success: the fault the check guards against is real.
    engine = make(name, debug=False)
    try:
        label = 'bucket {}'.format(1 if RANK == LAST else 0)
        labels = WORLD.allgather(label)
        assert len(set(labels)) == 2, labels  # the ranks do differ
        a = np.full(6, RANK + 1.0, dtype=np.float32)
        engine.allreduce(a, label=label).wait()
        np.testing.assert_array_equal(a, expected_sum(6))
    finally:
        engine.close()


@needs_two
@pytest.mark.parametrize('differ', ['label', 'size'])
@pytest.mark.parametrize('name', ENGINES)
def test_the_check_names_a_mismatched_post_on_every_rank(name, differ):
    engine = make(name, debug=True)
    try:
        odd = RANK == LAST
        n = 6 + (1 if odd and differ == 'size' else 0)
        label = 'bucket {}'.format(1 if odd and differ == 'label' else 0)
        posts = WORLD.allgather((label, n))
        assert len(set(posts)) == 2, posts  # the fault is produced
        a = np.full(n, RANK + 1.0, dtype=np.float32)
        h = engine.allreduce(a, label=label)
        with pytest.raises(chainermn_overlap.CollectiveMismatchError) as e:
            h.wait()
        msg = str(e.value)
        assert msg.startswith('rank {}: collective #1 differs between '
                              'ranks'.format(RANK)), msg
        for r, (lab, size) in enumerate(posts):
            # Each rank's post, by label and bytes (the priority engine
            # names the chunk too).
            assert "rank {}: '{}".format(r, lab) in msg, msg
            if name == 'mpi_thread':
                assert '({} bytes)'.format(4 * size) in msg, msg
        assert 'update() the same number of times' in msg, msg
        # Checked before reducing: nothing was reduced.
        assert (a == RANK + 1.0).all()
        # The sequence is broken: later collectives are not attempted.
        with pytest.raises(chainermn_overlap.CommunicationError,
                           match='not attempted'):
            engine.allreduce(np.ones(2, np.float32), label='later').wait()
        assert on_every_rank(True)
    finally:
        engine.close()


@needs_two
def test_the_check_names_a_round_of_another_size():
    # The priority engine's control exchange is checked too: the last rank
    # says a round has one item more than the others do.
    engine = make('mpi_priority', debug=True)
    try:
        n_items = 2 if RANK == LAST else 1
        assert len(set(WORLD.allgather(n_items))) == 2
        arrays = [np.full(3, RANK + 1.0, np.float32) for _ in range(n_items)]
        handles = [engine.allreduce(a, label='item {}'.format(i),
                                    slot=('round', i, n_items))
                   for i, a in enumerate(arrays)]
        with pytest.raises(chainermn_overlap.CollectiveMismatchError) as e:
            handles[0].wait()
        msg = str(e.value)
        assert 'control exchange #1 differs between ranks' in msg, msg
        assert 'of the 2 items of a round' in msg, msg
        assert 'of the 1 items of a round' in msg, msg
        for h in handles[1:]:
            with pytest.raises(chainermn_overlap.CommunicationError,
                               match='not attempted'):
                h.wait()
        assert all((a == RANK + 1.0).all() for a in arrays)
        assert on_every_rank(True)
    finally:
        engine.close()


@pytest.mark.parametrize('name', ENGINES)
def test_the_check_passes_matching_posts_bit_identically(name):
    # Positive control, at any size: the same posts with and without the
    # check give bit-identical results (rounds, priorities, chunks).
    rng = np.random.RandomState(RANK)
    data = [rng.randn(n).astype(np.float32) for n in (5, 1, 9, 4)]
    results = []
    for debug in (False, True):
        engine = make(name, debug=debug)
        try:
            arrays = [d.copy() for d in data]
            handles = [engine.allreduce(a, label='item {}'.format(i),
                                        slot=(7, i, len(arrays)),
                                        priority=i % 2)
                       for i, a in enumerate(arrays)]
            for h in handles:
                h.wait()
            results.append(arrays)
        finally:
            engine.close()
    for plain, checked in zip(*results):
        np.testing.assert_array_equal(plain, checked)
    total = np.sum(WORLD.allgather(data[2]), axis=0, dtype=np.float32)
    np.testing.assert_allclose(results[0][2], total, rtol=1e-5)


@pytest.mark.parametrize('name', ENGINES)
def test_the_emulated_engine_takes_its_communicator_in_the_constructor(
        name):
    link = emulated.LinkModel(nodes=2, bandwidth='1gbit', latency=0)
    engine = backends.get_backend('emulated')(
        WORLD, base=name, link=link, debug=True, timeout=60,
        **POLICY[name])
    try:
        assert isinstance(engine.comm, emulated._ModelledComm)
        assert engine.link is link and engine.debug
        assert engine.emulation['base'] == name
        a = np.full(5, RANK + 1.0, dtype=np.float32)
        engine.allreduce(a, label='x').wait()
        np.testing.assert_array_equal(a, expected_sum(5))
    finally:
        engine.close()
    with pytest.raises(ValueError, match='not both'):
        backends.get_backend('emulated')(WORLD, base=name, link=link,
                                         nodes=3)


def _max_allreduce(comm, buf):
    _max_allreduce.sizes.append(buf.size)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)


@pytest.mark.parametrize('name', ENGINES)
def test_run_posts_a_collective_of_its_own(name):
    # run(fn, ...) takes a place in the engine's order like allreduce, is
    # checked in debug mode, and is never sliced into chunks.
    _max_allreduce.sizes = []
    engine = make(name, debug=True)
    try:
        a = np.full(5, RANK + 1.0, dtype=np.float32)
        b = np.full(5, RANK + 1.0, dtype=np.float32)
        h1 = engine.allreduce(a, label='sum')
        h2 = engine.run(_max_allreduce, b, label='max', nbytes=3)
        assert (h2.label, h2.nbytes, h2.seq) == ('max', 3, 2)
        h2.wait()
        h1.wait()
        np.testing.assert_array_equal(a, expected_sum(5))
        np.testing.assert_array_equal(b, np.full(5, SIZE, np.float32))
        assert _max_allreduce.sizes == [5]
    finally:
        engine.close()


# ---------------------------------------------------------------------------
# Current-operation tracking and stall reports
# ---------------------------------------------------------------------------

@pytest.mark.parametrize('name', ENGINES)
def test_the_current_operation_is_tracked(name):
    gate = threading.Event()
    engine = make(name, comm=ScriptedComm(WORLD.Dup(), gate.wait))
    try:
        assert engine.status()['comm_thread'] == 'not inside a collective'
        first = np.full(4, RANK + 1.0, dtype=np.float32)
        second = np.full(3, RANK + 1.0, dtype=np.float32)
        h1 = engine.allreduce(first, label='first')
        h2 = engine.allreduce(second, label='second')
        # The thread is held inside the first data reduction.
        wait_until(lambda: engine.status()['comm_thread'].startswith(
            'in collective #1 (first) for '))
        status = engine.status()
        assert status['posted'] == 2 and status['last_posted'] == 'second'
        assert 'the communication thread is inside it' in (
            engine.describe_progress(h1))
        assert 'queued behind collective #1 (first), in progress for' in (
            engine.describe_progress(h2))
        # A timed-out wait names the collective and where it stands, and
        # the engine refuses further posts instead of queueing behind it.
        with pytest.raises(chainermn_overlap.CommunicationTimeout) as e:
            h2.wait(timeout=0.2)
        msg = str(e.value)
        # The message gives the time actually waited: at least the limit,
        # more on a loaded machine.
        waited = re.search(r'timed out after ([0-9.]+) s waiting for second',
                           msg)
        assert waited and float(waited.group(1)) >= 0.2, msg
        assert 'collective #2 of rank {}'.format(RANK) in msg, msg
        assert 'queued behind collective #1 (first)' in msg, msg
        assert engine.stuck == (
            'rank {}: collective #1 (first) never completed'.format(RANK))
        with pytest.raises(chainermn_overlap.CommunicationError,
                           match='cannot post third: an earlier collective '
                           'is stuck'):
            engine.allreduce(np.ones(1, np.float32), label='third')
        gate.set()
        h1.wait()
        h2.wait()
        np.testing.assert_array_equal(first, expected_sum(4))
        np.testing.assert_array_equal(second, expected_sum(3))
        assert engine.status()['comm_thread'] == 'not inside a collective'
    finally:
        gate.set()
        engine.close()
    assert not engine._thread.is_alive()
    assert engine not in engine_module._LIVE


def _check_stall_report(reports):
    assert reports, 'no stall warning'
    msg = reports[0]
    assert msg.startswith('rank {}: has waited'.format(RANK)), msg
    assert 'for late bucket (collective #1 of rank {}'.format(
        RANK) in msg, msg
    assert 'ranks [{}] have not posted it'.format(LAST) in msg, msg
    assert 'rank {}: has NOT posted it'.format(LAST) in msg, msg
    # This rank's own line says where its communication thread is.
    assert 'rank {}: posted it; communication thread in '.format(
        RANK) in msg, msg


@needs_two
@pytest.mark.parametrize('name', ENGINES)
def test_the_stall_report_names_the_rank_that_has_not_posted(name):
    # The stall inspector starts with the engine (stall_warning given to
    # the constructor).  The last rank posts 3 s late; the others warn.
    engine = make(name, stall_warning=0.3)
    try:
        assert engine.inspector is not None
        a = np.full(4, RANK + 1.0, dtype=np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always', chainermn_overlap.StallWarning)
            if RANK == LAST:
                time.sleep(3.0)
            engine.allreduce(a, label='late bucket').wait()
        np.testing.assert_array_equal(a, expected_sum(4))
        reports = [str(w.message) for w in caught
                   if issubclass(w.category, chainermn_overlap.StallWarning)]
        problem = None
        try:
            if RANK != LAST:
                _check_stall_report(reports)
        except AssertionError as e:
            problem = e
        # Every rank learns whether the report was right everywhere (a
        # failure on one rank must not leave the others waiting here).
        agreed = on_every_rank(problem is None)
        if problem is not None:
            raise problem
        assert agreed, 'the stall report was wrong on another rank'
    finally:
        engine.close()


@needs_two
@pytest.mark.parametrize('name', ENGINES)
def test_stall_reports_on_some_ranks_only_is_an_error_on_every_rank(name):
    # The inspector's Dup is a collective: with the setting on the last
    # rank only (as an environment variable given to one rank would), that
    # rank used to wait in it while the others went on.  Now every rank
    # raises, at construction, within the watchdog's timeout.
    t0 = time.monotonic()
    with pytest.raises(ValueError, match='stall reports are on for some '
                       'ranks and off for others') as e:
        make(name, stall_warning=0.5 if RANK == LAST else None, timeout=20)
    assert 'rank {}:'.format(RANK) in str(e.value)
    assert time.monotonic() - t0 < 20
    assert on_every_rank(True)
    engine = make(name, stall_warning=0.5, timeout=20)   # agreed: fine
    try:
        assert engine.inspector is not None
    finally:
        engine.close()


@needs_two
@pytest.mark.parametrize('name', ENGINES)
def test_debug_check_on_some_ranks_only_is_an_error_on_every_rank(name):
    # The debug check runs a collective before each one: on some ranks
    # only, it would pair with the others' real collectives.  The check is
    # on for the last rank only (each rank's message says its own value).
    debug = RANK == LAST
    with pytest.raises(ValueError, match='the debug check is on for some '
                       'ranks and off for others') as e:
        make(name, debug=debug, timeout=20)
    assert 'here: {}'.format('on' if debug else 'off') in str(e.value)
    assert on_every_rank(True)
    engine = make(name, debug=True, timeout=20)   # agreed: fine
    try:
        assert engine.debug
    finally:
        engine.close()


# ---------------------------------------------------------------------------
# The failure latch
# ---------------------------------------------------------------------------

def _fail():
    raise OSError('injected network failure')


@pytest.mark.parametrize('name', ENGINES)
def test_an_error_fails_every_pending_and_later_handle(name):
    engine = make(name, comm=ScriptedComm(WORLD.Dup(), _fail))
    try:
        h1 = engine.allreduce(np.ones(4, np.float32), label='first')
        h2 = engine.allreduce(np.ones(4, np.float32), label='second')
        with pytest.raises(chainermn_overlap.CommunicationError) as e:
            h1.wait()
        assert str(e.value) == ('allreduce of first failed: rank {}: '
                                'injected network failure'.format(RANK))
        for h, label in ((h2, 'second'), (engine.allreduce(
                np.ones(2, np.float32), label='later'), 'later')):
            with pytest.raises(chainermn_overlap.CommunicationError) as e:
                h.wait()
            assert str(e.value).startswith(
                'allreduce of {} failed: not attempted: an earlier reduction '
                'on rank {} failed (injected network failure)'.format(
                    label, RANK)), str(e.value)
    finally:
        engine.close()


class _Defective(backends.MpiThreadBackend):
    """A policy with a defect: its thread dies on the first item."""

    name = 'defective'

    def _serve(self):
        self._queue.get()
        raise KeyError('a defect')


def test_a_dead_thread_fails_its_waiters_instead_of_hanging_them():
    engine = _Defective(WORLD, timeout=60)
    try:
        h1 = engine.allreduce(np.ones(2, np.float32), label='first')
        with pytest.raises(chainermn_overlap.CommunicationError) as e:
            h1.wait()
        msg = str(e.value)
        assert msg.startswith('allreduce of first failed: rank {}: the '
                              'communication thread of the defective backend '
                              'died'.format(RANK)), msg
        assert "KeyError('a defect')" in msg, msg
        assert engine.status()['comm_thread'].startswith('dead')
        # Later posts fail at once.
        h2 = engine.allreduce(np.ones(2, np.float32), label='second')
        assert h2.done()
        with pytest.raises(chainermn_overlap.CommunicationError,
                           match='allreduce of second failed'):
            h2.wait()
    finally:
        engine.close()


@pytest.mark.parametrize('name', ENGINES)
def test_a_closed_engine_refuses_posts(name):
    engine = make(name)
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match='cannot post x: the {} '
                       'communication backend was closed'.format(name)):
        engine.allreduce(np.zeros(1, np.float32), label='x')


@pytest.mark.parametrize('name', ENGINES)
def test_engines_share_one_constructor(name):
    # configure() still works after construction (the optimizer calls it).
    engine = make(name, debug=False)
    try:
        engine.configure(timeout=5, stall_warning=None, debug=True,
                         mpi_comm=WORLD)
        assert engine.watchdog.timeout == 5.0 and engine.debug
        assert engine.inspector is None
        a = np.full(3, RANK + 1.0, dtype=np.float32)
        engine.allreduce(a).wait()
        np.testing.assert_array_equal(a, expected_sum(3))
    finally:
        engine.close()
    with pytest.raises(ValueError, match='timeout must be a number'):
        make(name, timeout='soon')


@pytest.mark.parametrize('name', ENGINES)
def test_both_ways_of_waiting_give_the_same_sums(name):
    # mpi_wait='sleep' (Iallreduce tested between sleeps) and 'poll' (the
    # blocking call): bit-identical sums, max and min included.
    rng = np.random.RandomState(RANK)
    data = [rng.randn(n).astype(np.float32) for n in (5, 1, 9, 4)]
    results = {}
    for mpi_wait in ('poll', 'sleep'):
        engine = make(name, mpi_wait=mpi_wait)
        try:
            arrays = [d.copy() for d in data]
            handles = [engine.allreduce(a, op, label='item {}'.format(i),
                                        slot=(3, i, len(arrays)))
                       for i, (a, op) in enumerate(zip(
                           arrays, ('sum', 'max', 'min', 'sum')))]
            for h in handles:
                h.wait()
            results[mpi_wait] = arrays
        finally:
            engine.close()
    for a, b in zip(results['poll'], results['sleep']):
        np.testing.assert_array_equal(a, b)
    gathered = WORLD.allgather(data[1])
    assert results['sleep'][1][0] == max(g[0] for g in gathered)
    with pytest.raises(ValueError, match="mpi_wait must be 'sleep' or"):
        make(name, mpi_wait='spin')
