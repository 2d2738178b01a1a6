"""Snapshots written by some ranks only: an error on every rank, not a hang.

Saving a sharded optimizer gathers its update-rule states from every rank
(:func:`.state.consolidate`), a collective.  A snapshot scheme in which one
rank writes for several -- ChainerMN's ``multi_node_snapshot``, where only
the lowest rank of each replica set serializes (with ``replica_sets=[]``,
rank 0 alone) -- would leave that rank waiting for ranks that never join,
and the others, gone on, waiting in ChainerMN's own unbounded calls (its
autoload's ``recv_obj``, the next communicator's set-up).  So the refusal
must come on every rank, at the same point, with no communication:

* :func:`check_extension` runs first in the extension's ``initialize`` and
  ``__call__``, which every rank calls (the trainer calls both on every
  rank; only inside them does the extension pick its writers).  Whether it
  refuses is a pure function of what every rank holds alike: the replica
  sets (recorded when the extension is made, as ChainerMN keeps only this
  rank's set) and whether the snapshot's target holds a sharded optimizer
  (:func:`register`).  So every rank raises the same error before any rank
  serializes, loads or sends.  The methods are wrapped while a sharded
  optimizer exists (:mod:`chainermn_overlap._patches` installs the wrappers
  of :func:`patches` when the first is made and removes them when the last
  is closed); the wrappers cost a few attribute reads.
* :func:`check_every_rank_writes`, when the states are saved: the call
  comes from within such an extension that the first check could not
  see (ChainerMN's layout changed).  Only the writing rank knows; the
  others are bounded by their watchdog.

Anything else that serializes on some ranks only (``if comm.rank == 0:
save_npz(path, optimizer)``) is caught by the gather's own limit: it waits
at most the optimizer's timeout and raises
:class:`~chainermn_overlap.CommunicationTimeout`.
"""
import functools
import sys
import weakref

from chainermn_overlap import _patches

__all__ = ['FIX', 'check_every_rank_writes', 'check_extension', 'patches',
           'register', 'unregister']

FIX = ('Use chainermn_overlap.extensions.auto_snapshot(comm, directory, '
       'trigger=...) instead (every rank writes its own file, atomically, '
       'and it resumes at any rank count), or give multi_node_snapshot '
       'replica_sets=[[r] for r in range(comm.size)] (every rank '
       'serializes), or use shard=None.')

_EXTENSION_FRAMES = ('__call__', 'initialize', 'on_error')

# The actual optimizers of sharded optimizers.
_SHARDED = weakref.WeakSet()
# multi_node_snapshot extension -> its replica sets (sorted lists).
_SETS = weakref.WeakKeyDictionary()
_GROUP = 'multi_node_snapshot'


def _multi_node_snapshot_module():
    try:
        from chainermn.extensions import _multi_node_snapshot
    except ImportError:   # another ChainerMN layout: nothing to recognise
        return None
    if not hasattr(_multi_node_snapshot, '_MultiNodeSnapshot'):
        return None
    return _multi_node_snapshot


def _multi_node_snapshot_class():
    module = _multi_node_snapshot_module()
    return None if module is None else module._MultiNodeSnapshot


def register(actual):
    """Marks ``actual`` as the actual optimizer of a sharded optimizer, and
    makes ``multi_node_snapshot`` check for it (:func:`check_extension`).

    Args:
        actual: the wrapped (actual) optimizer.
    """
    _SHARDED.add(actual)
    _patches.acquire(_GROUP, actual)


def unregister(actual):
    """The sharded optimizer of ``actual`` is closed."""
    _SHARDED.discard(actual)
    _patches.release(_GROUP, actual)


def _wrap_init(fn, module):
    @functools.wraps(fn)
    def __init__(self, comm, snapshot, replica_sets):
        # Read twice (by ChainerMN and here): a generator would be empty
        # the second time.
        replica_sets = [s if isinstance(s, int) else list(s)
                        for s in replica_sets]
        fn(self, comm, snapshot, replica_sets)
        _SETS[self] = [sorted(s) for s in module._parse_replica_sets(
            replica_sets, comm.size)]
    return __init__


