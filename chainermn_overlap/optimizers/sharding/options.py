"""The sharding arguments of ``create_overlapped_optimizer``, checked."""

__all__ = ['SHARD_MODES', 'check']

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
