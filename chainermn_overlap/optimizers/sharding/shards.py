"""Sharded snapshots: each rank writes its own slices of the states.

Without this, saving a sharded optimizer gathers every update-rule state
whole on every rank (:func:`.state.consolidate`): memory at save time is
that of an unsharded optimizer and a snapshot of every rank (such as
:func:`~chainermn_overlap.extensions.auto_snapshot`'s) holds ``size``
copies of the state.  Inside :func:`saving` (auto_snapshot enters it), a
sharded optimizer writes instead, with no communication:

* under its usual keys, the arrays of its states as it holds them: for a
  sharded parameter the 1-D slice ``[lo, hi)`` of the flattened state this
  rank owns (empty where it owns none);
* under ``shard_ranges`` (a JSON text, :data:`RANGES_KEY`), for each such
  parameter (named as ``namedparams()``) its ``lo``, ``hi``, ``shape`` and
  the state keys sliced;
* the model's parameters, likewise (:func:`write_params`): the same slice
  of each, under the model's keys, with a ``shard_ranges`` of the model
  whose key ``''`` names the parameter itself; with ``shard='parameters'``
  a rank's own pieces, nothing fetched.  Each element is on disk once.

Reading them back:

* at the same number of ranks, each rank reads its own file
  (:func:`read_ranges` in :func:`.state.load`); the first layout built
  afterwards (:func:`reconcile`, collective, every wait bounded) keeps the
  slices where the new layout cuts the same ranges, which is the case
  unless the bucket size, ``shard_unit`` or the order of use changed; else
  each state is gathered whole once from the slices of all ranks (one
  parameter at a time) and cut anew;
* at another number of ranks, or into an optimizer that is not sharded,
  :func:`assemble` rebuilds whole arrays from every rank's file (reading
  one file's slice at a time), as ``python -m chainermn_overlap.snapshot
  consolidate`` does for a single file that ChainerMN's ``load_npz`` reads;
  the model's parameters are rebuilt so at any number of ranks.

Everything read is checked (JSON, never pickle; the ranges must partition
each parameter): a file that does not fit raises an error naming it.
"""
import contextlib
import json

import numpy

import chainer

from chainermn_overlap import _host
from chainermn_overlap import _mpi_json

__all__ = ['RANGES_KEY', 'assemble', 'policy_of', 'read_ranges',
           'reconcile', 'saving', 'write', 'write_params']

RANGES_KEY = 'shard_ranges'


def policy_of(optimizer):
    """The sharded policy of an overlapped optimizer, else None."""
    st = getattr(optimizer, '_overlap', None)
    policy = getattr(st, 'policy', None)
    return policy if hasattr(policy, 'save_shards') else None


@contextlib.contextmanager
def saving(optimizers):
    """While the block runs, the sharded ones of ``optimizers`` serialize
    their slices (see the module docstring)."""
    policies = [p for p in map(policy_of, optimizers) if p is not None]
    for p in policies:
        p.save_slices(True)
    try:
        yield
    finally:
        for p in policies:
            p.save_slices(False)


def _arrays():
    return chainer.get_array_types()


def current_ranges(policy):
    """``{name: (lo, hi)}`` this rank holds in the layout in force."""
    names = {id(p): n for n, p in policy.actual.target.namedparams()}
    out = {}
    for bucket in policy.buckets:
        for piece in policy.pieces[bucket.index]:
            out[names[id(piece.info.param)]] = (piece.lo, piece.hi)
    return out


def _params(policy):
    return dict(policy.actual.target.namedparams())


def write(policy, actual, serializer):
    """Serializes ``actual`` with this rank's slices and their ranges."""
    ranges = (policy.loaded_ranges if policy.loaded_ranges is not None
              else current_ranges(policy))
    params = _params(policy)
    record = {}
    for name, (lo, hi) in sorted(ranges.items()):
        param = params[name]
        rule = param.update_rule
        if rule is None or rule.state is None:
            continue
        keys = sorted(k for k, v in rule.state.items()
                      if isinstance(v, _arrays()))
        record[name] = {'lo': lo, 'hi': hi, 'shape': list(param.shape),
                        'keys': keys}
    serializer(RANGES_KEY, numpy.array(json.dumps(record, sort_keys=True)))
    actual.serialize(serializer)


def _is_placeholder(array):
    # A released parameter of shard='parameters' (params.placeholder).
    return (isinstance(array, numpy.ndarray) and array.ndim > 0
            and array.size > 0 and all(st == 0 for st in array.strides))


