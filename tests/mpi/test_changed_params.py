"""A changed set of parameters broadcasts and skips the step, as ChainerMN.

Collective tests (``tests/mpi_run.py -n N``).  Whenever the set of
initialised parameters changes between two updates -- a link added (with or
without ``setup()`` again), a link removed, a lazily initialised link used
for the first time -- ChainerMN broadcasts rank 0's parameters and skips
that step.  Ours must do the same, whatever call led there, in both wait
modes: the same parameters and the same ``t`` after *every* step, no update
rule run on the skipped step and nothing of it applied later, no NaN.
``setup()`` again on an unchanged model must not skip.

Every scenario is compared step by step with
``chainermn.create_multi_node_optimizer`` (after each step ours is
synchronised, or, in the ``lazy`` variants, only ``t`` is compared per step
so the deferred updates stay pending across iterations as in real training).
The new links are initialised differently on each rank, so a step that is
not skipped, or a broadcast that is missing, shows as a difference.
"""
import copy

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from chainermn_overlap.testing import equivalence as eq

STEPS = 7
TOLS = {'momentum': dict(rtol=1e-5, atol=1e-6),
        'adam': dict(rtol=1e-4, atol=1e-5)}
ACTUALS = {
    'momentum': lambda: chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9),
    'adam': lambda: chainer.optimizers.Adam(alpha=0.01),
}


class Net(chainer.Chain):
    """``extra`` is used when present; ``late`` is lazily initialised."""

    def __init__(self, with_extra=False):
        super().__init__()
        self.use_late = False
        with self.init_scope():
            self.l1 = L.Linear(5, 8)
            self.l2 = L.Linear(8, 3)
            self.late = L.Linear(None, 3)
            if with_extra:
                self.extra = L.Linear(8, 8)

    def forward(self, x):
        h = F.relu(self.l1(x))
        if hasattr(self, 'extra'):
            h = h + F.relu(self.extra(h))
        y = self.l2(h)
        if self.use_late:
            y = y + self.late(h)
        return y


def _add_extra(model, opt, setup_again):
    # Rank-dependent initial values: only a broadcast makes them agree.
    eq.seed_for_rank(77)
    model.predictor.add_link('extra', L.Linear(8, 8))
    if setup_again:
        opt.setup(model)
    else:
        # Chainer's setup() gives update rules only to the parameters that
        # existed then; a user adding a link without setup() gives them one.
        for p in model.predictor.extra.params():
            p.update_rule = opt.create_update_rule()


def _backward(model, x, t):
    model.cleargrads()
    model(x, t).backward()


# Each scenario: (with_extra at start, {step: action}), where an action is
# called as action(model, opt, x, t) and must end with an update().
SCENARIOS = {
    # The cases: add_link + setup() again, then update() with no
    # backward since (the new parameter's gradient is uninitialised).
    'add+setup, no backward': (False, {2: lambda m, o, x, t: (
        _add_extra(m, o, True), o.update())}),
    'add+setup, backward': (False, {2: lambda m, o, x, t: (
        _add_extra(m, o, True), _backward(m, x, t), o.update())}),
    'add, no setup': (False, {2: lambda m, o, x, t: (
        _add_extra(m, o, False), o.update(m, x, t))}),
    'remove': (True, {3: lambda m, o, x, t: (
        delattr(m.predictor, 'extra'), o.update(m, x, t))}),
    'remove+setup': (True, {3: lambda m, o, x, t: (
        delattr(m.predictor, 'extra'), o.setup(m), o.update(m, x, t))}),
    'lazy first use': (False, {3: lambda m, o, x, t: (
        setattr(m.predictor, 'use_late', True), o.update(m, x, t))}),
    # Nothing changed: setup() again must not skip (ChainerMN does not).
    'setup again, unchanged': (False, {3: lambda m, o, x, t: (
        o.setup(m), o.update(m, x, t))}),
    'setup again, no backward': (False, {3: lambda m, o, x, t: (
        o.setup(m), o.update())}),
}

# ChainerMN's t after the last step: the first update always skips, a
# changed set skips its step, and setup() resets t to 0.
FINAL_T = {'add+setup, no backward': 4, 'add+setup, backward': 4,
           'add, no setup': 5, 'remove': 5, 'remove+setup': 3,
           'lazy first use': 5, 'setup again, unchanged': 4,
           'setup again, no backward': 4}


