"""Reliability (issue 6): consistency checks, nothing lost, bad input.

Collective tests (``tests/mpi_run.py -n N``); faults that end processes are
in ``tests/unit/test_faults.py``, which launches jobs of its own.
"""
import copy

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer_hooks
from chainer import serializers

import chainermn_overlap
from chainermn_overlap.communication import backends
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP

SGD_TOL = dict(rtol=1e-5, atol=1e-6)


def build(seed=0, **kwargs):
    eq.seed_for_rank(seed)
    return L.Classifier(MLP(**kwargs))


def sgd(lr=0.1):
    return lambda: chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)


def batches(seed, steps, per_rank=4):
    return eq.make_batches(seed, steps, per_rank, (5,), n_classes=3)


def overlapped(comm, model, lr=0.1, **options):
    return chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9), comm,
        **options).setup(model)


def all_raised(comm, ok):
    return all(comm.mpi_comm.allgather(bool(ok)))


# ---------------------------------------------------------------------------
# Ranks agree on the collective sequence.
# ---------------------------------------------------------------------------

def test_ranks_that_disagree_on_the_iteration_are_named(comm):
    # The control message of every iteration carries each rank's iteration
    # number and layout fingerprint.  Simulate a rank that is one iteration
    # ahead (as after a skipped or an extra update()).
    if comm.size == 1:
        pytest.skip('needs two ranks to disagree')
    data = batches(40, 4)
    model = build(40)
    opt = overlapped(comm, model, bucket_size=256)
    try:
        opt.update(model, *data[0])
        opt.update(model, *data[1])
        if comm.rank == comm.size - 1:
            opt._overlap.iteration += 1
        with pytest.raises(chainermn_overlap.CollectiveMismatchError) as e:
            opt.update(model, *data[2])
    finally:
        opt.close()
    msg = str(e.value)
    assert 'rank {}:'.format(comm.rank) in msg, msg
    assert 'ranks [{}]: iteration'.format(comm.size - 1) in msg, msg
    assert 'update() the same number of times' in msg, msg
    assert all_raised(comm, True)


def test_matching_iterations_pass_the_check(comm):
    # Negative control of the test above: the same run, untouched, trains.
    data = batches(40, 4)
    model = build(40)
    opt = overlapped(comm, model, bucket_size=256)
    for x, t in data:
        opt.update(model, x, t)
    opt.close()


@pytest.mark.parametrize('differ', [False, True])
def test_debug_mode_names_mismatched_collectives(comm, differ):
    if differ and comm.size == 1:
        pytest.skip('needs two ranks to differ')
    backend = backends.MpiThreadBackend(comm.mpi_comm, debug=True,
                                        timeout=60)
    try:
        n = 3 + (comm.rank if differ else 0)
        a = np.full(n, comm.rank + 1.0, dtype=np.float32)
        label = 'bucket {} of the test'.format(n)
        h = backend.allreduce(a, label=label)
        if not differ:
            h.wait()
            np.testing.assert_array_equal(
                a, np.full(n, comm.size * (comm.size + 1) / 2.0))
            return
        with pytest.raises(chainermn_overlap.CollectiveMismatchError) as e:
            h.wait()
        msg = str(e.value)
        # Names every rank and what each posted; nothing was reduced.
        for r in range(comm.size):
            assert "rank {}: 'bucket {} of the test' ({} bytes)".format(
                r, 3 + r, 4 * (3 + r)) in msg, msg
        assert (a == comm.rank + 1.0).all()
        # Later collectives are not attempted (the sequence is broken).
        with pytest.raises(chainermn_overlap.CommunicationError):
            backend.allreduce(np.ones(2, np.float32)).wait()
        assert all_raised(comm, True)
    finally:
        backend.close()


@pytest.mark.parametrize('backend', ['mpi_thread', 'mpi_priority'])
def test_debug_mode_and_watchdog_change_no_result(comm, backend):
    # No false positives, and bit-identical results with the checks on.
    data = batches(41, 5)
    template = build(41)
    runs = []
    for options in ({}, {'debug': True, 'stall_warning': 30,
                         'timeout': 60}):
        model = copy.deepcopy(template)
        opt = overlapped(comm, model, bucket_size=256, backend=backend,
                         **options)
        for x, t in data:
            opt.update(model, x, t)
        opt.synchronize()
        opt.close()
        runs.append(eq.param_state(model))
    eq.assert_equivalent(runs[1], runs[0], rtol=0, atol=0,
                         what='debug mode vs normal')


