"""Dynamic loss scaling (``optimizer.loss_scaling()``) under every ``shard=``.

Chainer's ``GradientMethod.update`` checks every (reduced) gradient for inf
and nan; if it finds one, the step is skipped (the optimizer's ``t``
counts it, no update rule runs) and the scale is halved; after good steps
it grows.  A sharded optimizer holds no whole gradient: each rank checks its
shard and one allreduce of a flag decides for every rank.  Each mode is
compared with ChainerMN's ``create_multi_node_optimizer`` over steps of which
two overflow: parameters, whole update-rule states (their ``t`` included,
gathered by serializing the optimizer), the optimizer's ``t`` and the scale
after every step.

The overflow is a single inf put into one element of one parameter's
gradient, in backward, on one rank (:class:`_Poison`): its mean is inf in
that element only, which lies in one rank's shard, so every other rank
learns of it from the allreduce alone.

Tolerances: bit for bit at up to 2 ranks (a reduce-scatter of two ranks
sums as the allreduce does; element-wise rules give the same bits on a
slice); at 3 ranks the reduce-scatter sums in another order than ChainerMN's
allreduce, so parameters and states agree to rounding only
(``test_sharding.py``'s tolerance); with ``GradientClipping`` its norm is
summed from the shards in another order at any size.  ``t``, the scale and
which steps are skipped are exact at every size (the inf is exact).
Collective tests: every rank runs this file.
"""
import warnings

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer_hooks
from chainer import serializers

import chainermn_overlap
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP

MODES = ['optimizer', 'gradients', 'parameters']
TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 8   # the first one broadcasts rank 0's parameters
INTERVAL = 2
INF_AT = 3  # the element of the probe's gradient made inf
NON_FINITE = 'Non finite number found in param.grad of'


class _Poison(chainer.FunctionNode):
    """Identity whose backward copies the gradient (``F.sum``'s is a
    read-only broadcast) and, with ``poisoned``, makes one element inf."""

    def __init__(self, poisoned):
        self.poisoned = poisoned

    def forward(self, inputs):
        return inputs[0].copy(),

    def backward(self, indexes, grad_outputs):
        g = grad_outputs[0].array.copy()
        if self.poisoned:
            g[INF_AT] = np.inf
        return chainer.Variable(g),


class _Probe(chainer.Link):
    """Adds ``0 * sum(w)`` to its input; with ``poisoned`` set, the gradient
    of ``w`` is inf in element :data:`INF_AT` (and zero elsewhere)."""

    def __init__(self, n=8):
        super().__init__()
        self.poisoned = False
        with self.init_scope():
            self.w = chainer.Parameter(chainer.initializers.Normal(0.1), (n,))

    def forward(self, h):
        w = _Poison(self.poisoned).apply((self.w,))[0]
        s = F.reshape(F.sum(w) * 0, (1, 1))
        return h + F.broadcast_to(s, h.shape)


class _Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.mlp = MLP(5, 7, 3)
            self.probe = _Probe()

    def forward(self, x):
        return self.probe(self.mlp(x))


def _template():
    eq.seed_for_rank(5)
    return L.Classifier(_Net())


def _batches(seed=41, steps=STEPS):
    return eq.make_batches(seed, steps, per_rank=4, x_shape=(5,),
                           n_classes=3)


def _poison_rank(comm):
    return min(1, comm.size - 1)


def _adam():
    opt = chainer.optimizers.Adam(alpha=0.01)
    opt.loss_scaling(interval=INTERVAL)
    return opt


def _step(comm, batches, poison, history):
    """One iteration; ``poison``: {iteration: the rank whose gradient gets
    the inf}.  Appends ``(t, loss scale)`` after the update."""
    def step(model, opt, it, impl):
        model.predictor.probe.poisoned = poison.get(it) == comm.rank
        x, t = batches[it]
        opt.update(model, x, t)
        model.predictor.probe.poisoned = False
        history.append((int(opt.t), float(opt._loss_scale)))
    return step


