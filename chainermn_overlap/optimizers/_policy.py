"""When reduced gradients become updates: in ``update()``, or per link later.

``wait='update'`` (and the fallback of ``wait='forward'``) completes the
iteration in ``update()``: every mean gradient goes into ``param.grad`` and
the actual optimizer runs, ChainerMN's state exactly.  ``wait='forward'``
defers each parameter's update until its link next runs (or anything reads
it): the optimizer's hyperparameters and hooks are snapshotted when the
iteration closes, so a deferred update equals the one the blocking
optimizer ran then.

:class:`Policy` is the interface every update policy implements (this
module's :class:`UpdatePolicy`, and the sharded ones of
:mod:`chainermn_overlap.optimizers.sharding`): what the optimizer's
wiring, the gradient tracker and the bucket reducer call.
"""
import abc
import contextlib
import time
import warnings

from chainer import optimizer as optimizer_module

from chainermn_overlap.communication import ownership
from chainermn_overlap.errors import FallbackWarning
from chainermn_overlap.optimizers import _clipping


def fallback_reason(actual):
    """Why ``actual`` cannot update parameter by parameter (None if it can)."""
    if not isinstance(actual, optimizer_module.GradientMethod):
        return '{} is not a GradientMethod'.format(type(actual).__name__)
    if type(actual).update is not optimizer_module.GradientMethod.update:
        return '{} overrides update()'.format(type(actual).__name__)
    if actual._loss_scaling_is_dynamic:
        return 'dynamic loss scaling needs every gradient at once'
    hookable = actual._hookable
    for hooks in (hookable._pre_update_hooks, hookable._post_update_hooks):
        for name, hook in hooks.items():
            if not getattr(hook, 'call_for_each_param', False):
                return ('optimizer hook {!r} ({}) needs every gradient at '
                        'once'.format(name, type(hook).__name__))
    return None


@contextlib.contextmanager
def hyperparams(hp, snapshot):
    """Applies hyperparameters as they were when the iteration closed.

    Extensions (learning-rate schedules) change them after update(); the
    deferred update must still use the values of its own iteration.
    """
    if not snapshot:
        yield
        return
    changed = {}
    for k, v in snapshot.items():
        cur = getattr(hp, k, None)
        if cur is not v and cur != v:
            changed[k] = cur
            setattr(hp, k, v)
    try:
        yield
    finally:
        for k, v in changed.items():
            setattr(hp, k, v)


def _run_rule(param, pre, post):
    """The actual optimizer's update of one parameter, with its hooks."""
    rule = param.update_rule
    for hook in pre:
        hook(rule, param)
    param.update()
    for hook in post:
        hook(rule, param)


class Policy(abc.ABC):
    """When and where the update rules run on the reduced gradients.

    What each caller uses:

    * the bucket reducer (through the optimizer's wiring):
      :meth:`flush_bucket` before a bucket's buffer is reused,
      :meth:`after_post` after a bucket is posted,
      :meth:`before_new_buffer` before a transient buffer is allocated;
      and, read when the reducer is built, the round's shape
      (:attr:`items_per_bucket`, :attr:`extra_items`) and whether buffers
      live only until reduced (:attr:`transient`);
    * the gradient tracker: :meth:`apply` and :attr:`pending_count` (a
      link's deferred updates before its forward); where
      :attr:`gathers_params` is set, the policy also makes released
      parameters whole for a use (``gather``, ``tapped``,
      ``release_nodes``, ``raw_use``: sharding.params);
    * the wiring: every other method.

    Args:
        actual (chainer.Optimizer): the wrapped optimizer.
        wait (str): ``'forward'`` or ``'update'``.
        reducer (BucketReducer): waits for buckets, reads mean gradients;
            its engine bounds the policy's own waits.
        timeline: the optimizer's timeline (a ``NullTimeline`` if off).
        mpi_comm: the optimizer's communicator (small collectives the main
            thread posts, e.g. a gradient norm).
    """

    # Items each bucket takes in a round of collectives, and items of a
    # round besides those (the control message not counted).
    items_per_bucket = 1
    extra_items = 0
    # Buckets' buffers live only until reduced.
    transient = False
    # Parameters are released between uses and made whole by the policy.
    gathers_params = False

    def __init__(self, actual, wait, reducer, timeline, mpi_comm=None):
        self.actual = actual
        self.wait = wait
        self.reducer = reducer
        self.timeline = timeline
        self.mpi_comm = mpi_comm
        self.infos = []
        self.by_bucket = {}
        # Updates of the last closed iteration not applied yet.
        self.pending_count = 0

    @abc.abstractmethod
    def set_layout(self, infos):
        """A new bucket layout (``infos``: its ``ParamState`` objects)."""

    @abc.abstractmethod
    def finish_iteration(self, target, immediate=()):
        """Every bucket of the iteration is posted: update or defer
        (``immediate``: parameters reduced within their group, their
        ``grad`` already the mean)."""

    @abc.abstractmethod
    def complete_in_update(self, immediate=()):
        """Completes the iteration inside ``update()`` (a rebuilt layout)."""

    @abc.abstractmethod
    def apply(self, infos):
        """Waits until the parameters of ``infos`` hold their update."""

    @abc.abstractmethod
    def flush_bucket(self, bucket):
        """Finishes a bucket of an earlier iteration before its reuse."""

    @abc.abstractmethod
    def wait_posted(self, bucket):
        """A bucket posted in the open iteration (``synchronize()``)."""

    def after_post(self, bucket):
        """A bucket was just posted (backward)."""

    def before_new_buffer(self):
        """A transient bucket buffer is about to be allocated."""

    def before_relayout(self):
        """The layout is about to be rebuilt."""

    def abandon_round(self):
        """The iteration's step is dropped (a relayout)."""

    def serialize(self, actual, serializer):
        actual.serialize(serializer)

    def close(self):
        """The optimizer is closed."""

    def wait_requests(self, requests, label, hint=''):
        """Waits for MPI requests of a collective the main thread posted,
        bounded as the reductions are (the optimizer's ``timeout=``)."""
        self.reducer.engine.watchdog.wait_requests(requests, label,
                                                   hint=hint)