def write_params(optimizer, data, prefix):
    """Inside :func:`saving`, after the trainer was serialized into
    ``data`` (a ``DictionarySerializer``'s dict): the parameters of
    ``optimizer``'s model, found under ``prefix``, become this rank's
    slices, the ranges of its update-rule states (so that each element is
    written by one rank), with their record under ``prefix + RANGES_KEY``.

    With ``shard='parameters'`` nothing was gathered to serialize them
    (``synchronize()`` leaves them released while saving): a released
    slice is this rank's own piece.  A released parameter serialized under
    another key than its model's is fetched whole for it.
    """
    policy = policy_of(optimizer)
    if policy is None or not policy.save_shards:
        return
    params = _params(policy)
    released = getattr(policy, 'released', ())
    own = {}
    for bucket in policy.buckets:
        if bucket.index in released:
            master = policy.master[bucket.index]
            for piece in policy.pieces[bucket.index]:
                own[id(piece.info.param)] = master[
                    piece.at:piece.at + piece.hi - piece.lo]
    sliced = set()
    if policy.states_sharded or policy.loaded_ranges is not None:
        ranges = (policy.loaded_ranges if policy.loaded_ranges is not None
                  else current_ranges(policy))
        record = {}
        for name, (lo, hi) in sorted(ranges.items()):
            key = prefix + name.lstrip('/')
            param = params[name]
            if key not in data or data[key] is not param.array:
                continue   # not this model's array (a copy: left whole)
            if id(param) in own:
                part = own[id(param)]
            elif _is_placeholder(param.array):
                continue
            else:
                part = param.array.reshape(-1)[lo:hi]
            # A view, as the serializer keeps the other arrays: written
            # before the next update changes it.
            data[key] = _host.to_host(part)
            record[name] = {'lo': lo, 'hi': hi, 'shape': list(param.shape),
                            'keys': ['']}
            sliced.add(key)
        if record:
            data[prefix + RANGES_KEY] = numpy.array(
                json.dumps(record, sort_keys=True))
    held = {id(p.array): p for p in params.values()
            if _is_placeholder(p.array)}
    stray = [k for k, v in data.items() if k not in sliced and id(v) in held]
    if stray:
        whole = {k: held[id(data[k])] for k in stray}
        policy.materialize()
        for k, param in whole.items():
            data[k] = numpy.array(_host.to_host(param.array))


def _key(prefix, name, key):
    # '' names the parameter itself (a model's record), else a state.
    name = name.strip('/')
    return prefix + name if key == '' else '{}{}/{}'.format(prefix, name,
                                                           key)


def _checked_record(raw, where):
    """The ranges record read from a file, validated (untrusted)."""
    try:
        record = json.loads(str(numpy.asarray(raw)[()]))
    except (TypeError, ValueError) as e:
        raise ValueError('{}: {} is not a JSON text ({}); the file is not a '
                         'sharded snapshot of this library.'.format(
                             where, RANGES_KEY, e))
    ok = isinstance(record, dict)
    for name, entry in (record.items() if ok else ()):
        ok = (isinstance(name, str) and isinstance(entry, dict)
              and isinstance(entry.get('shape'), list)
              and all(isinstance(d, int) and d >= 0 for d in entry['shape'])
              and all(isinstance(entry.get(k), int) for k in ('lo', 'hi'))
              and isinstance(entry.get('keys'), list)
              and all(isinstance(k, str) and '/' not in k
                      for k in entry['keys']))
        if ok:
            size = int(numpy.prod(entry['shape']))
            ok = 0 <= entry['lo'] <= entry['hi'] <= size
        if not ok:
            break
    if not ok:
        raise ValueError('{}: {} does not describe shard ranges (a dict '
                         'of name -> lo, hi, shape, keys with 0 <= lo <= hi '
                         '<= size); the file is damaged or not a sharded '
                         'snapshot of this library.'.format(where,
                                                            RANGES_KEY))
    return record


def read_ranges(deserializer):
    """The ranges record of a sharded snapshot being loaded, or None (a
    snapshot of whole states)."""
    try:
        raw = deserializer(RANGES_KEY, None)
    except KeyError:
        return None
    if raw is None:
        return None
    return _checked_record(raw, getattr(deserializer, 'path', '') +
                           RANGES_KEY)


