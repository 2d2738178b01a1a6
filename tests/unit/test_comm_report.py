"""CommunicationReport's arithmetic and argument checks (no MPI or trainer)."""
import pytest

from chainermn_overlap.extensions import CommunicationReport

BEFORE = {'buckets': 4, 'bytes': 1000, 'comm_seconds': 2.0,
          'wait_seconds': 0.5, 'hidden_fraction': 0.75}


def test_difference_of_two_readings():
    now = {'buckets': 6, 'bytes': 1500, 'comm_seconds': 3.0,
           'wait_seconds': 0.75, 'hidden_fraction': 0.75}
    out = CommunicationReport.difference(BEFORE, now)
    assert out == {'comm/buckets': 2, 'comm/bytes': 500,
                   'comm/comm_seconds': 1.0, 'comm/wait_seconds': 0.25,
                   'comm/hidden_fraction': 0.75}


def test_hidden_fraction_is_the_intervals_not_the_runs():
    # The run so far hid 75%; this interval waited for all of its 1 s.
    now = dict(BEFORE, bytes=1100, comm_seconds=3.0, wait_seconds=1.5)
    out = CommunicationReport.difference(BEFORE, now, prefix='')
    assert out['hidden_fraction'] == pytest.approx(0.0)


def test_no_reduction_no_hidden_fraction():
    out = CommunicationReport.difference(BEFORE, dict(BEFORE))
    assert out['comm/bytes'] == 0 and 'comm/hidden_fraction' not in out


def test_a_reset_in_between_counts_from_the_reset():
    now = {'buckets': 1, 'bytes': 200, 'comm_seconds': 0.5,
           'wait_seconds': 0.0, 'hidden_fraction': 1.0}
    out = CommunicationReport.difference(BEFORE, now)
    assert out['comm/bytes'] == 200 and out['comm/buckets'] == 1


def test_compression_time_reported_when_present():
    before = dict(BEFORE, compression_seconds=0.25)
    now = dict(BEFORE, bytes=1010, compression_seconds=0.5)
    out = CommunicationReport.difference(before, now)
    assert out['comm/compression_seconds'] == 0.25


def test_entries_follow_the_prefix():
    assert CommunicationReport(prefix='net/').entries == [
        'net/bytes', 'net/comm_seconds', 'net/wait_seconds',
        'net/hidden_fraction']


@pytest.mark.parametrize('kwargs,match', [
    ({'prefix': 3}, 'prefix must be a string'),
    ({'optimizer': object()}, 'communication_stats'),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CommunicationReport(**kwargs)