def test_timeout_option_is_validated(comm):
    with pytest.raises(ValueError, match='timeout must be a number'):
        chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), comm, timeout='soon')
    with pytest.raises(ValueError, match='stall_warning must be a number'):
        chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), comm, stall_warning=[1])


def test_stall_inspector_answers(comm):
    # Every rank's inspector answers a status request, with its posting
    # counter (the basis of stall reports).
    backend = backends.MpiThreadBackend(comm.mpi_comm)
    backend.configure(stall_warning=600, mpi_comm=comm.mpi_comm)
    try:
        backend.allreduce(np.ones(4, np.float32), label='x').wait()
        statuses = backend.inspector.ask_all(deadline=10.0)
        ok = (sorted(statuses) == list(range(comm.size))
              and all(s is not None and s['posted'] == 1
                      for s in statuses.values()))
        eq.assert_all_ranks(ok, 'statuses: %r' % statuses)
        comm.mpi_comm.Barrier()
    finally:
        backend.close()
    assert not backend.inspector._thread.is_alive()


# ---------------------------------------------------------------------------
# Nothing lost.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize('wait', ['forward', 'update'])
def test_snapshot_with_updates_in_flight_resumes_bit_exact(comm, wait,
                                                           tmp_path):
    steps, k = 10, 6
    data = batches(42, steps)
    template = build(42)

    # Uninterrupted; snapshot (model + optimizer) right after update() k.
    model = copy.deepcopy(template)
    opt = overlapped(comm, model, bucket_size=256, wait=wait)
    path = str(tmp_path / 'snap-rank{}.npz'.format(comm.rank))
    for it in range(steps):
        opt.update(model, *data[it])
        if it == k - 1:
            st = opt._overlap
            # The fault being guarded against is real: at this point
            # reductions or updates are still in flight.
            in_flight = (st.pending_count > 0 or any(
                b.handle is not None and not b.handle.done()
                for b in st.buckets))
            if wait == 'forward':
                assert st.pending_count > 0
            snap = {}
            serializers.save_npz(path, model)
            snap['opt'] = path + '.opt.npz'
            serializers.save_npz(snap['opt'], opt)
    opt.synchronize()
    opt.close()

    # A new model (different initial parameters) and optimizer, resumed.
    resumed = build(43)
    serializers.load_npz(path, resumed)
    ropt = overlapped(comm, resumed, bucket_size=256, wait=wait)
    serializers.load_npz(snap['opt'], ropt)
    for it in range(k, steps):
        ropt.update(resumed, *data[it])
    ropt.synchronize()
    ropt.close()
    eq.assert_equivalent(resumed, model, rtol=0, atol=0,
                         what='resumed vs uninterrupted (bit-exact, '
                         'in flight at snapshot: %s)' % in_flight)
    eq.assert_same_value(int(ropt.t), 'resumed t')
    assert ropt.t == opt.t


# The long run is 2,000 iterations at 2 ranks, where each rank has a core
# of its own (18 s; at 4 ranks on 2 cores it took 34 s of make test's
# time); other sizes run 300.  The drift it guards against depends on the
# number of steps, not of ranks.
LONG_STEPS = {2: 2000}
CHECK_EVERY = 100


def test_long_run_identical_across_ranks_and_to_chainermn(comm):
    """2,000 iterations; every 100: identical across ranks, equal to ChainerMN.

    Tolerance: both runs compute bit-identical local gradients; the sums
    can differ only in the reduction (ours: one fused bucket, then
    sum * (1/size); ChainerMN 'naive': one allreduce per array, then its
    own mean), i.e. at most about one float32 ulp per gradient element per
    step.
    Plain SGD at lr=0.05 on a tanh MLP is contracting, so these errors do
    not compound; after 2,000 steps they stay below 1e-5 relative (measured
    max ~1e-6), while a stale, missing or doubled step moves parameters by
    ~lr * |grad| ~ 1e-3.
    """
    steps = LONG_STEPS.get(comm.size, 300)
    rng = np.random.RandomState(7)
    xs = rng.randn(steps, comm.size * 2, 4).astype(np.float32)
    ts = rng.randint(0, 2, size=(steps, comm.size * 2)).astype(np.int32)
    lo, hi = comm.rank * 2, comm.rank * 2 + 2
    eq.seed_for_rank(44)
    template = L.Classifier(MLP(4, 8, 2, n_layers=2, activation=F.tanh))
    ours = copy.deepcopy(template)
    ref = copy.deepcopy(template)
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(0.05), comm).setup(ours)
    ref_opt = eq.REFERENCE.create(chainer.optimizers.SGD(0.05), comm)
    ref_opt.setup(ref)
    checks = 0
    for it in range(steps):
        x, t = xs[it, lo:hi], ts[it, lo:hi]
        opt.update(ours, x, t)
        ref_opt.update(ref, x, t)
        if (it + 1) % CHECK_EVERY == 0:
            opt.synchronize()
            eq.assert_equivalent(ours, ref, rtol=1e-5, atol=1e-6,
                                 what='iteration %d' % (it + 1))
            checks += 1
    opt.close()
    assert checks == steps // CHECK_EVERY
    # Training did something (not a vacuous comparison).
    eq.assert_different(ours, template, rtol=1e-3, atol=1e-3,
                        what='trained vs initial')


