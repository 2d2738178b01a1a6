"""Every optimizer hook and optimizer Chainer ships, under every ``shard=``.

For each hook of ``chainer.optimizer_hooks``, each deprecated alias of one
in ``chainer.optimizer`` (``chainer.optimizer.WeightDecay``, as ChainerMN's
DCGAN example uses; issue 35) and each optimizer of ``chainer.optimizers``
(hence each update rule), and for each mode of ``shard=``, the sharded
optimizer either trains a small MLP as ChainerMN's
``create_multi_node_optimizer`` does with the same hook and optimizer, or
refuses the hook at its first sharded update with a ``ValueError`` naming
the hook and the reason.  Which is expected is written down here
(:data:`REFUSED`); the classes are enumerated from the modules and counted
(:data:`EXPECTED_COUNTS`), so a class Chainer adds cannot be forgotten and
the tests cannot pass with none.

Tolerances: bit for bit at up to 2 ranks (a reduce-scatter of two ranks
sums as an allreduce does, and element-wise rules give the same bits on a
slice), except with ``GradientClipping``, whose norm is summed from the
shards in another order than Chainer's; otherwise ``test_sharding.py``'s.
Collective tests: every rank runs this file.
"""
import importlib
import pkgutil
import warnings

import pytest

import chainer
import chainer.links as L
from chainer import optimizer as optimizer_module
from chainer import optimizer_hooks
from chainer import optimizers

from chainermn_overlap.optimizers.sharding import rules
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP

MODES = ['optimizer', 'gradients', 'parameters']
TOL = dict(rtol=1e-4, atol=1e-5)
EXACT = dict(rtol=0, atol=0)
STEPS = 5   # the first one broadcasts rank 0's parameters

HOOKS = sorted((c for c in vars(optimizer_hooks).values()
                if isinstance(c, type)), key=lambda c: c.__name__)
ALIASES = sorted((c for c in vars(optimizer_module).values()
                  if isinstance(c, type) and issubclass(c, tuple(HOOKS))),
                 key=lambda c: c.__name__)
OPTIMIZERS = sorted((c for c in vars(optimizers).values()
                     if isinstance(c, type)
                     and issubclass(c, chainer.Optimizer)),
                    key=lambda c: c.__name__)


def _rule_classes():
    """Every ``UpdateRule`` defined in a module of ``chainer.optimizers``."""
    found = set()
    for info in pkgutil.iter_modules(optimizers.__path__):
        module = importlib.import_module(optimizers.__name__ + '.' + info.name)
        found.update(c for c in vars(module).values()
                     if isinstance(c, type)
                     and issubclass(c, chainer.UpdateRule)
                     and c.__module__ == module.__name__)
    return found


RULES = _rule_classes()

#: What Chainer 7.8.1 ships.
EXPECTED_COUNTS = {'hooks': 6, 'aliases': 5, 'optimizers': 15, 'rules': 11}

#: Hook arguments that make each hook change the training of the MLP.
HOOK_ARGS = {'WeightDecay': (1e-2,), 'Lasso': (1e-3,),
             'GradientClipping': (0.05,),
             'GradientHardClipping': (-0.02, 0.02),
             'GradientNoise': (0.01,), 'GradientLARS': ()}

#: Hooks refused with the default shard_unit='element', by name (an alias
#: has its hook's name), and the reason their message gives.
REFUSED = {'GradientLARS': 'not known to be element-wise',
           'GradientNoise': 'not known to be element-wise'}


def _batches(seed=31):
    return eq.make_batches(seed, STEPS, per_rank=4, x_shape=(5,),
                           n_classes=3)


def _template():
    eq.seed_for_rank(7)
    return L.Classifier(MLP(5, 7, 3))


def _step(batches):
    def step(model, opt, it, impl):
        x, t = batches[it]
        opt.update(model, x, t)
    return step


def _make_hook(cls):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)
        return cls(*HOOK_ARGS[cls.__name__])


def _momentum_sgd():
    return chainer.optimizers.MomentumSGD(lr=0.1)


def _train(impl, make_actual, hooks=(), shard=None):
    options = None if shard is None else {'shard': shard,
                                          'bucket_size': 256}
    return eq.train(impl, _template(), make_actual, _step(_batches()), STEPS,
                    options=options,
                    hooks=lambda: [_make_hook(c) for c in hooks])


