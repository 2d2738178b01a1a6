"""The shard server (``shard='parameters'``) on its own: answers land in the
fetch that asked for them, whatever order the owners answer in.

Collective tests: every rank runs this file; with one rank there is no
owner to fetch from and the tests skip.
"""
import types

import numpy as np
import pytest

from chainermn_overlap.optimizers.sharding import server as server_module


def _bucket(comm, index=0, per_rank=5):
    n = comm.size * per_rank
    bounds = [(r * per_rank, (r + 1) * per_rank) for r in range(comm.size)]
    return types.SimpleNamespace(
        index=index, bounds=bounds, param_dtype=np.float32,
        plan=types.SimpleNamespace(nelems=n))


def _piece(rank, version, per_rank=5):
    return np.full(per_rank, 100 * rank + version, dtype=np.float32)


@pytest.fixture
def server(comm):
    if comm.size < 2:
        pytest.skip('needs two ranks or more (an owner to fetch from)')
    srv = server_module.ShardServer(comm.mpi_comm, comm.rank)
    yield srv
    comm.mpi_comm.Barrier()
    srv.close()


def _own(rank, piece):
    def fill(full):
        full[rank * 5:(rank + 1) * 5] = piece
    return fill


def test_deferred_answer_goes_to_its_own_fetch(comm, server):
    """Rank 1 asks for version 1 (deferred: the owners have version 0),
    then for version 0 (answered at once, before the first): each fetch
    must get the version it asked for.  With one tag per bucket the early
    answer lands in the first fetch (and the second times out)."""
    bucket = _bucket(comm)
    piece = _piece(comm.rank, 0)
    server.publish(bucket.index, piece, version=0)
    comm.mpi_comm.Barrier()
    error, got_now = None, None
    if comm.rank == 1:
        mine = _own(comm.rank, piece)
        later = server.fetch(bucket, 1, mine)
        now = server.fetch(bucket, 0, mine)
        try:
            got_now = now.wait(10).copy()
        except RuntimeError as e:
            error = e
    comm.mpi_comm.Barrier()   # every version-0 answer is sent
    if comm.rank != 1:
        server.before_update(bucket.index)
        piece[...] = _piece(comm.rank, 1)
        server.updated(bucket.index)
    comm.mpi_comm.Barrier()
    if comm.rank == 1:
        piece[...] = _piece(comm.rank, 1)
        got_later = later.wait(10)
        if error is not None:
            now.wait(10)   # leaves no receive behind
        assert error is None, error
        for r in range(comm.size):
            np.testing.assert_array_equal(got_now[r * 5:(r + 1) * 5],
                                          _piece(r, 0))
            np.testing.assert_array_equal(got_later[r * 5:(r + 1) * 5],
                                          _piece(r, 1))


def test_fetch_tags_differ(comm, server):
    """Fetches of one bucket in flight together answer under their own
    tags, and each gets the whole bucket."""
    bucket = _bucket(comm)
    piece = _piece(comm.rank, 0)
    server.publish(bucket.index, piece, version=0)
    comm.mpi_comm.Barrier()
    fetches = [server.fetch(bucket, 0, _own(comm.rank, piece))
               for _ in range(3)]
    assert len({f.tag for f in fetches}) == 3
    for f in fetches:
        full = f.wait(60)
        for r in range(comm.size):
            np.testing.assert_array_equal(full[r * 5:(r + 1) * 5],
                                          _piece(r, 0))


def _listeners():
    import threading
    return [t for t in threading.enumerate()
            if t.name == 'chainermn_overlap-shards']


def test_one_listening_thread_for_many_servers(comm):
    """Many servers (optimizers dropped but not yet collected) share one
    thread; a closed server stops listening, and the thread ends when no
    server of the process listens any more."""
    import time
    listener = server_module._LISTENER
    servers = [server_module.ShardServer(comm.mpi_comm, comm.rank)
               for _ in range(20)]
    try:
        assert len(_listeners()) == 1
    finally:
        for s in servers:
            s.close()
    assert all(s._stopped.is_set() for s in servers)
    with listener._lock:
        assert not any(s in listener._servers for s in servers)
    # Servers of earlier tests' optimizers may still listen: stop them
    # all (their optimizers are no longer used) to see the thread end.
    with listener._lock:
        others = list(listener._servers)
    for s in others:
        s.stop()
    deadline = time.monotonic() + 10
    while _listeners() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _listeners() == []


def test_owner_waits_have_the_optimizer_limit(comm, monkeypatch):
    """``before_update`` and ``reset`` wait for this rank's answers to be
    sent with the limit the server was given (the optimizer's
    ``timeout=``), not the environment's: an answer that never completes
    ends the wait after 1.5 s where the environment says 30 s."""
    from chainermn_overlap import CommunicationTimeout
    import time
    monkeypatch.setenv('CHAINERMN_OVERLAP_TIMEOUT', '30')
    srv = server_module.ShardServer(comm.mpi_comm, comm.rank, timeout=1.5)
    try:
        for call in (lambda: srv.before_update(7), srv.reset):
            # An 'answer' that never completes: a receive nobody matches.
            stuck = srv.comm.Irecv(np.empty(1, np.float32),
                                   source=comm.rank, tag=4242)
            assert not stuck.Test()          # the fault is there
            srv._sends[7] = [stuck]
            start = time.perf_counter()
            with pytest.raises(CommunicationTimeout, match='answers'):
                call()
            waited = time.perf_counter() - start
            stuck.Cancel()
            stuck.Wait()
            srv._sends[7] = []
            assert 1.4 < waited < 10, waited
    finally:
        srv._sends = {}
        comm.mpi_comm.Barrier()
        srv.close()
