import numpy as np
import pytest
from hypothesis import given, strategies as st

from chainermn_overlap.communication.buckets import plan_buckets, wire_dtype
from chainermn_overlap.config import parse_size


def test_wire_dtype():
    assert wire_dtype(np.float16) == np.float32
    assert wire_dtype(np.float32) == np.float32
    assert wire_dtype(np.float64) == np.float64
    assert wire_dtype(np.float32, np.float16) == np.float16


def test_plan_simple():
    plans = plan_buckets([('a', 10, 'float32'), ('b', 10, 'float32'),
                          ('c', 30, 'float32')], bucket_size=80)
    assert [[e[0] for e in p.entries] for p in plans] == [['a', 'b'], ['c']]
    assert plans[0].entries == (('a', 0, 10), ('b', 10, 10))
    assert plans[1].nelems == 30


def test_plan_splits_on_dtype_change():
    plans = plan_buckets([('a', 1, 'float32'), ('b', 1, 'float64'),
                          ('c', 1, 'float64')], bucket_size=10 ** 6)
    assert [p.dtype for p in plans] == [np.float32, np.float64]
    assert [len(p.entries) for p in plans] == [1, 2]


def test_plan_rejects_nonpositive_size():
    with pytest.raises(ValueError):
        plan_buckets([('a', 1, 'float32')], 0)


entries_st = st.lists(
    st.tuples(st.integers(1, 500), st.sampled_from(['float16', 'float32'])),
    max_size=40)


@given(entries_st, st.integers(1, 4000), st.sampled_from([None, 'float16']))
def test_plan_properties(raw, bucket_size, wire):
    entries = [('p%d' % i, n, dt) for i, (n, dt) in enumerate(raw)]
    plans = plan_buckets(entries, bucket_size, wire)
    # Every parameter exactly once, in the given order.
    flat = [e for p in plans for e in p.entries]
    assert [e[0] for e in flat] == [e[0] for e in entries]
    for p in plans:
        # Members are contiguous and fill the buffer exactly.
        off = 0
        for name, o, n in p.entries:
            assert o == off
            off += n
        assert off == p.nelems
        # Within budget unless a single member is larger than the budget.
        if len(p.entries) > 1:
            assert p.nelems * p.dtype.itemsize <= bucket_size
    # Greedy: two neighbouring buckets of one dtype could not be merged.
    for a, b in zip(plans, plans[1:]):
        if a.dtype == b.dtype:
            first_b = b.entries[0][2]
            assert (a.nelems + first_b) * a.dtype.itemsize > bucket_size


@pytest.mark.parametrize('text, expected', [
    (1024, 1024), ('25MB', 25 * 10 ** 6), ('4MiB', 4 * 2 ** 20),
    ('512 kb', 512000), ('1.5GB', 1500 * 10 ** 6), ('100', 100)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize('bad', [0, -1, '3 furlongs', 'MB', None, True])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@given(entries_st, st.integers(1, 4000),
       st.lists(st.integers(1, 4000), max_size=4))
def test_plan_tail_limits(raw, bucket_size, tail):
    entries = [('p%d' % i, n, dt) for i, (n, dt) in enumerate(raw)]
    plans = plan_buckets(entries, bucket_size, tail=tuple(tail))
    flat = [e for p in plans for e in p.entries]
    assert [e[0] for e in flat] == [e[0] for e in entries]
    for k, p in enumerate(reversed(plans)):
        limit = min(tail[k], bucket_size) if k < len(tail) else bucket_size
        if len(p.entries) > 1:
            assert p.nelems * p.dtype.itemsize <= limit
        off = 0
        for name, o, n in p.entries:
            assert o == off
            off += n


def test_plan_tail_makes_last_buckets_small():
    entries = [('p%d' % i, 1000, 'float32') for i in range(10)]  # 4 kB each
    plans = plan_buckets(entries, 40000, tail=(4000, 8000))
    assert [len(p.entries) for p in plans] == [7, 2, 1]
