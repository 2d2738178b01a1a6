"""What each sharding stage holds between steps, against its promise.

Bytes held after ``update()`` returns (``tracemalloc``, after
``gc.collect()``), as a fraction of ChainerMN's optimizer on the same
model, must stay within 0.07 of the stage's ideal (Adam, float32: 16 bytes
per parameter for ChainerMN; ``8 + 12/N``, ``4 + 12/N`` and ``16/N`` for
``shard='optimizer'``, ``'gradients'``, ``'parameters'``, the reduced
gradient slice, 4/N, counted in each), with the
defaults, for ``wait='forward'`` and ``'update'``.  Every reduce-scatter is
slowed (a link slower than backward), so that with ``wait='forward'`` the
gradients of the last buckets are still in flight when ``update()``
returns: what the defaults must bound.  A negative control shows the test
can fail: ``shard_in_flight=None`` (no bound) holds as much as stage 1.
Collective tests: every rank runs this file.
"""
import gc
import time
import tracemalloc

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn

import chainermn_overlap
from chainermn_overlap.optimizers.sharding import collectives
from chainermn_overlap.testing import equivalence as eq

WIDTH = 256
LAYERS = 6
BUCKET = 32 * 1024   # 24 buckets: most of them still in flight when slowed
MARGIN = 0.07


class _Stack(chainer.ChainList):
    def __init__(self):
        super().__init__(*[L.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

    def forward(self, x):
        for link in self[:-1]:
            x = F.relu(link(x))
        return self[-1](x)


def ideal_ratio(shard, n):
    """The stage's ideal bytes per parameter over ChainerMN's 16."""
    return {'optimizer': 8 + 12.0 / n, 'gradients': 4 + 12.0 / n,
            'parameters': 16.0 / n}[shard] / 16


def _held_after_update(comm, shard, wait, **options):
    """Bytes per parameter this rank holds after the 4th ``update()``."""
    eq.seed_for_rank(7)
    rng = np.random.RandomState(comm.rank)
    x = rng.randn(4, WIDTH).astype(np.float32)
    t = rng.randint(0, WIDTH, 4).astype(np.int32)
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    model = _Stack()
    nparams = sum(p.size for p in model.params())
    actual = chainer.optimizers.Adam(alpha=1e-4)
    if shard is None:
        opt = chainermn.create_multi_node_optimizer(actual, comm)
    else:
        opt = chainermn_overlap.create_overlapped_optimizer(
            actual, comm, wait=wait, shard=shard, bucket_size=BUCKET,
            **options)
    opt.setup(model)

    def lossfun():
        return F.softmax_cross_entropy(model(x), t)
    for _ in range(3):
        opt.update(lossfun)
    comm.mpi_comm.Barrier()
    opt.update(lossfun)
    gc.collect()
    held = (tracemalloc.get_traced_memory()[0] - base) / nparams
    if hasattr(opt, 'close'):
        opt.close()
    return held


@pytest.fixture
def slow_link(monkeypatch):
    slow = collectives.reduce_scatter_mean

    def slowed(*args, **kwargs):
        time.sleep(0.01)
        return slow(*args, **kwargs)
    monkeypatch.setattr(collectives, 'reduce_scatter_mean', slowed)
    tracemalloc.start()
    yield
    tracemalloc.stop()


@pytest.mark.parametrize('wait', ['forward', 'update'])
@pytest.mark.parametrize('shard', ['optimizer', 'gradients', 'parameters'])
def test_defaults_keep_each_stages_memory(comm, shard, wait, slow_link):
    reference = _held_after_update(comm, None, 'update')
    held = _held_after_update(comm, shard, wait)
    # The largest rank's figure: the one that limits a job.
    ratio = max(comm.mpi_comm.allgather(held)) / max(
        comm.mpi_comm.allgather(reference))
    limit = ideal_ratio(shard, comm.size) + MARGIN
    eq.assert_all_ranks(
        ratio <= limit, "shard={!r}, wait={!r}: {:.3f} of ChainerMN's bytes "
        'after update(), more than {:.3f} (the ideal {:.3f} + {})'.format(
            shard, wait, ratio, limit, ideal_ratio(shard, comm.size),
            MARGIN), comm)


@pytest.mark.parametrize('shard', ['gradients', 'parameters'])
def test_no_bound_holds_the_gradients_in_flight(comm, shard, slow_link):
    # The negative control: shard_in_flight=None leaves the slowed
    # reduce-scatters in flight when update() returns.
    if comm.size == 1:
        pytest.skip('one rank reduces nothing')
    reference = _held_after_update(comm, None, 'update')
    held = _held_after_update(comm, shard, 'forward', shard_in_flight=None)
    ratio = max(comm.mpi_comm.allgather(held)) / max(
        comm.mpi_comm.allgather(reference))
    limit = ideal_ratio(shard, comm.size) + MARGIN
    eq.assert_all_ranks(
        ratio > limit, 'shard={!r}, shard_in_flight=None: {:.3f} of '
        "ChainerMN's bytes, expected above {:.3f} (gradients in flight)"
        .format(shard, ratio, limit), comm)
