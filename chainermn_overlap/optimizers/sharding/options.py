"""The sharding arguments of ``create_overlapped_optimizer``, checked."""
from chainermn_overlap import config

__all__ = ['SHARD_MODES', 'check', 'in_flight_limit']

SHARD_MODES = (None, 'optimizer', 'gradients', 'parameters')


def check(shard, shard_unit, shard_update, compression, backend):
    """Raises ``ValueError`` naming a bad sharding argument and the fix."""
    if shard_update not in ('backward', 'update'):
        raise ValueError("shard_update must be 'backward' or 'update', got "
                         '{!r}'.format(shard_update))
    if shard not in SHARD_MODES:
        raise ValueError(
            "shard must be None, 'optimizer', 'gradients' or 'parameters', "
            'got {!r}'.format(shard))
    if shard_unit not in ('element', 'parameter'):
        raise ValueError("shard_unit must be 'element' or 'parameter', got "
                         '{!r}'.format(shard_unit))
    if shard is None:
        return
    if compression is not None:
        raise ValueError(
            'shard={!r} cannot be combined with compression: PowerSGD '
            'reduces low-rank factors of whole gradients, which no rank '
            'holds when they are sharded; drop one of the two.'.format(shard))
    if backend == 'nccl':
        raise ValueError(
            "shard={!r} runs on the MPI engines ('mpi_priority', "
            "'mpi_thread'; GPU arrays are staged through host memory), not "
            "on backend='nccl'.".format(shard))


def in_flight_limit(shard, shard_in_flight):
    """How much of the full gradient buckets waiting for their
    reduce-scatter a rank may hold before backward waits: ``(n, 'bytes')``,
    ``(n, 'buckets')`` or None (no bound).

    ``'auto'``: no bound for ``'gradients'`` (at most the whole gradient,
    as unsharded: backward never waits for the link, which cost stage 2
    0.08 of scalability on ResNet-50 on the test bed with two buckets),
    two buckets for ``'parameters'`` (whose peak is the point).
    """
    if shard_in_flight == 'auto':
        return (2, 'buckets') if shard == 'parameters' else None
    if shard_in_flight is None:
        return None
    if shard not in ('gradients', 'parameters'):
        raise ValueError(
            'shard_in_flight={!r} bounds the gradients waiting for their '
            "reduce-scatter, which only shard='gradients' and 'parameters' "
            'release (shard={!r} keeps them whole): drop shard_in_flight or '
            'choose one of those.'.format(shard_in_flight, shard))
    try:
        return config.parse_size(shard_in_flight), 'bytes'
    except ValueError as e:
        raise ValueError('shard_in_flight: {} (or None for no bound, '
                         "'auto' for the default)".format(e)) from None
