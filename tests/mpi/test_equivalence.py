"""The overlapped optimizer equals ChainerMN's blocking optimizer (issue 2).

Collective tests: every rank runs this file (``tests/mpi_run.py -n N``).
Each test trains a tiny network for at least 5 steps twice on the same
per-rank data -- with ``chainermn.create_multi_node_optimizer`` and with
``chainermn_overlap.create_overlapped_optimizer`` (both wait modes) -- and
compares the parameters on every rank, and across ranks.

Ranks start from different initial parameters on purpose: the first update
must broadcast rank 0's and skip the step, as ChainerMN does.

Set ``CHAINERMN_OVERLAP_TEST_OPTIMIZER=chainermn`` to plug ChainerMN's own
optimizer in place of ours; that validates the harness (see
``chainermn_overlap/testing/equivalence.py``).

Tolerances.  Both runs compute bit-identical local gradients (same data,
same graph, same float32 kernels); they can differ only by the order in
which the all-reduce sums ranks (fused buckets may take a different MPICH
algorithm than ChainerMN's one-array-at-a-time allreduce), i.e. about one
float32 ulp of each gradient per step.  Over 5-10 SGD steps with lr <= 0.1
that stays far below ``rtol=1e-5, atol=1e-6``.  Adam divides by sqrt(v), which
amplifies relative gradient errors for elements whose gradient is near
``eps``; ``rtol=1e-4, atol=1e-5`` covers that while still catching a wrong,
stale or missing update (those move parameters by ~lr = 1e-2).
"""
import copy
import os
import warnings

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer_hooks
from chainer import serializers
from chainer import training
from chainer.training import extensions
import chainermn

from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP

SGD_TOL = dict(rtol=1e-5, atol=1e-6)
ADAM_TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 6
# Wait modes; both with a tiny fusion bucket (several buckets even for these
# tiny models, so bucket order and partial buckets are exercised), and
# wait='forward' also with the default bucket size (one bucket).
WAITS = ['forward', 'update', 'forward+default_bucket']
SMALL_BUCKET = 256   # bytes: one 8x8 float32 matrix


def mode(wait):
    """``(wait, options)`` for a ``wait`` fixture value."""
    if wait.endswith('+default_bucket'):
        return wait.split('+')[0], {}
    return wait, {'bucket_size': SMALL_BUCKET}


@pytest.fixture(params=WAITS)
def wait(request):
    return request.param


def build(cls, *args, seed=0, **kwargs):
    """A template model, initialised differently on each rank."""
    eq.seed_for_rank(seed)
    return cls(*args, **kwargs)


def momentum_sgd(lr=0.1):
    return lambda: chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)


def lossfun_step(batches, before=None):
    """``opt.update(model, x, t)``; ``before(model, it)`` may set state."""
    def step(model, opt, it, impl):
        if before is not None:
            before(model, it)
        x, t = batches[it]
        opt.update(model, x, t)
    return step


def check(impl, template, make_actual, step, wait, tol, steps=STEPS,
          hooks=None, options=None, persistents=True, expect_skips=1):
    """Train with both optimizers and assert they agree.

    ``expect_skips``: update steps skipped by broadcasts (ChainerMN's t
    counts only the updates it applied).
    """
    wait, opts = mode(wait)
    opts.update(options or {})
    if eq.shard_mode() and eq.get_communicator().size == 2:
        # Sharded at 2 ranks: a reduce-scatter sums a + b as an allreduce
        # does, and element-wise rules give the same bits on a slice.
        tol = dict(rtol=0, atol=0)
    ref, got = eq.train_both(impl, template, make_actual, step, steps, wait,
                             options=opts, hooks=hooks)
    eq.assert_equivalent(got.model, ref.model, persistents=persistents,
                         what='%s vs chainermn' % impl.name, **tol)
    eq.assert_all_ranks(
        got.opt.t == ref.opt.t == steps - expect_skips,
        'opt.t: ours %r, ChainerMN %r, expected %d'
        % (got.opt.t, ref.opt.t, steps - expect_skips))
    if impl.fallback_warning is not None:
        n = got.count_warnings(impl.fallback_warning)
        eq.assert_all_ranks(n == 0, 'unexpected FallbackWarning (%d): %s' % (
            n, [str(w.message) for w in got.warnings]))
    return ref, got


# ---------------------------------------------------------------------------
# Models.
# ---------------------------------------------------------------------------

