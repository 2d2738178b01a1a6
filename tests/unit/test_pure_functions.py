"""Pure functions the cross-rank layout and order depend on (no MPI).

Every rank computes the bucket plan, the layout fingerprint and the control
message itself; the job is correct only because these functions give every
rank the same answer for the same input.  ``tests/unit/test_buckets.py``
and ``tests/unit/test_watchdog.py`` hold the first tests of the same
functions; this file adds the cases they leave open.
"""
import json
import os
import subprocess
import sys

import chainer
import chainer.links as L
import numpy as np
import pytest
from hypothesis import given, strategies as st

from chainermn_overlap import _host
from chainermn_overlap import config
from chainermn_overlap.communication import backends
from chainermn_overlap.communication import buckets
from chainermn_overlap.communication import timeline
from chainermn_overlap.communication import watchdog
from chainermn_overlap.communication.buckets import plan_buckets
from chainermn_overlap.errors import CollectiveMismatchError
from chainermn_overlap.optimizers import _layout
from chainermn_overlap.optimizers._policy import fallback_reason
from chainermn_overlap.optimizers._policy import hyperparams
from chainermn_overlap.optimizers._reducer import CommunicationStats
from chainermn_overlap.optimizers._reducer import hidden_fraction

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _names(plans):
    return [[e[0] for e in p.entries] for p in plans]


# ---------------------------------------------------------------------------
# plan_buckets: sizes, tail buckets, dtype grouping, order


def test_plan_of_nothing_is_empty():
    assert plan_buckets([], 100) == []
    assert plan_buckets([], 100, tail=(10, 20)) == []


def test_plan_accepts_any_iterable():
    gen = (('p%d' % i, 4, 'float32') for i in range(3))
    assert _names(plan_buckets(gen, 32)) == [['p0', 'p1'], ['p2']]


def test_bucket_may_be_filled_exactly():
    # 2 x 10 float32 = 80 bytes: fits a budget of 80, not one of 79.
    entries = [('a', 10, 'float32'), ('b', 10, 'float32')]
    assert _names(plan_buckets(entries, 80)) == [['a', 'b']]
    assert _names(plan_buckets(entries, 79)) == [['a'], ['b']]


def test_oversized_member_gets_a_bucket_of_its_own():
    entries = [('small1', 2, 'float32'), ('huge', 1000, 'float32'),
               ('small2', 2, 'float32'), ('small3', 2, 'float32')]
    plans = plan_buckets(entries, 64)
    assert _names(plans) == [['small1'], ['huge'], ['small2', 'small3']]
    assert plans[1].nelems == 1000


def test_float16_parameters_share_float32_buckets():
    # Buckets group by *wire* dtype: float16 gradients are reduced in
    # float32, so they travel with the float32 ones.
    entries = [('h', 4, 'float16'), ('f', 4, 'float32'), ('d', 4, 'float64')]
    plans = plan_buckets(entries, 1 << 20)
    assert _names(plans) == [['h', 'f'], ['d']]
    assert [p.dtype for p in plans] == [np.float32, np.float64]


def test_wire_dtype_option_merges_groups_and_sets_the_budget_unit():
    # With float16 on the wire every member is 2 bytes per element: all
    # dtypes fuse, and 20 elements fit a 40-byte budget (10 would in
    # float32).
    entries = [('h', 10, 'float16'), ('f', 10, 'float32'),
               ('d', 10, 'float64')]
    plans = plan_buckets(entries, 40, allreduce_grad_dtype=np.float16)
    assert _names(plans) == [['h', 'f'], ['d']]
    assert all(p.dtype == np.float16 for p in plans)
    assert _names(plan_buckets(entries[:2], 40)) == [['h'], ['f']]