# ---------------------------------------------------------------------------
# Bad input: the right result or a clear error, on every rank.
# ---------------------------------------------------------------------------

def _train_pair(comm, template, step, steps, options=None, make=sgd(),
                hooks=None):
    ref = eq.train(eq.REFERENCE, template, make, step, steps, hooks=hooks)
    got = eq.train(eq.OverlappedImpl(), template, make, step, steps,
                   options=dict({'bucket_size': 256}, **(options or {})),
                   hooks=hooks)
    return ref, got


def test_zero_sample_local_batches(comm):
    # Some ranks have no samples in some iterations: their gradient is zero
    # and the mean is over all ranks, exactly as ChainerMN computes.
    data = batches(45, 6)

    def loss(model, x, t):
        # A sum (not a mean) is defined for an empty batch.
        return F.sum(F.square(model.predictor(x)))

    def step(model, opt, it, impl):
        x, t = data[it]
        if (it + comm.rank) % 2 == 1:
            x = x[:0]
        opt.update(lambda x: loss(model, x, None), x)

    ref, got = _train_pair(comm, build(45), step, 6)
    eq.assert_equivalent(got.model, ref.model, what='zero-sample batches',
                         **SGD_TOL)


@pytest.mark.parametrize('dtype', ['float16', 'float64'])
def test_float16_and_float64_parameters(comm, dtype):
    dt = np.dtype(dtype)
    with chainer.using_config('dtype', dt):
        template = build(46)
    data = [(x.astype(dt), t) for x, t in batches(46, 5)]

    def step(model, opt, it, impl):
        with chainer.using_config('dtype', dt):
            opt.update(model, *data[it])

    ref, got = _train_pair(comm, template, step, 5)
    for _, p in got.model.namedparams():
        assert p.dtype == dt
    # float16: the update itself rounds to 2^-11 relative.
    tol = dict(rtol=2e-3, atol=2e-3) if dt == np.float16 else \
        dict(rtol=1e-12, atol=1e-12)
    eq.assert_equivalent(got.model, ref.model, what=dtype, **tol)


def test_non_contiguous_arrays(comm):
    """Strided inputs, a Fortran-ordered parameter, a strided gradient.

    The right result is the one of the same training with contiguous
    arrays (computed by ChainerMN).  Negative control (2+ ranks): ChainerMN
    7.8.1's own 'naive' communicator gets these cases wrong (it reads the raw
    memory of non-contiguous arrays), so the test exercises them.
    """
    if eq.shard_mode() in ('gradients', 'parameters'):
        pytest.skip("the test edits param.grad after backward, which "
                    "shard='gradients' releases during backward")
    data = batches(47, 5)
    template = build(47)
    strided = copy.deepcopy(template)
    w = strided.predictor.l2.W
    w.array = np.asfortranarray(w.array)
    assert not w.array.flags.c_contiguous

    def step(model, opt, it, impl):
        x, t = data[it]
        if model.predictor.l2.W.array.flags.f_contiguous:
            wide = np.zeros((x.shape[0], 2 * x.shape[1]), x.dtype, order='F')
            wide[:, ::2] = x
            x = wide[:, ::2]
            assert not x.flags.c_contiguous
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        if model.predictor.l2.W.array.flags.f_contiguous:
            g = model.predictor.l1.b.grad
            wide = np.zeros((g.size, 2), dtype=g.dtype)
            wide[:, 0] = g
            model.predictor.l1.b.grad = wide[:, 0]
            assert not model.predictor.l1.b.grad.flags.c_contiguous
        opt.update()

    ref = eq.train(eq.REFERENCE, template, sgd(), step, 5)
    got = eq.train(eq.OverlappedImpl(), strided, sgd(), step, 5,
                   options={'bucket_size': 256})
    eq.assert_equivalent(got.model, ref.model, what='non-contiguous',
                         **SGD_TOL)
    if comm.size == 1:
        return  # ChainerMN does not communicate at one rank
    chainermn_strided = eq.train(eq.REFERENCE, strided, sgd(), step, 5)
    eq.assert_different(chainermn_strided.model, ref.model,
                        what='ChainerMN on non-contiguous arrays', **SGD_TOL)


