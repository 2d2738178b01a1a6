"""Trainer snapshots that never lose data, and exact resume.

:func:`auto_snapshot` is a Trainer extension for long runs under
``python -m chainermn_overlap.launch`` (which restarts a job that ended
abnormally)::

    trainer.extend(chainermn_overlap.extensions.auto_snapshot(
        comm, 'snapshots', trigger=(500, 'iteration'), keep=2))
    trainer.run()     # resumes by itself from the newest intact snapshot

What each rank saves.  Every rank writes the whole trainer state
(``trainer.serialize``: updater, iterators, optimizers, models, extensions,
triggers) plus its random states (NumPy's global ``RandomState`` and the
own ``RandomState`` of each iterator's order sampler, which Chainer's
serialization leaves out) to a file of its own.  Model and optimizer state
are replicated in data-parallel training, so rank 0's file alone holds them;
the iterators (each rank iterates its own share of a scattered dataset) and
the random states differ between ranks, so a per-rank file is the only way
to continue each rank's data order exactly.  The cost is ``size`` copies of
the replicated state on disk.

Layout, in ``directory`` (which every rank must see: a shared file system
on several nodes)::

    snapshot_iter_00001000/rank0.npz ... rank{size-1}.npz
    snapshot_iter_00001000/manifest.json   # written last: sha256 per file

Each file is written to a temporary name in the same folder, flushed and
fsync'ed, renamed, and the folder fsync'ed; the manifest (size, iteration,
sha256 and length of every rank's file) is written the same way, by rank 0,
only after every rank reported its file as durable.  A snapshot without a
manifest is incomplete (a rank died while writing); one whose files do not
match their checksums is corrupt.  Neither is ever loaded.

Resume (when the trainer starts, in ``initialize``): the ranks agree, by
collectives, on the newest snapshot that every rank finds complete and
intact; skipped ones are reported with a warning saying why; snapshots newer
than the chosen one are then removed (the run writes them again).  The
``keep`` newest complete snapshots are kept, older ones removed.

Resume on a different number of ranks (``launch --min-ranks``): every rank
loads rank 0's file except the iterators, so model parameters, optimizer
state (momentum, ``t``), the iteration count, extensions and triggers
continue; each rank's iterator starts over on its new share of the dataset
(epoch 0, a fresh order) and random states are not restored.  The global
batch (per-rank batch x ranks) changes with the number of ranks: scale the
per-rank batch or the learning rate yourself if that matters.  Use
iteration triggers (an epoch trigger counts from the restart then).

Which optimizers resume exactly (bit for bit, on CPU, the same rank count):
the overlapped optimizer (both ``wait`` modes; the first update after a
resume broadcasts without skipping its step) and ChainerMN's
``create_multi_node_optimizer`` (whose first update after a fresh start would
broadcast and *skip* its step; after a resume this extension tells it that
the parameters are already in place, so it does not).  The double-buffering
optimizer resumes consistently but not equal to an uninterrupted run: the
gradients in flight at the snapshot are not saved, and after a load it
restarts its pipeline (one broadcast step and one step that only posts), as
after ``setup()``.
"""
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from typing import Any

import numpy

from chainer import serializers
from chainer.training import extension as extension_module
from chainer.training import trigger as trigger_module

from chainermn_overlap import _mpi_json

__all__ = ['AutoSnapshot', 'SnapshotWarning', 'auto_snapshot',
           'RESTART_ENV', 'PROGRESS_ENV']

logger = logging.getLogger(__name__)

# Set by chainermn_overlap.launch for every rank of every attempt.
RESTART_ENV = 'CHAINERMN_OVERLAP_RESTART'
# A file the launcher reads after each attempt: one JSON line per event
# ('resumed', 'training', 'snapshot'), written by rank 0.
PROGRESS_ENV = 'CHAINERMN_OVERLAP_PROGRESS_FILE'

_FOLDER = 'snapshot_iter_{:08d}'
_FOLDER_RE = re.compile(r'^snapshot_iter_(\d{8,})$')
_MANIFEST = 'manifest.json'
_RANK_FILE = 'rank{}.npz'
_TMP_MARK = '.tmp.'
_EXTRA = 'auto_snapshot/'
_ITERATOR_PREFIX = 'updater/iterator:'


class SnapshotWarning(UserWarning):
    """A snapshot was skipped (incomplete or corrupt) or could not be used."""


# ----------------------------------------------------------------------------
# Durable files

