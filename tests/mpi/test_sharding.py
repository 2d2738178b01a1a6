"""Sharded optimizer state, gradients and parameters (``shard=``).

The training equivalence with ChainerMN for every network kind runs in
``test_equivalence.py`` and ``test_changed_params.py`` under
``CHAINERMN_OVERLAP_TEST_SHARD=<mode>`` (``make test`` runs them at 2 and 3
ranks, bit for bit at 2).  This file checks what is particular to
sharding: a negative control for the shard update, snapshots moved
between shardings and rank counts, what each mode holds between
iterations, reads of whole parameters on one rank alone, and the errors.
Collective tests: every rank runs this file.
"""
import os
import re

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer_hooks
from chainer import serializers
import chainermn

import chainermn_overlap
from chainermn_overlap.optimizers.sharding import rules
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP

MODES = ['optimizer', 'gradients', 'parameters']
WAITS = ['forward', 'update']
TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 5


def _template(seed=3):
    eq.seed_for_rank(seed)
    return L.Classifier(MLP(5, 7, 3))


def _batches(seed, steps=STEPS + 4):
    rng = np.random.RandomState(seed)
    return [(rng.randn(6, 5).astype(np.float32),
             rng.randint(0, 3, 6).astype(np.int32)) for _ in range(steps)]


def _step(batches):
    def step(model, opt, it, impl):
        x, t = batches[it]
        opt.update(model, x, t)
    return step


def _adam():
    return chainer.optimizers.Adam(alpha=0.01)


def _make(comm, actual, shard, wait='forward', **options):
    opt = chainermn_overlap.create_overlapped_optimizer(
        actual, comm, wait=wait, shard=shard, bucket_size=256, **options)
    return opt


def _same_everywhere(comm, ok, message):
    eq.assert_all_ranks(ok, message, comm)


# ---------------------------------------------------------------------------
# A negative control: a shard update that skips one rank's slice is caught.

@pytest.mark.parametrize('shard', MODES)
def test_skipping_one_ranks_slice_is_caught(comm, shard, monkeypatch):
    if comm.size == 1:
        pytest.skip('one rank owns every slice')
    batches = _batches(11)
    impl = eq.OverlappedImpl()
    options = {'shard': shard, 'bucket_size': 256}
    ref = eq.train(eq.REFERENCE, _template(), _adam, _step(batches), STEPS)
    got = eq.train(impl, _template(), _adam, _step(batches), STEPS,
                   options=options)
    eq.assert_equivalent(got.model, ref.model, what='as built', **TOL)
    real = rules.Snapshot.update

    def skip_last_rank(self, param, proxy):
        if comm.rank != comm.size - 1:
            real(self, param, proxy)
    monkeypatch.setattr(rules.Snapshot, 'update', skip_last_rank)
    broken = eq.train(impl, _template(), _adam, _step(batches), STEPS,
                      options=options)
    eq.assert_different(broken.model, ref.model, what='last slice skipped',
                        **TOL)


# ---------------------------------------------------------------------------
# Snapshots: whole states, loadable unsharded and at another rank count.

def _train_and_save(comm, make_opt, batches, path, steps=3):
    model = _template()
    opt = make_opt(model)
    for it in range(steps):
        x, t = batches[it]
        opt.update(model, x, t)
    serializers.save_npz(path + '.opt.npz', opt)
    serializers.save_npz(path + '.model.npz', model)
    return model, opt


