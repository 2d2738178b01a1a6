"""Hybrid sample x spatial training with a per-stage strategy is exact.

A spatial stage (conv, global BN, pool), a redistribution to sample layout,
a sample stage (plain conv, global BN in sample layout), pooling and a
classifier, trained a few steps with the multi-node optimizer over the
whole communicator, against single-process training on the global batch.
Also the examples run.
"""
import importlib.util
import os

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np
import pytest

from chainermn_overlap import distconv
from distconv_mpi_helpers import Checker, comm, grid, sum_over_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, '..', '..', '..', 'examples', 'spatial')


class Hybrid(chainer.Chain):

    def __init__(self, g=None):
        super(Hybrid, self).__init__()
        rng = np.random.RandomState(40)
        w1 = rng.randn(4, 3, 3, 3).astype(np.float32) * 0.3
        w2 = rng.randn(5, 4, 3, 3).astype(np.float32) * 0.3
        wf = rng.randn(3, 5).astype(np.float32) * 0.3
        self.g = g
        with self.init_scope():
            if g is None:
                self.c1 = L.Convolution2D(3, 4, 3, pad=1, initialW=w1)
                self.bn1 = L.BatchNormalization(4)
                self.bn2 = L.BatchNormalization(5)
            else:
                self.c1 = distconv.Convolution2D(g, 3, 4, 3, pad=1,
                                                 initialW=w1)
                self.bn1 = distconv.BatchNormalization(g, 4)
                self.bn2 = distconv.BatchNormalization(g, 5,
                                                       layout='sample')
            self.c2 = L.Convolution2D(4, 5, 3, stride=2, pad=1, initialW=w2)
            self.fc = L.Linear(5, 3, initialW=wf)

    def forward(self, x):
        g = self.g
        h = F.relu(self.bn1(self.c1(x)))
        if g is None:
            h = F.max_pooling_2d(h, 3, 2, 1)
        else:
            h = distconv.max_pooling_2d(g, h, 3, 2, 1)
            h = distconv.to_sample_layout(g, h)   # the stage boundary
        h = F.relu(self.bn2(self.c2(h)))
        return self.fc(F.average(h, axis=(2, 3)))


@pytest.mark.parametrize('shape', [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)],
                         ids=str)
@pytest.mark.parametrize('overlap', [True, False])
def test_hybrid_training_equals_serial(shape, overlap):
    g = grid(shape)
    old, g.overlap = g.overlap, overlap
    try:
        rng = np.random.RandomState(41)
        n = 6
        x = rng.randn(n, 3, 13, 11).astype(np.float32)
        t = rng.randint(0, 3, n).astype(np.int32)
        serial, dist = Hybrid(), Hybrid(g)
        opt_s = chainer.optimizers.MomentumSGD(0.1)
        opt_s.setup(serial)
        opt_d = chainermn.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(0.1), comm())
        opt_d.setup(dist)
        opt_d.update()  # ChainerMN broadcasts and skips its first update
        x_local = g.scatter(x)
        t_group = g.scatter_samples(t)
        a, b = distconv.sample_share(g, len(t_group))
        t_local = t_group[a:b]
        chk = Checker(2e-4, 2e-5)
        for _ in range(3):
            loss_s = F.softmax_cross_entropy(serial(x), t)
            serial.cleargrads()
            loss_s.backward()
            opt_s.update()
            y = dist(x_local)
            per = F.softmax_cross_entropy(y, t_local, reduce='no') \
                if len(t_local) else F.sum(y, axis=1) * 0
            loss = F.sum(per) * g.loss_scale(len(t_local))
            dist.cleargrads()
            loss.backward()
            opt_d.update()
            chk.close('loss', sum_over_ranks([loss.array])[0] / g.size,
                      loss_s.array)
        for (name, ps), (_, pd) in zip(sorted(serial.namedparams()),
                                       sorted(dist.namedparams())):
            chk.close(name, pd.array, ps.array)
        chk.close('bn2 running mean', dist.bn2.avg_mean, serial.bn2.avg_mean)
        chk.close('bn2 running var', dist.bn2.avg_var, serial.bn2.avg_var)
        chk.done()
    finally:
        g.overlap = old


def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(EXAMPLES, name + '.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resnet50_spatial_example_runs(capsys):
    m = _load('train_resnet50_spatial')
    times = m.main(['--iterations', '1', '--insize', '64', '--width', '4',
                    '--batchsize', '2'])
    assert len(times) == 1
    if comm().rank == 0:
        assert 'iteration   1' in capsys.readouterr().out


def test_cosmoflow3d_example_runs(capsys):
    m = _load('train_cosmoflow3d')
    times = m.main(['--iterations', '1', '--insize', '16', '--width', '2',
                    '--batchsize', '2'])
    assert len(times) == 1
    if comm().rank == 0:
        assert 'iteration   1' in capsys.readouterr().out
