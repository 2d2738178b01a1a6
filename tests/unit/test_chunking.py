"""The ring's chunk for N ranks (chainermn_overlap/communication/chunking.py):
the default chunk up to 16 ranks, at least 256 KiB per ring step beyond, an
explicit chunk kept; the float16 ring's bucket, and the replay's copy of
the rule."""
import os

import numpy
import pytest

from chainermn_overlap.communication import chunking, scheduler
from chainermn_overlap.optimizers import _wrapper

MIB = 1 << 20


def test_two_ranks_keep_todays_chunk():
    assert chunking.ring_chunk_bytes(2) == 4 * MIB
    assert chunking.ring_chunk_bytes(1) == 4 * MIB
    # The MPI engine's default, which the rule leaves as it is.
    assert scheduler.DEFAULT_CHUNK_BYTES == chunking.DEFAULT_CHUNK_BYTES \
        == 4 * MIB


def test_the_chunk_grows_so_each_step_moves_a_segment():
    # The default chunk up to 16 ranks, then 256 KiB a step.
    assert [chunking.ring_chunk_bytes(n) / MIB
            for n in (3, 4, 16, 17, 64, 1024)] == [4, 4, 4, 4.25, 16, 256]
    for n in range(2, 2049):
        assert chunking.ring_chunk_bytes(n) / n >= chunking.RING_SEGMENT_BYTES
    assert chunking.ring_chunk_bytes(8, segment_bytes=MIB) == 8 * MIB


def test_the_segment_keeps_latency_within_a_quarter_at_10_to_25_gbits():
    # A step of one segment: latency within 25 % of its transfer time at
    # 10-25 Gb/s and 5-20 us (what the module's docstring claims) ...
    for rate in (10e9, 25e9):
        for alpha in (5e-6, 20e-6):
            transfer = chunking.RING_SEGMENT_BYTES * 8 / rate
            assert alpha / transfer <= 0.25, (rate, alpha)
    # ... where the fixed 4 MiB chunk at 1,024 ranks (4 KiB a step) is
    # latency-bound even at the slowest corner.
    assert 5e-6 > 4 * MIB / 1024 * 8 / 10e9


def test_an_explicit_chunk_is_kept_at_any_size():
    assert chunking.ring_chunk_bytes(1024, MIB) == MIB
    assert chunking.ring_chunk_bytes(2, 16 * MIB) == 16 * MIB
    with pytest.raises(ValueError, match='chunk_bytes must be at least 1'):
        chunking.ring_chunk_bytes(4, 0)
    with pytest.raises(ValueError, match='at least one rank'):
        chunking.ring_chunk_bytes(0)


def test_the_float16_rings_bucket_follows_the_rule():
    f16, f32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)

    def bucket(nodes, wire=f16, chunk=None, shard=None):
        return _wrapper.resolve_bucket_size(None, shard, wire, None, chunk,
                                            16 * MIB, nodes)
    assert bucket(2) == bucket(16) == 4 * MIB      # as before
    assert bucket(32) == 8 * MIB
    assert bucket(1024) == 16 * MIB                # at most the fp32 bucket
    assert bucket(1024, chunk='1MiB') == MIB       # the user's chunk
    assert bucket(1024, wire=f32) == 16 * MIB      # float32: not a ring
    assert bucket(1024, shard='grads') == 4 * MIB  # sharded: unchanged


def test_the_replay_models_the_same_rule():
    from benchmarks.scale import replay
    assert os.path.samefile(replay.chunking.__file__, chunking.__file__)
    assert replay.chunking.ring_chunk_bytes(64) == \
        chunking.ring_chunk_bytes(64)
