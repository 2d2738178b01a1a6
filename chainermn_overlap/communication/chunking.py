"""The size of the pieces a ring reduces, chosen for the number of ranks.

A ring allreduce of ``c`` bytes over ``N`` ranks takes ``2 (N - 1)``
steps, each one latency ``alpha`` plus ``c / N`` bytes at the link's rate
``B``: ``2 (N - 1) (alpha + c / (N B))``.  With a fixed chunk, every step
moves less as ``N`` grows, and the latency term takes over: at 1,024 ranks
a 4 MiB chunk moves 4 KiB per step, a third of a microsecond at 100 Gb/s
against a latency of 5 to 25 microseconds.  So a ring's chunk grows with
``N`` so that each step moves at least :data:`RING_SEGMENT_BYTES`.

The segment: a step's latency should be a small fraction of its transfer
time, ``alpha <= f * s / B``, i.e. ``s >= alpha B / f``.  For links of
10 to 100 Gb/s and latencies of 5 to 20 microseconds, ``alpha B`` is
6 KB (10 Gb/s, 5 us) to 250 KB (100 Gb/s, 20 us); 2 MiB keeps the latency
within 12 % of the transfer at the worst corner (1.2 % at 10 Gb/s and
20 us).  2 MiB is also exactly what each step moves at two ranks with the
default chunk (4 MiB / 2), so the rule leaves two ranks as they were:
``max(4 MiB, 2 MiB * N)`` is 4 MiB for N <= 2.

This module imports nothing beyond the standard library: the SimGrid
replay (``benchmarks/scale/replay.py``, run by the system Python without
the project's dependencies) loads it by path and models the same rule.
"""

__all__ = ['DEFAULT_CHUNK_BYTES', 'RING_SEGMENT_BYTES', 'ring_chunk_bytes']

# The engines' default chunk (a higher-priority bucket can start at every
# chunk boundary); what a ring uses at two ranks.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# The least a ring step moves with the default chunk (see the module).
RING_SEGMENT_BYTES = 2 * 1024 * 1024


def ring_chunk_bytes(nodes, chunk_bytes=None,
                     segment_bytes=RING_SEGMENT_BYTES):
    """The chunk a ring allreduce over ``nodes`` ranks reduces at once.

    Args:
        nodes (int): ranks in the ring.
        chunk_bytes (int or None): the user's explicit chunk, kept as
            given (it is a choice of preemption granularity the user made;
            the rule never overrides it); None for the default rule.
        segment_bytes (int): least bytes per ring step under the default.

    Returns:
        int: ``chunk_bytes`` if given, else ``max(DEFAULT_CHUNK_BYTES,
        segment_bytes * nodes)`` (exactly the default chunk at two ranks).
    """
    if chunk_bytes is not None:
        if int(chunk_bytes) < 1:
            raise ValueError('chunk_bytes must be at least 1 byte, got {!r}'
                             .format(chunk_bytes))
        return int(chunk_bytes)
    if int(nodes) < 1:
        raise ValueError('a ring needs at least one rank, got {!r}'
                         .format(nodes))
    return max(DEFAULT_CHUNK_BYTES, int(segment_bytes) * int(nodes))