def test_dtype_change_splits_tail_buckets_too():
    entries = [('a', 1, 'float32'), ('b', 1, 'float64'),
               ('c', 1, 'float64'), ('d', 1, 'float32')]
    plans = plan_buckets(entries, 1 << 20, tail=(1 << 20,))
    assert _names(plans) == [['a'], ['b', 'c'], ['d']]


def test_tail_limits_apply_from_the_last_bucket_and_are_capped():
    # Ten 4-byte members.  The last bucket may hold 8 bytes, the one
    # before 12; the rest 16 (the tail limit of 1000 is capped by it).
    entries = [('p%d' % i, 1, 'float32') for i in range(10)]
    plans = plan_buckets(entries, 16, tail=(8, 12, 1000))
    sizes = [p.nelems for p in plans]
    assert sizes[-1] == 2 and sizes[-2] == 3
    assert all(n <= 4 for n in sizes)
    assert sum(sizes) == 10


def test_no_tail_is_the_same_as_an_empty_tail():
    entries = [('p%d' % i, i + 1, 'float32') for i in range(12)]
    assert plan_buckets(entries, 24) == plan_buckets(entries, 24, tail=())


def test_plan_entries_hold_offsets_into_the_flat_buffer():
    plans = plan_buckets([('a', 3, 'float32'), ('b', 5, 'float32')], 1000)
    assert plans[0].entries == (('a', 0, 3), ('b', 3, 5))
    assert plans[0].nelems == 8


entries_st = st.lists(
    st.tuples(st.integers(1, 300),
              st.sampled_from(['float16', 'float32', 'float64'])),
    max_size=30)


@given(entries_st, st.integers(1, 3000),
       st.lists(st.integers(1, 3000), max_size=3))
def test_plan_is_a_function_of_its_input(raw, bucket_size, tail):
    # Same list, same plan (what makes a plan computed on each rank, or
    # broadcast from rank 0 and recomputed, identical everywhere); and a
    # plan never depends on the names (only on sizes and dtypes).
    entries = [('p%d' % i, n, dt) for i, (n, dt) in enumerate(raw)]
    plans = plan_buckets(entries, bucket_size, tail=tuple(tail))
    assert plan_buckets(list(entries), bucket_size, tail=tuple(tail)) == plans
    renamed = [('q%d' % (100 - i), n, dt) for i, (n, dt) in enumerate(raw)]
    other = plan_buckets(renamed, bucket_size, tail=tuple(tail))
    assert [(p.dtype, p.nelems, len(p.entries)) for p in other] == [
        (p.dtype, p.nelems, len(p.entries)) for p in plans]


@given(entries_st, st.integers(1, 3000),
       st.lists(st.integers(1, 3000), max_size=3))
def test_every_bucket_has_one_wire_dtype(raw, bucket_size, tail):
    entries = [('p%d' % i, n, dt) for i, (n, dt) in enumerate(raw)]
    dtypes = {name: buckets.wire_dtype(dt) for name, _, dt in entries}
    for p in plan_buckets(entries, bucket_size, tail=tuple(tail)):
        assert {dtypes[name] for name, _, _ in p.entries} == {p.dtype}


def test_plan_rejects_a_negative_size():
    with pytest.raises(ValueError, match='bucket_size'):
        plan_buckets([('a', 1, 'float32')], -4)


# ---------------------------------------------------------------------------
# Bucket: views and the label used in error messages


def _bucket(names_sizes, dtype='float32', index=0):
    plan = plan_buckets([(n, s, dtype) for n, s in names_sizes], 1 << 30)[0]
    return buckets.Bucket(index, plan, params=[None] * len(names_sizes))


def test_bucket_slots_are_views_of_its_buffer():
    b = _bucket([('/l1/W', 6), ('/l1/b', 2)])
    buf = b.ensure_buffer(np)
    assert buf.shape == (8,) and buf.dtype == np.float32
    assert b.ensure_buffer(np) is buf        # reused, not reallocated
    b.slot(0)[...] = 1
    b.slot(1)[...] = 2
    np.testing.assert_array_equal(buf, [1] * 6 + [2] * 2)
    assert b.nbytes == 32


