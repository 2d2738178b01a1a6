"""The cached layout check and its fingerprint agreement, on one process.

The check runs on ``MPI.COMM_SELF``; the other ranks' side of the
agreement (one allreduce MAX of ``[miss, fp, -fp]``) is scripted by a
communicator that mixes in a given vote, so every case of the decision is
reached: all hit with one fingerprint (cached), another rank missed, and
another rank hit with another fingerprint (both: full check everywhere).
"""
import collections

import numpy as np
import pytest
from mpi4py import MPI

from chainermn_overlap.distconv import layout_check
from chainermn_overlap.distconv.topology import GridTopology


class OtherRankVotes(object):
    """COMM_SELF, whose allreduce also sees another rank's vote."""

    def __init__(self):
        self.other = None  # None: no other rank (a real one-process run)
        self.allreduces = 0

    def Iallreduce(self, send, recv, op):
        # The check posts its vote non-blocking and waits with the
        # watchdog's limit (communication.blocking): done at once here.
        assert op == MPI.MAX
        self.allreduces += 1
        vote = send[0]
        recv[0][...] = vote if self.other is None else np.maximum(
            vote, np.asarray(self.other, dtype=np.int64))
        return MPI.REQUEST_NULL

    def __getattr__(self, name):
        return getattr(MPI.COMM_SELF, name)


def make(mode='cached'):
    comm = OtherRankVotes()
    stats = collections.Counter()
    check = layout_check.LayoutCheck(GridTopology((1, 1), 1, 0), comm,
                                     stats, mode)
    return check, comm, stats


X = np.zeros((2, 3, 5, 4), np.float32)


def test_second_call_is_cached_and_returns_the_same_layout():
    check, comm, stats = make()
    a = check.spatial(X, 'l', ('sig',))
    assert stats == {'validate_full': 1}
    b = check.spatial(X, 'l', ('sig',))
    assert b is a and stats['validate_cached'] == 1
    assert a.spatial_shape == (5, 4) and a.channels == 3
    # Another geometry, signature or channel rule is a new entry.
    check.spatial(X[:1], 'l', ('sig',))
    check.spatial(X, 'l', ('other',))
    check.spatial(X, 'l', ('sig',), channel_split=False)
    assert stats['validate_full'] == 4


def _fp(check):
    (_, fp), = [v for k, v in check._cache.items()]
    return fp


def test_a_miss_on_another_rank_forces_the_full_check_here():
    check, comm, stats = make()
    check.spatial(X, 'l')
    comm.other = [1, 0, 0]  # the other rank has not seen this geometry
    check.spatial(X, 'l')
    assert stats == {'validate_full': 2}
    comm.other = [0, _fp(check), -_fp(check)]  # it has, with our layout
    check.spatial(X, 'l')
    assert stats == {'validate_full': 2, 'validate_cached': 1}


def test_another_fingerprint_forces_the_full_check():
    check, comm, stats = make()
    check.spatial(X, 'l')
    fp = _fp(check)
    for other in (fp + 1, fp - 1):
        comm.other = [0, other, -other]
        check.spatial(X, 'l')
    assert stats == {'validate_full': 3}


def test_always_mode_never_votes_and_never_caches():
    check, comm, stats = make('always')
    for _ in range(3):
        check.spatial(X, 'l')
    assert stats == {'validate_full': 3} and comm.allreduces == 0
    assert not check._cache


def test_unhashable_signatures_are_checked_every_time():
    check, comm, stats = make()
    for _ in range(2):
        check.spatial(X, 'l', (['a list'],))
    assert stats == {'validate_full': 2}
    # Every rank still votes (a miss), so the collective calls match.
    assert comm.allreduces == 2


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(layout_check, '_CACHE_SIZE', 2)
    check, comm, stats = make()
    x = np.zeros((3, 3, 5, 4), np.float32)
    for n in (1, 2, 3):
        check.spatial(x[:n], 'l')
    assert len(check._cache) == 1  # cleared when full, then refilled


def test_samples_check_is_cached_too():
    check, comm, stats = make()
    assert check.samples(X, 'l') == ((5, 4), [2])
    assert check.samples(X, 'l') == ((5, 4), [2])
    assert stats == {'validate_full': 1, 'validate_cached': 1}


def test_bad_input_raises_on_the_full_check():
    check, comm, stats = make()
    with pytest.raises(ValueError, match=r'l: input must have shape \(N, C, '
                       r'H, W\)'):
        check.spatial(X[0], 'l')


def test_fingerprints():
    a = layout_check.fingerprint('spatial', ((5, 4), [2]), '<f4', ())
    assert a == layout_check.fingerprint('spatial', ((5, 4), [2]), '<f4', ())
    assert 0 <= a < 2 ** 62
    assert a != layout_check.fingerprint('spatial', ((5, 4), [3]), '<f4', ())
    assert a != layout_check.fingerprint('spatial', ((5, 4), [2]), '<f8', ())


def test_bad_mode():
    with pytest.raises(ValueError, match="check must be 'cached' or "
                       "'always', got 'never'"):
        make('never')
