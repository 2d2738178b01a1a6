"""Equivalence harness for MPI tests of multi-node optimizers.

A test trains the same model on the same per-rank data twice -- once with
ChainerMN's blocking ``create_multi_node_optimizer`` (the reference) and once
with the implementation under test -- and compares the parameters afterwards.
Everything here is collective: call it on every rank in the same order.

The implementation under test is chosen by the test harness with
:func:`configure` (the project's MPI suites take it from their own
environment variables, ``tests/mpi/_suite_env.py``):

- ``'overlap'`` (default): ``chainermn_overlap.create_overlapped_optimizer``,
  with the ``shard=`` given to :func:`configure` unless a test gives one;
- ``'chainermn'``: ChainerMN's own optimizer plugged in place of ours, which
  validates the harness itself (every equivalence must then hold trivially,
  and the checks that only our optimizer satisfies are inverted or skipped).

Typical use::

    impl = equivalence.implementation_under_test()
    ref, got = equivalence.train_both(impl, template, make_actual, step,
                                      steps=5, wait='forward')
    equivalence.assert_equivalent(got.model, ref.model, rtol=1e-5, atol=1e-6)
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

import chainer
import chainermn

from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import blocking
from chainermn_overlap.testing import models

__all__ = [
    'REFERENCE', 'MLP', 'ChainerMNImpl', 'OverlappedImpl', 'Run',
    'all_ranks_ok', 'assert_all_ranks', 'assert_different',
    'assert_equivalent', 'assert_same_value', 'compare_states',
    'configure', 'cross_rank_errors', 'get_communicator', 'global_rng',
    'implementation_under_test', 'shard_mode', 'make_batches', 'param_state', 'rank_slice',
    'seed_for_rank', 'train', 'train_both',
]

# What the suites test (configure()): the implementation, and the shard=
# the overlapped optimizer gets by default (the same suites then check every
# sharding mode against ChainerMN).
_UNDER_TEST = {'optimizer': 'overlap', 'shard': None}

#: ``{name: array or None}``, as :func:`param_state` returns.
State = Dict[str, Optional[np.ndarray]]
Impl = Union['ChainerMNImpl', 'OverlappedImpl']

_comm = None


def get_communicator() -> chainermn.CommunicatorBase:
    """The session-wide ChainerMN communicator (created once, collectively)."""
    global _comm
    if _comm is None:
        _comm = chainermn.create_communicator('naive')
    return _comm


# ---------------------------------------------------------------------------
# Implementations: a tiny adapter so that tests can plug either optimizer.
# ---------------------------------------------------------------------------

class ChainerMNImpl(object):
    """ChainerMN's blocking optimizer behind the adapter interface.

    ``wait`` and the other options of ours are accepted and ignored (except
    ``zero_fill``), so the same test code runs against either implementation.
    """

    name = 'chainermn'
    is_reference = True
    # ChainerMN's wrapper forgets the parameter set when it is rebuilt from a
    # snapshot, so its first update after a resume broadcasts and is skipped.
    resume_skips = True
    fallback_warning = None

    def create(self, actual: chainer.Optimizer, comm: Any,
               wait: str = 'forward', **options: Any) -> Any:
        zero_fill = options.get('zero_fill', True)
        return chainermn.create_multi_node_optimizer(actual, comm,
                                                     zero_fill=zero_fill)

    def synchronize(self, opt: Any) -> None:
        pass

    def no_sync(self, opt: Any) -> contextlib.AbstractContextManager:
        # ChainerMN communicates only inside update(), so accumulating
        # several backward passes before update() is already local.
        return contextlib.nullcontext()


class OverlappedImpl(object):
    """``chainermn_overlap.create_overlapped_optimizer``."""

    name = 'overlap'
    is_reference = False
    resume_skips = False

    def __init__(self):
        import chainermn_overlap
        if not hasattr(chainermn_overlap, 'create_overlapped_optimizer'):
            raise RuntimeError(
                'chainermn_overlap.create_overlapped_optimizer does not exist '
                "(yet). configure(optimizer='chainermn') runs these tests "
                "against ChainerMN's optimizer, which validates the "
                'harness.')
        self._module = chainermn_overlap

    @property
    def fallback_warning(self):
        return self._module.FallbackWarning

    def create(self, actual: chainer.Optimizer, comm: Any,
               wait: str = 'forward', **options: Any) -> Any:
        shard = _UNDER_TEST['shard']
        if shard:
            options.setdefault('shard', shard)
        return self._module.create_overlapped_optimizer(
            actual, comm, wait=wait, **options)

    def synchronize(self, opt: Any) -> None:
        opt.synchronize()

    def no_sync(self, opt: Any) -> contextlib.AbstractContextManager:
        return opt.no_sync()


REFERENCE = ChainerMNImpl()


def configure(optimizer: str = 'overlap',
              shard: Optional[str] = None) -> None:
    """Sets what the suites test.

    Args:
        optimizer (str): ``'overlap'`` (ours) or ``'chainermn'``
            (ChainerMN's, to validate the harness).
        shard (str): the ``shard=`` the overlapped optimizer gets unless a
            test gives one (None or empty: none).
    """
    if optimizer not in ('overlap', 'chainermn'):
        raise ValueError('the optimizer under test must be "overlap" or '
                         '"chainermn", not %r' % (optimizer,))
    _UNDER_TEST.update(optimizer=optimizer, shard=shard or None)


def shard_mode() -> Optional[str]:
    """The ``shard=`` the overlapped optimizer gets by default (or None)."""
    return _UNDER_TEST['shard']


def implementation_under_test() -> Impl:
    """The adapter :func:`configure` selected."""
    if _UNDER_TEST['optimizer'] == 'chainermn':
        return ChainerMNImpl()
    return OverlappedImpl()


# ---------------------------------------------------------------------------
# Data: rank-dependent slices of a global batch drawn from a fixed seed.
# ---------------------------------------------------------------------------

def global_rng(seed: int) -> np.random.RandomState:
    return np.random.RandomState(seed)


def rank_slice(array: np.ndarray, comm: Any = None,
               axis: int = 1) -> np.ndarray:
    """This rank's contiguous share of ``array`` along ``axis``.

    ``array.shape[axis]`` must be a multiple of the number of ranks.
    """
    comm = comm or get_communicator()
    n = array.shape[axis]
    assert n % comm.size == 0, (n, comm.size)
    b = n // comm.size
    index = [slice(None)] * array.ndim
    index[axis] = slice(comm.rank * b, (comm.rank + 1) * b)
    return array[tuple(index)]


def make_batches(seed: int, steps: int, per_rank: int,
                 x_shape: Sequence[int], n_classes: Optional[int] = None,
                 y_shape: Optional[Sequence[int]] = None, comm: Any = None
                 ) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per-step ``(x, t)`` pairs: this rank's part of a global batch.

    The global batch of step ``i`` holds ``per_rank * size`` samples drawn
    from ``RandomState(seed)``; rank ``r`` gets samples ``r*per_rank`` to
    ``(r+1)*per_rank``.  With ``n_classes`` the targets are int32 labels,
    otherwise float32 regression targets of ``y_shape``.
    """
    comm = comm or get_communicator()
    rng = global_rng(seed)
    n = per_rank * comm.size
    xs = rng.standard_normal((steps, n) + tuple(x_shape)).astype(np.float32)
    if n_classes is not None:
        ts = rng.randint(0, n_classes, size=(steps, n)).astype(np.int32)
    else:
        ts = rng.standard_normal(
            (steps, n) + tuple(y_shape)).astype(np.float32)
    xs = rank_slice(xs, comm)
    ts = rank_slice(ts, comm)
    return [(xs[i], ts[i]) for i in range(steps)]


def seed_for_rank(seed: int, comm: Any = None) -> None:
    """Seed ``numpy.random`` differently on each rank.

    Model initialisation may differ between ranks (realistic: the first
    update broadcasts rank 0's parameters), but must be the same in both
    runs being compared; reseeding before each run makes lazily initialised
    links draw the same values in both.
    """
    comm = comm or get_communicator()
    np.random.seed(seed * 1009 + comm.rank)


# ---------------------------------------------------------------------------
# Training runs.
# ---------------------------------------------------------------------------

class Run(object):
    """Result of one training run."""

    def __init__(self, model: chainer.Link, opt: Any, impl: Impl,
                 caught: List[warnings.WarningMessage]) -> None:
        self.model = model
        self.opt = opt
        self.impl = impl
        self.warnings = caught

    def count_warnings(self, category: Optional[type]) -> int:
        if category is None:
            return 0
        return sum(1 for w in self.warnings
                   if issubclass(w.category, category))


def train(impl: Impl, template: chainer.Link,
          make_actual: Callable[[], chainer.Optimizer],
          step: Callable[[chainer.Link, Any, int, Impl], None], steps: int,
          wait: str = 'forward', options: Optional[dict] = None,
          hooks: Optional[Callable[[], list]] = None, seed: int = 0,
          synchronize: bool = True, comm: Any = None) -> Run:
    """Train a deep copy of ``template`` for ``steps`` iterations.

    Args:
        impl: implementation adapter (``REFERENCE`` or the one under test).
        template (chainer.Link): copied, never trained itself.
        make_actual (callable): returns a fresh actual optimizer.
        step (callable): ``step(model, opt, iteration, impl)`` runs one
            training iteration (forward, backward, update).
        steps (int): number of iterations.
        wait (str): ``'forward'`` or ``'update'`` (ignored by ChainerMN).
        options (dict): further options for the overlapped optimizer.
        hooks (callable): returns a list of optimizer hooks, added through
            the wrapper after ``setup`` (as a ChainerMN user does).
        seed (int): seeds ``numpy.random`` per rank before the run.
        synchronize (bool): call ``synchronize()`` at the end.

    Returns:
        Run: the model, the wrapper and every warning emitted in the run.
    """
    comm = comm or get_communicator()
    model = copy.deepcopy(template)
    seed_for_rank(seed, comm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        opt = impl.create(make_actual(), comm, wait=wait, **(options or {}))
        ret = opt.setup(model)
        assert ret is opt, 'setup() must return the wrapper'
        for hook in (hooks() if hooks is not None else ()):
            opt.add_hook(hook)
        for it in range(steps):
            step(model, opt, it, impl)
        if synchronize:
            impl.synchronize(opt)
    return Run(model, opt, impl, list(caught))


def train_both(impl: Impl, template: chainer.Link,
               make_actual: Callable[[], chainer.Optimizer],
               step: Callable[[chainer.Link, Any, int, Impl], None],
               steps: int, wait: str = 'forward',
               options: Optional[dict] = None,
               hooks: Optional[Callable[[], list]] = None,
               seed: int = 0) -> Tuple[Run, Run]:
    """Train with ChainerMN (reference) and with ``impl``; returns both."""
    ref = train(REFERENCE, template, make_actual, step, steps, wait,
                None, hooks, seed)
    got = train(impl, template, make_actual, step, steps, wait,
                options, hooks, seed)
    return ref, got


# ---------------------------------------------------------------------------
# Comparisons.  Every assertion is made consistent across ranks: each rank
# contributes (ok, message) through an allgather and all ranks raise if any
# rank failed, so a failure on one rank cannot leave the others waiting in
# the next collective.
# ---------------------------------------------------------------------------

def param_state(link: chainer.Link, persistents: bool = True) -> State:
    """``{name: array copy}`` for the parameters (and persistents) of link."""
    state = {}
    for name, param in link.namedparams():
        arr = param.array
        state['param ' + name] = None if arr is None else np.array(arr)
    if persistents:
        for path, sub in link.namedlinks():
            for pname in sorted(sub._persistent):
                value = sub.__dict__[pname]
                if isinstance(value, (np.ndarray, int, float, np.number)):
                    name = path.rstrip('/') + '/' + pname
                    state['persistent ' + name] = np.array(value)
    return state


def compare_states(got: State, ref: State, rtol: float,
                   atol: float) -> List[str]:
    """Human-readable differences between two states (empty when equal)."""
    errors = []
    for name in sorted(set(got) | set(ref)):
        if name not in got or name not in ref:
            errors.append('%s: present only in %s'
                          % (name, 'ours' if name in got else 'reference'))
            continue
        a, b = got[name], ref[name]
        if a is None or b is None:
            if not (a is None and b is None):
                errors.append('%s: initialised in %s only'
                              % (name, 'ours' if b is None else 'reference'))
            continue
        if a.shape != b.shape:
            errors.append('%s: shape %s != %s' % (name, a.shape, b.shape))
            continue
        if not np.allclose(a, b, rtol=rtol, atol=atol):
            diff = np.abs(a.astype(np.float64) - b)
            bound = atol + rtol * np.abs(b.astype(np.float64))
            i = np.unravel_index(np.argmax(diff - bound), diff.shape)
            errors.append('%s: max |diff| %.3g (at %s: %r vs %r), %d of %d '
                          'elements beyond rtol=%g atol=%g'
                          % (name, diff.max(), i, a[i], b[i],
                             int((diff > bound).sum()), a.size, rtol, atol))
    return errors


def all_ranks_ok(ok: bool, message: str = '',
                 comm: Any = None) -> Tuple[bool, str]:
    """Allgather a pass/fail flag; returns ``(all_ok, report)``."""
    comm = comm or get_communicator()
    results = _mpi_json.allgather_json(comm.mpi_comm, (bool(ok), message),
                                       what='the test flags')
    report = '\n'.join('rank %d: %s' % (r, m)
                       for r, (o, m) in enumerate(results) if not o)
    return all(o for o, _ in results), report


def assert_all_ranks(ok: bool, message: str = '',
                     comm: Any = None) -> None:
    """Raise AssertionError on every rank if ``ok`` is false on any rank."""
    all_ok, report = all_ranks_ok(ok, message, comm)
    if not all_ok:
        raise AssertionError(report)


def _bcast_state(mpi_comm: Any, state: State) -> State:
    """Rank 0's ``{name: array or None}`` on every rank: the names, shapes
    and dtypes as JSON, the arrays' bytes in one buffer (bounded waits)."""
    from mpi4py import MPI
    names = sorted(state)
    meta = _mpi_json.bcast_json(
        mpi_comm, [[n, None if state[n] is None else
                    [list(state[n].shape), state[n].dtype.str]]
                   for n in names], what='the test state names')
    sizes = [int(np.prod(m[0])) * np.dtype(m[1]).itemsize
             for _, m in meta if m is not None]
    if mpi_comm.Get_rank() == 0:
        buf = np.concatenate(
            [np.ascontiguousarray(state[n]).reshape(-1).view(np.uint8)
             for n, m in meta if m is not None] + [np.empty(0, np.uint8)])
    else:
        buf = np.empty(sum(sizes), dtype=np.uint8)
    blocking.bcast(mpi_comm, [buf, MPI.BYTE], 0, 'the test state')
    out, at = {}, 0
    for name, m in meta:
        if m is None:
            out[name] = None
            continue
        n = int(np.prod(m[0])) * np.dtype(m[1]).itemsize
        out[name] = buf[at:at + n].view(np.dtype(m[1])).reshape(m[0])
        at += n
    return out


def cross_rank_errors(link: chainer.Link, comm: Any = None) -> List[str]:
    """Differences of ``link``'s parameters from rank 0's (must be exact).

    All ranks apply the same update rule to the same all-reduced gradient,
    and MPI's allreduce hands every rank the same bits, so parameters must
    be bit-identical across ranks (persistents such as BatchNormalization's
    running statistics legitimately differ and are not compared).
    """
    comm = comm or get_communicator()
    mine = param_state(link, persistents=False)
    root = _bcast_state(comm.mpi_comm, mine)
    errors = []
    for name in sorted(set(mine) | set(root)):
        a, b = mine.get(name), root.get(name)
        if (a is None) != (b is None):
            errors.append('%s: initialised on one rank only' % name)
        elif a is not None and (a.shape != b.shape or
                                not np.array_equal(a, b)):
            errors.append('%s differs from rank 0 (max |diff| %s)'
                          % (name, 'shape' if a.shape != b.shape
                             else '%.3g' % np.abs(a - b).max()))
    return errors


def assert_equivalent(got: Union[chainer.Link, State],
                      ref: Union[chainer.Link, State], rtol: float,
                      atol: float, persistents: bool = True,
                      comm: Any = None, what: str = '') -> None:
    """``got`` equals ``ref`` on every rank and is identical across ranks.

    Args:
        got, ref (chainer.Link or dict): models or ``param_state`` dicts.
    """
    comm = comm or get_communicator()
    a = got if isinstance(got, dict) else param_state(got, persistents)
    b = ref if isinstance(ref, dict) else param_state(ref, persistents)
    errors = compare_states(a, b, rtol, atol)
    if isinstance(got, chainer.Link):
        errors += ['across ranks: ' + e for e in cross_rank_errors(got, comm)]
    prefix = (what + ': ') if what else ''
    assert_all_ranks(not errors, prefix + '; '.join(errors[:8]), comm)


def assert_different(got: Union[chainer.Link, State],
                     ref: Union[chainer.Link, State], rtol: float,
                     atol: float, comm: Any = None, what: str = '') -> None:
    """Negative control: ``got`` and ``ref`` differ beyond the tolerance."""
    comm = comm or get_communicator()
    a = got if isinstance(got, dict) else param_state(got, False)
    b = ref if isinstance(ref, dict) else param_state(ref, False)
    errors = compare_states(a, b, rtol, atol)
    prefix = (what + ': ') if what else ''
    assert_all_ranks(bool(errors), prefix + 'expected a difference beyond '
                     'rtol=%g atol=%g, found none' % (rtol, atol), comm)


def assert_same_value(value: Any, what: str, comm: Any = None) -> None:
    """A Python value is equal on every rank (e.g. ``opt.t``)."""
    comm = comm or get_communicator()
    values = _mpi_json.allgather_json(comm.mpi_comm, value, tuples=True,
                                      what='the values of ' + what)
    assert_all_ranks(all(v == values[0] for v in values),
                     '%s differs across ranks: %r' % (what, values), comm)


# Kept importable here (``equivalence.MLP``): the shared test models live in
# chainermn_overlap.testing.models.
MLP = models.MLP