def test_bucket_label_names_index_layers_and_size():
    b = _bucket([('/l2/W', 250000), ('/l2/b', 10), ('/l3/W', 10)], index=3)
    assert b.label() == ('bucket 3 (3 params of layers /l2, /l3; 1.00 MB)')
    one = _bucket([('/l1/W', 4), ('/l1/b', 4)])
    assert 'params of layer /l1;' in one.label()


def test_bucket_label_shortens_long_layer_lists():
    b = _bucket([('/l%d/W' % i, 1) for i in range(9)])
    label = b.label(max_layers=3)
    assert '/l0, /l1, /l2, ... (6 more)' in label
    assert '/l3' not in label


# ---------------------------------------------------------------------------
# Watchdog: fingerprint and control message


def _buckets_of(spec):
    """Buckets from ``[(dtype, [(name, size), ...]), ...]``."""
    return [_bucket(members, dtype, i) for i, (dtype, members) in
            enumerate(spec)]


BASE = [('float32', [('/l1/W', 20), ('/l1/b', 4)]),
        ('float32', [('/l2/W', 12)])]


def test_fingerprint_is_equal_for_equal_layouts():
    assert (watchdog.layout_fingerprint(_buckets_of(BASE))
            == watchdog.layout_fingerprint(_buckets_of(list(BASE))))


@pytest.mark.parametrize('changed', [
    # another member name, size, dtype, order, bucket boundary
    [('float32', [('/l1/W', 20), ('/lx/b', 4)]), BASE[1]],
    [('float32', [('/l1/W', 20), ('/l1/b', 5)]), BASE[1]],
    [BASE[0], ('float64', [('/l2/W', 12)])],
    [BASE[1], BASE[0]],
    [('float32', [('/l1/W', 20)]),
     ('float32', [('/l1/b', 4), ('/l2/W', 12)])],
    [BASE[0]],
])
def test_fingerprint_changes_with_the_buckets_of(changed):
    assert (watchdog.layout_fingerprint(_buckets_of(changed))
            != watchdog.layout_fingerprint(_buckets_of(BASE)))


def test_fingerprint_fits_a_control_slot():
    # 31 bits: non-negative, so it always beats the INT64_MIN filler of the
    # other ranks' slots in the MAX reduction.
    for spec in (BASE, [], [BASE[1]]):
        fp = watchdog.layout_fingerprint(_buckets_of(spec))
        assert 0 <= fp < 2 ** 31


def test_fingerprint_and_plan_are_the_same_in_another_process():
    # Ranks are separate interpreters with their own hash seeds; the
    # fingerprint and the plan must not depend on them (no hash(), no set
    # order).
    code = (
        'import json\n'
        'from chainermn_overlap.communication import buckets, watchdog\n'
        'entries = [("/l%d/W" % i, 7 * i + 1, "float32") for i in range(9)]'
        '\n'
        'plans = buckets.plan_buckets(entries, 64, tail=(16,))\n'
        'bs = [buckets.Bucket(i, p, [None] * len(p.entries))'
        ' for i, p in enumerate(plans)]\n'
        'print(json.dumps([watchdog.layout_fingerprint(bs),'
        ' [[list(e) for e in p.entries] for p in plans]]))\n')
    outs = []
    for seed in ('1', '2'):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                             env=env, capture_output=True, text=True,
                             check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    entries = [('/l%d/W' % i, 7 * i + 1, 'float32') for i in range(9)]
    plans = plan_buckets(entries, 64, tail=(16,))
    bs = [buckets.Bucket(i, p, [None] * len(p.entries))
          for i, p in enumerate(plans)]
    assert outs[0][0] == watchdog.layout_fingerprint(bs)


