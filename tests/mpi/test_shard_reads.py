"""Reading ``param.array`` yourself under ``shard=`` (docs/sharding.md,
"Reading parameters yourself").

Chainer's public API lets code read ``param.array`` without running the
link: a trainer extension after ``update()`` (``ParameterStatistics``), a
print in a loop.  With ``wait='forward'`` the update of each bucket may
still be running on the communication thread when ``update()`` returns
(stages 1 and 2 write ``param.array`` in place there), and with
``shard='parameters'`` the parameter is a placeholder between steps.  After
``synchronize()`` every read is exact, until the next ``update()``.

Collective tests: every rank runs this file.
"""
import numpy as np
import pytest

import chainer
import chainer.links as L
import chainermn

import chainermn_overlap
from chainermn_overlap.optimizers.sharding.params import is_placeholder
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP


def _model():
    eq.seed_for_rank(11)
    return L.Classifier(MLP(5, 7, 3))


@pytest.mark.parametrize('shard, wait', [
    ('optimizer', 'forward'), ('gradients', 'forward'),
    ('parameters', 'forward'),
    # update() waits for everything: no synchronize() needed.
    ('optimizer', 'update'), ('gradients', 'update')])
def test_reads_after_synchronize_are_exact(shard, wait):
    comm = chainermn.create_communicator('naive')
    ref, ours = _model(), _model()
    ref_opt = chainermn.create_multi_node_optimizer(
        chainer.optimizers.Adam(alpha=0.01), comm).setup(ref)
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.Adam(alpha=0.01), comm, shard=shard,
        wait=wait, bucket_size=256, timeout=20).setup(ours)
    rng = np.random.RandomState(comm.rank)
    for step in range(3):
        x = rng.randn(4, 5).astype(np.float32)
        t = rng.randint(0, 3, size=4).astype(np.int32)
        ref_opt.update(ref, x, t)
        opt.update(ours, x, t)
        if shard == 'parameters' and step > 0:
            # The read the docs warn about: between update() and
            # synchronize() a parameter holds no value (the first update(),
            # which builds the layout, leaves them whole).
            assert all(is_placeholder(p.array) for p in ours.params())
        if wait == 'forward':
            opt.synchronize()
        expected = dict(ref.namedparams())
        for name, p in ours.namedparams():
            assert not is_placeholder(p.array), name
            np.testing.assert_array_equal(p.array, expected[name].array,
                                          err_msg=name)
    opt.close()
