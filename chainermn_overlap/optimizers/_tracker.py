"""Gradient readiness: which parameter's gradient is final, and when.

The :class:`GradientTracker` is the sink the hooks report to (it implements
:class:`chainermn_overlap.hooks.taps.GradientSink`).  It owns the link
hooks, puts a tap on every initialised parameter when its link runs, counts
the uses made in forward and the taps fired in backward, and declares a
parameter's gradient final when every use has delivered its part.  What to
do with a final gradient is not its business: it calls ``on_ready(info,
grad)``, which the optimizer wires to the bucket reducer.

Per-parameter state lives in :class:`ParamState`, one per parameter of the
current layout; the layout (:mod:`._layout`) creates them.

The links it hooks are a :class:`LinkSet`; the iteration it counts is an
:class:`Iteration`, which the update policy and the wiring read.
"""
import contextlib
import time
import weakref

import chainer

from chainermn_overlap import _autosync
from chainermn_overlap.hooks import taps


class ParamState(object):
    """Per-parameter state of the current iteration and the pending update.

    ``bucket``/``index`` place the parameter in the bucket layout;
    ``pending`` is set while its deferred update (``wait='forward'``) has
    not been applied.
    """

    __slots__ = ('name', 'param', 'bucket', 'index', 'expected', 'fired',
                 'total', 'ready', 'tainted', 'armed', 'late', 'packed',
                 'nested', 'pending')

    def __init__(self, name, param, bucket, index):
        self.name = name
        self.param = param
        self.bucket = bucket
        self.index = index
        self.pending = False
        self.reset()

    def reset(self):
        self.expected = 0   # tapped uses made in forward
        self.fired = 0      # taps that delivered their gradient
        self.total = None   # gradient accumulated through taps so far
        self.ready = False  # packed into the bucket; will not change
        self.tainted = False  # used outside its link: final only at close
        # Gradient cleared (cleargrads/zerograds) this iteration: taps may
        # declare it final.  Without it, a backward could be a different
        # loss's (a GAN's discriminator loss reaching the generator), and
        # only update() knows.
        self.armed = False
        self.late = False   # read by a function after its bucket was sent
        self.packed = None  # the array packed, to detect later changes
        self.nested = False  # taps fired in a nested backward (F.forget)

    def unready(self):
        """Takes the parameter out of its bucket's ready count."""
        if self.ready:
            self.ready = False
            self.bucket.n_ready -= 1


class Iteration(object):
    """The optimizer's iteration count (the round key of its collectives).

    The tracker advances it; the update policy and the wiring read it
    (calling it returns the count).
    """

    __slots__ = ('value',)

    def __init__(self, value=0):
        self.value = value

    def __call__(self):
        return self.value


class LinkSet(object):
    """The links the optimizer's link hook is on, and their names.

    Args:
        link_hook: the hook to add (``taps.OverlapLinkHook``).
        timeline: the optimizer's timeline (links are named in it).
    """

    def __init__(self, link_hook, timeline):
        self.link_hook = link_hook
        self.timeline = timeline
        self.hooked = weakref.WeakSet()
        self.name_by_pid = {}
        self.link_names = {}

    def __contains__(self, link):
        return link in self.hooked

    def hook(self, target):
        """Hooks every link of ``target`` that has parameters (again)."""
        current = set(target.links())
        for link in list(self.hooked):
            if link not in current:
                # Removed from the model (delete_link): no longer ours.
                self.unhook(link)
        name = self.link_hook.name
        for link in current:
            if link in self.hooked or not link._params:
                continue
            hooks = link.local_link_hooks
            if isinstance(hooks.get(name), taps.InertLinkHook):
                # A copy of a link set up before (copy.deepcopy, pickling).
                link.delete_hook(name)
            if name in hooks:
                if hooks[name] is not self.link_hook:
                    raise ValueError(
                        'link {} is already managed by another overlapped '
                        'optimizer; a link can be set up with only one.'
                        .format(type(link).__name__))
            else:
                link.add_hook(self.link_hook)
            self.hooked.add(link)
        self.name_by_pid = {id(p): n for n, p in target.namedparams()}
        if self.timeline.enabled:
            self.link_names = {id(l): n or '/'
                               for n, l in target.namedlinks()}

    def unhook(self, link):
        if link.local_link_hooks.get(self.link_hook.name) is self.link_hook:
            link.delete_hook(self.link_hook.name)
        self.hooked.discard(link)
        _autosync.unregister(link)

    def unhook_all(self):
        for link in list(self.hooked):
            self.unhook(link)


