"""Whole update-rule states from the shards, for snapshots and relayouts.

Each rank holds the update rules' state (momentum, Adam's moments) of its
own slices only (:mod:`.rules`).  :func:`consolidate` gathers every state
array back to the parameter's shape on every rank: a snapshot then holds
the same state an unsharded optimizer would write (loadable by one, and by
a sharded one at another rank count), and a new layout cuts the whole
arrays anew.  It is collective over the communicator: every rank calls it
at the same point, with no reduction in flight (after ``synchronize()``);
its waits are bounded by the optimizer's timeout, so a rank that never
joins (a snapshot written by some ranks only, :mod:`.writers`) is an error,
not a hang.

Loading (:func:`load`) needs no communication: the deserializer reads
whole arrays into fresh state dictionaries, which are checked (shape, every
array read) before any state is replaced, so a load that fails leaves the
optimizer as it was and names the key; each rank then cuts its slices out
(:func:`~.rules.init_states`).
"""
import numpy

import chainer

from chainermn_overlap import _host
from chainermn_overlap import _mpi_json
from chainermn_overlap.optimizers.sharding import shards
from chainermn_overlap.optimizers.sharding import writers

__all__ = ['consolidate', 'load']

_HINT = ('Gathering sharded states is collective: every rank must serialize '
         'the optimizer at the same point. A snapshot written by some ranks '
         'only (chainermn.extensions.multi_node_snapshot, or save_npz on '
         'rank 0 alone) waits for ranks that never join. ')


def _pieces_by_param(policy):
    for bucket in policy.buckets:
        for piece, (_, off, size) in zip(policy.pieces[bucket.index],
                                         bucket.plan.entries):
            yield bucket, piece, off, size


def consolidate(policy, why):
    """Every sharded state array becomes the parameter's whole array.

    Does nothing unless the states are cut for the layout in force
    (``policy.states_sharded``: the same on every rank, so every rank
    takes part in the same collectives or none); the policy then records
    that they are whole.

    Args:
        policy (ShardedPolicy): the layout in force (buckets, pieces); its
            ``wait_requests`` bounds the waits.
        why (str): what gathers them (``'serialize()'``), for messages.

    Raises:
        CommunicationTimeout: a rank did not join within the timeout.
    """
    if not policy.states_sharded:
        return
    comm = policy.mpi_comm
    label = 'the gather of the sharded update-rule states ({})'.format(why)
    hint = _HINT + writers.FIX

    def wait(requests, what=label):
        policy.wait_requests(requests, what, hint=hint)
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
    for r, theirs in enumerate(_mpi_json.allgather_json(comm, mine,
                                                        wait=wait)):
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
            wait([comm.Iallgatherv(part, [whole, (counts, displs)])],
                 '{}: {!r} of {}'.format(label, key, param.name))
            state[key] = xp.asarray(whole).reshape(param.shape)


def _arrays():
    return chainer.get_array_types()


def _key_path(deserializer, name, key):
    return '{}{}/{}'.format(getattr(deserializer, 'path', ''),
                            name.lstrip('/'), key)


def _placed(value, like, dtype=None):
    """A copy of ``value`` on the device of ``like``, in ``dtype`` (None:
    its own), as loading into an existing array gives."""
    device = chainer.backend.get_device_from_array(like)
    with chainer.using_device(device):
        return device.xp.array(_host.to_host(value), dtype=dtype)


def _checked(deserializer, name, param, sharded, before, read,
             ranged=None):
    """The state to keep for one rule, from the one it held and the one
    read (``read``: what the deserializer left in the staged dictionary).

    A key the deserializer left unread (``strict=False``) keeps the array
    held before, as an unsharded optimizer keeps it.  An array read must
    have the parameter's shape if the parameter is sharded (a file holds
    whole states), else the shape of the array held before; a slice of a
    sharded snapshot (``ranged``: its ``(lo, hi)``) has shape ``(hi - lo,)``.
    """
    if read is None:
        return None
    out = {}
    for key, value in read.items():
        held = before.get(key) if before is not None else None
        held_array = isinstance(held, _arrays())
        if value is None and held_array:
            out[key] = held
            continue
        if not isinstance(value, _arrays()):
            out[key] = value
            continue
        if ranged is not None:
            shape = (ranged[1] - ranged[0],)
        elif sharded:
            shape = param.shape if param.array is not None else None
        else:
            shape = held.shape if held_array else None
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise ValueError(
                'cannot load the optimizer state {}: it has shape {}, and '
                '{} needs shape {} (the snapshot was written for another '
                'model); nothing was loaded.'.format(
                    _key_path(deserializer, name, key), tuple(value.shape),
                    name, tuple(shape)))
        if held_array:
            # Chainer copies into the array held, casting to its dtype.
            out[key] = _placed(value, held, held.dtype)
        elif param.array is not None:
            out[key] = _placed(value, param.array)
        else:
            out[key] = value
    return out


def load(policy, actual, deserializer):
    """``actual.serialize(deserializer)``, all or nothing.

    Every rule's state is read into a staged dictionary (arrays ``None``,
    so that the deserializer returns the whole arrays read: Chainer's
    copy into an existing array would need the shard's shape), together
    with ``t`` and ``epoch``; everything is checked; only then are the
    states, ``t`` and ``epoch`` replaced.  On any error (a key missing
    with ``strict=True``, a wrong shape) the optimizer holds what it held
    before, and the error names the key.

    Args:
        policy (ShardedPolicy): the layout in force (which parameters are
            sharded).
        actual: the wrapped optimizer.
        deserializer: a ``chainer.serializer.Deserializer``.

    Returns:
        The ranges of the slices loaded (None: whole states), for the
        policy's ``loaded_ranges``.
    """
    if getattr(actual, 'target', None) is None:
        actual.serialize(deserializer)
        return policy.loaded_ranges
    sharded = {id(piece.info.param)
               for _, piece, _, _ in _pieces_by_param(policy)}
    entries = [(name, param, param.update_rule)
               for name, param in actual.target.namedparams()
               if getattr(param, 'update_rule', None) is not None]
    before = [(rule, rule._state, rule.t) for _, _, rule in entries]
    t, epoch = actual.t, actual.epoch
    for _, _, rule in entries:
        if rule._state is not None:
            rule._state = {k: None if isinstance(v, _arrays()) else v
                           for k, v in rule._state.items()}
    try:
        record = shards.read_ranges(deserializer) or {}
        ranges = {n: (e['lo'], e['hi']) for n, e in record.items()}
        actual.serialize(deserializer)
        staged = [
            (rule, _checked(deserializer, name, param,
                            id(param) in sharded, held, rule._state,
                            ranges.get(name)),
             rule.t)
            for (name, param, rule), (_, held, _) in zip(entries, before)]
        new_t, new_epoch = actual.t, actual.epoch
    finally:
        for rule, state, rule_t in before:
            rule._state, rule.t = state, rule_t
        actual.t, actual.epoch = t, epoch
    for rule, state, rule_t in staged:
        if state is not None and rule._state is not None:
            # The same dictionary: copies of the rule share it.
            rule._state.clear()
            rule._state.update(state)
        else:
            rule._state = state
        rule.t = rule_t
    actual.t, actual.epoch = new_t, new_epoch
    return ranges or None