def test_control_message_slots():
    buf = watchdog.control_message(True, True, 2, 4, 99, 17)
    assert buf.dtype == np.int64 and buf.shape == (2 + 2 * 4,)
    assert buf[0] == 1 and buf[1] == -1
    assert buf[2 + 2] == 99 and buf[2 + 4 + 2] == 17
    others = [i for i in range(2, 10) if i not in (4, 8)]
    assert (buf[others] == np.iinfo(np.int64).min).all()


@pytest.mark.parametrize('size', [1, 2, 5])
def test_max_of_control_messages_is_an_allgather(size):
    msgs = [watchdog.control_message(False, False, r, size, 1000 + r, 7 + r)
            for r in range(size)]
    buf = np.maximum.reduce(msgs)
    assert buf[2:2 + size].tolist() == [1000 + r for r in range(size)]
    assert buf[2 + size:].tolist() == [7 + r for r in range(size)]


@pytest.mark.parametrize('loaded, expected', [
    ([True, True, True], -1), ([True, False, True], 0),
    ([False, False, False], 0)])
def test_loaded_flag_is_true_only_if_every_rank_loaded(loaded, expected):
    # -loaded reduced with MAX is an AND: a snapshot counts as loaded only
    # when every rank loaded it.
    msgs = [watchdog.control_message(False, flag, r, 3, 5, 1)
            for r, flag in enumerate(loaded)]
    assert np.maximum.reduce(msgs)[1] == expected


def test_changed_flag_is_true_if_any_rank_changed():
    msgs = [watchdog.control_message(r == 2, False, r, 3, 5, 1)
            for r in range(3)]
    assert np.maximum.reduce(msgs)[0] == 1
    msgs = [watchdog.control_message(False, False, r, 3, 5, 1)
            for r in range(3)]
    assert np.maximum.reduce(msgs)[0] == 0


def test_check_control_names_layout_disagreement():
    msgs = [watchdog.control_message(False, False, r, 4,
                                     11 if r in (1, 3) else 22, 5)
            for r in range(4)]
    with pytest.raises(CollectiveMismatchError) as e:
        watchdog.check_control(np.maximum.reduce(msgs), 3, 4)
    msg = str(e.value)
    assert msg.startswith('rank 3:')
    assert ('ranks [0, 2]: bucket layout 22; ranks [1, 3]: bucket layout 11'
            in msg), msg
    assert 'iteration 5' not in msg    # the iterations agree


def test_check_control_reports_both_disagreements():
    msgs = [watchdog.control_message(False, False, r, 2, 10 + r, 3 * r)
            for r in range(2)]
    with pytest.raises(CollectiveMismatchError) as e:
        watchdog.check_control(np.maximum.reduce(msgs), 0, 2)
    msg = str(e.value)
    assert ('ranks [0]: iteration 0; ranks [1]: iteration 3 | '
            'ranks [0]: bucket layout 10; ranks [1]: bucket layout 11'
            in msg), msg


def test_check_control_ignores_a_buffer_without_per_rank_slots():
    # Shorter than 2 + 2 * size: no per-rank slots to compare.
    watchdog.check_control(np.array([0, 0], dtype=np.int64), 0, 4)


@given(st.integers(1, 6), st.integers(0, 2 ** 31 - 1),
       st.integers(0, 10 ** 6))
def test_check_control_accepts_any_agreement(size, fp, it):
    msgs = [watchdog.control_message(False, False, r, size, fp, it)
            for r in range(size)]
    watchdog.check_control(np.maximum.reduce(msgs), size - 1, size)


def test_stall_warning_default_environment_and_option(monkeypatch):
    monkeypatch.delenv(config.STALL_WARNING_ENV, raising=False)
    assert config.resolve_stall_warning(None) is None
    monkeypatch.setenv(config.STALL_WARNING_ENV, '30')
    assert config.resolve_stall_warning(None) == 30.0
    assert config.resolve_stall_warning(2) == 2.0
    assert config.resolve_stall_warning('off') is None
    monkeypatch.setenv(config.STALL_WARNING_ENV, 'soon')
    with pytest.raises(ValueError, match=config.STALL_WARNING_ENV):
        config.resolve_stall_warning(None)


