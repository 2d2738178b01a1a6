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
the replicated state on disk, except for a sharded optimizer's (``shard=``):
each rank writes only its slices of the update-rule states and of the
model's parameters (the same ranges), with their ranges, and nothing is
gathered (:mod:`chainermn_overlap.optimizers.sharding.shards`): one copy
of both.  The parameters are rebuilt whole from every rank's file at any
rank count; the states too at another rank count, or into an optimizer
without ``shard=``.

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

Resume on a different number of ranks (fewer after a lost rank or host,
more when a host comes back: ``launch --min-ranks``, ``--min-hosts``,
``--host-discovery``): every rank
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

Stopping at a snapshot when asked.  Under the launcher
(``CHAINERMN_OVERLAP_RESTART`` set) the extension takes ``SIGUSR1`` (where
nothing else has) as a request to stop at the next snapshot: that snapshot
is written as usual, the ranks agree collectively that one of them was
asked, the optimizers are synchronized and closed, and every rank ends
with ``SystemExit(75)`` (the code after ``trainer.run()`` does not run).
The launcher sends it when ``--host-discovery`` reports other usable hosts,
and restarts the job on them from that snapshot; only to a job whose every
rank took the signal (the extension made on the main thread, no handler of
the program's own), as its ``resumed`` event says (``resize``).
"""
import errno
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any

import numpy

from chainer import serializers
from chainer.training import extension as extension_module
from chainer.training import trigger as trigger_module

from chainermn_overlap import config
from chainermn_overlap.extensions import _store
from chainermn_overlap.extensions._timed import TimedCollectives
from chainermn_overlap.optimizers.sharding import shards
from chainermn_overlap.extensions._store import (
    RANK_FILE, random_state_arrays, random_states, set_random_state,
    write_durably)

__all__ = ['AutoSnapshot', 'SnapshotWarning', 'auto_snapshot',
           'PROGRESS_TAG']

logger = logging.getLogger(__name__)

# Rank 0 reports events ('resumed', 'training', 'snapshot', 'stopping')
# for the launcher, one JSON line each, where config.progress_file() says:
# a file, or '-' for standard output, as a line that starts with
# PROGRESS_TAG (the launcher reads it from mpiexec's output on whichever
# host rank 0 runs, and does not show it).
PROGRESS_TAG = 'chainermn_overlap.progress: '
# Exit status of every rank after a stop at a snapshot that was asked for.
STOP_EXIT = 75

_EXTRA = 'auto_snapshot/'
_ITERATOR_PREFIX = 'updater/iterator:'


class SnapshotWarning(UserWarning):
    """A snapshot was skipped (incomplete or corrupt) or could not be used."""


def _needs_whole(data, trainer, same_size):
    """The prefixes under which ``data`` holds slices (a sharded snapshot)
    that this job cannot read as they are: the model parameters (always:
    each element was written by one rank), and the optimizer states at
    another rank count or into an optimizer that is not sharded now."""
    prefixes = {k[:-len(shards.RANGES_KEY)] for k in data
                if k.endswith('/' + shards.RANGES_KEY)}
    if not same_size:
        return prefixes
    sharded = {'updater/optimizer:{}/'.format(name)
               for name, opt in trainer.updater.get_all_optimizers().items()
               if shards.policy_of(opt) is not None}
    return prefixes - sharded


def _assemble(data, paths, prefixes):
    files = [numpy.load(p, allow_pickle=False) for p in paths]
    try:
        shards.assemble(data, files, prefixes)
    finally:
        for f in files:
            f.close()


# ----------------------------------------------------------------------------
# The extension

class AutoSnapshot(extension_module.Extension):
    """Writes atomic, checksummed snapshots and resumes from them.

    Use :func:`auto_snapshot` to create it; see the module docstring.
    """

    priority = -100     # after every other extension of the iteration
    name = 'AutoSnapshot'

    def __init__(self, comm: Any, directory: str, trigger=(1000, 'iteration'),
                 keep: int = 2, timeout=None) -> None:
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
        # The optimizer's watchdog limit for the snapshot's collectives.
        self.coll = TimedCollectives(self.mpi_comm,
                                     config.resolve_timeout(timeout))
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.store = _store.SnapshotStore(self.directory, keep)
        self.trigger = _SnapshotTrigger(trigger_module.get_trigger(trigger))
        self.resumed_from = None    # iteration loaded in initialize, if any
        # The launcher's attempt (None: not under the launcher).
        attempt = config.launcher_attempt()
        self.restart = attempt or 0
        self._progress_path = config.progress_file()
        # Under the launcher, a stop at the next snapshot may be asked for
        # with SIGUSR1: where every rank took the signal (initialize agrees;
        # a rank without the handler would die of it).
        self.stoppable = False
        self.stop_requested = False
        self._took_signal = (attempt is not None
                             and self._take_stop_signal())

    # -- resume -----------------------------------------------------------

    def initialize(self, trainer):
        """Resumes every rank from the newest snapshot all ranks accept."""
        if self.rank == 0:
            os.makedirs(self.directory, exist_ok=True)
        self._barrier('the start of the resume')
        if config.launcher_attempt() is not None:
            self.stoppable = all(self.coll.allgather_json(
                bool(self._took_signal), "every rank's handler of SIGUSR1"))
        listed = self.store.listing() if self.rank == 0 else None
        candidates = self.coll.bcast_json(
            listed, "rank 0's list of snapshots")
        chosen = None
        skipped = []
        for it in sorted(candidates, reverse=True):
            ok, why = self.store.check(it, self._checked_ranks)
            verdicts = self.coll.allgather_json(
                [ok, why], "every rank's check of the snapshot of iteration "
                '{}'.format(it))
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
            self.store.remove_newer_than(chosen)
            self.store.remove_temporaries()
        self._barrier('the clean-up before the resume')
        if chosen is None:
            if skipped:
                self._warn('auto_snapshot: no intact snapshot in {}; '
                           'training starts from the beginning.'.format(
                               self.directory))
            self.trigger.announce = self.restart > 0
            self._event('resumed', iteration=None, resize=self.stoppable)
            return
        ok, why = True, ''
        try:
            self._load(trainer, chosen)
        except Exception as e:  # reported on every rank below
            ok, why = False, '{}: {}'.format(type(e).__name__, e)
        verdicts = self.coll.allgather_json(
            [ok, why], "every rank's load of the snapshot of iteration "
            '{}'.format(chosen))
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
        self._event('resumed', iteration=chosen, resize=self.stoppable)

    def _checked_ranks(self, manifest):
        # The file loaded; at another rank count a sharded snapshot is
        # read from every file: each rank checks its share of them.
        ranks = [self._source_rank(manifest)]
        if manifest['size'] != self.size and manifest.get('sharded'):
            ranks += [r for r in range(1, manifest['size'])
                      if r % self.size == self.rank]
        return ranks

    def _source_rank(self, manifest):
        return self.rank if manifest['size'] == self.size else 0

    def _load(self, trainer, iteration):
        manifest = self.store.read_manifest(iteration)
        src = self._source_rank(manifest)
        same_size = manifest['size'] == self.size
        folder = self.store.folder(iteration)
        path = os.path.join(folder, manifest['files'][src]['name'])
        with numpy.load(path, allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
        prefixes = _needs_whole(data, trainer, same_size)
        if prefixes:
            # Slices of the parameters, and of sharded optimizers' states
            # for another rank count or an optimizer that is not sharded:
            # whole arrays from every file.
            _assemble(data, [os.path.join(folder, f['name'])
                             for f in manifest['files']], prefixes)
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
            for key, rs in random_states(trainer).items():
                prefix = '{}random/{}/'.format(_EXTRA, key)
                if prefix + 'keys' in data:
                    set_random_state(rs, {
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
        folder = self.store.folder(iteration)
        # A snapshot of this iteration left by an earlier attempt (corrupt,
        # or partial) must not mix with the new files.
        if self.rank == 0 and os.path.exists(folder):
            self.store.remove(iteration)
        self._barrier('the start of the snapshot of iteration {}'
                      .format(iteration))
        data = {}
        # A sharded optimizer writes its own slices (no gathering).
        optimizers = trainer.updater.get_all_optimizers()
        with shards.saving(optimizers.values()):
            trainer.serialize(serializers.DictionarySerializer(data))
            # Each parameter slice once, by the rank that owns it.
            for opt_name, opt in optimizers.items():
                shards.write_params(opt, data,
                                    'updater/model:{}/'.format(opt_name))
        for key, rs in random_states(trainer).items():
            for k, v in random_state_arrays(rs).items():
                data['{}random/{}/{}'.format(_EXTRA, key, k)] = v
        data[_EXTRA + 'size'] = numpy.array(self.size)
        data[_EXTRA + 'rank'] = numpy.array(self.rank)
        name = RANK_FILE.format(self.rank)
        path = os.path.join(folder, name)
        result = {'ok': True}
        try:
            os.makedirs(folder, exist_ok=True)
            write_durably(path, lambda f: _store.savez(f, data),
                          before_rename=lambda: self._fault_point(
                              'rank_file_written', iteration))
            digest, n = _store.sha256(path)
            result.update(name=name, sha256=digest, bytes=n,
                          sharded=any(k.endswith('/' + shards.RANGES_KEY)
                                      for k in data))
        except OSError as e:
            result = {'ok': False, 'error': '{}: {}'.format(
                type(e).__name__, e), 'enospc': e.errno == errno.ENOSPC}
        results = self.coll.allgather_json(
            result, "every rank's file of the snapshot of iteration {}"
            .format(iteration))
        # The same on every rank: whether rank 0 writes the manifest.
        if all(r['ok'] for r in results):
            if self.rank == 0:
                results[0] = self._write_manifest(iteration, results)
            # Rank 0's verdict on the manifest, to every rank.
            results[0] = self.coll.bcast_json(
                results[0], "rank 0's manifest of the snapshot of iteration "
                '{}'.format(iteration))
        if not all(r['ok'] for r in results):
            self._fail(iteration, results)
        if self.rank == 0:
            self.store.prune()
            self._event('snapshot', iteration=iteration)
        logger.debug('rank %d: snapshot of iteration %d written', self.rank,
                     iteration)
        if self.stoppable:
            self._stop_if_asked(trainer, iteration)

    # -- stop when asked ------------------------------------------------------

    def _take_stop_signal(self):
        """Installs the SIGUSR1 handler; False where it cannot (not the
        main thread) or must not (the program's own handler stays)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return False

        def handler(signum, frame):
            self.stop_requested = True
        signal.signal(signal.SIGUSR1, handler)
        return True

    def _stop_if_asked(self, trainer, iteration):
        # Collective: the signal reaches the ranks at different moments.
        asked = self.coll.allgather_json(
            self.stop_requested, 'the agreement to stop at the snapshot of '
            'iteration {}'.format(iteration))
        if not any(asked):
            return
        logger.info('rank %d: stopping at the snapshot of iteration %d, as '
                    'asked', self.rank, iteration)
        self._event('stopping', iteration=iteration)
        for opt in trainer.updater.get_all_optimizers().values():
            for name in ('synchronize', 'close'):
                if callable(getattr(opt, name, None)):
                    getattr(opt, name)()
        raise SystemExit(STOP_EXIT)

    def _write_manifest(self, iteration, results):
        self._fault_point('files_written', iteration)
        try:
            self.store.write_manifest(iteration, self.size, results)
        except OSError as e:
            return {'ok': False, 'error': '{}: {} (writing the manifest)'
                    .format(type(e).__name__, e),
                    'enospc': e.errno == errno.ENOSPC}
        return results[0]

    def _fail(self, iteration, results):
        try:
            os.unlink(os.path.join(self.store.folder(iteration),
                                   RANK_FILE.format(self.rank)))
        except OSError:
            pass
        self._barrier('the clean-up of the failed snapshot of iteration '
                      '{}'.format(iteration))
        if self.rank == 0:
            try:
                self.store.remove(iteration)
            except OSError:
                pass
        previous = [it for it in self.store.complete_listing()
                    if it < iteration]
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

    # -- helpers -------------------------------------------------------------

    def _barrier(self, what):
        self.coll.barrier(what)

    def _warn(self, message):
        warnings.warn(message, SnapshotWarning, stacklevel=2)

    def _event(self, event, **fields):
        if self.rank != 0 or self._progress_path is None:
            return
        line = json.dumps(dict(fields, event=event, attempt=self.restart,
                               size=self.size, time=time.time()))
        if self._progress_path == '-':
            # One write of the whole line, flushed: the process manager
            # must not splice it with another rank's output.
            sys.stdout.write(config.report_line(PROGRESS_TAG, line))
            sys.stdout.flush()
            return
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
                  keep: int = 2, timeout=None) -> AutoSnapshot:
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
        timeout: seconds any rank waits in one of the snapshot's
            collectives before it raises ``CommunicationTimeout`` (a peer's
            host or link gone); None: ``CHAINERMN_OVERLAP_TIMEOUT``, else
            600 s; 0 waits without a limit.  Give the optimizer's.

    Returns:
        AutoSnapshot: the extension; add it with ``trainer.extend``.
    """
    return AutoSnapshot(comm, directory, trigger=trigger, keep=keep,
                        timeout=timeout)