def _opt_state(opt):
    """Every value the optimizer serializes (whole states, ``t``), plus the
    scaling's own state."""
    s = serializers.DictionarySerializer()
    s.save(opt)
    out = {k: np.array(v) for k, v in s.target.items()}
    out['_loss_scale'] = np.array(opt._loss_scale)
    out['_loss_scaling_isnan_ever'] = np.array(
        float(getattr(opt, '_loss_scaling_isnan_ever', False)))
    return out


def _run(comm, impl, shard=None, hooks=(), wait='forward', **options):
    poison = {3: _poison_rank(comm), 6: 0}
    history = []
    if shard is not None:
        options = dict(options, shard=shard, bucket_size=256)
    run = eq.train(impl, _template(), _adam,
                   _step(comm, _batches(), poison, history), STEPS,
                   wait=wait, options=options or None,
                   hooks=lambda: [h() for h in hooks])
    return run, history, _opt_state(run.opt)


def _differences(got, ref, state, ref_state, exact):
    """What differs between two runs: parameters and optimizer states bit
    for bit (``exact``), or ``t``s and the scale exactly and the rest to
    :data:`TOL`."""
    errors = []
    if exact:
        a = eq.param_state(got.model, persistents=False)
        b = eq.param_state(ref.model, persistents=False)
        pairs = [('optimizer ' + k, state.get(k), ref_state.get(k))
                 for k in sorted(set(state) | set(ref_state))]
        pairs += [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))]
        for name, x, y in pairs:
            try:
                np.testing.assert_array_equal(x, y)
            except AssertionError as e:
                errors.append('{}: {}'.format(
                    name, ' '.join(str(e).strip().splitlines()[:4])))
        return errors
    exact_keys = ['t', '_loss_scale', '_loss_scaling_isnan_ever'] + sorted(
        k for k in ref_state if k.endswith('/t'))
    for name in exact_keys:
        if not np.array_equal(state.get(name), ref_state[name]):
            errors.append('optimizer {}: {} vs {}'.format(
                name, state.get(name), ref_state[name]))
    errors += ['optimizer ' + e for e in eq.compare_states(
        {k: v for k, v in state.items() if k not in exact_keys},
        {k: v for k, v in ref_state.items() if k not in exact_keys}, **TOL)]
    return errors


def _compare(comm, shard, hooks=(), exact=True, wait='forward', **options):
    ref, ref_history, ref_state = _run(comm, eq.REFERENCE, hooks=hooks)
    got, history, state = _run(comm, eq.OverlappedImpl(), shard, hooks,
                               wait, **options)
    try:
        what = 'shard={!r} wait={!r} {} vs chainermn'.format(
            shard, wait, options)
        errors = []
        # The scale grows (doubling, then by 2 ** (1 / INTERVAL) once it has
        # overflowed) and halves at steps 3 and 6: the test is not vacuous.
        scales = [s for _, s in ref_history]
        if not (scales[3] < scales[2] and scales[6] < scales[5]
                and scales[5] > scales[4]):
            errors.append('the reference did not overflow as planned: '
                          '{}'.format(ref_history))
        if history != ref_history:
            errors.append('(t, scale) per step {} vs {}'.format(
                history, ref_history))
        errors += _differences(got, ref, state, ref_state, exact)
        eq.assert_all_ranks(not errors, what + ': ' + '; '.join(errors[:6]),
                            comm)
        eq.assert_equivalent(got.model, ref.model, persistents=False,
                             what=what, **(dict(rtol=0, atol=0) if exact
                                            else TOL))
    finally:
        got.opt.close()


@pytest.mark.parametrize('wait', ['forward', 'update'])
@pytest.mark.parametrize('shard', MODES)
def test_equals_chainermn(comm, shard, wait):
    _compare(comm, shard, exact=comm.size <= 2, wait=wait)


