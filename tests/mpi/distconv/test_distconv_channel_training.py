"""Training filter/channel-parallel models equals single-process training.

Model: spatial conv -> BN -> ReLU -> filter conv -> BN (channel split) ->
ReLU -> channel conv (strided) -> global average pooling -> Linear ->
softmax cross entropy, each rank's loss the ordinary mean over its sample
group's samples (the training convention).

* ``test_descriptor_reduction``: the gradients are reduced by hand exactly
  as the reduction-group descriptor says (replicated parameters: average
  over the communicator; split ones: sum over ``rg.mpi_comm`` times
  ``rg.sum_scale``), then a plain optimizer steps on every rank. This pins
  the descriptor's meaning independently of any optimizer.
* ``test_overlapped_optimizer``: the same with ``create_overlapped_optimizer``
  (both wait modes), skipped until the optimizer declares
  ``chainermn_overlap.optimizers.overlapped.SUPPORTS_REDUCTION_GROUPS``.
* ``test_channel_allreduce_adjoint``: dot-product test of the channel
  axis's reduction.
"""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
import pytest
from mpi4py import MPI

from chainermn_overlap import distconv
from chainermn_overlap.distconv import channels as dc_channels
from distconv_mpi_helpers import Checker, comm, sum_over_ranks

_GRIDS = {}

TRAIN_GRIDS = [((1, 1), 1), ((1, 1), 2), ((2, 1), 2), ((1, 1), 3),
               ((1, 2), 1)]


def cgrid(shape, channels):
    c = comm()
    if c.size % (int(np.prod(shape)) * channels):
        pytest.skip('grid %r x %d channels does not fit %d processes'
                    % (shape, channels, c.size))
    key = (tuple(shape), channels)
    if key not in _GRIDS:
        _GRIDS[key] = distconv.SpatialGrid(c, shape, channels=channels)
    return _GRIDS[key]


def _ids(v):
    return '%sx%d' % (v[0], v[1])


class Net(chainer.Chain):

    def __init__(self, g=None):
        super(Net, self).__init__()
        self.g = g
        rng = np.random.RandomState(40)
        w0 = (rng.randn(4, 3, 3, 3) * 0.4).astype(np.float32)
        w1 = (rng.randn(5, 4, 3, 3) * 0.3).astype(np.float32)
        w2 = (rng.randn(6, 5, 3, 3) * 0.3).astype(np.float32)
        wf = (rng.randn(3, 6) * 0.3).astype(np.float32)
        with self.init_scope():
            if g is None:
                self.c0 = L.Convolution2D(3, 4, 3, 1, 1, initialW=w0)
                self.bn0 = L.BatchNormalization(4)
                self.c1 = L.Convolution2D(4, 5, 3, 1, 1, initialW=w1)
                self.bn1 = L.BatchNormalization(5)
                self.c2 = L.Convolution2D(5, 6, 3, 2, 1, initialW=w2)
            else:
                self.c0 = distconv.Convolution2D(g, 3, 4, 3, 1, 1,
                                                 initialW=w0)
                self.bn0 = distconv.BatchNormalization(g, 4)
                self.c1 = distconv.Convolution2D(g, 4, 5, 3, 1, 1,
                                                 initialW=w1, split='filter')
                self.bn1 = distconv.BatchNormalization(g, 5,
                                                       channel_split=True)
                self.c2 = distconv.Convolution2D(g, 5, 6, 3, 2, 1,
                                                 initialW=w2, split='channel')
            self.fc = L.Linear(6, 3, initialW=wf)

    def forward(self, x):
        h = F.relu(self.bn0(self.c0(x)))
        h = F.relu(self.bn1(self.c1(h)))
        h = self.c2(h)
        if self.g is None:
            h = F.mean(h, axis=(2, 3))
        else:
            h = distconv.global_average_pooling(self.g, h)
        return self.fc(h)


def _data(n):
    rng = np.random.RandomState(41)
    return (rng.randn(n, 3, 7, 6).astype(np.float32),
            rng.randint(0, 3, size=n).astype(np.int32))