class GradientTracker(taps.GradientSink):
    """Turns hook events into "this parameter's gradient is final".

    Args:
        rank (int): for error messages.
        timeline: the optimizer's timeline (a ``NullTimeline`` if off).
        on_ready (callable): ``on_ready(info, grad_array_or_None)`` when a
            gradient is final (the reducer packs it and posts what it can).
        on_backward_start (callable): called at the first tap of an
            iteration, when forward is complete on this rank.
        policy (chainermn_overlap.optimizers._policy.Policy): applies
            pending deferred updates (``apply``, ``pending_count``); where
            it ``gathers_params``, it also makes released parameters whole.
        iteration (Iteration): the count this tracker advances (default:
            a new one from 0).
        release_grads (bool): leave no gradient in ``param.grad`` once it
            is packed (sharded gradients: Chainer then keeps no full
            gradient either).
    """

    def __init__(self, rank, timeline, on_ready, on_backward_start,
                 policy, iteration=None, release_grads=False):
        self.rank = rank
        self.timeline = timeline
        self.on_ready = on_ready
        self.on_backward_start = on_backward_start
        self.release_grads = release_grads
        self.policy = policy
        # What makes released parameters whole (shard='parameters').
        self.shard_params = policy if policy.gathers_params else None
        self.clock = iteration if iteration is not None else Iteration()
        self.links = LinkSet(taps.OverlapLinkHook(self), timeline)
        self.forward_started = {}
        self.swaps = {}
        self.no_sync_depth = 0
        # The current layout's ParamStates (none before the first update).
        self.has_layout = False
        self.infos = []
        self.info_by_pid = {}
        self.array_lookup = {}
        self.backward_started = False
        # Gradient order seen before the first layout (rank 0's becomes the
        # bucket order).
        self.observed = []
        self.observed_set = set()

    @property
    def iteration(self):
        return self.clock.value

    @contextlib.contextmanager
    def no_sync(self):
        """Passes inside are not tracked (gradients accumulate locally)."""
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1

    # ------------------------------------------------------------------
    # GradientSink interface (used by the hooks)

    @property
    def pending_count(self):
        return self.policy.pending_count

    def apply_pending(self, info):
        self.policy.apply([info])

    def hook_links(self, target):
        """Hooks every link of ``target`` that has parameters (again)."""
        self.links.hook(target)

    def unhook_all(self):
        self.links.unhook_all()

    # ------------------------------------------------------------------
    # Forward

    def _real_params(self, link):
        stack = self.swaps.get(id(link))
        d = link.__dict__
        if stack:
            base = stack[0][1]
            return [(n, base.get(n, d[n])) for n in link._params]
        return [(n, d[n]) for n in link._params]

    def before_forward(self, link, args, kwargs):
        if link not in self.links:
            return
        taps.ensure_param_use_hook()
        if self.timeline.enabled:
            self.forward_started.setdefault(id(link), []).append(
                time.perf_counter())
        params = self._real_params(link)
        if self.policy.pending_count:
            todo = []
            for _, p in params:
                info = self.info_by_pid.get(id(p))
                if info is not None and info.pending:
                    todo.append(info)
            if todo:
                self.policy.apply(todo)
        cfg = chainer.config
        recomputing = cfg.in_recomputing
        will_recompute = cfg._will_recompute
        backprop = cfg.enable_backprop or will_recompute
        if self.no_sync_depth or not backprop:
            if self.shard_params is not None:
                self._swap_whole(link, params, backprop)
            return
        whole = self.shard_params
        dummy = taps.first_variable(args, kwargs)
        new, nodes = {}, []
        for name, p in params:
            if p.array is None:
                continue
            info = self.info_by_pid.get(id(p))
            value = (whole.gather(info) if whole is not None
                     and info is not None else None)
            if will_recompute and not recomputing:
                # First pass of F.forget: no graph now, the gradient comes
                # from the recomputation in backward; count the use once.
                if info is not None:
                    self._count_use(info)
                new[name] = chainer.Variable(
                    (p.array if value is None else value).view(),
                    requires_grad=False)
                continue
            if info is not None and not recomputing:
                self._count_use(info)
            tap = taps.GradTap(self, p, self.iteration, value)
            inputs = (p,) if dummy is None else (p, dummy)
            new[name] = tap.tap(inputs)
            if value is not None:
                nodes.append(new[name].node)
                whole.tapped(new[name].node, info)
        self._swap(link, new, nodes)

    def _swap_whole(self, link, params, backprop):
        """Released parameters (``shard='parameters'``) made whole for a
        call that is not tracked (no backprop, or under ``no_sync``)."""
        new, nodes = {}, []
        for name, p in params:
            info = self.info_by_pid.get(id(p))
            value = (None if info is None or p.array is None
                     else self.shard_params.gather(info))
            if value is None:
                continue
            if backprop:
                # The gradient reaches the parameter, as without sharding.
                new[name] = taps.GradTap(self, p, None, value).tap((p,))
                nodes.append(new[name].node)
                self.shard_params.tapped(new[name].node, info)
            else:
                new[name] = chainer.Variable(value, requires_grad=False)
        self._swap(link, new, nodes)

    def _swap(self, link, new, nodes=()):
        if new:
            d = link.__dict__
            saved = {n: d[n] for n in new}
            self.swaps.setdefault(id(link), []).append((link, saved, nodes))
            d.update(new)

    def after_forward(self, link):
        starts = self.forward_started.get(id(link))
        if starts:
            self.timeline.span(
                'forward ' + self.links.link_names.get(id(link), '?'),
                'forward',
                starts.pop(), time.perf_counter())
        stack = self.swaps.get(id(link))
        if stack:
            _, saved, nodes = stack.pop()
            link.__dict__.update(saved)
            self._release(nodes)
            if not stack:
                del self.swaps[id(link)]

    def _release(self, nodes):
        if nodes:
            # Functions that retained a whole parameter get it back for
            # their backward (shard_params.before_backward).
            self.shard_params.release_nodes(nodes)

    def restore_all_swaps(self):
        # A forward that raised never ran its post-hooks.
        for key, stack in list(self.swaps.items()):
            while stack:
                link, saved, nodes = stack.pop()
                link.__dict__.update(saved)
                self._release(nodes)
            del self.swaps[key]

    def _count_use(self, info):
        if info.bucket.posted:
            # A forward after the gradient was sent (e.g. for logging).
            # Harmless unless a backward follows: its taps would then fire
            # on a sent gradient, which raises there.
            return
        info.unready()
        info.expected += 1

    # ------------------------------------------------------------------
    # Backward

    def on_cleargrads(self, link):
        """``link.cleargrads()``/``zerograds()``: gradients restart at 0."""
        for p in link.params():
            info = self.info_by_pid.get(id(p))
            if info is None:
                continue
            if info.ready and info.bucket.posted:
                raise RuntimeError(
                    'the gradient of {} was cleared after it was sent '
                    'for reduction in this iteration (rank {}); clear '
                    'gradients before backward, not between backward '
                    'and update().'.format(info.name, self.rank))
            info.unready()
            info.fired = 0
            info.total = None
            info.armed = True

    def on_tap(self, param, so_far, gy, iteration):
        """A tap fired: ``gy`` is one use's gradient contribution.

        ``so_far`` is what Chainer accumulated for the parameter until now;
        ``iteration`` is when the tap was made.  Returns the new accumulated
        gradient for Chainer.
        """
        if gy is None:
            new = so_far
        else:
            new = gy if so_far is None else so_far + gy
        info = self.info_by_pid.get(id(param))
        if info is None:
            if not self.has_layout:
                name = self.links.name_by_pid.get(id(param))
                if name is not None and name not in self.observed_set:
                    self.observed_set.add(name)
                    self.observed.append(name)
            return new
        if iteration != self.iteration or not info.armed:
            # A graph of an earlier iteration, or gradient that may still be
            # cleared: update() will take whatever param.grad holds then.
            return new
        if not self.backward_started:
            self.backward_started = True
            self.on_backward_start()
        if info.fired == 0 or so_far is info.total:
            info.total = new
        elif gy is not None:
            # A nested backward (F.forget's recomputation) accumulates in a
            # table of its own; Chainer 7 then keeps only one of the two
            # sums in param.grad.  Our total keeps every contribution.
            info.nested = True
            info.total = gy if info.total is None else info.total + gy
        info.fired += 1
        if info.tainted:
            return new
        if info.ready or info.fired > info.expected:
            # More gradient after the parameter looked final (a forward
            # after it was packed, or backward twice over one graph).
            self._taint(info)
            return new
        if info.fired == info.expected:
            # Every use is accounted for: the gradient is final.
            self.timeline.instant('grad ready ' + info.name, 'backward')
            total, info.total = info.total, None
            self.on_ready(info, None if total is None else total.array)
            if self.release_grads:
                return None
        return new

    def on_raw_use(self, info):
        if info.pending:
            self.policy.apply([info])
        if self.shard_params is not None:
            self.shard_params.raw_use(info)
        if self.no_sync_depth or not self.has_layout:
            return
        cfg = chainer.config
        if cfg.in_recomputing:
            return
        if cfg.enable_backprop or cfg._will_recompute:
            if info.bucket.posted:
                # Checked in update(): harmless if no gradient follows.
                info.late = True
            else:
                self._taint(info)

    def _taint(self, info):
        if info.bucket.posted and info.ready:
            self.raise_changed(info)
        info.unready()
        info.tainted = True
        info.total = None

    def raise_changed(self, info):
        raise RuntimeError(
            'the gradient of parameter {} changed after it was sent for '
            'reduction in this iteration (rank {}): a forward/backward ran '
            'after its backward and before update(). To accumulate gradients '
            'over several passes, run all but the last inside `with '
            'optimizer.no_sync():`, or call update() after each backward.'
            .format(info.name, self.rank))

    # ------------------------------------------------------------------
    # Iterations and layouts

    def unsent(self):
        """Parameters no tap will reach, final now (at backward's start).

        Nothing used them in forward, their gradient was cleared, and
        nothing else touched them: ship them at once instead of holding up
        their bucket until update().
        """
        return [info for info in self.infos
                if info.expected == 0 and info.armed and not info.tainted
                and not info.ready]

    @staticmethod
    def changed_after_send(info):
        """Whether a parameter read after it was sent got more gradient."""
        return (info.late and not info.nested
                and info.param.grad is not info.packed)

    def set_layout(self, infos):
        self.has_layout = True
        self.infos = infos
        self.info_by_pid = {id(i.param): i for i in infos}
        self.observed, self.observed_set = [], set()

    def clear_layout(self):
        self.has_layout = False
        self.infos = []
        self.info_by_pid = {}
        self.array_lookup = {}

    def next_iteration(self):
        for info in self.infos:
            info.reset()
        self.clock.value += 1
        self.backward_started = False
        self.array_lookup = {id(i.param.array): i for i in self.infos
                             if i.param.array is not None}