def _npz(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize('shard', MODES)
def test_snapshot_holds_the_unsharded_state(comm, shard, tmp_path):
    batches = _batches(12)
    base = str(tmp_path / 'r{}'.format(comm.rank))

    def sharded(model):
        return _make(comm, _adam(), shard).setup(model)

    def reference(model):
        return chainermn.create_multi_node_optimizer(
            _adam(), comm).setup(model)
    _, opt = _train_and_save(comm, sharded, batches, base + 's')
    _train_and_save(comm, reference, batches, base + 'r')
    got, ref = _npz(base + 's.opt.npz'), _npz(base + 'r.opt.npz')
    errors = [] if sorted(got) == sorted(ref) else [
        'keys differ: {} vs {}'.format(sorted(got), sorted(ref))]
    for k in sorted(set(got) & set(ref)):
        if got[k].shape != ref[k].shape or not np.allclose(got[k], ref[k],
                                                           **TOL):
            errors.append(k)
    _same_everywhere(comm, not errors, 'sharded snapshot differs from '
                     "ChainerMN's: {}".format(errors[:5]))
    # The file holds whole states (moments of every parameter's shape).
    m = [k for k in got if k.endswith('/m')]
    _same_everywhere(comm, bool(m), 'no Adam moments in the snapshot')
    opt.close()


@pytest.mark.parametrize('shard', MODES)
def test_resume_at_another_rank_count(comm, shard, tmp_path):
    """Written by a sharded optimizer on every rank; resumed by a sharded
    one on one rank fewer (and by an unsharded one), which then trains as
    ChainerMN resumed from its own snapshot does."""
    batches = _batches(13)
    path = str(tmp_path / 'r{}'.format(comm.rank))
    _, opt = _train_and_save(
        comm, lambda m: _make(comm, _adam(), shard).setup(m), batches,
        path + 's')
    opt.close()
    _train_and_save(
        comm, lambda m: chainermn.create_multi_node_optimizer(
            _adam(), comm).setup(m), batches, path + 'r')
    size = max(1, comm.size - 1)
    sub_mpi = comm.mpi_comm.Split(0 if comm.rank < size else 1, comm.rank)
    if comm.rank < size:
        sub = chainermn.create_communicator('naive', mpi_comm=sub_mpi)
        results = {}
        # ChainerMN's own wrapper skips the first update after a resume;
        # the unsharded overlapped optimizer resumed from ChainerMN's file
        # is the reference (test_equivalence checks it resumes exactly).
        for name, shard_of, src in [('sharded', shard, 's'),
                                    ('unsharded', None, 's'),
                                    ('reference', None, 'r')]:
            model = _template()
            serializers.load_npz(path + src + '.model.npz', model)
            opt = _make(sub, _adam(), shard_of).setup(model)
            serializers.load_npz(path + src + '.opt.npz', opt)
            for it in range(3, 6):
                x, t = batches[it]
                opt.update(model, x, t)
            opt.synchronize()
            opt.close()
            results[name] = eq.param_state(model, persistents=False)
        errors = (eq.compare_states(results['sharded'],
                                    results['reference'], **TOL)
                  + eq.compare_states(results['unsharded'],
                                      results['reference'], **TOL))
        ok = not errors
    else:
        ok, errors = True, []
    sub_mpi.Free()
    _same_everywhere(comm, ok, 'resumed on {} rank(s): {}'.format(
        size, errors[:5]))


def _held(model, opt):
    """Copies of every rule's ``t`` and state arrays, and the optimizer's
    ``t`` and ``epoch``."""
    out = {'t': opt.t, 'epoch': opt.epoch}
    for name, p in model.namedparams():
        rule = p.update_rule
        out[name] = (rule.t, None if rule.state is None else {
            k: None if v is None else np.array(v, copy=True)
            for k, v in rule.state.items()})
    return out


def _held_differences(a, b):
    errors = []
    for key in sorted(a):
        x, y = a[key], b[key]
        if key in ('t', 'epoch'):
            if x != y:
                errors.append('{}: {} then {}'.format(key, x, y))
            continue
        if x[0] != y[0]:
            errors.append('{}/t: {} then {}'.format(key, x[0], y[0]))
        if (x[1] is None) != (y[1] is None) or (
                x[1] is not None and sorted(x[1]) != sorted(y[1])):
            errors.append('{}: state keys {} then {}'.format(
                key, x[1] and sorted(x[1]), y[1] and sorted(y[1])))
            continue
        for k in sorted(x[1] or {}):
            u, v = x[1][k], y[1][k]
            if (u is None) != (v is None) or (
                    u is not None and (u.shape != v.shape
                                       or not np.array_equal(u, v))):
                errors.append('{}/{} changed'.format(key, k))
    return errors


def _load_error(path, opt, expected, **kwargs):
    """Loads ``path`` into ``opt``; returns what differs from raising
    ``expected`` (an exception type, message pattern)."""
    cls, pattern = expected
    try:
        serializers.load_npz(path, opt, **kwargs)
    except cls as e:
        if not re.search(pattern, str(e)):
            return ['{} says {!r}, not {!r}'.format(cls.__name__, str(e),
                                                    pattern)]
        return []
    except Exception as e:  # reported on every rank, not raised on one
        return ['raised {!r}, not {}'.format(e, cls.__name__)]
    return ['loaded without error, expected {}'.format(cls.__name__)]


@pytest.mark.parametrize('shard', MODES)
def test_a_load_reads_everything_before_it_replaces_anything(comm, shard,
                                                            tmp_path):
    """A load that fails (a key missing, a wrong shape) leaves the state as
    it was and names the key; ``strict=False`` with a key missing keeps
    that key's state (as an unsharded optimizer does), loads the rest, and
    training goes on."""
    batches = _batches(18)
    base = str(tmp_path / 'r{}'.format(comm.rank))
    model, opt = _train_and_save(
        comm, lambda m: _make(comm, _adam(), shard).setup(m), batches, base)
    opt.synchronize()
    good = _npz(base + '.opt.npz')
    name = 'predictor/l2/W/m'
    assert name in good, sorted(good)
    held = _held(model, opt)
    errors = []
    missing = {k: v for k, v in good.items() if k != name}
    np.savez(base + '.missing.npz', **missing)
    errors += _load_error(base + '.missing.npz', opt,
                          (KeyError, re.escape(name)))
    errors += ['missing key: ' + e
               for e in _held_differences(held, _held(model, opt))]
    wrong = dict(good, **{name: np.zeros(3, dtype=np.float32)})
    np.savez(base + '.wrong.npz', **wrong)
    errors += _load_error(base + '.wrong.npz', opt,
                          (ValueError, re.escape(name) + '.*shape'))
    errors += ['wrong shape: ' + e
               for e in _held_differences(held, _held(model, opt))]
    # strict=False: every other moment read (+1), l2's m kept.
    shifted = {k: (v + 1 if k.endswith(('/m', '/v')) else v)
               for k, v in missing.items()}
    shifted['t'] = np.asarray(good['t'] + 7)
    np.savez(base + '.shifted.npz', **shifted)
    serializers.load_npz(base + '.shifted.npz', opt, strict=False)
    after = _held(model, opt)
    l2m = after['/predictor/l2/W'][1]['m']
    if not np.array_equal(l2m, held['/predictor/l2/W'][1]['m']):
        errors.append("strict=False: the missing key's state was not kept")
    l1v = after['/predictor/l1/W'][1]['v']
    if not np.allclose(l1v, held['/predictor/l1/W'][1]['v'] + 1):
        errors.append('strict=False: the other states were not loaded')
    if after['t'] != held['t'] + 7:
        errors.append('strict=False: t is {}, not {}'.format(
            after['t'], held['t'] + 7))
    x, t = batches[3]
    opt.update(model, x, t)
    opt.synchronize()
    if not all(np.isfinite(p.array).all() for p in model.params()):
        errors.append('the update after the load is not finite')
    opt.close()
    _same_everywhere(comm, not errors, '; '.join(errors[:6]))


# ---------------------------------------------------------------------------
# What each mode holds between iterations.

@pytest.mark.parametrize('wait', WAITS)
@pytest.mark.parametrize('shard', MODES)
def test_what_is_held_after_update(comm, shard, wait):
    model = _template()
    opt = _make(comm, _adam(), shard, wait=wait).setup(model)
    batches = _batches(14)
    for it in range(4):
        x, t = batches[it]
        opt.update(model, x, t)
    params = dict(model.namedparams())
    errors = []
    for name, p in sorted(params.items()):
        state = p.update_rule.state
        sizes = {k: v.size for k, v in state.items()
                 if isinstance(v, np.ndarray)}
        # Moments: this rank's slice only (all of them on one rank).
        total = comm.mpi_comm.allreduce(sizes.get('m', 0))
        if total != p.size:
            errors.append('{}: moments over ranks hold {} of {} elements'
                          .format(name, total, p.size))
        grad_kept = p.grad is not None
        if grad_kept != (shard == 'optimizer'):
            errors.append('{}: grad {}'.format(
                name, 'kept' if grad_kept else 'released'))
        released = p.array is not None and all(s == 0
                                               for s in p.array.strides)
        if released != (shard == 'parameters'):
            errors.append('{}: array {}'.format(
                name, 'released' if released else 'whole'))
    opt.synchronize()
    whole = all(p.array.strides != (0,) * p.array.ndim
                for p in model.params())
    if not whole:
        errors.append('parameters not whole after synchronize()')
    opt.close()
    _same_everywhere(comm, not errors, '; '.join(errors[:6]))


# ---------------------------------------------------------------------------
# The bound on gradients waiting for their reduce-scatter (shard_in_flight).

def _held_while_filling(comm, shard, monkeypatch, **options):
    """The most bytes, and buckets, of full buffers still waiting for their
    reduce-scatter each time backward starts filling another bucket, over 3
    steps, with every reduce-scatter slowed by 20 ms (a link slower than
    backward); and the number of buckets."""
    import time
    from chainermn_overlap.optimizers.sharding import collectives
    slow = collectives.reduce_scatter_mean

    def slowed(*args, **kwargs):
        time.sleep(0.02)
        return slow(*args, **kwargs)
    monkeypatch.setattr(collectives, 'reduce_scatter_mean', slowed)
    eq.seed_for_rank(5)
    model = L.Classifier(MLP(40, 40, 10, n_layers=3))
    opt = chainermn_overlap.create_overlapped_optimizer(
        _adam(), comm, shard=shard, bucket_size=1024, **options)
    opt.setup(model)
    reducer = opt._overlap.reducer
    throttle = reducer.before_new_buffer
    most = [0, 0]

    def measured():
        throttle()
        held = [0, 0]
        for b in reducer.buckets:
            buf = b.buffer
            if buf is not None and b.handle is not None \
                    and not b.handle.done():
                held = [held[0] + buf.nbytes, held[1] + 1]
        most[:] = [max(most[0], held[0]), max(most[1], held[1])]
    reducer.before_new_buffer = measured
    rng = np.random.RandomState(1)
    for _ in range(3):
        opt.update(model, rng.randn(6, 40).astype(np.float32),
                   rng.randint(0, 10, 6).astype(np.int32))
    buckets = len(reducer.buckets)
    opt.close()
    return most[0], most[1], buckets


@pytest.mark.parametrize('shard', ['gradients', 'parameters'])
def test_shard_in_flight_bounds_the_gradients_held(comm, shard, monkeypatch):
    # Without a bound the slowed reduce-scatters pile up (the control shows
    # the bound has something to stop); with one, backward waits.
    free, _, buckets = _held_while_filling(comm, shard, monkeypatch,
                                           shard_in_flight=None)
    bounded, _, _ = _held_while_filling(comm, shard, monkeypatch,
                                        shard_in_flight=2048)
    _same_everywhere(comm, buckets >= 4 and free >= 4096 and bounded < 2048,
                     '{} buckets; most held: {} bytes unbounded, {} with a '
                     'bound of 2048'.format(buckets, free, bounded))


def test_shard_in_flight_defaults(comm, monkeypatch):
    # 'auto': no bound for either (a bound cost stage 3 0.10-0.12 of
    # scalability on the bed); a bound of one bucket is the control.
    _, grads, _ = _held_while_filling(comm, 'gradients', monkeypatch)
    _, params, _ = _held_while_filling(comm, 'parameters', monkeypatch)
    _, bounded, _ = _held_while_filling(comm, 'parameters', monkeypatch,
                                        shard_in_flight=1024)
    _same_everywhere(comm, grads >= 3 and params >= 3 and bounded < 2,
                     'most buckets waiting: {} (gradients), {} (parameters),'
                     ' {} (parameters, 1024 bytes)'.format(grads, params,
                                                           bounded))


def test_shard_options_in_one_object(comm, monkeypatch):
    # shard=ShardOptions(...) is the shard_* keywords at work: its bound
    # holds, against the same object without it (the control).
    opts = chainermn_overlap.ShardOptions
    _, free, _ = _held_while_filling(comm, opts('parameters'), monkeypatch)
    _, bounded, _ = _held_while_filling(
        comm, opts('parameters', in_flight=1024), monkeypatch)
    # Both spellings at once: refused on every rank, before any collective.
    try:
        chainermn_overlap.create_overlapped_optimizer(
            _adam(), comm, shard=opts('parameters'), shard_prefetch=0)
        refused = ''
    except ValueError as e:
        refused = str(e)
    _same_everywhere(comm, free >= 3 and bounded < 2
                     and 'shard_prefetch=0' in refused,
                     'most buckets waiting: {} (default), {} (in_flight='
                     '1024); both spellings: {!r}'.format(free, bounded,
                                                          refused))


# ---------------------------------------------------------------------------
# Whole parameters fetched ahead and kept (shard_prefetch).

def _fetches(comm, **options):
    """Runs 5 steps of shard='parameters'; returns the fetches made in the
    last two, the most bytes of whole buckets held besides the one in use,
    the released buckets' sizes, and the final parameters."""
    eq.seed_for_rank(5)
    model = L.Classifier(MLP(40, 40, 10, n_layers=4))
    opt = chainermn_overlap.create_overlapped_optimizer(
        _adam(), comm, shard='parameters', bucket_size=2048, **options)
    opt.setup(model)
    rng = np.random.RandomState(1)

    def step():
        opt.update(model, rng.randn(6, 40).astype(np.float32),
                   rng.randint(0, 10, 6).astype(np.int32))
    step()   # the layout (and the server) is made here
    policy = opt._overlap.policy
    acquire, start = policy._acquire, policy.server.fetch
    seen = {'fetches': 0, 'most': 0}

    def counted(*args, **kwargs):
        seen['fetches'] += 1
        return start(*args, **kwargs)

    def measured(bucket, keep=(), why='forward'):
        full = acquire(bucket, keep, why)
        held = sum(policy.plan.sizes[i] for i in
                   set(policy.live) | set(policy.fetching) if i !=
                   bucket.index)
        seen['most'] = max(seen['most'], held)
        return full
    policy._acquire = measured
    policy.server.fetch = counted
    for _ in range(2):   # the first releases, the second records the uses
        step()
    seen.update(fetches=0, most=0)
    for _ in range(2):
        step()
    sizes = sorted(policy.plan.sizes[i] for i in policy.released)
    fetches, most = seen['fetches'], seen['most']
    opt.synchronize()   # makes every parameter whole: fetches them all
    params = {n: p.array.copy() for n, p in model.namedparams()}
    opt.close()
    return fetches, most, sizes, params


def test_shard_prefetch_holds_what_the_next_uses_need(comm):
    # No bound: every bucket is fetched once per iteration (the backward
    # finds what forward fetched); the least (0: one bucket ahead) fetches
    # most buckets again for backward; a budget bounds the bytes held.
    every, most_every, sizes, ref = _fetches(comm, shard_prefetch=None)
    least, most_least, _, p0 = _fetches(comm, shard_prefetch=0)
    budget = 2 * max(sizes)
    _, most_budget, _, p1 = _fetches(comm, shard_prefetch=budget)
    n = len(sizes)
    ok = (n >= 4 and every == 2 * n and least > every
          and most_every > budget and most_least <= max(sizes)
          and most_budget <= budget)
    # Only the waits depend on the budget: the results are the same bits.
    same = all(np.array_equal(ref[k], p[k]) for p in (p0, p1) for k in ref)
    _same_everywhere(comm, ok and same,
                     '{} buckets of {} bytes; fetches in 2 steps: {} (no '
                     'bound), {} (0); most held: {} (no bound), {} (0), {} '
                     '(budget {}); same results: {}'.format(
                         n, sizes, every, least, most_every, most_least,
                         most_budget, budget, same))


# ---------------------------------------------------------------------------
# Updates posted in backward (shard_update='backward'; the default is
# 'update').

def _backward(model, opt, batch):
    model.cleargrads()
    loss = model(*batch)
    loss.backward()


@pytest.mark.parametrize('wait', WAITS)
@pytest.mark.parametrize('shard', ['optimizer', 'gradients'])
@pytest.mark.parametrize('when', ['backward', 'update', None])
def test_when_the_shard_updates_are_posted(comm, shard, wait, when):
    """With 'backward' every bucket's update is posted before update() and
    training equals ChainerMN; with 'update' (the default, None) none is,
    and it equals too."""
    batches = _batches(21)
    ref = eq.train(eq.REFERENCE, _template(), _adam, _step(batches), STEPS)
    model = _template()
    options = {} if when is None else {'shard_update': when}
    opt = _make(comm, _adam(), shard, wait=wait, **options).setup(model)
    policy = opt._overlap.policy
    posted = []
    for it in range(STEPS):
        _backward(model, opt, batches[it])
        posted.append(len(policy.posted))
        opt.update()
    opt.close()
    n = len(policy.buckets)
    # The first update() builds the layout and, as ChainerMN's, only
    # broadcasts; the second is the first to update (and cuts the states).
    want = [0, 0] + [n if when == 'backward' else 0] * (STEPS - 2)
    _same_everywhere(comm, n > 1 and posted == want,
                     'updates posted before update(): {}, want {}'.format(
                         posted, want))
    eq.assert_equivalent(model, ref.model, what='shard_update={!r}'
                         .format(when), **TOL)


@pytest.mark.parametrize('change', ['hyperparameter', 'hook'])
def test_a_change_between_backward_and_update_raises(comm, change):
    batches = _batches(22)
    model = _template()
    opt = _make(comm, _adam(), 'gradients',
                shard_update='backward').setup(model)
    for it in range(2):
        opt.update(model, *batches[it])
    before = {n: p.array.copy() for n, p in model.namedparams()}
    _backward(model, opt, batches[2])
    # The fault is real: the shards are updated (and gathered) before
    # update(), with the alpha the optimizer held in backward.
    opt.synchronize()
    moved = all(not np.array_equal(p.array, before[n])
                for n, p in model.namedparams())
    _same_everywhere(comm, moved, 'not every parameter was updated in '
                     'backward')
    if change == 'hyperparameter':
        opt.alpha = 0.002
        match = 'hyperparameter alpha of .*: 0.01 then, 0.002 now'
    else:
        opt.add_hook(optimizer_hooks.WeightDecay(1e-4))
        match = 'the optimizer hooks'
    with pytest.raises(ValueError, match=match + r".*shard_update='update'"):
        opt.update()
    opt.close()


def test_one_rank_reads_whole_parameters_alone(comm, tmp_path):
    """shard='parameters': rank 0 alone saves the model; its parameters are
    fetched from the other ranks, which go on training meanwhile."""
    batches = _batches(15)
    model = _template()
    opt = _make(comm, chainer.optimizers.MomentumSGD(0.1),
                'parameters').setup(model)
    ref_model = _template()
    ref_opt = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.1), comm).setup(ref_model)
    path = str(tmp_path / 'model{}.npz'.format(comm.rank))
    for it in range(4):
        x, t = batches[it]
        opt.update(model, x, t)
        ref_opt.update(ref_model, x, t)
        if comm.rank == 0 and it == 2:
            serializers.save_npz(path, model)
            saved = eq.param_state(ref_model, persistents=False)
    ok, msg = True, ''
    if comm.rank == 0:
        got = {'param /' + k: v for k, v in _npz(path).items()
               if not k.endswith(('avg_mean', 'avg_var', 'N'))}
        errors = eq.compare_states(got, saved, **TOL)
        ok, msg = not errors, str(errors[:3])
    opt.synchronize()
    eq.assert_equivalent(model, ref_model, **TOL)
    opt.close()
    _same_everywhere(comm, ok, 'model saved on rank 0 alone: ' + msg)