def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path, chunk=1 << 20):
    h = hashlib.sha256()
    n = 0
    with open(path, 'rb') as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
            n += len(b)
    return h.hexdigest(), n


def _write_durably(path, write, before_rename=None):
    """Writes ``path`` through a temporary file in the same folder.

    ``write(f)`` fills the open binary file; then it is flushed, fsync'ed,
    renamed over ``path`` and the folder fsync'ed, so that after a crash
    ``path`` is either absent, its old content, or complete.  The temporary
    file is removed on error.
    """
    folder = os.path.dirname(path) or '.'
    tmp = '{}{}{}'.format(path, _TMP_MARK, os.getpid())
    try:
        with open(tmp, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ----------------------------------------------------------------------------
# Random states that Chainer's serialization leaves out

def _random_state_arrays(rs):
    name, keys, pos, has_gauss, gauss = rs.get_state()
    assert name == 'MT19937'
    return {'keys': numpy.asarray(keys, dtype=numpy.uint32),
            'misc': numpy.array([pos, has_gauss], dtype=numpy.int64),
            'gauss': numpy.array([gauss], dtype=numpy.float64)}


def _set_random_state(rs, arrays):
    pos, has_gauss = (int(v) for v in arrays['misc'])
    rs.set_state(('MT19937', numpy.asarray(arrays['keys'], numpy.uint32),
                  pos, has_gauss, float(arrays['gauss'][0])))


def _own_samplers(trainer):
    """Iterators' order samplers with a RandomState of their own."""
    global_rs = numpy.random.random.__self__
    out = {}
    iterators = getattr(trainer.updater, '_iterators', {}) or {}
    for name, it in sorted(iterators.items()):
        sampler = getattr(it, 'order_sampler', None)
        rs = getattr(sampler, '_random', None)
        if isinstance(rs, numpy.random.RandomState) and rs is not global_rs:
            out[name] = rs
    return out


def _random_states(trainer):
    states = {'numpy_global': numpy.random.random.__self__}
    for name, rs in _own_samplers(trainer).items():
        states['iterator:' + name] = rs
    return states


# ----------------------------------------------------------------------------
# The extension

class AutoSnapshot(extension_module.Extension):
    """Writes atomic, checksummed snapshots and resumes from them.

    Use :func:`auto_snapshot` to create it; see the module docstring.
    """

    priority = -100     # after every other extension of the iteration
    name = 'AutoSnapshot'

    def __init__(self, comm: Any, directory: str, trigger=(1000, 'iteration'),
                 keep: int = 2) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(
                'auto_snapshot: keep must be an integer >= 1 (how many '
                'complete snapshots to keep), got {!r}. Use keep=2 (the '
                'default) so that a snapshot lost while written still leaves '
                'one to resume from.'.format(keep))
        if not isinstance(directory, str) or not directory:
            raise ValueError('auto_snapshot: directory must be a non-empty '
                             'path, got {!r}.'.format(directory))
        self.comm = comm
        self.mpi_comm = getattr(comm, 'mpi_comm', comm)
        self.rank = self.mpi_comm.Get_rank()
        self.size = self.mpi_comm.Get_size()
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.trigger = _SnapshotTrigger(trigger_module.get_trigger(trigger))
        self.resumed_from = None    # iteration loaded in initialize, if any
        self.restart = int(os.environ.get(RESTART_ENV, '0') or 0)
        self._progress_path = os.environ.get(PROGRESS_ENV) or None

    # -- resume -----------------------------------------------------------

    def initialize(self, trainer):
        """Resumes every rank from the newest snapshot all ranks accept."""
        if self.rank == 0:
            os.makedirs(self.directory, exist_ok=True)
        self._barrier()
        listed = self._listing() if self.rank == 0 else None
        candidates = _mpi_json.bcast_json(self.mpi_comm, listed)
        chosen = None
        skipped = []
        for it in sorted(candidates, reverse=True):
            ok, why = self._check(it)
            verdicts = _mpi_json.allgather_json(self.mpi_comm, [ok, why])
            bad = [(r, w) for r, (o, w) in enumerate(verdicts) if not o]
            if not bad:
                chosen = it
                break
            skipped.append(it)
            if self.rank == 0:
                self._warn(
                    'auto_snapshot: skipping the snapshot of iteration {} in '
                    '{}: {}. It is never loaded; an older one is tried.'
                    .format(it, self.directory, '; '.join(
                        'rank {}: {}'.format(r, w) for r, w in bad)))
        if self.rank == 0:
            self._remove_newer_than(chosen)
            self._remove_temporaries()
        self._barrier()
        if chosen is None:
            if skipped:
                self._warn('auto_snapshot: no intact snapshot in {}; '
                           'training starts from the beginning.'.format(
                               self.directory))
            self.trigger.announce = self.restart > 0
            self._event('resumed', iteration=None)
            return
        ok, why = True, ''
        try:
            self._load(trainer, chosen)
        except Exception as e:  # reported on every rank below
            ok, why = False, '{}: {}'.format(type(e).__name__, e)
        verdicts = _mpi_json.allgather_json(self.mpi_comm, [ok, why])
        bad = [(r, w) for r, (o, w) in enumerate(verdicts) if not o]
        if bad:
            raise RuntimeError(
                'rank {}: auto_snapshot could not load the snapshot of '
                'iteration {} from {} ({}). Its checksums matched, so it was '
                'written by a different program (model, optimizer, '
                'iterators or extensions changed). Fix: resume with the '
                'program that wrote it, or move the snapshot folders away '
                'to start afresh.'.format(
                    self.rank, chosen, self.directory, '; '.join(
                        'rank {}: {}'.format(r, w) for r, w in bad)))
        self.resumed_from = chosen
        self.trigger.announce = True
        logger.info('rank %d: resumed from the snapshot of iteration %d in '
                    '%s', self.rank, chosen, self.directory)
        self._event('resumed', iteration=chosen)

    def _listing(self):
        out = []
        for entry in os.listdir(self.directory):
            m = _FOLDER_RE.match(entry)
            if m and os.path.isdir(os.path.join(self.directory, entry)):
                out.append(int(m.group(1)))
        return sorted(out)

    def _folder(self, iteration):
        return os.path.join(self.directory, _FOLDER.format(iteration))

    def _read_manifest(self, iteration):
        path = os.path.join(self._folder(iteration), _MANIFEST)
        with open(path, 'rb') as f:
            manifest = json.loads(f.read().decode('utf-8'))
        if (manifest.get('iteration') != iteration
                or not isinstance(manifest.get('files'), list)
                or len(manifest['files']) != manifest.get('size')):
            raise ValueError('inconsistent manifest')
        return manifest

    def _source_rank(self, manifest):
        return self.rank if manifest['size'] == self.size else 0

    def _check(self, iteration):
        """(ok, why) for the file this rank would load from ``iteration``."""
        try:
            manifest = self._read_manifest(iteration)
        except FileNotFoundError:
            return False, 'incomplete (no manifest: a rank ended while ' \
                'writing it)'
        except (OSError, ValueError, UnicodeDecodeError) as e:
            return False, 'unreadable manifest ({})'.format(e)
        src = self._source_rank(manifest)
        entry = manifest['files'][src]
        path = os.path.join(self._folder(iteration), entry['name'])
        try:
            digest, n = _sha256(path)
        except OSError as e:
            return False, 'cannot read {} ({})'.format(entry['name'], e)
        if n != entry['bytes'] or digest != entry['sha256']:
            return False, ('corrupt: {} has {} bytes and sha256 {}..., the '
                           'manifest says {} bytes and {}...'.format(
                               entry['name'], n, digest[:12], entry['bytes'],
                               entry['sha256'][:12]))
        return True, ''

    def _load(self, trainer, iteration):
        manifest = self._read_manifest(iteration)
        src = self._source_rank(manifest)
        same_size = manifest['size'] == self.size
        path = os.path.join(self._folder(iteration),
                            manifest['files'][src]['name'])
        with numpy.load(path, allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
        ignore = None
        if not same_size:
            def ignore(key):
                return key.startswith(_ITERATOR_PREFIX)
            if self.rank == 0:
                self._warn(
                    'auto_snapshot: resuming the snapshot of iteration {} '
                    'written by {} ranks on {}: model, optimizer state and '
                    'the iteration count continue; the iterators start over '
                    'on the new shares of the dataset and the global batch '
                    'changes from {} to {} times the per-rank batch.'.format(
                        iteration, manifest['size'], self.size,
                        manifest['size'], self.size))
        deserializer = serializers.NpzDeserializer(
            data, strict=True, ignore_names=ignore)
        trainer.serialize(deserializer)
        if same_size:
            for key, rs in _random_states(trainer).items():
                prefix = '{}random/{}/'.format(_EXTRA, key)
                if prefix + 'keys' in data:
                    _set_random_state(rs, {
                        k: data[prefix + k] for k in ('keys', 'misc',
                                                      'gauss')})
        for opt in trainer.updater.get_all_optimizers().values():
            _mark_resumed(opt)

    # -- write --------------------------------------------------------------

    def __call__(self, trainer):
        if self.trigger.announce_now:
            self.trigger.announce_now = False
            self._event('training', iteration=trainer.updater.iteration)
        consulted = self.trigger.consulted == trainer.updater.iteration
        if consulted and not self.trigger.fired:
            return
        # (A trigger given to trainer.extend instead of auto_snapshot fired.)
        self.trigger.fired = False
        self.write(trainer)

    def write(self, trainer) -> None:
        """Writes the snapshot of the current iteration (collective)."""
        iteration = int(trainer.updater.iteration)
        folder = self._folder(iteration)
        # A snapshot of this iteration left by an earlier attempt (corrupt,
        # or partial) must not mix with the new files.
        if self.rank == 0 and os.path.exists(folder):
            self._remove(iteration)
        self._barrier()
        data = {}
        trainer.serialize(serializers.DictionarySerializer(data))
        for key, rs in _random_states(trainer).items():
            for k, v in _random_state_arrays(rs).items():
                data['{}random/{}/{}'.format(_EXTRA, key, k)] = v
        data[_EXTRA + 'size'] = numpy.array(self.size)
        data[_EXTRA + 'rank'] = numpy.array(self.rank)
        name = _RANK_FILE.format(self.rank)
        path = os.path.join(folder, name)
        result = {'ok': True}
        try:
            os.makedirs(folder, exist_ok=True)
            _write_durably(path, lambda f: numpy.savez(f, **data),
                           before_rename=lambda: self._fault_point(
                               'rank_file_written', iteration))
            digest, n = _sha256(path)
            result.update(name=name, sha256=digest, bytes=n)
        except OSError as e:
            result = {'ok': False, 'error': '{}: {}'.format(
                type(e).__name__, e), 'enospc': e.errno == errno.ENOSPC}
        results = _mpi_json.allgather_json(self.mpi_comm, result)
        # The same on every rank: whether rank 0 writes the manifest.
        if all(r['ok'] for r in results):
            if self.rank == 0:
                results[0] = self._write_manifest(iteration, folder, results)
            # Rank 0's verdict on the manifest, to every rank.
            results[0] = _mpi_json.bcast_json(self.mpi_comm, results[0])
        if not all(r['ok'] for r in results):
            self._fail(iteration, results)
        if self.rank == 0:
            self._prune()
            self._event('snapshot', iteration=iteration)
        logger.debug('rank %d: snapshot of iteration %d written', self.rank,
                     iteration)

    def _write_manifest(self, iteration, folder, results):
        self._fault_point('files_written', iteration)
        manifest = {'iteration': iteration, 'size': self.size,
                    'time': time.time(),
                    'files': [{k: r[k] for k in ('name', 'sha256', 'bytes')}
                              for r in results]}
        try:
            _write_durably(
                os.path.join(folder, _MANIFEST),
                lambda f: f.write(json.dumps(manifest, indent=1)
                                  .encode('utf-8')))
        except OSError as e:
            return {'ok': False, 'error': '{}: {} (writing the manifest)'
                    .format(type(e).__name__, e),
                    'enospc': e.errno == errno.ENOSPC}
        return results[0]

    def _fail(self, iteration, results):
        try:
            os.unlink(os.path.join(self._folder(iteration),
                                   _RANK_FILE.format(self.rank)))
        except OSError:
            pass
        self._barrier()
        if self.rank == 0:
            try:
                self._remove(iteration)
            except OSError:
                pass
        previous = [it for it in self._complete_listing() if it < iteration]
        kept = ('the previous snapshot (iteration {}) is intact and a '
                'restart resumes from it'.format(previous[-1]) if previous
                else 'there is no earlier snapshot')
        full = any(r.get('enospc') for r in results)
        fix = ('Free space on that file system, lower keep= (now {}), or '
               'point auto_snapshot at a larger one.'.format(self.keep)
               if full else 'Check that the directory is writable and '
               'shared by all ranks.')
        raise RuntimeError(
            'rank {}: auto_snapshot could not write the snapshot of '
            'iteration {} to {}: {}. Nothing of it is kept; {}. {}'.format(
                self.rank, iteration, self.directory, '; '.join(
                    'rank {}: {}'.format(r, res['error'])
                    for r, res in enumerate(results) if not res['ok']),
                kept, fix))

    def _fault_point(self, stage, iteration):
        """Does nothing; tests replace it to end a rank mid-snapshot."""

    # -- housekeeping (rank 0) ---------------------------------------------

    def _complete_listing(self):
        try:
            return [it for it in self._listing() if os.path.exists(
                os.path.join(self._folder(it), _MANIFEST))]
        except OSError:
            return []

    def _remove(self, iteration):
        folder = self._folder(iteration)
        # The manifest first: a half-removed snapshot must look incomplete.
        try:
            os.unlink(os.path.join(folder, _MANIFEST))
            _fsync_dir(folder)
        except FileNotFoundError:
            pass
        shutil.rmtree(folder, ignore_errors=True)

    def _prune(self):
        complete = self._complete_listing()
        if len(complete) <= self.keep:
            oldest_kept = complete[0] if complete else None
        else:
            oldest_kept = complete[-self.keep]
        if oldest_kept is None:
            return
        for it in self._listing():
            if it < oldest_kept:
                self._remove(it)

    def _remove_newer_than(self, chosen):
        for it in self._listing():
            if chosen is None or it > chosen:
                self._remove(it)

    def _remove_temporaries(self):
        for it in self._listing():
            folder = self._folder(it)
            for entry in os.listdir(folder):
                if _TMP_MARK in entry:
                    try:
                        os.unlink(os.path.join(folder, entry))
                    except OSError:
                        pass

    # -- helpers -------------------------------------------------------------

    def _barrier(self):
        self.mpi_comm.Barrier()

    def _warn(self, message):
        warnings.warn(message, SnapshotWarning, stacklevel=2)

    def _event(self, event, **fields):
        if self.rank != 0 or self._progress_path is None:
            return
        line = json.dumps(dict(fields, event=event, attempt=self.restart,
                               size=self.size, time=time.time()))
        try:
            with open(self._progress_path, 'a') as f:
                f.write(line + '\n')
        except OSError as e:
            logger.warning('auto_snapshot: cannot write the progress file %s '
                           '(%s); the launcher cannot tell progress.',
                           self._progress_path, e)

    def serialize(self, serializer):
        # Nothing of its own: what it saves is the trainer.
        pass


class _SnapshotTrigger(object):
    """The snapshot interval, plus one call right after the first update of
    an attempt (to report "training again")."""

    def __init__(self, inner):
        self.inner = inner
        self.fired = False
        self.announce = False
        self.announce_now = False
        self.consulted = None

    def __call__(self, trainer):
        self.consulted = trainer.updater.iteration
        self.fired = bool(self.inner(trainer))
        if self.announce:
            self.announce = False
            self.announce_now = True
        return self.fired or self.announce_now

    def serialize(self, serializer):
        if hasattr(self.inner, 'serialize'):
            self.inner.serialize(serializer)


def _mark_resumed(opt):
    """Tells an optimizer that every rank loaded the same parameters."""
    try:
        from chainermn.optimizers import _MultiNodeOptimizer
    except ImportError:  # chainermn without this class
        return
    if isinstance(opt, _MultiNodeOptimizer):
        # Its first update after a fresh start compares the parameter set
        # with an empty one, broadcasts and skips the step; after a resume
        # on every rank the parameters are already equal everywhere, and an
        # uninterrupted run would not skip that step.
        object.__setattr__(opt, 'target_params', [
            (name, param.data is not None)
            for name, param in sorted(opt.target.namedparams())])


def auto_snapshot(comm: Any, directory: str, trigger=(1000, 'iteration'),
                  keep: int = 2) -> AutoSnapshot:
    """A Trainer extension: durable snapshots and automatic exact resume.

    Every ``trigger`` (an interval such as ``(500, 'iteration')``), all
    ranks write the trainer's state atomically, each to its own file, with
    a checksum manifest written last; when the trainer starts, all ranks
    resume from the newest snapshot they all find complete and intact
    (skipping, with a :class:`SnapshotWarning`, partial or corrupt ones);
    the ``keep`` newest complete snapshots are kept.  Collective: add it on
    every rank.  See the module docstring for what is saved and what
    changes when resuming on a different number of ranks.

    Args:
        comm: a ChainerMN communicator (or an mpi4py communicator).
        directory (str): folder for the snapshots, seen by every rank.
        trigger: when to write (anything ``chainer.training.get_trigger``
            accepts).
        keep (int): complete snapshots to keep (>= 1).

    Returns:
        AutoSnapshot: the extension; add it with ``trainer.extend``.
    """
    return AutoSnapshot(comm, directory, trigger=trigger, keep=keep)
