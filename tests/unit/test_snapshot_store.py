"""auto_snapshot's writer of rank files (extensions/_store.savez)."""
import gc
import io
import tracemalloc

import numpy as np

from chainermn_overlap.extensions import _store


def _arrays():
    rng = np.random.RandomState(0)
    return {'updater/model:main/l1/W': rng.randn(300, 700).astype(
                np.float32),
            'x': np.array(3), 't': np.array(1.5),
            'shard_ranges': np.array('{"/l1/W": {"lo": 0}}'),
            'empty': np.empty(0, np.float32),
            'fortran': np.asfortranarray(rng.randn(5, 7)),
            'strided': rng.randn(10, 10)[:, ::2],
            'ints': np.arange(5, dtype=np.int32),
            'flags': np.array([True, False])}


def test_numpy_load_reads_what_it_writes_as_numpy_savez_wrote_it():
    arrays = _arrays()
    ours, theirs = io.BytesIO(), io.BytesIO()
    _store.savez(ours, arrays)
    np.savez(theirs, **arrays)
    for buf in (ours, theirs):
        buf.seek(0)
    a = np.load(ours, allow_pickle=False)
    b = np.load(theirs, allow_pickle=False)
    assert sorted(a.files) == sorted(b.files) == sorted(arrays)
    for key, value in arrays.items():
        assert a[key].dtype == value.dtype and a[key].shape == value.shape
        assert a[key].tobytes() == b[key].tobytes(), key


def _peak_while_writing(write, big):
    buf = io.BytesIO()
    buf.write(b'\0' * (big.nbytes + (1 << 20)))   # room made beforehand
    buf.seek(0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    write(buf, {'big': big})
    peak = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    return peak


def test_no_copy_of_a_whole_array_while_writing():
    big = np.ones(2 << 20, dtype=np.float32)     # 8 MiB
    ours = _peak_while_writing(_store.savez, big)
    theirs = _peak_while_writing(lambda f, d: np.savez(f, **d), big)
    # numpy.savez copies the array (the negative control), ours writes
    # views of 1 MiB.
    assert theirs >= big.nbytes
    assert ours < big.nbytes / 4, ours