@pytest.mark.parametrize('env, expected', [
    (None, False), ('', False), ('0', False), ('off', False),
    ('False', False), ('no', False), ('1', True), ('yes', True),
    (' ON ', True)])
def test_debug_from_environment(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv(config.DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(config.DEBUG_ENV, env)
    assert config.resolve_debug(None) is expected


def test_debug_option_wins_over_environment(monkeypatch):
    monkeypatch.setenv(config.DEBUG_ENV, '1')
    assert config.resolve_debug(False) is False
    monkeypatch.setenv(config.DEBUG_ENV, '0')
    assert config.resolve_debug(True) is True


# ---------------------------------------------------------------------------
# Handles and staging


def test_busy_seconds_sums_chunk_spans():
    h = backends.Handle('x')
    assert h.busy_seconds() == 0.0
    h.started_at, h.finished_at = 1.0, 5.0
    assert h.busy_seconds() == 4.0
    # Interleaved chunks: only the time spent on this buffer counts.
    h.spans = [(1.0, 1.5), (3.0, 3.25)]
    assert h.busy_seconds() == 0.75


def test_numpy_arrays_are_reduced_in_place():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    host, finish = _host.stage_to_host(a)
    assert host is a and finish is None


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(ValueError) as e:
        backends.get_backend('no-such-engine')
    assert 'no-such-engine' in str(e.value)
    assert 'mpi_thread' in str(e.value)


# ---------------------------------------------------------------------------
# Timeline files


@pytest.mark.parametrize('path, rank, expected', [
    ('trace.json', 3, 'trace.rank3.json'),
    ('trace', 0, 'trace.rank0.json'),
    ('t-{rank}.json', 2, 't-2.json')])
def test_timeline_path_per_rank(tmp_path, path, rank, expected):
    tl = timeline.Timeline(str(tmp_path / path), rank)
    assert os.path.basename(tl.path) == expected


def test_timeline_writes_chrome_trace(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 'sub' / 'trace.json'), 1)
    t0 = tl.t0
    tl.span('forward /l1', 'forward', t0 + 1.0, t0 + 1.5)
    tl.span('never started', 'comm', None, t0 + 2.0)
    tl.instant('post bucket 0', 'comm', t=t0 + 2.0, tid=tl.COMM,
               args={'bytes': 8})
    with open(tl.write()) as f:
        trace = json.load(f)
    events = [e for e in trace['traceEvents'] if e['ph'] != 'M']
    assert [e['name'] for e in events] == ['forward /l1', 'post bucket 0']
    span, inst = events
    assert span['ts'] == pytest.approx(1e6) and span['dur'] == pytest.approx(
        5e5)
    assert span['pid'] == 1 and span['tid'] == tl.MAIN
    assert inst['tid'] == tl.COMM and inst['args'] == {'bytes': 8}


def test_timeline_stops_recording_at_its_limit(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0, max_events=5)
    for i in range(10):
        tl.instant('i%d' % i, 'x')
    assert len(tl.events) == 5 and tl.full


def test_null_timeline_takes_every_call_of_a_timeline(tmp_path):
    # Code records events unconditionally: the do-nothing timeline must
    # accept each call a real one does, and record nothing.
    real = timeline.Timeline(str(tmp_path / 't.json'), 0)
    null = timeline.NullTimeline()
    public = [n for n in dir(real) if not n.startswith('_')
              and callable(getattr(real, n))]
    assert set(public) <= set(dir(null)), set(public) - set(dir(null))
    assert (null.MAIN, null.COMM) == (real.MAIN, real.COMM)
    null.span('x', 'c', 0.0, 1.0, tid=null.COMM, args={'a': 1})
    null.instant('y', 'c')
    assert null.write() is None
    assert real.enabled and not null.enabled
    assert null.full      # callers that check it skip building events


# ---------------------------------------------------------------------------
# Optimizer-side pure parts


class _HP(object):
    pass


def test_deferred_update_sees_the_hyperparameters_of_its_iteration():
    hp = _HP()
    hp.lr, hp.momentum = 0.01, 0.9
    # A schedule changed lr after the iteration closed with lr=0.1.
    with hyperparams(hp, {'lr': 0.1, 'momentum': 0.9}):
        assert (hp.lr, hp.momentum) == (0.1, 0.9)
    assert (hp.lr, hp.momentum) == (0.01, 0.9)


def test_hyperparameters_are_restored_after_an_error():
    hp = _HP()
    hp.lr = 0.5
    with pytest.raises(KeyError):
        with hyperparams(hp, {'lr': 0.25}):
            raise KeyError('in the update rule')
    assert hp.lr == 0.5


def test_no_snapshot_changes_nothing():
    hp = _HP()
    hp.lr = 0.5
    with hyperparams(hp, None):
        assert hp.lr == 0.5
    with hyperparams(hp, {}):
        assert hp.lr == 0.5


def test_communication_stats():
    stats = CommunicationStats()
    assert stats.as_dict()['hidden_fraction'] is None  # nothing measured
    h = backends.Handle('b', nbytes=100)
    h.spans = [(0.0, 2.0)]
    stats.record(h, 0.5)
    stats.record(h, 0.0)
    d = stats.as_dict()
    assert (d['buckets'], d['bytes']) == (2, 200)
    assert d['comm_seconds'] == 4.0 and d['wait_seconds'] == 0.5
    assert d['hidden_fraction'] == pytest.approx(1 - 0.5 / 4.0)
    stats.reset()
    assert stats.as_dict()['buckets'] == 0


@pytest.mark.parametrize('wait, comm, expected', [
    (0.0, 0.0, None), (0.0, 2.0, 1.0), (0.5, 2.0, 0.75), (2.0, 2.0, 0.0)])
def test_hidden_fraction(wait, comm, expected):
    assert hidden_fraction(wait, comm) == expected


def test_per_parameter_updates_for_plain_gradient_methods():
    opt = chainer.optimizers.MomentumSGD(0.1)
    opt.setup(L.Linear(2, 2))
    assert fallback_reason(opt) is None
    # A hook applied parameter by parameter keeps the layer-wise update.
    opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    assert fallback_reason(opt) is None


def test_fallback_reasons_name_the_cause():
    clip = chainer.optimizers.SGD(0.1)
    clip.setup(L.Linear(2, 2))
    clip.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
    assert "'GradientClipping'" in fallback_reason(clip)
    assert 'every gradient at once' in fallback_reason(clip)

    class OwnUpdate(chainer.optimizers.SGD):
        def update(self, lossfun=None, *args, **kwds):
            return super().update(lossfun, *args, **kwds)

    assert fallback_reason(OwnUpdate()) == 'OwnUpdate overrides update()'

    class NotGradient(chainer.Optimizer):
        pass

    assert 'not a GradientMethod' in fallback_reason(NotGradient())

    dyn = chainer.optimizers.SGD(0.1)
    dyn.loss_scaling()      # dynamic by default
    assert 'dynamic loss scaling' in fallback_reason(dyn)


def test_local_structure_is_sorted_by_name_and_marks_lazy_params():
    # The layout is built from it: every rank must list its parameters in
    # the same order, whatever order the model registered them in.
    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.z = L.Linear(3, 2)
                self.a = L.Linear(None, 4)

    rows = _layout._local_structure(Net())
    assert [r[0] for r in rows] == ['/a/W', '/a/b', '/z/W', '/z/b']
    assert rows[0][2:] == (None, None)           # not initialised yet
    assert rows[2][2:] == ((2, 3), 'float32')
