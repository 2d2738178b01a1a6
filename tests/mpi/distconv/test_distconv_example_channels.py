"""examples/spatial/train_resnet50_channels.py: runs, and one step of its
model (spatial stem..res3, filter/channel res4/res5) equals the same model
trained on one process (grids over MPI.COMM_SELF)."""
import importlib.util
import os
import sys

import chainer
import chainer.functions as F
import numpy as np
import pytest
from mpi4py import MPI

from chainermn_overlap import distconv
from distconv_mpi_helpers import Checker, comm

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, '..', '..', '..', 'examples', 'spatial',
                       'train_resnet50_channels.py')


def _module():
    spec = importlib.util.spec_from_file_location('resnet_channels', EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_runs(monkeypatch, capsys):
    m = _module()
    monkeypatch.setattr(sys, 'argv', ['x'])
    times = m.main(['--iterations', '1', '--insize', '32', '--width', '2',
                    '--batchsize', '2'])
    assert len(times) == 1
    if comm().rank == 0:
        assert 'iteration   1' in capsys.readouterr().out


@pytest.mark.skipif(comm().size != 2, reason='the example\'s --tune end '
                    'to end at 2 ranks only (the tuner\'s choices are '
                    'tested at every rank count in test_distconv_tuner.py)')
def test_example_tune(capsys):
    m = _module()
    times = m.main(['--tune', '--tune-cuts', 'res4', '--tune-iterations',
                    '1', '--iterations', '1', '--insize', '32', '--width',
                    '2', '--batchsize', '2'])
    assert len(times) == 1
    if comm().rank == 0:
        out = capsys.readouterr().out
        assert 'chosen:' in out and 'iteration   1' in out


def test_one_step_equals_single_process():
    # float64: fifty layers of batch normalisation over tiny batches
    # amplify float32 rounding (a different summation order) past any
    # useful tolerance; in float64 the comparison is tight.
    with chainer.using_config('dtype', np.float64):
        _one_step()


def _one_step():
    m = _module()
    c = comm()
    shape = (2, 1) if c.size % 2 == 0 else (1, 1)
    grid = distconv.SpatialGrid(c, shape)
    cgrid = distconv.SpatialGrid(c, (1, 1), channels=grid.spatial_size)
    sgrid = distconv.SpatialGrid(MPI.COMM_SELF, (1, 1))
    np.random.seed(0)
    serial = m.ResNet50Channels(sgrid, sgrid, 'res4', width=2, n_classes=5)
    dist = m.ResNet50Channels(grid, cgrid, 'res4', width=2, n_classes=5)
    distconv.load_serial_params(grid, dist, serial)
    n = 2 * grid.n_groups
    rng = np.random.RandomState(3)
    x = rng.randn(n, 3, 32, 32)
    t = rng.randint(0, 5, n).astype(np.int32)
    opt_s = chainer.optimizers.MomentumSGD(0.1)
    opt_s.setup(serial)
    opt_d = chainer.optimizers.MomentumSGD(0.1)
    opt_d.setup(dist)
    serial.cleargrads()
    F.softmax_cross_entropy(serial(x), t).backward()
    opt_s.update()
    dist.cleargrads()
    F.softmax_cross_entropy(dist(grid.scatter(x)),
                            grid.scatter_samples(t)).backward()
    m.reduce_by_groups(dist, c)
    opt_d.update()
    np.random.seed(1)
    back = m.ResNet50Channels(sgrid, sgrid, 'res4', width=2, n_classes=5)
    distconv.store_serial_params(grid, dist, back)
    chk = Checker(rtol=1e-7, atol=1e-9)
    sp = dict(serial.namedparams())
    for path, p in back.namedparams():
        chk.close(path, p.array, sp[path].array)
    chk.close('res5 bn running var', back.res5[0].bn1.avg_var,
              serial.res5[0].bn1.avg_var)
    chk.done()