def _run(impl, scenario, actual, wait, sync_each_step, comm,
         mimic_old_setup=False):
    """Trains; returns ``[(t, state or None)]`` after every step."""
    with_extra, actions = SCENARIOS[scenario]
    eq.seed_for_rank(5)
    model = L.Classifier(Net(with_extra))
    batches = eq.make_batches(31, STEPS, 2, (5,), n_classes=3, comm=comm)
    eq.seed_for_rank(0)
    opt = impl.create(ACTUALS[actual](), comm, wait=wait, bucket_size=256)
    opt.setup(model)
    if mimic_old_setup:
        _mimic_old_setup(opt)
    record = []
    for it in range(STEPS):
        x, t = batches[it]
        if it in actions:
            actions[it](model, opt, x, t)
        else:
            opt.update(model, x, t)
        if sync_each_step:
            impl.synchronize(opt)
            record.append((opt.t, eq.param_state(model, persistents=False)))
        else:
            record.append((opt.t, None))
    impl.synchronize(opt)
    return model, record


def _mimic_old_setup(opt):
    """Negative control: what setup() again did before (treat as resume)."""
    state = opt._overlap
    original = type(opt).setup

    def setup(link):
        again = state.target is link and state.buckets is not None
        original(opt, link)
        if again:
            state.mark_loaded()
        return opt
    opt.__dict__['setup'] = setup


def _compare(model, record, ref_model, ref_record, tol, label):
    for it, ((t, s), (rt, rs)) in enumerate(zip(record, ref_record)):
        eq.assert_all_ranks(t == rt, '%s: t after step %d: ours %r, '
                            'ChainerMN %r' % (label, it, t, rt))
        if s is not None:
            eq.assert_equivalent(s, rs, what='%s, after step %d'
                                 % (label, it), **tol)
    eq.assert_equivalent(model, ref_model, what=label, **tol)
    nan = [n for n, p in model.namedparams()
           if p.array is not None and not np.isfinite(p.array).all()]
    eq.assert_all_ranks(not nan, '%s: non-finite parameters %s'
                        % (label, nan))


@pytest.mark.parametrize('scenario', sorted(SCENARIOS))
@pytest.mark.parametrize('wait', ['forward', 'update'])
@pytest.mark.parametrize('actual,sync_each_step', [
    ('momentum', True), ('adam', True), ('momentum', False)])
def test_changed_parameters_equal_chainermn(impl, comm, scenario, wait,
                                            actual, sync_each_step):
    if scenario == 'setup again, no backward' and eq.shard_mode() in (
            'gradients', 'parameters'):
        pytest.skip("with shard='gradients' no gradient outlives update(): "
                    'an update without a new backward reduces zeros, where '
                    "ChainerMN reuses the last mean (documented)")
    ref_model, ref_record = _run(eq.REFERENCE, scenario, actual, wait,
                                 True, comm)
    model, record = _run(impl, scenario, actual, wait, sync_each_step, comm)
    _compare(model, record, ref_model, ref_record, TOLS[actual],
             '%s (%s, %s)' % (scenario, wait, actual))
    # The reference itself behaves as the scenario says (setup() resets t).
    eq.assert_all_ranks(ref_record[-1][0] == FINAL_T[scenario],
                        'ChainerMN ended at t=%d, expected %d'
                        % (ref_record[-1][0], FINAL_T[scenario]))


@pytest.mark.parametrize('wait', ['forward', 'update'])
def test_negative_control_old_setup_behaviour_is_caught(impl, comm, wait):
    """The comparison above fails for the previous behaviour of setup()."""
    if impl.is_reference:
        pytest.skip('mimics a behaviour of the overlapped optimizer')
    scenario = 'add+setup, backward'
    ref_model, ref_record = _run(eq.REFERENCE, scenario, 'momentum', wait,
                                 True, comm)
    with np.errstate(all='ignore'):
        model, record = _run(impl, scenario, 'momentum', wait, True, comm,
                             mimic_old_setup=True)
    with pytest.raises(AssertionError) as err:
        _compare(model, record, ref_model, ref_record, TOLS['momentum'],
                 'old behaviour')
    assert 't after step 2' in str(err.value)


def test_setup_on_a_copy_with_the_same_names(impl, comm):
    """setup() on another model object: same names, new parameter objects.

    ChainerMN compares names only and neither broadcasts nor skips; ours
    must not skip either (t and values as ChainerMN where ranks agree).
    """
    def run(im):
        eq.seed_for_rank(5)
        model = L.Classifier(Net())
        batches = eq.make_batches(32, 4, 2, (5,), n_classes=3, comm=comm)
        opt = im.create(ACTUALS['momentum'](), comm, wait='forward')
        opt.setup(model)
        for it in range(2):
            opt.update(model, *batches[it])
        im.synchronize(opt)
        model = copy.deepcopy(model)
        opt.setup(model)
        for it in range(2, 4):
            opt.update(model, *batches[it])
        im.synchronize(opt)
        return model, opt.t
    ref_model, ref_t = run(eq.REFERENCE)
    model, t = run(impl)
    eq.assert_all_ranks(t == ref_t == 2, 't: ours %r, ChainerMN %r'
                        % (t, ref_t))
    eq.assert_equivalent(model, ref_model, **TOLS['momentum'])