class CNN(chainer.Chain):
    """Two conv + BatchNormalization blocks and a classifier head."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(1, 4, 3, pad=1)
            self.bn1 = L.BatchNormalization(4)
            self.c2 = L.Convolution2D(4, 4, 3, pad=1, nobias=True)
            self.bn2 = L.BatchNormalization(4)
            self.fc = L.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        h = F.relu(self.bn1(self.c1(x)))
        h = F.relu(self.bn2(self.c2(h)))
        return self.fc(F.average_pooling_2d(h, 2))


class MLPBN(chainer.Chain):

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 8)
            self.bn = L.BatchNormalization(8)
            self.l2 = L.Linear(8, 3)

    def forward(self, x):
        return self.l2(F.relu(self.bn(self.l1(x))))


class LSTMNet(chainer.Chain):
    """An LSTM unrolled over T steps inside one iteration."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.lstm = L.LSTM(3, 6)
            self.out = L.Linear(6, 2)

    def forward(self, xs, ts):
        self.lstm.reset_state()
        loss = 0
        for s in range(xs.shape[1]):
            h = self.lstm(xs[:, s])
            loss += F.mean_squared_error(self.out(h), ts[:, s])
        return loss / xs.shape[1]


class SharedWeights(chainer.Chain):
    """l1 is called twice per forward."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 5)
            self.l2 = L.Linear(5, 3)

    def forward(self, x):
        h = F.tanh(self.l1(x))
        h = F.tanh(self.l1(h))
        return self.l2(h)


class Lazy(chainer.Chain):
    """Lazily initialised links; ``late`` is first used at iteration 3."""

    def __init__(self):
        super().__init__()
        self.use_late = False
        with self.init_scope():
            self.l1 = L.Linear(None, 8)
            self.l2 = L.Linear(None, 3)
            self.late = L.Linear(None, 3)

    def forward(self, x):
        h = F.relu(self.l1(x))
        y = self.l2(h)
        if self.use_late:
            y = y + self.late(h)
        return y


class Growing(chainer.Chain):
    """A link ``extra`` is added by the training loop (add_link)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 8)
            self.l2 = L.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.l1(x))
        if hasattr(self, 'extra'):
            h = h + F.relu(self.extra(h))
        return self.l2(h)


class Dynamic(chainer.Chain):
    """The branch taken depends on the iteration and on the rank.

    Branches use different links, a different number of calls, and
    branch 3 uses none, so on every iteration (at 1 to 4 ranks) some links
    are used on some ranks only and gradients become ready in a
    rank-dependent order.
    """

    def __init__(self):
        super().__init__()
        self.branch = 0
        with self.init_scope():
            self.trunk = L.Linear(6, 6)
            self.b0 = L.Linear(6, 6)
            self.b1 = L.Linear(6, 6)
            self.b2 = L.Linear(6, 6)
            self.head = L.Linear(6, 3)

    def forward(self, x):
        h = F.tanh(self.trunk(x))
        if self.branch == 0:
            h = F.tanh(self.b0(h))
        elif self.branch == 1:
            h = F.tanh(self.b1(F.tanh(self.b0(h))))
        elif self.branch == 2:
            h = F.tanh(self.b2(F.tanh(self.b2(h))))
            h = F.tanh(self.trunk(h))
        return self.head(h)


class Forgetful(chainer.Chain):
    """A block under F.forget (recomputed in backward) that calls l1 twice.

    With ``l1_outside``, l1 is also called outside the forgotten block.
    ``use_forget=False`` computes the same function without F.forget.
    """

    def __init__(self, l1_outside=False):
        super().__init__()
        self.l1_outside = l1_outside
        self.use_forget = True
        with self.init_scope():
            self.l0 = L.Linear(5, 6)
            self.l1 = L.Linear(6, 6)
            self.l2 = L.Linear(6, 6)
            self.l3 = L.Linear(6, 3)

    def _block(self, h):
        h = F.relu(self.l1(h))
        return F.relu(self.l2(F.tanh(self.l1(h))))

    def forward(self, x):
        h = F.relu(self.l0(x))
        h = F.forget(self._block, h) if self.use_forget else self._block(h)
        if self.l1_outside:
            h = h + F.tanh(self.l1(h))
        return self.l3(h)