class UpdatePolicy(Policy):
    """Runs the update rules on the mean gradients (no sharding).

    Args: as :class:`Policy`.
    """

    def __init__(self, actual, wait, reducer, timeline, mpi_comm=None):
        super().__init__(actual, wait, reducer, timeline, mpi_comm)
        self.hyperparams = None
        # Optimizer hooks as they were when the deferred updates' iteration
        # closed: a hook added later must not apply to them (ChainerMN had
        # already run that update when the hook was added).
        self.deferred_hooks = None
        # The user's chainer.config values when the iteration closed: a
        # deferred update runs under them (at the next forward, an
        # evaluation's train=False may be in force).
        self.deferred_config = None
        self.warned_fallback = False

    def set_layout(self, infos):
        self.infos = infos
        self.by_bucket = {}
        for info in infos:
            self.by_bucket.setdefault(info.bucket.index, []).append(info)
        self.pending_count = 0

    def finish_iteration(self, target, immediate=()):
        """All buckets of the iteration are posted: update or defer.

        ``immediate``: parameters outside the layout whose ``grad`` already
        holds the reduced gradient (reduced within their group): with
        ``wait='forward'`` they are updated now, not deferred.
        """
        fallback = fallback_reason(self.actual)
        if self.wait == 'update' or fallback:
            if fallback and self.wait == 'forward' and not self.warned_fallback:
                self.warned_fallback = True
                warnings.warn(
                    "wait='forward' falls back to waiting in update(): {}. "
                    'Results are exact, but communication overlaps only '
                    'with backward.'.format(fallback), FallbackWarning,
                    stacklevel=5)
            self.complete_in_update(immediate)
        else:
            self._defer(target)
            self._update_now(immediate)

    def wait_posted(self, bucket):
        """A bucket posted in the open iteration: its reduction finishes
        and its result stays for ``update()``."""
        bucket.handle.wait()

    def complete_in_update(self, immediate=()):
        """ChainerMN semantics: mean gradients in param.grad, then update
        (every parameter, the channel blocks ``immediate`` too)."""
        self.reducer.mean_grads_to_params(self.infos)
        with _clipping.across_groups(self.actual, self.mpi_comm,
                                     self.wait_requests):
            self.actual.update()

    def _defer(self, target):
        actual = self.actual
        self.hyperparams = actual.hyperparam.get_dict()
        self.deferred_config = ownership.capture_config()
        hookable = actual._hookable
        self.deferred_hooks = (list(hookable._pre_update_hooks.values()),
                               list(hookable._post_update_hooks.values()))
        actual.t += 1
        for info in self.infos:
            info.pending = True
            self.reducer.alias_grad(info)
        self.pending_count = len(self.infos)
        # Parameters outside the layout (never initialised) still go through
        # their update rule, as GradientMethod.update would do.
        in_layout = {id(i.param) for i in self.infos}
        for p in target.params():
            if id(p) not in in_layout and p.array is None:
                p.update()

    def _update_now(self, params):
        pre, post = self.deferred_hooks
        for param in params:
            _run_rule(param, pre, post)

    def apply(self, infos):
        """Waits for the reductions of ``infos`` and runs their update."""
        t0 = time.perf_counter()
        actual = self.actual
        hookable = actual._hookable
        if self.deferred_hooks is not None:
            pre, post = self.deferred_hooks
        else:
            pre = list(hookable._pre_update_hooks.values())
            post = list(hookable._post_update_hooks.values())
        reducer = self.reducer
        with hyperparams(actual.hyperparam, self.hyperparams), \
                ownership.using_config(self.deferred_config):
            for info in infos:
                if not info.pending:
                    continue
                reducer.wait_bucket(info.bucket)
                param = info.param
                saved = param.grad
                param.grad = reducer.mean_grad(info)
                _run_rule(param, pre, post)
                # Still the bucket's view (see BucketReducer.alias_grad),
                # unless the gradient was cleared or set since the iteration
                # closed (e.g. under no_sync): that one stays.
                param.grad = saved
                info.pending = False
                self.pending_count -= 1
        for info in infos:
            b = info.bucket
            if b.handle is not None and not any(
                    i.pending for i in self._bucket_infos(b)):
                b.handle = None
        if self.timeline.enabled:
            self.timeline.span(
                'update ' + infos[0].name.rsplit('/', 1)[0], 'update', t0,
                time.perf_counter(), args={'params': [i.name for i in infos]})

    def _bucket_infos(self, bucket):
        return self.by_bucket[bucket.index]

    def flush_bucket(self, bucket):
        """Finishes a bucket of an earlier iteration before its reuse."""
        pending = [i for i in self._bucket_infos(bucket) if i.pending]
        if pending:
            self.apply(pending)
        else:
            self.reducer.wait_bucket(bucket)
        bucket.handle = None