def test_use_outside_the_link_after_release_raises(comm):
    model = _template()
    opt = _make(comm, chainer.optimizers.SGD(0.1), 'parameters').setup(model)
    batches = _batches(16)
    for it in range(3):
        x, t = batches[it]
        opt.update(model, x, t)
    with pytest.raises(RuntimeError, match='outside its link'):
        F.linear(batches[3][0], model.predictor.l1.W)
    opt.close()


# ---------------------------------------------------------------------------
# Errors, on every rank.

@pytest.mark.parametrize('kwargs, match', [
    ({'shard': 'all'}, 'shard must be'),
    ({'shard': 'optimizer', 'shard_unit': 'row'}, 'shard_unit must be'),
    ({'shard': 'gradients',
      'compression': chainermn_overlap.PowerSGD(rank=2)}, 'compression'),
    ({'shard': 'optimizer', 'backend': 'nccl'}, 'MPI engines'),
    ({'shard': 'optimizer', 'shard_in_flight': '8MB'},
     "only shard='gradients' and 'parameters'"),
    ({'shard': 'gradients', 'shard_in_flight': 'lots'},
     'shard_in_flight: size'),
])
def test_bad_options(comm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.SGD(), comm, **kwargs)


def test_double_buffering_does_not_shard(comm):
    with pytest.raises(ValueError, match='double buffering'):
        chainermn_overlap.create_double_buffering_optimizer(
            chainer.optimizers.SGD(), comm, shard='optimizer')