def test_equals_chainermn_with_updates_posted_in_backward(comm):
    # shard_update='backward' posts the updates in backward; with dynamic
    # scaling they must wait for the overflow flag, at update().
    _compare(comm, 'gradients', exact=comm.size <= 2,
             shard_update='backward')


@pytest.mark.parametrize('shard', MODES)
def test_equals_chainermn_with_gradient_clipping(comm, shard):
    # The norm is summed from the shards: not Chainer's order (allclose).
    _compare(comm, shard, hooks=[lambda: optimizer_hooks.GradientClipping(
        0.05)], exact=False)


@pytest.mark.parametrize('shard', MODES)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(comm, shard):
    batches = _batches(43, steps=5)
    model = _template()
    opt = chainermn_overlap.create_overlapped_optimizer(
        _adam(), comm, shard=shard, bucket_size=256).setup(model)
    try:
        for it in range(3):
            opt.update(model, *batches[it])
        opt.synchronize()
        params = eq.param_state(model, persistents=False)
        state = _opt_state(opt)
        probe = model.predictor.probe
        probe.poisoned = comm.rank == _poison_rank(comm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            opt.update(model, *batches[3])
        probe.poisoned = False
        warned = any(NON_FINITE in str(w.message) for w in caught)
        opt.synchronize()
        errors = eq.compare_states(eq.param_state(model, persistents=False),
                                   params, rtol=0, atol=0)
        after = _opt_state(opt)
        want = dict(state, t=state['t'] + 1, _loss_scale=np.array(
            max(1.0, float(state['_loss_scale']) / 2)),
            _loss_scaling_isnan_ever=np.array(1.0))
        errors += ['optimizer ' + e
                   for e in eq.compare_states(after, want, rtol=0, atol=0)]
        eq.assert_all_ranks(not errors, 'the step that overflowed changed: '
                            + '; '.join(errors[:6]), comm)
        # One rank owns the inf element: it alone found it (the others
        # skipped on its word).
        eq.assert_all_ranks(sum(comm.mpi_comm.allgather(warned)) == 1,
                            'ranks that found the inf: {}'.format(
                                comm.mpi_comm.allgather(warned)), comm)
        # The next step updates again (rules' t included).
        opt.update(model, *batches[4])
        opt.synchronize()
        eq.assert_different(model, params, what='the step after', **TOL)
        later = _opt_state(opt)
        rule_t = [k for k in state if k.endswith('/t') and k != 't']
        eq.assert_all_ranks(bool(rule_t) and all(
            later[k] == state[k] + 1 for k in rule_t),
            'rule t after the next step: {}'.format(
                {k: (state[k], later[k]) for k in rule_t}), comm)
    finally:
        opt.close()


@pytest.mark.parametrize('shard', MODES)
def test_a_static_scale_changed_between_steps_equals_chainermn(comm, shard):
    # No flag is exchanged without dynamic scaling; the rules still unscale
    # by the scale of each step's backward (with 'gradients' and
    # 'parameters' no gradient reaches the parameter, whose _loss_scale
    # backward then leaves as it was: the step's is the optimizer's).
    scales = {0: 4.0, 2: 16.0, 4: 0.75}

    def make_actual():
        return chainer.optimizers.Adam(alpha=0.01)

    def step(model, opt, it, impl):
        if it in scales:
            opt.set_loss_scale(scales[it])
        opt.update(model, *batches[it])

    batches = _batches(47, steps=6)
    ref = eq.train(eq.REFERENCE, _template(), make_actual, step, 6)
    got = eq.train(eq.OverlappedImpl(), _template(), make_actual, step, 6,
                   options={'shard': shard, 'bucket_size': 256})
    try:
        errors = _differences(got, ref, _opt_state(got.opt),
                              _opt_state(ref.opt), exact=comm.size <= 2)
        eq.assert_all_ranks(not errors, 'static scale, shard={!r}: {}'.format(
            shard, '; '.join(errors[:6])), comm)
    finally:
        got.opt.close()
