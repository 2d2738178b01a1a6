"""Whole update-rule states from the shards, for snapshots and relayouts.

Each rank holds the update rules' state (momentum, Adam's moments) of its
own slices only (:mod:`.rules`).  :func:`consolidate` gathers every state
array back to the parameter's shape on every rank: a snapshot then holds
the same state an unsharded optimizer would write (loadable by one, and by
a sharded one at another rank count), and a new layout cuts the whole
arrays anew.  Loading needs no communication: the deserializer fills whole
arrays, and the next update cuts each rank's slice out of them
(:func:`~.rules.init_states`).

Collective over the communicator: every rank calls it at the same point,
with no reduction in flight (after ``synchronize()``).
"""
import numpy

import chainer

from chainermn_overlap import _host
from chainermn_overlap import _mpi_json

__all__ = ['consolidate', 'forget_arrays']


def _pieces_by_param(policy):
    for bucket in policy.buckets:
        for piece, (_, off, size) in zip(policy.pieces[bucket.index],
                                         bucket.plan.entries):
            yield bucket, piece, off, size


def consolidate(policy):
    """Every sharded state array becomes the parameter's whole array.

    Does nothing unless the states are cut for the layout in force
    (``policy.states_sharded``: the same on every rank, so every rank
    takes part in the same collectives or none).

    Args:
        policy (ShardedPolicy): the layout in force (buckets, pieces).
    """
    if not policy.states_sharded:
        return
    comm = policy.mpi_comm
    todo = []
    for bucket, piece, off, size in _pieces_by_param(policy):
        rule = piece.info.param.update_rule
        state = None if rule is None else rule.state
        keys = sorted(k for k, v in (state or {}).items()
                      if isinstance(v, chainer.get_array_types()))
        todo.append((bucket, piece, off, size, keys))
    # Ranks must agree on the keys: a mismatch would pair unrelated arrays
    # in the collectives below.  JSON, never pickle, from peers.
    mine = [t[4] for t in todo]
    for r, theirs in enumerate(_mpi_json.allgather_json(comm, mine)):
        if theirs != mine:
            raise RuntimeError(
                'rank {} holds other update-rule states than rank {}, so '
                'they cannot be gathered into a snapshot.'.format(
                    r, policy.rank))
    for bucket, piece, off, size, keys in todo:
        param = piece.info.param
        counts, displs, at = [], [], 0
        for start, stop in bucket.bounds:
            n = max(0, min(off + size, stop) - max(off, start))
            counts.append(n)
            displs.append(at)
            at += n
        state = param.update_rule.state
        for key in keys:
            value = state[key]
            xp = chainer.backend.get_array_module(value)
            part = numpy.ascontiguousarray(_host.to_host(value))
            whole = numpy.empty(size, dtype=part.dtype)
            comm.Allgatherv(part, [whole, (counts, displs)])
            state[key] = xp.asarray(whole).reshape(param.shape)
    policy.states_sharded = False


def forget_arrays(policy):
    """Before a deserializer fills the states: drop the sharded arrays.

    Chainer's deserializers copy into an existing array of the same shape;
    with the arrays gone (``None``) they return the whole arrays read,
    which the next update cuts (:func:`~.rules.init_states`).
    """
    for _, piece, _, _ in _pieces_by_param(policy):
        rule = piece.info.param.update_rule
        if rule is None or rule.state is None:
            continue
        for key, value in rule.state.items():
            if isinstance(value, chainer.get_array_types()):
                rule.state[key] = None
    policy.states_sharded = False
