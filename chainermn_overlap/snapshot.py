"""``python -m chainermn_overlap.snapshot``: tools for auto_snapshot folders.

``consolidate DIR [--iteration N] [--out FILE]`` writes the newest complete
snapshot of ``DIR`` (or that of iteration ``N``) as one ``.npz`` file of
whole states: rank 0's trainer state with every sharded optimizer's slices
(:mod:`chainermn_overlap.optimizers.sharding.shards`) joined from all
ranks' files, without auto_snapshot's own entries (random states, rank
count).  Every file is checked against the manifest's checksums first.
The file loads with Chainer's ``load_npz`` into a trainer, or into a model
or optimizer with ``path=`` (e.g. ``path='updater/optimizer:main/'``), for
inference, evaluation or ChainerMN.  Default output:
``DIR/consolidated_iter_N.npz``.

Exit status 0, or 2 with a message naming the problem (no complete
snapshot, a corrupt or unreadable file, shards that do not fit).
"""
import argparse
import os
import sys

import numpy

from chainermn_overlap.extensions import _store
from chainermn_overlap.optimizers.sharding import shards

__all__ = ['consolidate', 'main']

_EXTRA = 'auto_snapshot/'


class SnapshotError(Exception):
    """A snapshot that cannot be consolidated; the message says why."""


def _choose(store, iteration):
    try:
        complete = store.complete_listing()
    except OSError as e:
        raise SnapshotError('cannot list {} ({})'.format(store.directory, e))
    if iteration is None:
        if not complete:
            raise SnapshotError(
                'no complete snapshot in {} (a folder snapshot_iter_N with '
                'a manifest.json, as auto_snapshot writes)'.format(
                    store.directory))
        return complete[-1]
    if iteration not in complete:
        raise SnapshotError('no complete snapshot of iteration {} in {} '
                            '(complete: {})'.format(iteration,
                                                    store.directory,
                                                    complete or 'none'))
    return iteration


def consolidate(directory, iteration=None, out=None):
    """Writes one file of whole states; returns ``(path, iteration)``.

    Raises:
        SnapshotError: no such snapshot, or it is damaged.
    """
    store = _store.SnapshotStore(os.path.abspath(directory), keep=1)
    iteration = _choose(store, iteration)
    try:
        manifest = store.read_manifest(iteration)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise SnapshotError('the manifest of iteration {} is unreadable '
                            '({})'.format(iteration, e))
    ok, why = store.check(iteration, lambda m: range(m['size']))
    if not ok:
        raise SnapshotError('the snapshot of iteration {} cannot be used: '
                            '{}'.format(iteration, why))
    folder = store.folder(iteration)
    paths = [os.path.join(folder, f['name']) for f in manifest['files']]
    files = []
    try:
        files = [numpy.load(p, allow_pickle=False) for p in paths]
        data = {k: files[0][k] for k in files[0].files
                if not k.startswith(_EXTRA)}
        shards.assemble(data, files)
    except (OSError, ValueError, KeyError) as e:
        raise SnapshotError('the snapshot of iteration {} cannot be '
                            'consolidated: {}'.format(iteration, e))
    finally:
        for f in files:
            f.close()
    if out is None:
        out = os.path.join(store.directory,
                           'consolidated_iter_{:08d}.npz'.format(iteration))
    try:
        _store.write_durably(out, lambda f: _store.savez(f, data))
    except OSError as e:
        raise SnapshotError('cannot write {} ({})'.format(out, e))
    return out, iteration


def main(argv=None):
    """Entry point; returns the exit status."""
    p = argparse.ArgumentParser(
        prog='python -m chainermn_overlap.snapshot',
        description='Tools for the snapshot folders of auto_snapshot.')
    sub = p.add_subparsers(dest='command', required=True)
    c = sub.add_parser('consolidate', help='one file of whole states, from '
                       "every rank's file (sharded optimizers joined)")
    c.add_argument('directory', help="auto_snapshot's folder")
    c.add_argument('--iteration', type=int, default=None,
                   help='the snapshot of this iteration (default: the '
                   'newest complete one)')
    c.add_argument('--out', default=None, help='the file to write '
                   '(default: DIRECTORY/consolidated_iter_N.npz)')
    args = p.parse_args(argv)
    try:
        path, iteration = consolidate(args.directory, args.iteration,
                                      args.out)
    except SnapshotError as e:
        sys.stdout.write('chainermn_overlap.snapshot: {}\n'.format(e))
        return 2
    sys.stdout.write('chainermn_overlap.snapshot: wrote {} (iteration {}, '
                     'whole states)\n'.format(path, iteration))
    return 0


if __name__ == '__main__':
    sys.exit(main())
