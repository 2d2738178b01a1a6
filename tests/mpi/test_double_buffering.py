"""Double buffering equals ChainerMN's blocking optimizer fed stale gradients.

Collective tests: every rank runs this file (``tests/mpi_run.py -n N``).

The reference is built from ChainerMN's blocking optimizer: update 1
broadcasts and skips (as both do); at iteration 2 the reference only
computes and keeps its local gradients; from iteration 3 on it computes the
current gradients, puts back the previous iteration's local ones and calls
the blocking ``update()``, which averages them and applies the actual
optimizer.  That is ChainerMN's ``_DoubleBufferingOptimizer`` semantics,
written without any double buffering.

Tolerance: both sides compute bit-identical local gradients and sum the
same arrays; only the summation order inside MPI may differ (fused buffer
vs one array at a time), about one float32 ulp per step.
"""
import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers
import chainermn

import chainermn_overlap
from chainermn_overlap.communication import emulated
from chainermn_overlap.compression import PowerSGD
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing import models

TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 7


class MLP(models.MLP):
    """The shared 5-8-3 ReLU MLP plus a link that forward never uses."""

    def __init__(self):
        super().__init__(5, 8, 3, n_layers=2)
        with self.init_scope():
            # Never used in forward: its gradient is None on every rank and
            # must count as zeros, as ChainerMN's zero_fill=True does (Adam
            # then still updates it; the reference must agree).
            self.unused = L.Linear(2, 2)


def make_model(seed=0):
    # Different initial parameters on each rank: the first update must
    # broadcast rank 0's.
    eq.seed_for_rank(seed)
    return MLP()


def loss_of(model, x, t):
    return F.softmax_cross_entropy(model(x), t)


def train_ours(comm, batches, make_actual, backend='mpi_thread',
               sync_each_step=False, **options):
    model = make_model()
    opt = chainermn_overlap.create_double_buffering_optimizer(
        make_actual(), comm, backend=backend, **options)
    opt.setup(model)
    for x, t in batches:
        opt.update(loss_of, model, x, t)
        if sync_each_step:
            opt.synchronize()
    opt.close()
    return model, opt


def train_reference(comm, batches, make_actual):
    model = make_model()
    opt = chainermn.create_multi_node_optimizer(make_actual(), comm)
    opt.setup(model)
    previous = None
    for it, (x, t) in enumerate(batches):
        if it == 0:
            opt.update(loss_of, model, x, t)   # broadcast, step skipped
            continue
        model.cleargrads()
        loss_of(model, x, t).backward()
        current = {n: (None if p.grad is None else p.grad.copy())
                   for n, p in model.namedparams()}
        if previous is not None:
            for n, p in model.namedparams():
                p.grad = previous[n]
            opt.update()                       # mean of last iteration's
        previous = current
    return model, opt


def train_blocking(comm, batches, make_actual):
    model = make_model()
    opt = chainermn.create_multi_node_optimizer(make_actual(), comm)
    opt.setup(model)
    for x, t in batches:
        opt.update(loss_of, model, x, t)
    return model, opt


def batches(steps=STEPS):
    return eq.make_batches(3, steps, per_rank=4, x_shape=(5,), n_classes=3)


OPTIMIZERS = {
    'momentum_sgd': lambda: chainer.optimizers.MomentumSGD(0.1, 0.9),
    'adam': lambda: chainer.optimizers.Adam(alpha=0.01),
}


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_equals_blocking_with_one_step_delay(comm, name):
    data = batches()
    got, opt = train_ours(comm, data, OPTIMIZERS[name])
    ref, ref_opt = train_reference(comm, data, OPTIMIZERS[name])
    tol = TOL if name == 'momentum_sgd' else dict(rtol=1e-4, atol=1e-5)
    eq.assert_equivalent(got, ref, persistents=False,
                         what='double buffering vs delayed blocking', **tol)
    # Update 1 broadcasts, update 2 only posts: STEPS - 2 steps applied.
    eq.assert_all_ranks(opt.t == ref_opt.t == STEPS - 2,
                        'opt.t: ours %r, reference %r, expected %d'
                        % (opt.t, ref_opt.t, STEPS - 2))


@pytest.mark.parametrize('backend,options', [
    ('mpi_priority', {'bucket_size': 64, 'chunk_size': None}),
    ('mpi_thread', {'bucket_size': '100B'}),
])
def test_same_parts_as_the_overlapped_optimizer(comm, backend, options):
    # Several buckets (64-100 bytes), either engine, synchronize() after
    # every step: still exactly the delayed blocking optimizer.
    options = {k: v for k, v in options.items() if v is not None}
    data = batches()
    got, opt = train_ours(comm, data, OPTIMIZERS['momentum_sgd'], backend,
                          sync_each_step=True, **options)
    ref, _ = train_reference(comm, data, OPTIMIZERS['momentum_sgd'])
    eq.assert_equivalent(got, ref, persistents=False,
                         what='double buffering (%s)' % backend, **TOL)
    stats = opt.communication_stats()
    # 5 posting iterations (the first broadcasts) of more than one bucket.
    eq.assert_all_ranks(stats['buckets'] > STEPS - 1 and
                        stats['buckets'] % (STEPS - 1) == 0,
                        'buckets: %r' % (stats,))


def test_negative_control_differs_from_fresh_gradients(comm):
    # Proves the comparison can fail: the non-stale blocking run differs.
    data = batches()
    got, _ = train_ours(comm, data, OPTIMIZERS['momentum_sgd'])
    fresh, _ = train_blocking(comm, data, OPTIMIZERS['momentum_sgd'])
    eq.assert_different(got, fresh, what='double buffering vs blocking',
                        **TOL)