def _wrap_entry(fn):
    @functools.wraps(fn)
    def wrapper(self, trainer):
        check_extension(self, trainer)
        return fn(self, trainer)
    return wrapper


def patches():
    """``(class, name, replacement factory)`` for ChainerMN's
    ``multi_node_snapshot`` extension; empty where it is not found."""
    module = _multi_node_snapshot_module()
    if module is None:
        return []
    cls = module._MultiNodeSnapshot
    return [(cls, '__init__', lambda fn: _wrap_init(fn, module)),
            (cls, 'initialize', _wrap_entry),
            (cls, '__call__', _wrap_entry)]


def _one_writer(ext):
    """Whether some rank of ``ext`` (a multi_node_snapshot) writes for
    others.  From the sets recorded, the same on every rank; for an
    extension made before them, from this rank's set alone."""
    sets = _SETS.get(ext)
    if sets is None:
        return len(getattr(ext, 'replica_set', ())) > 1
    return any(len(s) > 1 for s in sets)


def _message(rank, where, ext):
    sets = _SETS.get(ext)
    return ('rank {}: {} chainermn.extensions.multi_node_snapshot, which '
            'serializes on the lowest rank of each replica set only ({}'
            "this rank's set: {}). Saving an optimizer with shard= gathers "
            'its state from every rank, so the writing rank would wait for '
            'ranks that never join, and the job would hang. {}'.format(
                rank, where,
                '' if sets is None else 'replica sets: {}; '.format(sets),
                sorted(getattr(ext, 'replica_set', ())), FIX))


def _serialized_optimizers(snapshot, trainer):
    """The optimizers a snapshot (the wrapped extension) serializes, as far
    as can be seen: its target's, or the trainer's updater's."""
    from chainer import training
    target = getattr(snapshot, '_target', None)
    if target is None:
        if not hasattr(snapshot, '_target'):
            return []   # not Chainer's snapshot: the save-time check sees it
        target = trainer
    if isinstance(target, training.Trainer):
        target = target.updater
    if isinstance(target, training.Updater):
        get_all = getattr(target, 'get_all_optimizers', None)
        return [] if get_all is None else list(get_all().values())
    return [target]


def check_extension(ext, trainer):
    """Raises ``RuntimeError`` if ``ext`` (a ``multi_node_snapshot``) has a
    rank write for others and its snapshot holds a sharded optimizer.

    Called first in ``ext.initialize`` and ``ext.__call__`` on every rank;
    the answer is the same on every rank (see the module docstring).

    Args:
        ext: the ``multi_node_snapshot`` extension.
        trainer: the trainer passed to it.
    """
    if not _one_writer(ext):
        return
    for opt in _serialized_optimizers(ext.snapshot, trainer):
        if getattr(opt, 'actual_optimizer', None) in _SHARDED:
            raise RuntimeError(_message(
                ext.comm.rank, 'a snapshot of the sharded optimizer is '
                'taken by', ext))


def _frames_self(names):
    """``self`` of the calling frames whose function is in ``names``."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in names:
            obj = frame.f_locals.get('self')
            if obj is not None:
                yield obj
        frame = frame.f_back


def check_every_rank_writes(rank):
    """Raises ``RuntimeError`` if called from within a one-writer
    ``multi_node_snapshot`` (see the module docstring).

    Args:
        rank (int): for the message.
    """
    cls = _multi_node_snapshot_class()
    if cls is None:
        return
    for obj in _frames_self(_EXTENSION_FRAMES):
        if isinstance(obj, cls) and _one_writer(obj):
            raise RuntimeError(_message(
                rank, 'the sharded optimizer is serialized from within', obj))