def _reduce_by_descriptor(model, size):
    groups = distconv.reduction_groups(model)
    world = comm().mpi_comm
    for path, p in sorted(model.namedparams()):
        g = p.grad.astype(np.float64)
        out = np.empty_like(g)
        rg = groups.get(path)
        if rg is None:
            world.Allreduce(g, out, op=MPI.SUM)
            out /= size
        else:
            rg.mpi_comm.Allreduce(g, out, op=MPI.SUM)
            out *= rg.sum_scale
        p.grad[...] = out


def _train(g, steps, make_dist_opt, reduce_by_hand=False, flush=False,
           make_hook=None, synchronize=False):
    n = 4 * g.n_groups
    x, t = _data(n)
    serial = Net()
    dist = Net(g)
    opt_s = chainer.optimizers.MomentumSGD(lr=0.1)
    opt_s.setup(serial)
    opt_d = make_dist_opt(chainer.optimizers.MomentumSGD(lr=0.1))
    opt_d.setup(dist)
    for opt in (opt_s, opt_d) if make_hook is not None else ():
        hooks = make_hook()
        for hook in hooks if isinstance(hooks, list) else [hooks]:
            opt.add_hook(hook)
    if not reduce_by_hand:
        opt_d.update()  # the data-parallel optimizers' first, broadcast step
    x_local = g.scatter(x)
    t_local = g.scatter_samples(t)
    chk = Checker(2e-4, 2e-5)
    for step in range(steps):
        serial.cleargrads()
        F.softmax_cross_entropy(serial(x), t).backward()
        opt_s.update()
        dist.cleargrads()
        F.softmax_cross_entropy(dist(x_local), t_local).backward()
        if reduce_by_hand:
            _reduce_by_descriptor(dist, g.size)
        opt_d.update()
    if flush:
        with chainer.using_config('train', False):
            dist(x_local)
    if synchronize:
        opt_d.synchronize()   # shard='parameters': the parameters whole
    back = Net()
    distconv.store_serial_params(g, dist, back)
    sp = dict(serial.namedparams())
    for path, p in back.namedparams():
        chk.close('param %s after %d steps' % (path, steps), p.array,
                  sp[path].array)
    for name in ('bn0', 'bn1'):
        chk.close(name + '.avg_var', getattr(back, name).avg_var,
                  getattr(serial, name).avg_var)
    chk.done()


@pytest.mark.parametrize('gc', TRAIN_GRIDS, ids=_ids)
def test_descriptor_reduction(gc):
    g = cgrid(*gc)
    _train(g, 2, lambda opt: opt, reduce_by_hand=True)


def test_descriptor_reduction_negative_control():
    """Averaging the split gradients over their group instead of using
    sum_scale is wrong as soon as the channel axis is longer than 1."""
    g = cgrid((1, 1), 2)
    n = 4 * g.n_groups
    x, t = _data(n)
    serial, dist = Net(), Net(g)
    serial.cleargrads()
    dist.cleargrads()
    F.softmax_cross_entropy(serial(x), t).backward()
    F.softmax_cross_entropy(dist(g.scatter(x)),
                            g.scatter_samples(t)).backward()
    groups = distconv.reduction_groups(dist)
    rg = groups['/c1/W']
    right = rg.mpi_comm.allreduce(dist.c1.W.grad) * rg.sum_scale
    wrong = rg.mpi_comm.allreduce(dist.c1.W.grad) / rg.size
    lo, hi = g.channel_range(5)
    want = serial.c1.W.grad[lo:hi]
    np.testing.assert_allclose(right, want, rtol=2e-4, atol=2e-5)
    assert not np.allclose(wrong, want, rtol=1e-2, atol=1e-4)


def _overlapped_support():
    try:
        from chainermn_overlap.optimizers import overlapped
    except ImportError:
        return None
    if not getattr(overlapped, 'SUPPORTS_REDUCTION_GROUPS', False):
        return None
    return overlapped


@pytest.mark.parametrize('wait', ['update', 'forward'])
@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2), ((1, 1), 3)],
                         ids=_ids)
