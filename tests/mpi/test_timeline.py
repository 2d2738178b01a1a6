"""The Chrome-trace timeline shows per-link forward, waits and reductions."""
import json

import chainer
import chainer.functions as F
import numpy as np

import chainermn_overlap
from chainermn_overlap.testing.models import Deep


def test_timeline_records_the_iteration(comm, tmp_path_factory):
    # One folder for all ranks: rank 0 creates it, all use it.
    path = comm.mpi_comm.bcast(
        str(tmp_path_factory.mktemp('trace') / 'trace.json')
        if comm.rank == 0 else None)
    # 4 x Linear(64, 64), loss sum(relu(h)).
    model = Deep(4, 64, loss=F.sum)
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(0.01), comm, bucket_size=64 * 65 * 4,
        timeline=path).setup(model)
    x = np.ones((8, 64), dtype=np.float32)
    for _ in range(4):
        opt.update(model, x)
    opt.close()
    with open(path.replace('.json', '.rank{}.json'.format(comm.rank))) as f:
        events = json.load(f)['traceEvents']
    names = [e['name'] for e in events]
    assert {'forward /{}'.format(i) for i in range(4)} <= set(names)
    assert 'update()' in names
    ready = [n for n in names if n.startswith('grad ready')]
    # Iteration 1 broadcasts (no layout yet); each later one reports all
    # 8 parameters once.
    assert len(ready) == 8 * 3, ready
    comm_spans = [e for e in events if e.get('cat') == 'comm']
    assert comm_spans and all(e['tid'] == 1 and e['dur'] >= 0
                              for e in comm_spans)
    # Overlap, structurally: in each iteration, the first bucket was posted
    # during backward, before update() was called.
    updates = [e['ts'] for e in events if e['name'] == 'update()']
    posts = [e['ts'] for e in events if e['name'].startswith('post bucket')]
    for u_prev, u in zip(updates[1:], updates[2:]):
        assert any(u_prev < p < u for p in posts)
