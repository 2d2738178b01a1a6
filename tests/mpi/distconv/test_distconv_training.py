"""Training with distconv equals single-process training on the global batch.

The model is conv -> BN -> ReLU -> max-pool -> strided conv -> global average
pooling -> Linear -> softmax cross entropy. The distributed model is updated
by a data-parallel optimizer over the whole communicator (ChainerMN's
multi-node optimizer, or this package's overlapped one); the serial model by
the plain optimizer on the global batch.
"""
import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy as np
import pytest

from chainermn_overlap import distconv
from distconv_mpi_helpers import GRIDS_2D, Checker, comm, grid, \
    sum_over_ranks


class Net(chainer.Chain):

    def __init__(self, g=None, sample_layout=False, in_size=(8, 7)):
        super(Net, self).__init__()
        rng = np.random.RandomState(20)
        w1 = rng.randn(4, 3, 3, 3).astype(np.float32) * 0.3
        w2 = rng.randn(5, 4, 3, 3).astype(np.float32) * 0.3
        self.g = g
        self.sample_layout = sample_layout
        with self.init_scope():
            if g is None:
                self.c1 = L.Convolution2D(3, 4, 3, pad=1, initialW=w1)
                self.bn = L.BatchNormalization(4)
                self.c2 = L.Convolution2D(4, 5, 3, stride=2, pad=1,
                                          initialW=w2)
            else:
                self.c1 = distconv.Convolution2D(g, 3, 4, 3, pad=1,
                                                 initialW=w1)
                self.bn = distconv.BatchNormalization(g, 4)
                self.c2 = distconv.Convolution2D(g, 4, 5, 3, stride=2, pad=1,
                                                 initialW=w2)
            n_fc = 4 * in_size[0] * in_size[1] if sample_layout else 5
            self.fc = L.Linear(n_fc, 3, initialW=rng.randn(3, n_fc).astype(
                np.float32) * 0.3)

    def forward(self, x):
        g = self.g
        h = F.relu(self.bn(self.c1(x)))
        if self.sample_layout:
            # Whole samples for the fully connected layer.
            if g is not None:
                h = distconv.to_sample_layout(g, h)
            return self.fc(h)
        if g is None:
            h = F.max_pooling_2d(h, 2, 1)
            h = F.mean(self.c2(h), axis=(2, 3))
        else:
            h = distconv.max_pooling_2d(g, h, 2, 1)
            h = distconv.global_average_pooling(g, self.c2(h))
        return self.fc(h)


def _data(n, size=(8, 7)):
    rng = np.random.RandomState(21)
    x = rng.randn(n, 3, *size).astype(np.float32)
    t = rng.randint(0, 3, size=n).astype(np.int32)
    return x, t


def _labels(g, t, n_local_samples, sample_layout):
    t_group = g.scatter_samples(t)
    if sample_layout:
        a, b = distconv.sample_share(g, len(t_group))
        return t_group[a:b]
    return t_group


def _train(g, n, steps, make_opt, loss_mode='scale', sample_layout=False,
           flush=False):
    x, t = _data(n)
    serial = Net(sample_layout=sample_layout)
    dist = Net(g, sample_layout=sample_layout)
    opt_s = chainer.optimizers.MomentumSGD(lr=0.1)
    opt_s.setup(serial)
    opt_d = make_opt(chainer.optimizers.MomentumSGD(lr=0.1))
    opt_d.setup(dist)
    # Data-parallel optimizers broadcast rank 0's parameters at their first
    # update and skip that step (ChainerMN's contract): do it up front.
    opt_d.update()
    x_local = g.scatter(x)
    chk = Checker(2e-4, 2e-5)
    for step in range(steps):
        loss_s = F.softmax_cross_entropy(serial(x), t)
        serial.cleargrads()
        loss_s.backward()
        opt_s.update()

        y = dist(x_local)
        t_local = _labels(g, t, len(y), sample_layout)
        if loss_mode == 'scale':
            if len(t_local):
                per_sample = F.softmax_cross_entropy(y, t_local, reduce='no')
            else:
                # Chainer's softmax_cross_entropy cannot backpropagate an
                # empty batch; a process without samples still needs a loss
                # connected to the graph, since backward is collective.
                per_sample = F.sum(y, axis=1) * 0
            loss = F.sum(per_sample) * g.loss_scale(len(t_local))
        else:  # plain per-process mean, exact for equal sample groups
            loss = F.softmax_cross_entropy(y, t_local)
        dist.cleargrads()
        loss.backward()
        opt_d.update()
        # The mean of the processes' losses is the global mean loss.
        chk.close('loss at step %d' % step,
                  sum_over_ranks([loss.array])[0] / g.size, loss_s.array)
    if flush:
        # wait='forward' applies each link's update before its next
        # forward: run one (test-mode, so BN statistics stay) to apply it.
        with chainer.using_config('train', False):
            dist(x_local)
    for (name, ps), (_, pd) in zip(sorted(serial.namedparams()),
                                   sorted(dist.namedparams())):
        chk.close('param %s after %d steps' % (name, steps), pd.array,
                  ps.array)
    chk.close('bn.avg_mean', dist.bn.avg_mean, serial.bn.avg_mean)
    chk.close('bn.avg_var', dist.bn.avg_var, serial.bn.avg_var)
    chk.done()


def _multi_node(opt):
    return chainermn.create_multi_node_optimizer(opt, comm())


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
def test_one_step_multi_node_optimizer_mean_loss(shape):
    """Equal sample groups: the usual per-process mean loss is exact."""
    g = grid(shape)
    _train(g, 12, 1, _multi_node, loss_mode='mean')


@pytest.mark.parametrize('shape', GRIDS_2D, ids=str)
@pytest.mark.parametrize('n', [5, 2])
def test_whole_model_training_uneven_batch(shape, n):
    """Three steps; uneven groups, and fewer samples than processes."""
    g = grid(shape)
    _train(g, n, 3, _multi_node)


@pytest.mark.parametrize('shape', [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)],
                         ids=str)
def test_sample_layout_head(shape):
    """Fully connected layer on whole samples after to_sample_layout."""
    g = grid(shape)
    _train(g, 5, 2, _multi_node, sample_layout=True)


@pytest.mark.parametrize('wait', ['update', 'forward'])
@pytest.mark.parametrize('shape', [(2, 1), (2, 2), (1, 1)], ids=str)
def test_overlapped_optimizer(shape, wait):
    g = grid(shape)
    try:
        from chainermn_overlap import create_overlapped_optimizer
    except ImportError:
        pytest.skip('overlapped optimizer not available')

    def make(opt):
        return create_overlapped_optimizer(opt, comm(), wait=wait)
    _train(g, 5, 2, make, flush=(wait == 'forward'))