class _NormRule(chainer.optimizers.momentum_sgd.MomentumSGDRule):
    """Not element-wise (a subclass may change the arithmetic)."""


class _NormSGD(chainer.optimizers.MomentumSGD):
    def create_update_rule(self):
        return _NormRule(self.hyperparam)


@pytest.mark.parametrize('hook, match', [
    (optimizer_hooks.GradientLARS(), 'GradientLARS'),
    (optimizer_hooks.GradientNoise(0.01), 'GradientNoise'),
    (None, '_NormRule'),
])
def test_rules_that_are_not_elementwise(comm, hook, match):
    model = _template()
    actual = _NormSGD(0.1) if hook is None else chainer.optimizers.SGD(0.1)
    # (The default shard_unit='auto' keeps a parameter whole for its own
    # rule, test_exact_models.py; an optimizer hook is refused there too.)
    opt = _make(comm, actual, 'optimizer',
                shard_unit='element').setup(model)
    if hook is not None:
        opt.add_hook(hook)
    x, t = _batches(17)[0]
    opt.update(model, x, t)   # builds the layout (nothing is sharded yet)
    with pytest.raises(ValueError, match=match) as info:
        opt.update(model, x, t)
    assert "shard_unit='parameter'" in str(info.value)
    opt.close()
    # The documented way out: whole parameters per rank.
    opt = _make(comm, _NormSGD(0.1) if hook is None
                else chainer.optimizers.SGD(0.1), 'optimizer',
                shard_unit='parameter').setup(model)
    if isinstance(hook, optimizer_hooks.GradientLARS):
        opt.add_hook(hook)
    for _ in range(2):
        opt.update(model, x, t)
    opt.close()


def test_register_elementwise(comm):
    model = _template()
    rules.register_elementwise(_NormRule)
    try:
        opt = _make(comm, _NormSGD(0.1), 'optimizer').setup(model)
        x, t = _batches(18)[0]
        for _ in range(3):
            opt.update(model, x, t)
        opt.close()
    finally:
        rules._REGISTERED.discard(_NormRule)