def _check_equal(make_actual, hooks, shard, comm):
    clipped = any(issubclass(c, optimizer_hooks.GradientClipping)
                  for c in hooks)
    tol = EXACT if comm.size <= 2 and not clipped else TOL
    ref = _train(eq.REFERENCE, make_actual, hooks)
    got = _train(eq.OverlappedImpl(), make_actual, hooks, shard)
    try:
        eq.assert_equivalent(got.model, ref.model, persistents=False,
                             what='shard={!r} vs chainermn'.format(shard),
                             **tol)
    finally:
        got.opt.close()


def test_the_enumeration_found_every_class():
    found = {'hooks': len(HOOKS), 'aliases': len(ALIASES),
             'optimizers': len(OPTIMIZERS), 'rules': len(RULES)}
    assert found == EXPECTED_COUNTS
    assert set(REFUSED) <= {c.__name__ for c in HOOKS}
    assert set(HOOK_ARGS) == {c.__name__ for c in HOOKS}
    # Each alias subclasses the hook of its name, and still warns.
    for alias in ALIASES:
        assert alias.__bases__ == (getattr(optimizer_hooks,
                                           alias.__name__),)
        with pytest.warns(DeprecationWarning):
            alias(*HOOK_ARGS[alias.__name__])
    # The optimizers create every update rule there is.
    model = L.Linear(2, 2)
    made = set()
    for cls in OPTIMIZERS:
        opt = cls()
        opt.setup(model)
        made.add(type(opt.create_update_rule()))
    assert made == RULES


@pytest.mark.parametrize('hook', [c for c in HOOKS
                                  if c.__name__ not in REFUSED],
                         ids=lambda c: c.__name__)
def test_each_accepted_hook_changes_the_training(comm, hook):
    """Not vacuous: with its arguments the hook bites on this MLP."""
    plain = _train(eq.REFERENCE, _momentum_sgd)
    hooked = _train(eq.REFERENCE, _momentum_sgd, [hook])
    eq.assert_different(hooked.model, plain.model, what=hook.__name__,
                        **TOL)


@pytest.mark.parametrize('shard', MODES)
@pytest.mark.parametrize('hook', HOOKS + ALIASES,
                         ids=lambda c: c.__module__.split('.')[1] + '.'
                         + c.__name__)
def test_hook(comm, hook, shard):
    name = hook.__name__
    if name not in REFUSED:
        _check_equal(_momentum_sgd, [hook], shard, comm)
        return
    opt = eq.OverlappedImpl().create(_momentum_sgd(), comm, shard=shard,
                                     bucket_size=256)
    model = _template()
    opt.setup(model)
    opt.add_hook(_make_hook(hook))
    batches = _batches()
    try:
        # The first update builds the layout (nothing is sharded yet);
        # the first sharded one checks the hooks.
        with pytest.raises(ValueError) as info:
            for it in range(2):
                x, t = batches[it]
                opt.update(model, x, t)
    finally:
        opt.close()
    message = str(info.value)
    eq.assert_all_ranks(
        'optimizer hook {} '.format(name) in message
        and REFUSED[name] in message and "shard_unit='parameter'" in message,
        'unexpected message: ' + message, comm)


@pytest.mark.parametrize('shard', MODES)
@pytest.mark.parametrize('cls', OPTIMIZERS, ids=lambda c: c.__name__)
def test_optimizer(comm, cls, shard):
    _check_equal(cls, [], shard, comm)


# ---------------------------------------------------------------------------
# Only Chainer's own aliases stand for the hooks: a user subclass may change
# what the hook does, and is known only by its exact class.

class _MyWeightDecay(optimizer_hooks.WeightDecay):
    """Adds nothing, but is not Chainer's alias: not known."""


class _MyClipping(optimizer_hooks.GradientClipping):
    def __call__(self, opt):
        pass


@pytest.mark.parametrize('hook, match', [
    (_MyWeightDecay(1e-2), 'optimizer hook _MyWeightDecay is not known to '
     'be element-wise'),
    (_MyClipping(0.05), 'optimizer hook _MyClipping subclasses '
     'GradientClipping: shard= clips with the norm it takes from the shards'),
], ids=['WeightDecay_subclass', 'GradientClipping_subclass'])
def test_user_subclasses_are_refused(hook, match):
    opt = _momentum_sgd()
    opt.setup(L.Linear(3, 2))
    opt.add_hook(hook)
    with pytest.raises(ValueError, match=match):
        rules.check_optimizer(opt, list(opt.target.params()), 'element', 0)


def test_chainers_aliases_are_the_ones_known():
    assert rules.DEPRECATED_ALIASES == {
        alias: getattr(optimizer_hooks, alias.__name__) for alias in ALIASES}
