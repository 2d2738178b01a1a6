"""Reductions must progress while the main thread computes.

Non-blocking MPI collectives do not progress on their own on CPU.  This test
measures, on real MPI traffic, how much of the time spent reducing gradients
was hidden behind computation: ``1 - (time training waited for reductions)
/ (time the reductions took)``.  The negative control, one bucket posted only
when ``update()`` is called (the blocking scheme), hides nothing, which shows
the measurement can fail.
"""
import gc
import os

import chainer
import numpy as np
import pytest

import chainermn_overlap
from chainermn_overlap.testing import models

# A measured fraction of time: run alone (the timing tier), not beside
# another suite.
pytestmark = pytest.mark.timing


def _measure(comm, wait, bucket_size, iterations=7, warmup=2):
    model = models.Deep(8, 1024, loss=models.sum_of_squares)
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(1e-7), comm, wait=wait,
        bucket_size=bucket_size).setup(model)
    x = np.random.RandomState(comm.rank).randn(256, 1024).astype(np.float32)
    for i in range(iterations):
        if i == warmup:
            opt.communication_stats(reset=True)
        opt.update(model, x)
    opt.synchronize()
    stats = opt.communication_stats()
    opt.close()
    return stats


def test_reductions_are_hidden_behind_compute(comm):
    if comm.size == 1:
        pytest.skip('one rank has nothing to communicate')
    if (os.cpu_count() or 1) < comm.size:
        pytest.skip('overlap needs a core per rank; {} ranks on {} cores '
                    'time-share the cores'.format(comm.size, os.cpu_count()))
    # Objects that earlier tests of this process left alive (an optimizer
    # dropped without close() keeps its thread) would be scanned by every
    # full garbage collection, pausing both threads mid-measurement: move
    # them out of the collector's way.  Three interleaved repetitions, the
    # median of each mode.
    gc.collect()
    gc.freeze()
    try:
        samples = {'forward': [], 'update': [], 'control': []}
        for _ in range(3):
            for name, wait, bucket in [('forward', 'forward', '4MB'),
                                       ('update', 'update', '4MB'),
                                       ('control', 'update', '1GB')]:
                st = _measure(comm, wait, bucket)
                # Judge on the slowest rank: every rank must make progress.
                samples[name].append(
                    min(comm.mpi_comm.allgather(st['hidden_fraction'])))
    finally:
        gc.unfreeze()
    results = {name: float(np.median(v)) for name, v in samples.items()}
    if comm.rank == 0:
        print('hidden fraction (min over ranks):', results)
    # The blocking control posts its only bucket inside update() and
    # waits for it there: nothing can be hidden.
    assert results['control'] < 0.15, results
    # Alone the overlapped modes hide 0.74-0.86; late in the full suite on
    # a 2-core CI machine 0.55-0.58 was seen, and on the same machine on
    # another day, quiet, medians of 0.25-0.94 (forward) and 0.30-0.94
    # (update) over eleven runs of the code before and after one change,
    # with the control at -0.04 to -0.01 every time: the bound keeps a
    # margin over the control (about 0; it must stay below 0.15) without
    # failing on that spread.
    assert results['forward'] > 0.2, results
    assert results['update'] > 0.2, results
