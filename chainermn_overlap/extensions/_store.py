"""The snapshot folder on disk: durable files, manifests, housekeeping.

Pure file-system code for :mod:`chainermn_overlap.extensions.snapshot`, no
MPI: writing a file so that a crash leaves it absent, old or complete;
checksums; which snapshots a folder holds and which are complete; removing
old, newer-than-chosen, partial and temporary ones.  Also the random states
that Chainer's serialization leaves out.
"""
import hashlib
import json
import os
import re
import shutil
import time

import numpy

FOLDER = 'snapshot_iter_{:08d}'
FOLDER_RE = re.compile(r'^snapshot_iter_(\d{8,})$')
MANIFEST = 'manifest.json'
RANK_FILE = 'rank{}.npz'
TMP_MARK = '.tmp.'


def fsync_dir(path):
    """fsync of a folder, so that a rename in it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path, chunk=1 << 20):
    """(hex digest, length in bytes) of the file at ``path``."""
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


def savez(f, arrays, chunk=1 << 20):
    """``numpy.savez(f, **arrays)`` without a copy of each array.

    ``numpy.savez`` writes an array into its zip entry through a copy of
    the whole array (``tobytes``): the largest parameter's size added to
    the memory of every rank while it saves.  This writes the same file
    (uncompressed entries ``KEY.npy``, read by ``numpy.load``) from views,
    ``chunk`` bytes at a time.
    """
    import zipfile
    from numpy.lib import format as npy
    with zipfile.ZipFile(f, mode='w', compression=zipfile.ZIP_STORED,
                         allowZip64=True) as zf:
        for key, value in arrays.items():
            a = numpy.asanyarray(value)
            if a.dtype.hasobject:
                raise ValueError('{}: an object array cannot be saved '
                                 'without pickle'.format(key))
            if not a.flags.c_contiguous:
                a = numpy.ascontiguousarray(a)
            flat = a.reshape(-1).view(numpy.uint8)
            with zf.open(key + '.npy', 'w', force_zip64=True) as out:
                npy.write_array_header_2_0(
                    out, npy.header_data_from_array_1_0(a))
                for i in range(0, flat.size, chunk):
                    out.write(flat[i:i + chunk])


def write_durably(path, write, before_rename=None):
    """Writes ``path`` through a temporary file in the same folder.

    ``write(f)`` fills the open binary file; then it is flushed, fsync'ed,
    renamed over ``path`` and the folder fsync'ed, so that after a crash
    ``path`` is either absent, its old content, or complete.  The temporary
    file is removed on error.
    """
    folder = os.path.dirname(path) or '.'
    tmp = '{}{}{}'.format(path, TMP_MARK, os.getpid())
    try:
        with open(tmp, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
        fsync_dir(folder)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class SnapshotStore(object):
    """The snapshots in one folder (every rank sees the same folder).

    Args:
        directory (str): absolute path of the folder.
        keep (int): complete snapshots to keep when pruning.
    """

    def __init__(self, directory, keep):
        self.directory = directory
        self.keep = keep

    def listing(self):
        """Iterations of the snapshot folders present, ascending."""
        out = []
        for entry in os.listdir(self.directory):
            m = FOLDER_RE.match(entry)
            if m and os.path.isdir(os.path.join(self.directory, entry)):
                out.append(int(m.group(1)))
        return sorted(out)

    def folder(self, iteration):
        return os.path.join(self.directory, FOLDER.format(iteration))

    def read_manifest(self, iteration):
        """The manifest of ``iteration``; ValueError when inconsistent."""
        path = os.path.join(self.folder(iteration), MANIFEST)
        with open(path, 'rb') as f:
            manifest = json.loads(f.read().decode('utf-8'))
        if (manifest.get('iteration') != iteration
                or not isinstance(manifest.get('files'), list)
                or len(manifest['files']) != manifest.get('size')
                or any(not isinstance(f, dict)
                       or f.get('name') != RANK_FILE.format(r)
                       for r, f in enumerate(manifest['files']))):
            raise ValueError('inconsistent manifest')
        return manifest

    def check(self, iteration, source_ranks):
        """(ok, why) for the files a rank would load from ``iteration``.

        ``source_ranks(manifest)`` names the ranks whose files it reads.
        """
        try:
            manifest = self.read_manifest(iteration)
        except FileNotFoundError:
            return False, 'incomplete (no manifest: a rank ended while ' \
                'writing it)'
        except (OSError, ValueError, UnicodeDecodeError) as e:
            return False, 'unreadable manifest ({})'.format(e)
        for rank in source_ranks(manifest):
            entry = manifest['files'][rank]
            path = os.path.join(self.folder(iteration), entry['name'])
            try:
                digest, n = sha256(path)
            except OSError as e:
                return False, 'cannot read {} ({})'.format(entry['name'], e)
            if n != entry['bytes'] or digest != entry['sha256']:
                return False, ('corrupt: {} has {} bytes and sha256 {}..., '
                               'the manifest says {} bytes and {}...'.format(
                                   entry['name'], n, digest[:12],
                                   entry['bytes'], entry['sha256'][:12]))
        return True, ''

    def write_manifest(self, iteration, size, results):
        """Writes the manifest of ``iteration`` from every rank's result."""
        manifest = {'iteration': iteration, 'size': size,
                    'time': time.time(),
                    # Slices of sharded optimizers in the rank files.
                    'sharded': any(r.get('sharded') for r in results),
                    'files': [{k: r[k] for k in ('name', 'sha256', 'bytes')}
                              for r in results]}
        write_durably(
            os.path.join(self.folder(iteration), MANIFEST),
            lambda f: f.write(json.dumps(manifest, indent=1).encode('utf-8')))

    def complete_listing(self):
        """Iterations whose snapshot has a manifest, ascending."""
        try:
            return [it for it in self.listing() if os.path.exists(
                os.path.join(self.folder(it), MANIFEST))]
        except OSError:
            return []

    def remove(self, iteration):
        folder = self.folder(iteration)
        # The manifest first: a half-removed snapshot must look incomplete.
        try:
            os.unlink(os.path.join(folder, MANIFEST))
            fsync_dir(folder)
        except FileNotFoundError:
            pass
        shutil.rmtree(folder, ignore_errors=True)

    def prune(self):
        """Removes everything older than the ``keep`` newest complete."""
        complete = self.complete_listing()
        if len(complete) <= self.keep:
            oldest_kept = complete[0] if complete else None
        else:
            oldest_kept = complete[-self.keep]
        if oldest_kept is None:
            return
        for it in self.listing():
            if it < oldest_kept:
                self.remove(it)

    def remove_newer_than(self, chosen):
        """Removes every snapshot after ``chosen`` (all when None)."""
        for it in self.listing():
            if chosen is None or it > chosen:
                self.remove(it)

    def remove_temporaries(self):
        for it in self.listing():
            folder = self.folder(it)
            for entry in os.listdir(folder):
                if TMP_MARK in entry:
                    try:
                        os.unlink(os.path.join(folder, entry))
                    except OSError:
                        pass


# ----------------------------------------------------------------------------
# Random states that Chainer's serialization leaves out

def random_state_arrays(rs):
    """A RandomState's state as named arrays (for an npz file)."""
    name, keys, pos, has_gauss, gauss = rs.get_state()
    if name != 'MT19937':
        raise ValueError('cannot save a {} random state: only MT19937 '
                         '(numpy.random.RandomState)'.format(name))
    return {'keys': numpy.asarray(keys, dtype=numpy.uint32),
            'misc': numpy.array([pos, has_gauss], dtype=numpy.int64),
            'gauss': numpy.array([gauss], dtype=numpy.float64)}


def set_random_state(rs, arrays):
    """Restores what :func:`random_state_arrays` saved."""
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


def random_states(trainer):
    """NumPy's global RandomState and the iterators' own, by name."""
    states = {'numpy_global': numpy.random.random.__self__}
    for name, rs in _own_samplers(trainer).items():
        states['iterator:' + name] = rs
    return states