def test_parameter_arrays_replaced_between_iterations(comm):
    # param.array replaced by a new (equal-valued) array object each step.
    data = batches(48, 5)

    def step(model, opt, it, impl):
        if it >= 2:
            for _, p in model.namedparams():
                p.array = p.array.copy()
        opt.update(model, *data[it])

    ref, got = _train_pair(comm, build(48), step, 5)
    eq.assert_equivalent(got.model, ref.model, what='arrays replaced',
                         **SGD_TOL)


def test_link_replaced_between_iterations(comm):
    # A sub-link replaced by a new one, initialised differently on each rank:
    # the optimizer notices, broadcasts rank 0's parameters (skipping that
    # step, as after setup) and trains the new link; ranks stay identical.
    # (ChainerMN would not notice and let ranks diverge.)
    data = batches(49, 7)
    model = build(49)
    opt = overlapped(comm, model, bucket_size=256)
    old = None
    for it, (x, t) in enumerate(data):
        if it == 3:
            # (Reading param.array needs synchronize() with wait='forward'.)
            opt.synchronize()
            old = model.predictor.l2
            old_w = old.W.array.copy()
            with model.predictor.init_scope():
                del model.predictor.l2
                eq.seed_for_rank(50 + comm.rank)
                model.predictor.l2 = L.Linear(8, 8)
            # As in Chainer, a link added after setup() needs update rules.
            for p in model.predictor.l2.params():
                p.update_rule = opt.create_update_rule()
            fresh = model.predictor.l2.W.array.copy()
        opt.update(model, x, t)
        if it == 3:
            # Broadcast from rank 0, step skipped.
            eq.assert_all_ranks(not eq.cross_rank_errors(model),
                                'after the replacement')
    opt.synchronize()
    opt.close()
    eq.assert_all_ranks(not eq.cross_rank_errors(model), 'ranks differ')
    np.testing.assert_array_equal(old.W.array, old_w)  # not trained on
    # Trained after the replacement (fresh is rank 0's broadcast value).
    if comm.rank == 0:
        assert not np.array_equal(model.predictor.l2.W.array, fresh)


def test_setup_called_twice(comm):
    data = batches(51, 5)

    def step(model, opt, it, impl):
        if it == 2:
            # Both re-create the update rules (momentum restarts); neither
            # skips the step (the parameters are already consistent).
            assert opt.setup(model) is opt
        opt.update(model, *data[it])

    ref, got = _train_pair(comm, build(51), step, 5)
    eq.assert_equivalent(got.model, ref.model, what='setup twice', **SGD_TOL)


def test_setup_twice_before_training(comm):
    data = batches(52, 4)
    template = build(52)
    model = copy.deepcopy(template)
    opt = overlapped(comm, model, bucket_size=256)
    opt.setup(model)
    for x, t in data:
        opt.update(model, x, t)
    opt.synchronize()
    opt.close()
    ref = eq.train(eq.REFERENCE, template, sgd(),
                   lambda m, o, it, i: o.update(m, *data[it]), 4)
    eq.assert_equivalent(model, ref.model, what='setup twice first',
                         **SGD_TOL)


@pytest.mark.parametrize('hook', ['WeightDecay', 'GradientClipping'])
def test_optimizer_hook_added_after_setup_and_training(comm, hook):
    data = batches(53, 6)

    def make_hook():
        if hook == 'WeightDecay':
            return optimizer_hooks.WeightDecay(1e-2)
        return optimizer_hooks.GradientClipping(0.05)

    def step(model, opt, it, impl):
        if it == 3:
            opt.add_hook(make_hook())
        opt.update(model, *data[it])

    ref, got = _train_pair(comm, build(53), step, 6)
    eq.assert_equivalent(got.model, ref.model, what=hook + ' added late',
                         **SGD_TOL)
