"""Snapshots written by some ranks only: an error at once, not a hang.

Saving a sharded optimizer gathers its update-rule states from every rank
(:func:`.state.consolidate`), a collective.  A snapshot scheme in which one
rank writes for several -- ChainerMN's ``multi_node_snapshot``, where only
the lowest rank of each replica set serializes (with ``replica_sets=[]``,
rank 0 alone) -- would leave that rank waiting for ranks that never join.
Where such a scheme can be seen, these checks raise an error that says what
to use instead:

* :func:`check_trainer`, at the first update of every layout, on every
  rank: the trainer running the update (found on the call stack) has a
  ``multi_node_snapshot`` whose snapshot holds this optimizer and whose
  replica sets are not all single ranks.  Every rank raises at the same
  point, before any snapshot is due.
* :func:`check_every_rank_writes`, when the states are saved: the call
  comes from within such an extension (an extension added after the first
  update, a target the first check could not see).  Only the writing rank
  knows; the others are bounded by their watchdog.

Anything else that serializes on some ranks only (``if comm.rank == 0:
save_npz(path, optimizer)``) is caught by the gather's own limit: it waits
at most the optimizer's timeout and raises
:class:`~chainermn_overlap.CommunicationTimeout`.

Frames are searched by function name first (``run``, ``__call__``,
``initialize``, ``on_error``), so the checks cost a few attribute reads.
"""
import sys

__all__ = ['FIX', 'check_every_rank_writes', 'check_trainer']

FIX = ('Use chainermn_overlap.extensions.auto_snapshot(comm, directory, '
       'trigger=...) instead (every rank writes its own file, atomically, '
       'and it resumes at any rank count), or give multi_node_snapshot '
       'replica_sets=[[r] for r in range(comm.size)] (every rank '
       'serializes), or use shard=None.')

_EXTENSION_FRAMES = ('__call__', 'initialize', 'on_error')


def _multi_node_snapshot_class():
    try:
        from chainermn.extensions import _multi_node_snapshot
    except ImportError:   # another ChainerMN layout: nothing to recognise
        return None
    return getattr(_multi_node_snapshot, '_MultiNodeSnapshot', None)


def _frames_self(names):
    """``self`` of the calling frames whose function is in ``names``."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in names:
            obj = frame.f_locals.get('self')
            if obj is not None:
                yield obj
        frame = frame.f_back


def _one_writer(ext):
    """Whether ``ext`` (a multi_node_snapshot) writes for several ranks."""
    return len(getattr(ext, 'replica_set', ())) > 1


def _message(rank, where, ext):
    return ('rank {}: {} chainermn.extensions.multi_node_snapshot, which '
            'serializes on the lowest rank of each replica set only (this '
            "rank's set: {}). Saving an optimizer with shard= gathers its "
            'state from every rank, so the writing rank would wait for ranks '
            'that never join, and the job would hang. {}'.format(
                rank, where, sorted(getattr(ext, 'replica_set', ())), FIX))


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


def _holds(snapshot, trainer, actual):
    """Whether ``snapshot`` (the wrapped extension) serializes ``actual``."""
    if not hasattr(snapshot, '_target'):
        return False    # not Chainer's snapshot: the save-time check sees it
    target = snapshot._target
    if target is None:
        updater = getattr(trainer, 'updater', None)
        get_all = getattr(updater, 'get_all_optimizers', None)
        if get_all is None:
            return True
        return any(getattr(o, 'actual_optimizer', o) is actual
                   for o in get_all().values())
    return getattr(target, 'actual_optimizer', target) is actual


def check_trainer(actual, rank):
    """Raises ``RuntimeError`` if the trainer running this update has a
    one-writer ``multi_node_snapshot`` of this optimizer.

    Args:
        actual: the wrapped (actual) optimizer.
        rank (int): for the message.
    """
    cls = _multi_node_snapshot_class()
    if cls is None:
        return
    from chainer import training
    for obj in _frames_self(('run',)):
        if not isinstance(obj, training.Trainer):
            continue
        for name, entry in getattr(obj, '_extensions', {}).items():
            ext = entry.extension
            if (isinstance(ext, cls) and _one_writer(ext)
                    and _holds(ext.snapshot, obj, actual)):
                raise RuntimeError(_message(
                    rank, 'the trainer has (as extension {!r})'.format(name),
                    ext))
        return
