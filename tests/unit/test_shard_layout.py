"""Shard layouts (pure functions) and the element-wise checks, without MPI."""
import numpy as np
import pytest

import chainer
import chainer.links as L
from chainer import optimizer_hooks

from chainermn_overlap.optimizers.sharding import layout
from chainermn_overlap.optimizers.sharding import rules


@pytest.mark.parametrize('n, size', [(0, 3), (1, 4), (10, 4), (7, 7),
                                     (1000003, 8)])
def test_element_counts_are_even_and_complete(n, size):
    for rotate in range(size):
        c = layout.element_counts(n, size, rotate)
        assert sum(c) == n and len(c) == size
        assert max(c) - min(c) <= 1


def test_element_extras_rotate_over_buckets():
    # 3 buckets of 5 elements on 4 ranks: every rank gets about the same.
    counts = layout.plan_counts([[5], [5], [5], [5]], 4)
    totals = np.sum(counts, axis=0)
    assert totals.max() - totals.min() <= 1


def test_parameter_counts_keep_parameters_whole():
    sizes = [[3, 5, 2], [7], [1, 1, 1], [4, 4]]
    counts = layout.plan_counts(sizes, 3, 'parameter')
    for members, c in zip(sizes, counts):
        # Each piece is a run of whole members, in order.
        cuts = np.cumsum([0] + members)
        for start, stop in layout.bounds_from_counts(c):
            assert start in cuts and stop in cuts
    totals = np.sum(counts, axis=0)
    assert totals.max() - totals.min() <= max(max(m) for m in sizes)


def test_parameter_counts_balance_a_model_of_one_parameter_buckets():
    sizes = [[10]] * 8
    totals = np.sum(layout.plan_counts(sizes, 4, 'parameter'), axis=0)
    assert sorted(totals) == [20, 20, 20, 20]


@pytest.mark.parametrize('sizes, whole, size', [
    ([3, 5, 2], [False, True, False], 2),
    ([3, 5, 2], [False, True, False], 4),
    ([10], [True], 3),
    ([4, 1, 4, 1, 4], [False, True, False, True, False], 5),
    ([7, 7], [True, True], 3),
])
def test_auto_counts_keep_marked_parameters_whole(sizes, whole, size):
    starts = np.cumsum([0] + sizes)
    for rotate in range(size):
        even = layout.element_counts(sum(sizes), size, rotate)
        counts = layout.keep_whole(even, sizes, whole)
        assert len(counts) == size and sum(counts) == sum(sizes)
        assert min(counts) >= 0
        for start, _ in layout.bounds_from_counts(counts):
            for off, n, w in zip(starts, sizes, whole):
                assert not (w and off < start < off + n)
        # A cut outside the whole parameters stays where it was.
        for (a, _), (b, _) in zip(layout.bounds_from_counts(even),
                                  layout.bounds_from_counts(counts)):
            if not any(w and off < a < off + n
                       for off, n, w in zip(starts, sizes, whole)):
                assert a == b


def test_auto_without_whole_parameters_is_element():
    sizes = [[3, 5, 2], [7], [1, 1, 1]]
    assert layout.plan_counts(sizes, 3, 'auto') == \
        layout.plan_counts(sizes, 3, 'element')
    element = layout.plan_counts(sizes, 3)
    auto = layout.plan_counts(sizes, 3, 'auto',
                              [[False] * 3, [True], [False] * 3])
    assert auto[0] == element[0] and auto[2] == element[2]
    assert sorted(auto[1]) == [0, 0, 7]


def test_owned_range():
    # A parameter at 4..10 of its bucket; the rank owns 6..8 of the bucket.
    assert layout.owned_range(4, 6, 6, 8) == (2, 4, 0)
    assert layout.owned_range(4, 6, 0, 5) == (0, 1, 4)
    assert layout.owned_range(4, 6, 10, 12)[0:2] == (0, 0)


def test_bad_unit():
    with pytest.raises(ValueError, match="'element' or 'parameter'"):
        layout.plan_counts([[1]], 2, 'row')


def _setup(opt, *hooks):
    model = L.Linear(3, 2)
    opt.setup(model)
    for h in hooks:
        opt.add_hook(h)
    return list(model.params())


@pytest.mark.parametrize('hook', [optimizer_hooks.WeightDecay(1e-3),
                                  optimizer_hooks.Lasso(1e-3),
                                  optimizer_hooks.GradientHardClipping(-1, 1),
                                  optimizer_hooks.GradientClipping(1.0)])
def test_elementwise_and_global_hooks_pass(hook):
    opt = chainer.optimizers.Adam()
    rules.check_optimizer(opt, _setup(opt, hook), 'element', 0)


@pytest.mark.parametrize('hook', [optimizer_hooks.GradientLARS(),
                                  optimizer_hooks.GradientNoise(0.1)])
def test_hooks_that_need_whole_parameters(hook):
    opt = chainer.optimizers.SGD()
    params = _setup(opt, hook)
    with pytest.raises(ValueError, match="shard_unit='parameter'"):
        rules.check_optimizer(opt, params, 'element', 0)
    rules.check_optimizer(opt, params, 'parameter', 0)


def test_a_whole_optimizer_hook_is_refused():
    def clip_all(opt):
        pass
    opt = chainer.optimizers.SGD()
    params = _setup(opt, clip_all)
    with pytest.raises(ValueError, match='every gradient at once'):
        rules.check_optimizer(opt, params, 'parameter', 0)


@pytest.mark.parametrize('cls', [chainer.optimizers.SGD,
                                 chainer.optimizers.MomentumSGD,
                                 chainer.optimizers.Adam,
                                 chainer.optimizers.AdaGrad,
                                 chainer.optimizers.RMSprop,
                                 chainer.optimizers.NesterovAG,
                                 chainer.optimizers.AdaDelta,
                                 chainer.optimizers.SMORMS3])
def test_builtin_rules_update_a_slice_as_the_whole(cls):
    """What the element-wise list promises: the update of a slice (on its
    own rule state) gives the bits of the same slice of the whole update."""
    rng = np.random.RandomState(0)
    w = rng.randn(7, 5).astype(np.float32)
    grads = [rng.randn(7, 5).astype(np.float32) for _ in range(3)]
    whole = chainer.Parameter(w.copy())
    opt = cls()
    opt.setup(chainer.Link())
    rule = opt.create_update_rule()
    assert type(rule) in rules.ELEMENTWISE_RULES
    part_rule = opt.create_update_rule()
    part = chainer.Parameter(w.reshape(-1)[9:23].copy())
    for g in grads:
        whole.grad = g.copy()
        rule.update(whole)
        part.grad = g.reshape(-1)[9:23].copy()
        part_rule.update(part)
    np.testing.assert_array_equal(part.array, whole.array.reshape(-1)[9:23])