class ParamOutside(chainer.Chain):
    """Parameters used outside their link's forward: l1's in F.linear
    before and after l1() is called (weight tying); l3 is never called, only
    l3.W is used (so l3.b never gets a gradient)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 5)
            self.l2 = L.Linear(5, 3)
            # A non-zero bias, so that WeightDecay visibly moves the
            # never-used l3.b (zero-filled gradient).
            self.l3 = L.Linear(5, 3, initial_bias=0.5)

    def forward(self, x):
        h = F.tanh(F.linear(x, self.l1.W, self.l1.b))
        h = F.tanh(self.l1(h))
        h = h + F.linear(h, self.l1.W)      # raw use after the link's call
        return self.l2(h) + F.linear(h, self.l3.W)


class DeadEnds(chainer.Chain):
    """Links that run in forward but get no gradient from the loss: an
    output that is discarded, or one used only through ``.array``; which of
    them happens depends on the rank and the iteration."""

    def __init__(self):
        super().__init__()
        self.kind = 0
        with self.init_scope():
            self.l1 = L.Linear(5, 6)
            self.aux = L.Linear(6, 6)
            self.l2 = L.Linear(6, 3)

    def forward(self, x):
        h = F.tanh(self.l1(x))
        if self.kind == 0:
            self.aux(h)                            # output discarded
        elif self.kind == 1:
            h = h + self.aux(h).array              # no gradient to aux
        elif self.kind == 2:
            h = h + self.aux(h)                    # ordinary use
        return self.l2(h)


class Generator(chainer.Chain):

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 8)
            self.bn = L.BatchNormalization(8)
            self.l2 = L.Linear(8, 5)

    def forward(self, z):
        return self.l2(F.relu(self.bn(self.l1(z))))


class Discriminator(chainer.Chain):

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 8)
            self.l2 = L.Linear(8, 1)

    def forward(self, x):
        return self.l2(F.leaky_relu(self.l1(x)))


class GAN(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.gen = Generator()
            self.dis = Discriminator()


def classification_batches(seed, x_shape=(5,), n_classes=3, steps=STEPS,
                           per_rank=4):
    return eq.make_batches(seed, steps, per_rank, x_shape,
                           n_classes=n_classes)


# ---------------------------------------------------------------------------
# The networks of issue 2.
# ---------------------------------------------------------------------------

def test_cnn_batchnorm_momentum_sgd(impl, wait):
    template = L.Classifier(build(CNN, seed=1))
    batches = classification_batches(11, x_shape=(1, 6, 6))
    check(impl, template, momentum_sgd(0.05), lossfun_step(batches), wait,
          SGD_TOL)


def test_mlp_adam_weight_decay(impl, wait):
    template = L.Classifier(build(MLP, seed=2))
    batches = classification_batches(12)
    check(impl, template, lambda: chainer.optimizers.Adam(alpha=0.01),
          lossfun_step(batches), wait, ADAM_TOL,
          hooks=lambda: [optimizer_hooks.WeightDecay(1e-3)])


def test_lstm_several_steps_per_iteration(impl, wait):
    template = build(LSTMNet, seed=3)
    batches = eq.make_batches(13, STEPS, 3, (4, 3), y_shape=(4, 2))
    check(impl, template, momentum_sgd(0.1), lossfun_step(batches), wait,
          SGD_TOL)


def test_shared_weights_called_twice(impl, wait):
    template = L.Classifier(build(SharedWeights, seed=4))
    batches = classification_batches(14)
    check(impl, template, momentum_sgd(0.1), lossfun_step(batches), wait,
          SGD_TOL)


def test_lazily_initialised_links(impl, wait):
    # l1 and l2 are initialised by the first forward (broadcast, skipped
    # step); `late` by the forward of iteration 3 (second broadcast and
    # skip).  Uninitialised parameters get no gradient in between.
    template = L.Classifier(build(Lazy, seed=5))
    batches = classification_batches(15, steps=7)

    def before(model, it):
        model.predictor.use_late = it >= 3

    check(impl, template, momentum_sgd(0.1), lossfun_step(batches, before),
          wait, SGD_TOL, steps=7, expect_skips=2)


def test_link_added_after_training_started(impl, wait):
    template = L.Classifier(build(Growing, seed=6))
    batches = classification_batches(16, steps=7)

    def step(model, opt, it, impl):
        if it == 2:
            # Rank-dependent init; rank 0's is broadcast by this update.
            eq.seed_for_rank(66)
            model.predictor.add_link('extra', L.Linear(8, 8))
            # Chainer's setup() gives update rules only to the parameters
            # that existed then; a user adding a link gives it one.
            for p in model.predictor.extra.params():
                p.update_rule = opt.create_update_rule()
        x, t = batches[it]
        opt.update(model, x, t)

    check(impl, template, momentum_sgd(0.1), step, wait, SGD_TOL, steps=7,
          expect_skips=2)


def test_dynamic_branch_differs_between_ranks_and_iterations(impl, wait,
                                                             comm):
    template = L.Classifier(build(Dynamic, seed=7))
    batches = classification_batches(17, x_shape=(6,), steps=8)

    def before(model, it):
        model.predictor.branch = (it + comm.rank) % 4

    check(impl, template, momentum_sgd(0.1), lossfun_step(batches, before),
          wait, SGD_TOL, steps=8)


def test_dynamic_branch_adam_weight_decay(impl, wait, comm):
    # Zero-filled (unused) parameters still get WeightDecay and Adam's
    # moment updates, which makes a missing zero fill visible.
    template = L.Classifier(build(Dynamic, seed=8))
    batches = classification_batches(18, x_shape=(6,), steps=8)

    def before(model, it):
        model.predictor.branch = (it * 3 + comm.rank) % 4

    check(impl, template, lambda: chainer.optimizers.Adam(alpha=0.01),
          lossfun_step(batches, before), wait, ADAM_TOL, steps=8,
          hooks=lambda: [optimizer_hooks.WeightDecay(1e-2)])


def test_forget(impl, wait):
    template = L.Classifier(build(Forgetful, seed=9))
    batches = classification_batches(19)
    check(impl, template, momentum_sgd(0.1), lossfun_step(batches), wait,
          SGD_TOL)


def test_forget_with_link_also_used_outside(impl, wait):
    # Chainer 7.8.1's F.forget loses the gradient of a parameter that is
    # used both inside and outside the forgotten function: plain Chainer
    # gives only the outside part (checked against finite differences), so
    # ChainerMN's result is wrong here.  The oracle is ChainerMN on the same
    # function computed without F.forget, i.e. the true gradient.
    template = L.Classifier(build(Forgetful, l1_outside=True, seed=9))
    batches = classification_batches(19)

    def step(model, opt, it, impl):
        model.predictor.use_forget = impl is not eq.REFERENCE
        x, t = batches[it]
        opt.update(model, x, t)

    wait, options = mode(wait)
    ref, got = eq.train_both(impl, template, momentum_sgd(0.1), step, STEPS,
                             wait, options=options)
    if impl.is_reference:
        # Harness validation: Chainer's own result misses the gradient.
        eq.assert_different(got.model, ref.model, **SGD_TOL)
    else:
        eq.assert_equivalent(got.model, ref.model, **SGD_TOL)


def test_parameter_used_outside_its_link(impl, wait):
    template = L.Classifier(build(ParamOutside, seed=10))
    batches = classification_batches(20)
    check(impl, template, momentum_sgd(0.1), lossfun_step(batches), wait,
          SGD_TOL, hooks=lambda: [optimizer_hooks.WeightDecay(1e-2)])


def test_gradient_clipping_falls_back_with_one_warning(impl, wait):
    # The threshold is well below the gradient norm, so clipping is active
    # on every step and depends on every gradient of the model.
    template = L.Classifier(build(MLP, seed=11))
    batches = classification_batches(21)
    wait, options = mode(wait)
    ref, got = eq.train_both(
        impl, template, momentum_sgd(0.1), lossfun_step(batches), STEPS,
        wait, options=options,
        hooks=lambda: [optimizer_hooks.GradientClipping(0.05)])
    eq.assert_equivalent(got.model, ref.model, **SGD_TOL)
    if impl.fallback_warning is None:
        return
    assert issubclass(impl.fallback_warning, UserWarning)
    n = got.count_warnings(impl.fallback_warning)
    # Sharded, the norm is taken over the shards: nothing falls back.
    expected = 1 if wait == 'forward' and not eq.shard_mode() else 0
    eq.assert_all_ranks(n == expected, 'wait=%r: %d FallbackWarning(s), '
                        'expected %d: %s' % (wait, n, expected,
                                             [str(w.message)
                                              for w in got.warnings]))


def test_per_parameter_hooks(impl, wait):
    template = L.Classifier(build(MLP, seed=12))
    batches = classification_batches(22)
    # GradientLARS takes norms of whole parameters: sharded, each
    # parameter must then be updated whole by one rank.
    options = {'shard_unit': 'parameter'} if eq.shard_mode() else None
    check(impl, template, momentum_sgd(0.1), lossfun_step(batches), wait,
          SGD_TOL, options=options, hooks=lambda: [
              optimizer_hooks.WeightDecay(1e-2),
              optimizer_hooks.Lasso(1e-3),
              optimizer_hooks.GradientHardClipping(-0.2, 0.2),
              optimizer_hooks.GradientLARS(threshold=1e-2)])


def test_links_run_without_gradient(impl, wait, comm):
    template = L.Classifier(build(DeadEnds, seed=19))
    batches = classification_batches(27, steps=7)

    def before(model, it):
        model.predictor.kind = (it + comm.rank) % 3

    check(impl, template, momentum_sgd(0.1), lossfun_step(batches, before),
          wait, SGD_TOL, steps=7,
          hooks=lambda: [optimizer_hooks.WeightDecay(1e-2)])


def test_two_optimizers_gan_updater(impl, wait, comm):
    # ChainerMN's DCGAN example: one optimizer per network; the
    # discriminator's loss also back-propagates into the generator, and the
    # generator's loss is back-propagated through the same graph again.
    template = build(GAN, seed=20)
    data = eq.make_batches(28, STEPS, 4, (5,), y_shape=(3,))
    w, options = mode(wait)

    def loss_dis(dis, y_fake, y_real):
        n = len(y_fake)
        return (F.sum(F.softplus(-y_real)) + F.sum(F.softplus(y_fake))) / n

    def loss_gen(gen, y_fake):
        return F.sum(F.softplus(-y_fake)) / len(y_fake)

    def run(which):
        model = copy.deepcopy(template)
        eq.seed_for_rank(0)
        opts = {}
        for name in ('gen', 'dis'):
            opts[name] = which.create(
                chainer.optimizers.Adam(alpha=0.01, beta1=0.5), comm,
                wait=w, **options).setup(getattr(model, name))
        for x_real, z in data:
            y_real = model.dis(x_real)
            y_fake = model.dis(model.gen(z))
            opts['dis'].update(loss_dis, model.dis, y_fake, y_real)
            opts['gen'].update(loss_gen, model.gen, y_fake)
        for o in opts.values():
            which.synchronize(o)
        return model, opts

    ref, _ = run(eq.REFERENCE)
    got, _ = run(impl)
    eq.assert_equivalent(got, ref, **ADAM_TOL)


# ---------------------------------------------------------------------------
# Calling styles.
# ---------------------------------------------------------------------------

def test_manual_backward_then_update(impl, wait):
    template = L.Classifier(build(CNN, seed=13))
    batches = classification_batches(23, x_shape=(1, 6, 6))

    def step(model, opt, it, impl):
        x, t = batches[it]
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        opt.update()

    check(impl, template, momentum_sgd(0.05), step, wait, SGD_TOL)


def test_zerograds_and_the_mean_gradient_after_update(impl, wait):
    # zerograds fills param.grad in place; after update() param.grad is a
    # view of the pending mean (wait='forward'), which must be applied
    # before it is zeroed.  After synchronize() param.grad is the mean
    # gradient, as ChainerMN leaves it.
    template = L.Classifier(build(CNN, seed=16))
    batches = classification_batches(26, x_shape=(1, 6, 6))

    def step(model, opt, it, impl):
        x, t = batches[it]
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', DeprecationWarning)
            model.zerograds()
        model(x, t).backward()
        opt.update()

    ref, got = check(impl, template, momentum_sgd(0.05), step, wait,
                     SGD_TOL)
    grads = dict(got.model.namedparams())
    errors = []
    for name, p in ref.model.namedparams():
        mine = grads[name].grad
        if eq.shard_mode() in ('gradients', 'parameters'):
            # No rank holds a whole mean gradient; none is left.
            if mine is not None:
                errors.append(name)
        elif eq.shard_mode() == 'optimizer':
            pass   # the local gradient stays (tests/mpi/test_sharding.py)
        elif mine is None or not np.allclose(mine, p.grad, **SGD_TOL):
            errors.append(name)
    eq.assert_all_ranks(not errors, 'param.grad after update() differs '
                        "from ChainerMN's mean gradient: %s" % errors)


def test_gradients_set_by_hand_without_backward(impl, wait, comm):
    template = build(MLP, seed=14)

    def step(model, opt, it, impl):
        rng = np.random.RandomState(1000 * it + comm.rank)
        for name, p in sorted(model.namedparams()):
            if (it + comm.rank) % 4 == 3:
                p.cleargrad()        # a rank without any gradient
            elif name == '/l2/b' and (it + comm.rank) % 2 == 0:
                p.cleargrad()        # missing gradient: counts as zeros
            else:
                p.grad = rng.standard_normal(p.shape).astype(np.float32)
        opt.update()

    check(impl, template, momentum_sgd(0.1), step, wait, SGD_TOL, steps=8,
          hooks=lambda: [optimizer_hooks.WeightDecay(1e-2)])


def test_forward_without_backprop_inside_the_loss(impl, wait):
    # DQN-style: a target computed by the same model under
    # no_backprop_mode (and train=False) inside the loss function.
    template = build(MLPBN, seed=21)
    batches = eq.make_batches(29, STEPS, 4, (5,), y_shape=(5,))

    def lossfun(model, x, x_next):
        with chainer.no_backprop_mode(), \
                chainer.using_config('train', False):
            target = F.max(model(x_next), axis=1)
        q = F.max(model(x), axis=1)
        return F.mean_squared_error(q, 0.5 + 0.9 * target.array)

    def step(model, opt, it, impl):
        x, x_next = batches[it]
        opt.update(lossfun, model, x, x_next)

    check(impl, template, momentum_sgd(0.05), step, wait, SGD_TOL)


def test_extra_forward_between_backward_and_update(impl, wait):
    # A forward for logging after backward and before update() (no
    # backward of its own): legal with ChainerMN, must not change results.
    template = L.Classifier(build(MLP, seed=22))
    batches = classification_batches(30)

    def step(model, opt, it, impl):
        x, t = batches[it]
        model.cleargrads()
        model(x, t).backward()
        model.predictor(x)             # e.g. logging the training outputs
        opt.update()

    check(impl, template, momentum_sgd(0.1), step, wait, SGD_TOL)


def test_sequential_chainlist(impl, wait):
    eq.seed_for_rank(23)
    # Sequential is a ChainList: parameters are named /0/W, /2/W, ...
    template = L.Classifier(chainer.Sequential(
        L.Linear(5, 8), F.relu, L.Linear(8, 8), F.relu, L.Linear(8, 3)))
    batches = classification_batches(31)
    check(impl, template, momentum_sgd(0.1), lossfun_step(batches), wait,
          SGD_TOL)


def test_gradient_accumulation_with_no_sync(impl, wait):
    # k micro-batches per update: the first k-1 inside no_sync() (local
    # accumulation), the last outside.  ChainerMN reduces once in update(),
    # i.e. it is given the summed gradients.
    k = 3
    template = L.Classifier(build(MLPBN, seed=15))
    batches = eq.make_batches(24, STEPS * k, 2, (5,), n_classes=3)

    def step(model, opt, it, impl):
        model.cleargrads()
        for j in range(k):
            x, t = batches[it * k + j]
            if j < k - 1:
                with impl.no_sync(opt):
                    model(x, t).backward()
            else:
                model(x, t).backward()
        opt.update()

    check(impl, template, momentum_sgd(0.05), step, wait, SGD_TOL)


@pytest.mark.parametrize('read', ['save_npz_model', 'optimizer_serialize',
                                  'copy', 'to_cpu'])
def test_reads_through_chainer_see_updated_parameters(impl, wait, read,
                                                      tmp_path):
    # No synchronize() here: reading parameters through Chainer must
    # synchronize by itself.
    template = L.Classifier(build(MLP, seed=16))
    batches = classification_batches(25)
    ref = eq.train(eq.REFERENCE, template, momentum_sgd(0.1),
                   lossfun_step(batches), STEPS)
    wait, options = mode(wait)
    got = eq.train(impl, template, momentum_sgd(0.1), lossfun_step(batches),
                   STEPS, wait, options=options, synchronize=False)
    comm = eq.get_communicator()
    if read == 'save_npz_model':
        path = str(tmp_path / ('model-rank%d.npz' % comm.rank))
        serializers.save_npz(path, got.model)
        loaded = copy.deepcopy(template)
        serializers.load_npz(path, loaded)
        seen = eq.param_state(loaded)
    elif read == 'optimizer_serialize':
        path = str(tmp_path / ('opt-rank%d.npz' % comm.rank))
        serializers.save_npz(path, got.opt)
        seen = eq.param_state(got.model)
    elif read == 'copy':
        seen = eq.param_state(got.model.copy(mode='copy'))
    else:
        got.model.to_cpu()
        seen = eq.param_state(got.model)
    eq.assert_equivalent(seen, ref.model, what=read, **SGD_TOL)
    impl.synchronize(got.opt)
    eq.assert_equivalent(got.model, ref.model, what='after synchronize',
                         **SGD_TOL)


def test_wait_forward_defers_updates_to_the_next_forward(impl):
    # Makes sure the wait='forward' runs above really exercised the deferred
    # per-link path: update() leaves the parameters as they were, the next
    # forward of a link applies that link's update only.
    if eq.shard_mode():
        pytest.skip('sharded, the communication thread updates each bucket '
                    'as soon as it is reduced; test_sharding.py checks what '
                    'a forward waits for')
    template = L.Classifier(build(MLP, seed=24))
    batches = classification_batches(32)
    ref = eq.train(eq.REFERENCE, template, momentum_sgd(0.1),
                   lossfun_step(batches), STEPS)
    got = eq.train(impl, template, momentum_sgd(0.1), lossfun_step(batches),
                   STEPS - 1, 'forward', options={'bucket_size': SMALL_BUCKET})
    model, opt = got.model, got.opt
    before = eq.param_state(model, persistents=False)
    x, t = batches[STEPS - 1]
    opt.update(model, x, t)
    after_update = eq.param_state(model, persistents=False)
    l1 = model.predictor.l1
    l1(x)                          # only l1 runs
    after_l1 = eq.param_state(model, persistents=False)
    if impl.is_reference:
        # ChainerMN updates inside update(): the check below can fail.
        eq.assert_different(after_update, before, rtol=0, atol=0)
        return
    eq.assert_equivalent(after_update, before, rtol=0, atol=0,
                         what='parameters right after update()')
    l1_names = {'param /predictor/l1/W', 'param /predictor/l1/b'}
    eq.assert_equivalent({k: v for k, v in after_l1.items() if k in l1_names},
                         {k: v for k, v in eq.param_state(ref.model).items()
                          if k in l1_names}, what='l1 after its forward',
                         **SGD_TOL)
    eq.assert_equivalent({k: v for k, v in after_l1.items()
                          if k not in l1_names},
                         {k: v for k, v in before.items()
                          if k not in l1_names}, rtol=0, atol=0,
                         what='other links before their forward')
    opt.synchronize()
    eq.assert_equivalent(model, ref.model, **SGD_TOL)


# ---------------------------------------------------------------------------
# Trainer, Evaluator, snapshot and resume.
# ---------------------------------------------------------------------------

STOP = 7
SNAPSHOT_AT = 3   # between two evaluations: updates are pending there


def _datasets(comm):
    rng = eq.global_rng(30)
    n_train, n_test = 12 * comm.size, 8 * comm.size
    x = rng.standard_normal((n_train + n_test, 5)).astype(np.float32)
    t = rng.randint(0, 3, size=n_train + n_test).astype(np.int32)
    train = chainer.datasets.TupleDataset(eq.rank_slice(x[:n_train], axis=0),
                                          eq.rank_slice(t[:n_train], axis=0))
    test = chainer.datasets.TupleDataset(eq.rank_slice(x[n_train:], axis=0),
                                         eq.rank_slice(t[n_train:], axis=0))
    return train, test


def _make_trainer(impl, model, wait, out, comm, record):
    train, test = _datasets(comm)
    wait, options = mode(wait)
    opt = impl.create(chainer.optimizers.MomentumSGD(lr=0.1), comm,
                      wait=wait, **options)
    opt.setup(model)
    opt.add_hook(optimizer_hooks.WeightDecay(1e-3))
    updater = training.StandardUpdater(
        chainer.iterators.SerialIterator(train, 4, shuffle=False), opt)
    trainer = training.Trainer(updater, (STOP, 'iteration'), out=out)
    evaluator = extensions.Evaluator(
        chainer.iterators.SerialIterator(test, 4, repeat=False,
                                         shuffle=False), model)
    trainer.extend(chainermn.create_multi_node_evaluator(evaluator, comm),
                   trigger=(2, 'iteration'), name='validation')
    # Sets opt.lr through the wrapper every iteration (and is resumed).
    trainer.extend(extensions.ExponentialShift('lr', 0.8),
                   trigger=(1, 'iteration'))
    trainer.extend(
        extensions.snapshot(filename='snapshot_{.updater.iteration}'),
        trigger=(SNAPSHOT_AT, 'iteration'))

    @training.make_extension(trigger=(1, 'iteration'),
                             priority=training.PRIORITY_READER)
    def record_validation(trainer):
        value = trainer.observation.get('validation/main/loss')
        if value is not None:
            record[trainer.updater.iteration] = float(
                np.asarray(getattr(value, 'array', value)))

    trainer.extend(record_validation)
    return trainer, opt


def test_trainer_evaluator_snapshot_resume(impl, wait, comm, tmp_path):
    template = L.Classifier(build(MLPBN, seed=17))
    outs = {}
    for name in ('ref', 'ours', 'resumed'):
        outs[name] = str(tmp_path / ('%s-rank%d' % (name, comm.rank)))
        os.makedirs(outs[name])

    # The reference: ChainerMN, uninterrupted.
    ref_model, ref_record = copy.deepcopy(template), {}
    ref_trainer, ref_opt = _make_trainer(eq.REFERENCE, ref_model, wait,
                                         outs['ref'], comm, ref_record)
    ref_trainer.run()

    # Ours, uninterrupted; it also writes the snapshot at SNAPSHOT_AT.
    model, record = copy.deepcopy(template), {}
    trainer, opt = _make_trainer(impl, model, wait, outs['ours'], comm,
                                 record)
    trainer.run()
    # Immediately after training, without synchronize(): the saved model
    # must hold the final, updated parameters.
    model_path = os.path.join(outs['ours'], 'final_model.npz')
    serializers.save_npz(model_path, model)
    saved = copy.deepcopy(template)
    serializers.load_npz(model_path, saved)
    eq.assert_equivalent(saved, ref_model, what='save_npz(model) after '
                         'trainer.run()', **SGD_TOL)
    impl.synchronize(opt)
    eq.assert_equivalent(model, ref_model, what='uninterrupted', **SGD_TOL)
    eq.assert_all_ranks(opt.t == ref_opt.t == STOP - 1,
                        't: ours %r, ChainerMN %r' % (opt.t, ref_opt.t))
    eq.assert_all_ranks(
        sorted(record) == sorted(ref_record) == [2, 4, 6] and all(
            np.isclose(record[i], ref_record[i], **SGD_TOL) for i in record),
        'validation losses: ours %r, ChainerMN %r' % (record, ref_record))

    # A new model, optimizer and trainer resumed from the snapshot.
    snapshot = os.path.join(outs['ours'], 'snapshot_%d' % SNAPSHOT_AT)
    resumed_model, resumed_record = copy.deepcopy(template), {}
    resumed, resumed_opt = _make_trainer(impl, resumed_model, wait,
                                         outs['resumed'], comm,
                                         resumed_record)
    serializers.load_npz(snapshot, resumed)
    eq.assert_all_ranks(resumed.updater.iteration == SNAPSHOT_AT,
                        'resumed at iteration %r'
                        % resumed.updater.iteration)
    resumed.run()
    impl.synchronize(resumed_opt)
    if impl.resume_skips:
        # ChainerMN skips the first update after a resume: the harness must
        # see that as a difference.
        eq.assert_different(resumed_model, model, what='chainermn resume',
                            **SGD_TOL)
        return
    eq.assert_equivalent(resumed_model, model, what='resumed vs '
                         'uninterrupted', **SGD_TOL)
    eq.assert_equivalent(resumed_model, ref_model, what='resumed vs '
                         'chainermn', **SGD_TOL)
    eq.assert_all_ranks(resumed_opt.t == opt.t,
                        't: resumed %r, uninterrupted %r'
                        % (resumed_opt.t, opt.t))
    eq.assert_all_ranks(
        sorted(resumed_record) == [4, 6] and all(
            np.isclose(resumed_record[i], record[i], **SGD_TOL)
            for i in resumed_record),
        'validation losses: resumed %r, uninterrupted %r'
        % (resumed_record, record))


# ---------------------------------------------------------------------------
# Negative controls: the harness can fail.
# ---------------------------------------------------------------------------

def test_negative_controls(impl, wait, comm):
    template = L.Classifier(build(MLP, seed=18))
    batches = classification_batches(26)
    step = lossfun_step(batches)
    wait, options = mode(wait)
    got = eq.train(impl, template, momentum_sgd(0.1), step, STEPS, wait,
                   options=options)
    ref = eq.train(eq.REFERENCE, template, momentum_sgd(0.1), step, STEPS)
    eq.assert_equivalent(got.model, ref.model, **SGD_TOL)
    # One step fewer.
    short = eq.train(eq.REFERENCE, template, momentum_sgd(0.1), step,
                     STEPS - 1)
    eq.assert_different(got.model, short.model, what='one step fewer',
                        **SGD_TOL)
    # Learning rate perturbed by 1%.
    other = eq.train(eq.REFERENCE, template, momentum_sgd(0.101), step,
                     STEPS)
    eq.assert_different(got.model, other.model, what='lr * 1.01',
                        **SGD_TOL)
    # A parameter perturbed by 1e-5 (relative) on the last rank only is
    # caught by the cross-rank check.
    if comm.size > 1:
        tweaked = copy.deepcopy(got.model)
        if comm.rank == comm.size - 1:
            tweaked.predictor.l1.W.array[0, 0] *= 1 + 1e-5
        errors = eq.cross_rank_errors(tweaked)
        ok, _ = eq.all_ranks_ok(not errors)
        assert not ok, 'the cross-rank check missed a difference'
    # Ranks started from different parameters (so the broadcast matters).
    ok, _ = eq.all_ranks_ok(not eq.cross_rank_errors(template))
    assert comm.size == 1 or not ok, 'templates should differ across ranks'
