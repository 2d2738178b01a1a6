"""Models whose training must equal ChainerMN's bit for bit, and why.

* :class:`~chainermn_overlap.testing.models.SSDLike`: feature maps read by
  three consumers (two heads and the next layer).  Our gradient taps once
  raised the rank of every link's function in Chainer's backward, which
  changed the order in which those three gradients are summed: a few ulp
  from ChainerMN, with ``wait='update'`` and ``'forward'`` alike.
* SSD's recipe (:func:`~chainermn_overlap.testing.models.add_ssd_hooks`):
  ``GradientScaling`` (a hook of the user's, not known to be element-wise)
  on the biases, ``WeightDecay`` on the rest.  Every ``shard=`` mode trains
  it with no change of the user's code (``shard_unit='auto'`` keeps the
  scaled parameters whole); ``shard_unit='element'`` given explicitly
  refuses the hook as before.

Bit for bit at up to 2 ranks; beyond, a sharded mean is summed in another
order than ChainerMN's allreduce (``test_shard_rules.py``'s tolerance).
Collective tests: every rank runs this file.
"""
import numpy as np
import pytest

import chainer
import chainer.links as L

import chainermn_overlap
from chainermn_overlap.errors import FallbackWarning
from chainermn_overlap.optimizers.sharding import layout
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing import models

MODES = [None, 'optimizer', 'gradients', 'parameters']
EXACT = dict(rtol=0, atol=0)
TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 4   # the first one broadcasts rank 0's parameters


def _batches(comm, seed=0, per_rank=2):
    rng = np.random.RandomState(seed)
    n, na = per_rank * comm.size, models.SSDLike.n_anchors
    xs = rng.randn(STEPS, n, 3, 8, 8).astype(np.float32)
    locs = rng.randn(STEPS, n, na, 4).astype(np.float32)
    labels = (rng.randint(1, 4, (STEPS, n, na))
              * (rng.rand(STEPS, n, na) < 0.2)).astype(np.int32)
    return [tuple(eq.rank_slice(a[i], comm, axis=0) for a in (xs, locs,
                                                              labels))
            for i in range(STEPS)]


def _template():
    eq.seed_for_rank(11)
    return models.SSDLike()


def _step(batches, hooks=True):
    def step(model, opt, it, impl):
        if it == 0 and hooks:
            models.add_ssd_hooks(model)   # after setup, as SSD's script
        opt.update(model, *batches[it])
    return step


def _sgd():
    return chainer.optimizers.MomentumSGD(lr=1e-3)


def _train(impl, comm, shard=None, wait='update', hooks=True, **options):
    if shard is not None:
        options.update(shard=shard, bucket_size=256)
    return eq.train(impl, _template(), _sgd, _step(_batches(comm), hooks),
                    STEPS, wait=wait, options=options)


def _tolerance(comm, shard):
    return EXACT if comm.size <= 2 or shard is None else TOL


@pytest.mark.parametrize('wait', ['update', 'forward'])
@pytest.mark.parametrize('hooks', [False, True], ids=['plain', 'ssd_hooks'])
def test_ssd_like_equals_chainermn(comm, wait, hooks):
    ref = _train(eq.REFERENCE, comm, hooks=hooks)
    got = _train(eq.implementation_under_test(), comm, wait=wait,
                 hooks=hooks)
    eq.assert_equivalent(got.model, ref.model, persistents=False,
                         what='wait={!r}'.format(wait), **EXACT)


@pytest.mark.parametrize('shard', MODES[1:])
def test_gradient_scaling_trains_under_every_shard_mode(comm, shard):
    """No code change: the default shard_unit keeps the scaled biases
    whole, cuts the other parameters evenly, and says so once (rank 0)."""
    ref = _train(eq.REFERENCE, comm)
    got = _train(eq.OverlappedImpl(), comm, shard=shard)
    try:
        eq.assert_equivalent(got.model, ref.model, persistents=False,
                             what='shard={!r}'.format(shard),
                             **_tolerance(comm, shard))
        if comm.size == 1:
            return   # one rank cuts nothing: the equality is what is left
        policy = got.opt._overlap.policy
        names = {id(p): n for n, p in got.model.namedparams()}
        cut = {names[i] for i in policy.cut}
        eq.assert_all_ranks(
            not any(n.endswith('/b') for n in cut)
            and any(n.endswith('/W') for n in cut),
            'cut between ranks: {}'.format(sorted(cut)), comm)
        # Not vacuous: an even cut of the same buckets splits a bias.
        straddled = [
            name for b in policy.buckets
            for name, off, size in b.plan.entries
            for start, _ in layout.bounds_from_counts(layout.element_counts(
                b.plan.nelems, comm.size, rotate=b.index))
            if name.endswith('/b') and off < start < off + size]
        eq.assert_all_ranks(bool(straddled),
                            'no bias would be cut by an even cut', comm)
        warned = [str(w.message) for w in got.warnings
                  if issubclass(w.category, FallbackWarning)]
        ok = (len(warned) == 1 and 'GradientScaling on ' in warned[0]
              if comm.rank == 0 else not warned)
        eq.assert_all_ranks(ok, 'warnings: {}'.format(warned), comm)
    finally:
        got.opt.close()


@pytest.mark.parametrize('shard', MODES[1:])
def test_explicit_element_unit_refuses_the_hook(comm, shard):
    with pytest.raises(ValueError) as info:
        _train(eq.OverlappedImpl(), comm, shard=shard,
               shard_unit='element')
    message = str(info.value)
    eq.assert_all_ranks(
        'update-rule hook GradientScaling of b is not known to be '
        'element-wise' in message and "shard_unit='parameter'" in message,
        'unexpected message: ' + message, comm)


def test_a_hook_added_to_a_cut_parameter_later_is_refused(comm):
    """The layout is built at the first update: a hook added afterwards to
    a parameter it cuts cannot be run on the slices."""
    model = L.Classifier(models.MLP(5, 64, 3))
    opt = chainermn_overlap.create_overlapped_optimizer(
        _sgd(), comm, shard='optimizer', bucket_size=256).setup(model)
    rng = np.random.RandomState(3)
    x = rng.randn(4, 5).astype(np.float32)
    t = rng.randint(0, 3, 4).astype(np.int32)
    try:
        opt.update(model, x, t)
        cut = [p for p in model.params() if id(p) in opt._overlap.policy.cut]
        eq.assert_all_ranks(comm.size == 1 or bool(cut), 'nothing cut', comm)
        if not cut:
            return
        cut[0].update_rule.add_hook(models.GradientScaling(2))
        with pytest.raises(ValueError, match='came after the bucket layout.*'
                           'before the first update'):
            opt.update(model, x, t)
    finally:
        opt.close()