def test_overlapped_optimizer(gc, wait):
    if _overlapped_support() is None:
        pytest.skip('chainermn_overlap.optimizers.overlapped does not declare '
                    'SUPPORTS_REDUCTION_GROUPS yet: it reduces every '
                    'gradient over the whole communicator, which is wrong '
                    'for channel blocks (distconv.reduction_groups)')
    g = cgrid(*gc)
    from chainermn_overlap import create_overlapped_optimizer

    def make(opt):
        return create_overlapped_optimizer(opt, comm(), wait=wait)
    _train(g, 2, make, flush=(wait == 'forward'))


@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2), ((1, 1), 3),
                                ((1, 1), 1)], ids=_ids)
def test_channel_allreduce_adjoint(gc):
    g = cgrid(*gc)
    rng = np.random.RandomState(100 + comm().rank)
    x = rng.randn(2, 3, 4, 5).astype(np.float64)
    y = rng.randn(2, 3, 4, 5).astype(np.float64)
    ax = dc_channels.ChannelAllreduce(g).apply((x,))[0].array
    aty = dc_channels.ChannelAllreduce(g).backward(
        (0,), (chainer.Variable(y),))[0].array
    lhs = sum_over_ranks([np.vdot(ax, y)])[0]
    rhs = sum_over_ranks([np.vdot(x, aty)])[0]
    np.testing.assert_allclose(lhs, rhs, rtol=1e-12)
    # Negative control: it really moves data when the axis is longer.
    if g.channels > 1:
        assert not np.allclose(ax, x)


# A threshold below the gradient's norm on every step of _train's data, so
# that every step clips (test_gradient_clipping_threshold_really_clips).
_CLIP = 0.05


def _clipping():
    return chainer.optimizer_hooks.GradientClipping(_CLIP)


@pytest.mark.parametrize('shard', [None, 'optimizer', 'gradients',
                                   'parameters'])
@pytest.mark.parametrize('wait', ['update', 'forward'])
@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2), ((1, 1), 3)],
                         ids=_ids)
def test_gradient_clipping_takes_the_whole_models_norm(gc, wait, shard):
    """GradientClipping clips with the norm of the single-process gradient:
    a channel block counted once (not once per member of its group, nor
    left out), every rank with the same rate."""
    g = cgrid(*gc)
    from chainermn_overlap import create_overlapped_optimizer

    def make(opt):
        return create_overlapped_optimizer(opt, comm(), wait=wait,
                                           shard=shard)
    _train(g, 2, make, flush=(wait == 'forward'), make_hook=_clipping,
           synchronize=(shard == 'parameters'))


def _per_param_hooks():
    return [chainer.optimizer_hooks.WeightDecay(1e-2),
            chainer.optimizer_hooks.GradientHardClipping(-3e-3, 3e-3)]


@pytest.mark.parametrize('shard', [None, 'optimizer', 'gradients',
                                   'parameters'])
@pytest.mark.parametrize('gc', [((1, 1), 2), ((2, 1), 2)], ids=_ids)
def test_per_parameter_hooks_on_channel_blocks(gc, shard):
    """Per-parameter hooks (weight decay, hard clipping) run on the channel
    blocks too, as on the single-process model's parameters."""
    g = cgrid(*gc)
    from chainermn_overlap import create_overlapped_optimizer

    def make(opt):
        return create_overlapped_optimizer(opt, comm(), shard=shard)
    # wait='forward' (the default): a forward applies the last update.
    _train(g, 2, make, flush=True, make_hook=_per_param_hooks,
           synchronize=(shard == 'parameters'))


def test_gradient_clipping_threshold_really_clips():
    """Negative control of the test above: with its threshold the serial
    model's gradient norm is well above it, so the hook changes every
    step."""
    x, t = _data(4)
    serial = Net()
    serial.cleargrads()
    F.softmax_cross_entropy(serial(x), t).backward()
    norm = np.sqrt(sum(float((p.grad.astype(np.float64) ** 2).sum())
                       for p in serial.params()))
    assert norm > 4 * _CLIP