def test_emulated_backend_gives_the_same_result(comm):
    # A fast emulated link: the real reduction plus a short modelled delay.
    name = emulated.configure(nodes=4, bandwidth='100gbit', latency=0)
    data = batches(5)
    got, opt = train_ours(comm, data, OPTIMIZERS['momentum_sgd'], name)
    ref, _ = train_reference(comm, data, OPTIMIZERS['momentum_sgd'])
    eq.assert_equivalent(got, ref, persistents=False,
                         what='double buffering (emulated backend)', **TOL)
    stats = opt.communication_stats()
    eq.assert_all_ranks(stats['buckets'] == 5 - 1,
                        'collectives: %r' % (stats,))


def test_relayout_when_a_link_is_added(comm):
    # Adding a link changes the parameter set: that update broadcasts and
    # skips, and the pipeline restarts; ranks stay identical.
    data = batches(6)
    model = make_model()
    opt = chainermn_overlap.create_double_buffering_optimizer(
        chainer.optimizers.SGD(0.1), comm)
    opt.setup(model)
    for it, (x, t) in enumerate(data):
        if it == 3:
            eq.seed_for_rank(9)
            with model.init_scope():
                model.extra = L.Linear(2, 2)
        opt.update(loss_of, model, x, t)
    opt.close()
    # Applied: it 2 (after it 0 bcast, it 1 post); it 3 rebuilds; it 4
    # posts; it 5 applies.
    eq.assert_all_ranks(opt.t == 2, 'opt.t %r, expected 2' % opt.t)
    errors = eq.cross_rank_errors(model, comm)
    eq.assert_all_ranks(not errors, '; '.join(errors))


def test_rejects_bad_arguments(comm):
    with pytest.raises(TypeError, match='ChainerMN communicator'):
        chainermn_overlap.create_double_buffering_optimizer(
            chainer.optimizers.SGD(), object())
    with pytest.raises(TypeError, match='chainer.Optimizer'):
        chainermn_overlap.create_double_buffering_optimizer(object(), comm)
    with pytest.raises(ValueError, match='unknown communication backend'):
        chainermn_overlap.create_double_buffering_optimizer(
            chainer.optimizers.SGD(), comm, backend='nope')
    opt = chainermn_overlap.create_double_buffering_optimizer(
        chainer.optimizers.SGD(), comm)
    with pytest.raises(RuntimeError, match='before setup'):
        opt.update()


def test_powersgd_warmup_is_exact_then_compresses(comm, tmp_path):
    data = batches()
    plain, _ = train_ours(comm, data, OPTIMIZERS['momentum_sgd'])
    # Warm-up longer than the run: the plain double buffering, bit for bit.
    got, _ = train_ours(comm, data, OPTIMIZERS['momentum_sgd'],
                        compression=PowerSGD(rank=1, warmup_iterations=100))
    eq.assert_equivalent(got, plain, persistents=False, rtol=0, atol=0,
                         what='PowerSGD during warm-up vs plain')
    # Compressed after 2 posts: differs (the control), identical across
    # ranks, finite; the warm-up counts posts (the first update only
    # broadcasts).
    c = PowerSGD(rank=1, warmup_iterations=2)
    got, opt = train_ours(comm, data, OPTIMIZERS['momentum_sgd'],
                          compression=c)
    stats = opt.communication_stats()
    eq.assert_different(got, plain, what='PowerSGD vs plain', **TOL)
    errors = eq.cross_rank_errors(got, comm)
    eq.assert_all_ranks(not errors, '; '.join(errors))
    eq.assert_all_ranks(all(np.isfinite(p.array).all()
                            for p in got.params()), 'non-finite parameters')
    eq.assert_all_ranks(c.iterations == STEPS - 1 and c.errors
                        and stats['compression_seconds'] > 0,
                        'iterations %d, stats %r' % (c.iterations, stats))
    # Its state is part of the optimizer's snapshot.
    path = str(tmp_path / 'opt.npz')
    serializers.save_npz(path, opt)
    with np.load(path) as saved:
        keys = set(saved.files)
    eq.assert_all_ranks('compression/iterations' in keys
                        and 'compression/error0' in keys, sorted(keys))


def test_float16_wire_reduces_with_float32_arithmetic(comm):
    data = batches()
    plain, plain_opt = train_ours(comm, data, OPTIMIZERS['momentum_sgd'])
    got, opt = train_ours(comm, data, OPTIMIZERS['momentum_sgd'],
                          allreduce_grad_dtype=np.float16)
    # float16 keeps 11 significant bits: ~5e-4 relative per gradient.
    eq.assert_equivalent(got, plain, persistents=False, rtol=1e-2,
                         atol=1e-3, what='float16 wire vs float32')
    ops = {type(r.operation).__name__ for r in opt._db.reducers}
    eq.assert_all_ranks(ops == {'LowPrecisionMean'}, repr(ops))
    half = opt.communication_stats()['bytes'] * 2
    eq.assert_all_ranks(half == plain_opt.communication_stats()['bytes'],
                        'bytes: float16 %r, float32 %r' % (
                            half, plain_opt.communication_stats()['bytes']))


def test_powersgd_needs_a_wide_wire(comm):
    with pytest.raises(ValueError, match='too narrow'):
        chainermn_overlap.create_double_buffering_optimizer(
            chainer.optimizers.SGD(), comm, compression=PowerSGD(),
            allreduce_grad_dtype=np.float16)
