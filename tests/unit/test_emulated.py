"""The α–β ring-allreduce model (pure) and the emulated backend.

The backend runs on ``MPI.COMM_SELF``: one process, no ``mpiexec`` needed.
"""
import time

import numpy as np
import pytest
from mpi4py import MPI

from chainermn_overlap import config
from chainermn_overlap.communication import backends
from chainermn_overlap.communication import engine as engine_module
from chainermn_overlap.communication import emulated as em


def test_ring_formula_closed_form():
    # 16 nodes, 100 MB at 10 Gbit/s: 2*15/16 * 1e8 B / 1.25e9 B/s = 0.15 s,
    # plus 30 steps of 25 us.
    t = em.ring_allreduce_seconds(10 ** 8, 16, 25e-6, 10e9 / 8)
    assert t == pytest.approx(0.15 + 30 * 25e-6, rel=1e-12)


def test_ring_single_node_is_free():
    assert em.ring_allreduce_seconds(10 ** 9, 1, 1.0, 1.0) == 0.0


def test_ring_two_nodes_moves_the_whole_array_once():
    assert em.ring_allreduce_seconds(1000, 2, 0.0, 100.0) == pytest.approx(10)


def test_ring_rejects_bad_arguments():
    with pytest.raises(ValueError):
        em.ring_allreduce_seconds(1, 0, 0.0, 1.0)
    with pytest.raises(ValueError):
        em.ring_allreduce_seconds(1, 2, 0.0, 0.0)


def test_schedule_serialises_on_one_link():
    # Three 2-node collectives of 100 B at 100 B/s (1 s each, alpha 0).
    posts = [(0.0, 100), (0.5, 100), (5.0, 100)]
    got = em.schedule(posts, 2, 0.0, 100.0)
    # The second waits for the first; the third finds the link idle.
    assert got == [(0.0, 1.0), (1.0, 2.0), (5.0, 6.0)]


def test_schedule_respects_link_busy_before():
    assert em.schedule([(0.0, 100)], 2, 0.0, 100.0, free_at=3.0) == [
        (3.0, 4.0)]


def test_link_model_reserve_matches_schedule():
    link = em.LinkModel(4, '800bit', 0.25)
    posts = [(0.0, 100), (0.1, 50), (10.0, 0)]
    expected = em.schedule(posts, 4, 0.25, 100.0)
    assert [link.reserve(*p) for p in posts] == expected


def test_parse_settings():
    s = config.parse_emulation_settings('nodes=8, bandwidth=1gbit,latency=10us')
    assert s == {'nodes': 8, 'bandwidth': 1e9, 'latency': pytest.approx(1e-5)}
    with pytest.raises(ValueError, match='CHAINERMN_OVERLAP_EMULATION'):
        config.parse_emulation_settings('speed=3')


def test_backend_registered_and_configurable():
    assert backends.get_backend('emulated') is em.emulated_backend
    name = em.configure(nodes=2, bandwidth=8000, latency=0,
                        base='mpi_thread')
    backend = backends.get_backend(name)(MPI.COMM_SELF)
    try:
        assert backend.link.nodes == 2 and backend.link.bandwidth == 8000
        assert backend.emulation['emulation'] is True
        assert 'emulation' in backend.emulation['label']
        assert backend.emulation['base'] == 'mpi_thread'
    finally:
        backend.close()
    with pytest.raises(ValueError, match='unknown communication backend'):
        em.configure(nodes=2, bandwidth=8000, base='nope')


@pytest.mark.timing  # completion times within 30 ms of the model
def test_backend_completion_follows_the_model():
    # 2 nodes at 8 kbit/s (1000 B/s): a 100 B array takes 0.1 s; posted
    # together, three complete at 0.1, 0.2 and 0.3 s; data unchanged (one
    # real process: the sum is the array itself).
    backend = em.emulated_backend(MPI.COMM_SELF, base='mpi_thread', nodes=2,
                                  bandwidth=8000, latency=0)
    try:
        arrays = [np.full(25, i, dtype=np.float32) for i in range(3)]
        t0 = time.perf_counter()
        handles = [backend.allreduce(a) for a in arrays]
        done = []
        for h in handles:
            h.wait()
            done.append(time.perf_counter() - t0)
        for i, (d, a) in enumerate(zip(done, arrays)):
            assert d == pytest.approx(0.1 * (i + 1), abs=0.03)
            assert np.all(a == i)
        # The second one could start only when the first had finished.
        assert handles[1].started_at == pytest.approx(
            handles[0].posted_at + 0.1, abs=0.02)
    finally:
        backend.close()


@pytest.mark.parametrize('base', sorted(
    set(engine_module.backend_names()) & {'mpi_thread', 'mpi_priority'}))
@pytest.mark.timing  # completion times within 30 ms of the model
def test_every_engine_takes_at_least_the_modelled_time(base):
    # Whatever the engine's chunking and control exchanges, the link cannot
    # carry the bytes faster than the model: 4 x 100 B at 1000 B/s.
    backend = em.emulated_backend(MPI.COMM_SELF, base=base, nodes=2,
                                  bandwidth=8000, latency=0)
    try:
        arrays = [np.full(25, i, dtype=np.float32) for i in range(4)]
        t0 = time.perf_counter()
        handles = [backend.allreduce(a) for a in arrays]
        for h in handles:
            h.wait()
        elapsed = time.perf_counter() - t0
        assert 0.4 <= elapsed < 0.4 + 0.25
        assert all(np.all(a == i) for i, a in enumerate(arrays))
    finally:
        backend.close()


def test_backend_rejects_use_after_close():
    backend = em.emulated_backend(MPI.COMM_SELF, base='mpi_thread', nodes=2,
                                  bandwidth=8000, latency=0)
    backend.close()
    with pytest.raises(RuntimeError, match='closed'):
        backend.allreduce(np.zeros(1, np.float32))
