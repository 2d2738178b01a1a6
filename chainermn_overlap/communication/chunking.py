"""The size of the pieces a ring reduces, chosen for the number of ranks.

A ring allreduce of ``c`` bytes over ``N`` ranks takes ``2 (N - 1)``
steps, each one latency ``alpha`` plus ``c / N`` bytes at the link's rate
``B``: ``2 (N - 1) (alpha + c / (N B))``.  With a fixed chunk, every step
moves less as ``N`` grows, and the latency term takes over: at 1,024 ranks
a 4 MiB chunk moves 4 KiB per step, a third of a microsecond at 100 Gb/s
against a latency of 5 to 25 microseconds.  So a ring's chunk grows with
``N`` so that each step moves at least :data:`RING_SEGMENT_BYTES`.

The segment trades the ring's latency against the priority engine's
preemption: a more urgent bucket can start only at a chunk boundary, so a
chunk larger than needed makes what the next forward needs wait.  A step's
latency is ``alpha B / s`` of its transfer time.  The fixed 4 MiB chunk
moves 256 KiB a step at 16 ranks, where the SimGrid projection of
ResNet-50 (``benchmarks/results/scale_ring_chunks.json``) still matches
MPICH's halving within 0.01 at 10, 25 and 100 Gb/s; with 256 KiB a step,
``alpha B`` (6 KB at 10 Gb/s and 5 us, 62 KB at 25 Gb/s and 20 us) is 2 %
to 24 % of it (at 100 Gb/s and 20 us as much as the step's transfer, 21
us: short either way).  A 2 MiB segment cost 0.076 of scalability at 16
ranks on 10 Gb/s in the same projection (GPU-class compute, without the
communication thread's CPU time: whole 16 MiB buckets ahead of the first
layers'), so the segment is 256 KiB: the chunk is the default 4 MiB up to
16 ranks, exactly as before, and grows beyond.

This module imports nothing beyond the standard library: the SimGrid
replay (``benchmarks/scale/replay.py``, run by the system Python without
the project's dependencies) loads it by path and models the same rule.
"""

__all__ = ['DEFAULT_CHUNK_BYTES', 'RING_SEGMENT_BYTES', 'ring_chunk_bytes']

# The engines' default chunk (a higher-priority bucket can start at every
# chunk boundary); what a ring uses at two ranks.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# The least a ring step moves with the default chunk (see the module).
RING_SEGMENT_BYTES = 256 * 1024


def ring_chunk_bytes(nodes, chunk_bytes=None, segment_bytes=None):
    """The chunk a ring allreduce over ``nodes`` ranks reduces at once.

    Args:
        nodes (int): ranks in the ring.
        chunk_bytes (int or None): the user's explicit chunk, kept as
            given (it is a choice of preemption granularity the user made;
            the rule never overrides it); None for the default rule.
        segment_bytes (int): least bytes per ring step under the default
            (default :data:`RING_SEGMENT_BYTES`, read at the call).

    Returns:
        int: ``chunk_bytes`` if given, else ``max(DEFAULT_CHUNK_BYTES,
        segment_bytes * nodes)``: the default chunk up to 16 ranks.
    """
    if chunk_bytes is not None:
        if int(chunk_bytes) < 1:
            raise ValueError('chunk_bytes must be at least 1 byte, got {!r}'
                             .format(chunk_bytes))
        return int(chunk_bytes)
    if int(nodes) < 1:
        raise ValueError('a ring needs at least one rank, got {!r}'
                         .format(nodes))
    if segment_bytes is None:
        segment_bytes = RING_SEGMENT_BYTES
    return max(DEFAULT_CHUNK_BYTES, int(segment_bytes) * int(nodes))
