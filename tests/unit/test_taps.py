"""Gradient taps leave gradients bit-identical, without MPI.

A tap (:class:`chainermn_overlap.hooks.taps.GradTap`) stands between a
parameter and its link's call.  Chainer sums the gradients a variable gets
from several consumers in the order its backward runs them, which follows
the nodes' ranks; :meth:`GradTap.tap` keeps every other node's rank as
without taps.  :class:`~chainermn_overlap.testing.models.SSDLike` has
feature maps read by three consumers, where a changed order shows (the
negative control: taps that raise their consumers' rank, as before).
"""
import copy

import numpy as np
import pytest

import chainer
from chainer import link_hook

from chainermn_overlap.hooks import taps
from chainermn_overlap.testing import models


class _Sink(taps.GradientSink):
    def on_tap(self, param, so_far, gy, iteration):
        if gy is None:
            return so_far
        return gy if so_far is None else so_far + gy


class _Taps(link_hook.LinkHook):
    """Taps every parameter of every link call, as the optimizer does
    (the link's input as the dummy second input)."""

    name = 'test_taps'

    def __init__(self, keep_rank):
        self.sink = _Sink()
        self.keep_rank = keep_rank
        self.saved = []

    def forward_preprocess(self, args):
        link, dummy = args.link, taps.first_variable(args.args, args.kwargs)
        new = {}
        for name in link._params:
            p = link.__dict__[name]
            if p.array is None:
                continue
            tap = taps.GradTap(self.sink, p)
            inputs = (p,) if dummy is None else (p, dummy)
            new[name] = (tap.tap(inputs) if self.keep_rank
                         else tap.apply(inputs)[0])
        self.saved.append((link, {n: link.__dict__[n] for n in new}))
        link.__dict__.update(new)

    def forward_postprocess(self, args):
        link, saved = self.saved.pop()
        link.__dict__.update(saved)


def _batch(seed=0, n=2):
    rng = np.random.RandomState(seed)
    na = models.SSDLike.n_anchors
    labels = rng.randint(1, 4, (n, na)) * (rng.rand(n, na) < 0.2)
    return (rng.randn(n, 3, 8, 8).astype(np.float32),
            rng.randn(n, na, 4).astype(np.float32),
            labels.astype(np.int32))


def _grads(model, batch, hook=None):
    model = copy.deepcopy(model)
    model.cleargrads()
    if hook is None:
        loss = model(*batch)
    else:
        with hook:
            loss = model(*batch)
    loss.backward()
    return {n: p.grad.copy() for n, p in model.namedparams()}


def _differ(a, b):
    return sorted(n for n in a if not np.array_equal(a[n], b[n]))


@pytest.fixture
def model():
    np.random.seed(5)
    return models.SSDLike()


def test_tapped_gradients_are_bit_identical(model):
    batch = _batch()
    assert _differ(_grads(model, batch, _Taps(keep_rank=True)),
                   _grads(model, batch)) == []


def test_taps_that_raise_the_rank_change_the_rounding(model):
    """Negative control: the order of the three-term sums is what
    matters (the maps read by three consumers and what lies before)."""
    batch = _batch()
    plain = _grads(model, batch)
    assert _differ(_grads(model, batch), plain) == []   # deterministic
    differ = _differ(_grads(model, batch, _Taps(keep_rank=False)), plain)
    assert '/conv1/W' in differ
    # The last map has two consumers (a + b == b + a): its heads agree.
    assert not any(n.startswith(('/loc/3/', '/conf/3/')) for n in differ)