def reconcile(policy, loaded):
    """After a sharded snapshot was loaded, at a new layout (collective,
    no reduction in flight): keeps the slices if every rank's loaded
    ranges are the ranges the layout cuts, else makes every state whole
    again from the slices of all ranks (:func:`.state` cuts them anew).

    Raises:
        RuntimeError: the ranks' loaded ranges do not partition a
            parameter (files of another run or rank count were loaded).
    """
    if loaded is None:
        return
    label = 'the exchange of the loaded shard ranges'

    def wait(requests, what=label):
        policy.wait_requests(requests, what)
    current = current_ranges(policy)
    same = all(current.get(n) == tuple(r) for n, r in loaded.items())
    views = _mpi_json.allgather_json(
        policy.mpi_comm, [same, sorted((n, list(r))
                                       for n, r in loaded.items())],
        wait=wait)
    if all(v[0] for v in views):
        return
    names = [n for n, _ in views[0][1]]
    for r, (_, theirs) in enumerate(views):
        if [n for n, _ in theirs] != names:
            raise RuntimeError(
                'rank {} loaded shards of other parameters than rank 0; '
                'the ranks read files of different snapshots.'.format(r))
    params = _params(policy)
    for i, name in enumerate(names):
        param = params[name]
        bounds = [tuple(v[1][i][1]) for v in views]
        _gather_whole(policy, param, name, bounds, wait)


def _gather_whole(policy, param, name, bounds, wait):
    size = param.size
    covered = sorted(b for b in bounds if b[1] > b[0])
    at = 0
    for lo, hi in covered:
        if lo != at:
            break
        at = hi
    if at != size:
        raise RuntimeError(
            'the loaded shards of {} cover {} of its {} elements over the '
            'ranks: the files were written at another rank count or by '
            'another run. Load a sharded snapshot through '
            'chainermn_overlap.extensions.auto_snapshot (it reassembles '
            'shards written at another rank count), or consolidate it first '
            '(python -m chainermn_overlap.snapshot consolidate DIR).'.format(
                name, covered, size))
    counts = [hi - lo for lo, hi in bounds]
    displs = [lo for lo, _ in bounds]
    state = param.update_rule.state
    for key in sorted(k for k, v in state.items()
                      if isinstance(v, _arrays())):
        value = state[key]
        xp = chainer.backend.get_array_module(value)
        part = numpy.ascontiguousarray(_host.to_host(value)).reshape(-1)
        whole = numpy.empty(size, dtype=part.dtype)
        wait([policy.mpi_comm.Iallgatherv(part, [whole, (counts, displs)])],
             'the gather of the loaded shards of {!r} of {}'.format(key,
                                                                  name))
        state[key] = xp.asarray(whole).reshape(param.shape)


def assemble(data, files, prefixes=None):
    """``data`` (one rank's file, a dict) with whole states and parameters
    instead of slices, read from every rank's file.

    Args:
        data (dict): key -> array, from one rank's file (changed in place
            and returned).
        files (list): every rank's file of the snapshot, opened
            (``numpy.load``, lazy: one slice is read at a time), in rank
            order.
        prefixes (set): only the records under these prefixes (such as
            ``'updater/model:main/'``); None: every record.
    """
    suffix = '/' + RANGES_KEY
    for rkey in [k for k in data if k == RANGES_KEY or k.endswith(suffix)]:
        prefix = rkey[:-len(RANGES_KEY)]
        if prefixes is not None and prefix not in prefixes:
            continue
        records = []
        for r, f in enumerate(files):
            if rkey not in f.files:
                raise ValueError('rank {}\'s file has no {}: the files are '
                                 'of different snapshots.'.format(r, rkey))
            records.append(_checked_record(f[rkey], 'rank {}: {}'.format(
                r, rkey)))
        for name, entry in sorted(records[0].items()):
            shape = tuple(entry['shape'])
            size = int(numpy.prod(shape))
            for key in entry['keys']:
                full = _key(prefix, name, key)
                whole, at = None, 0
                parts = sorted((rec[name]['lo'], rec[name]['hi'], r)
                               for r, rec in enumerate(records)
                               if name in rec and
                               rec[name]['hi'] > rec[name]['lo'])
                for lo, hi, r in parts:
                    part = numpy.asarray(files[r][full]).reshape(-1)
                    if lo != at or part.size != hi - lo:
                        raise ValueError(
                            'the shards of {} in the files do not fit '
                            'together (rank {} holds [{}, {}) with {} '
                            'elements, {} were covered before).'.format(
                                full, r, lo, hi, part.size, at))
                    if whole is None:
                        whole = numpy.empty(size, dtype=part.dtype)
                    whole[lo:hi] = part
                    at = hi
                if at != size:
                    raise ValueError('the shards of {} cover {} of {} '
                                     'elements.'.format(full, at, size))
                data[full] = (whole if whole is not None else
                              numpy.empty(0, numpy.float32)).reshape(shape)
        del data[rkey]
    return data
