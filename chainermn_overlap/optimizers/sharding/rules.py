"""Running the actual optimizer's update rules on a rank's shard.

A sharded optimizer updates, on each rank, only the elements the rank owns
(:mod:`.layout`): for every parameter the slice ``lo:hi`` of its flattened
array.  The update rule runs on a *proxy* parameter whose array is a view
of that slice and whose gradient is the matching slice of the reduced
shard, with the rule's state sized for the slice.  For element-wise rules
and hooks (SGD, MomentumSGD, Adam and the other built-in rules;
``WeightDecay``, ``Lasso``, ``GradientHardClipping``) that gives the same
bits as the update of the whole array.  Anything else needs parameters
that are not cut, or must be declared element-wise with
:func:`register_elementwise`.  With ``shard_unit='auto'`` (the default) a
parameter whose rule or rule hooks are not known element-wise (ChainerCV's
``GradientScaling`` on SSD's biases) is not cut (:func:`whole_reason`): one
rank updates it whole.  ``shard_unit='parameter'`` cuts no parameter;
``shard_unit='element'`` cuts any and refuses what is not known.  Classes
are known by their exact type (a subclass may change the arithmetic),
except Chainer's deprecated aliases in ``chainer.optimizer``
(``chainer.optimizer.WeightDecay`` and the like), which stand for the hooks
they subclass (:data:`DEPRECATED_ALIASES`).

Updates run on the communication thread with a :class:`Snapshot`: a copy
of each rule whose hyperparameters are frozen when the snapshot is made (at
the first bucket posted in backward, or at ``update()``), and the optimizer
hooks registered then.  A snapshot made in backward is checked at
``update()`` against the optimizer as it is then (:meth:`Snapshot.changes`):
a hyperparameter or hook changed in between raises an error instead of
updating some shards with the old values.  ``GradientClipping`` needs the
norm of every gradient: it is computed from the shards (one small
allreduce) on the main thread once every shard is reduced, and the
pre-update hooks then run there.  Dynamic loss scaling is checked from
the shards too (:mod:`.scaling`).
"""
import copy
import warnings

import numpy

import chainer
from chainer import optimizer as optimizer_module
from chainer import optimizer_hooks
from chainer import optimizers

from chainermn_overlap.errors import FallbackWarning

__all__ = ['DEPRECATED_ALIASES', 'ELEMENTWISE_HOOKS', 'ELEMENTWISE_RULES',
           'GLOBAL_HOOKS', 'Snapshot', 'check_optimizer', 'init_states',
           'make_proxy', 'register_elementwise', 'warn_kept_whole',
           'whole_reason']

#: Update rules whose update of a slice equals the slice of their update.
ELEMENTWISE_RULES = {
    optimizers.sgd.SGDRule, optimizers.momentum_sgd.MomentumSGDRule,
    optimizers.corrected_momentum_sgd.CorrectedMomentumSGDRule,
    optimizers.nesterov_ag.NesterovAGRule, optimizers.ada_grad.AdaGradRule,
    optimizers.ada_delta.AdaDeltaRule, optimizers.adam.AdamRule,
    optimizers.rmsprop.RMSpropRule,
    optimizers.rmsprop_graves.RMSpropGravesRule,
    optimizers.smorms3.SMORMS3Rule, optimizers.msvag.MSVAGRule,
}

#: Per-parameter optimizer hooks that act element by element.
ELEMENTWISE_HOOKS = {
    optimizer_hooks.WeightDecay, optimizer_hooks.Lasso,
    optimizer_hooks.GradientHardClipping,
}

#: Hooks of the whole optimizer computed from the shards.
GLOBAL_HOOKS = (optimizer_hooks.GradientClipping,)

_REGISTERED = set()


class _Plain(object):
    """What a class statement defining only ``__init__`` holds: Python 3.13
    adds ``__firstlineno__`` and ``__static_attributes__`` to every class
    statement (not to ``type(...)``'s classes), so this is written as one."""

    def __init__(self):
        pass


def _deprecated_aliases():
    # An alias is chainer.optimizer's class of the same name as a hook of
    # chainer.optimizer_hooks, with that hook as its only base, defining
    # nothing but __init__ (which warns) besides what Python gives every
    # class: it runs the hook's own arithmetic.
    plain = set(vars(_Plain))
    aliases = {}
    for name, real in vars(optimizer_hooks).items():
        alias = getattr(optimizer_module, name, None)
        if (isinstance(real, type) and isinstance(alias, type)
                and alias.__module__ == optimizer_module.__name__
                and alias.__bases__ == (real,)
                and set(vars(alias)) <= plain):
            aliases[alias] = real
    return aliases


#: Chainer's deprecated hook aliases (``chainer.optimizer.WeightDecay``
#: ...) -> the hooks of ``chainer.optimizer_hooks`` they stand for.
DEPRECATED_ALIASES = _deprecated_aliases()


def register_elementwise(cls):
    """Declares an update rule or hook class element-wise.

    Its update of any slice of a parameter must give the same values as the
    same slice of its update of the whole parameter (no norms, sums or
    random numbers over the array).  Usable as a class decorator.

    Returns:
        ``cls``.
    """
    _REGISTERED.add(cls)
    return cls


def _known_class(obj):
    # The exact class (a subclass may override the arithmetic), or the hook
    # that a deprecated alias stands for.
    cls = type(obj)
    return DEPRECATED_ALIASES.get(cls, cls)


def _elementwise(obj, known):
    cls = _known_class(obj)
    return cls in known or cls in _REGISTERED


def _hooks(hookable):
    return (list(hookable._pre_update_hooks.values()),
            list(hookable._post_update_hooks.values()))


def whole_reason(param):
    """Why ``shard_unit='auto'`` keeps ``param`` whole, or None.

    Returns:
        str or None: the class of its update rule, or of the first hook of
        its rule, that is not known to be element-wise.
    """
    rule = getattr(param, 'update_rule', None)
    if rule is None:
        return None
    if not _elementwise(rule, ELEMENTWISE_RULES):
        return type(rule).__name__
    pre, post = _hooks(rule._hookable)
    for hook in pre + post:
        if not _elementwise(hook, ELEMENTWISE_HOOKS):
            return type(hook).__name__
    return None


def check_optimizer(actual, params, unit, rank, cut=None):
    """Raises ``ValueError`` where the shard update would not be exact.

    Args:
        actual: the wrapped optimizer.
        params: the parameters that are sharded.
        unit (str): ``'auto'``, ``'element'`` or ``'parameter'`` (see
            :mod:`.layout`).
        rank (int): for the message.
        cut (set): with ``'auto'``, the ids of the parameters the layout
            cuts between ranks (None: every parameter).
    """
    fix_unit = ("pass shard_unit='parameter' (each parameter updated whole "
                'by one rank), or declare the class element-wise with '
                'chainermn_overlap.register_elementwise if it is')
    fix_late = ("add such hooks before the first update() (the layout then "
                'keeps the parameter whole), pass '
                "shard_unit='parameter', or declare the class element-wise "
                'with chainermn_overlap.register_elementwise if it is')
    if not isinstance(actual, optimizer_module.GradientMethod):
        raise ValueError(
            'shard= needs a chainer GradientMethod (its update rules run on '
            'the shards), got {} (rank {}); use shard=None.'.format(
                type(actual).__name__, rank))
    if type(actual).update is not optimizer_module.GradientMethod.update:
        raise ValueError(
            '{} overrides update(), which shard= cannot run on shards (rank '
            '{}); use shard=None.'.format(type(actual).__name__, rank))
    pre, post = _hooks(actual._hookable)
    for hook in pre + post:
        name = type(hook).__name__
        if isinstance(hook, GLOBAL_HOOKS):
            if _known_class(hook) not in GLOBAL_HOOKS:
                base = ', '.join(c.__name__ for c in GLOBAL_HOOKS)
                raise ValueError(
                    'optimizer hook {} subclasses {}: shard= clips with the '
                    'norm it takes from the shards and would ignore what '
                    'the subclass changes (rank {}); use {} itself or '
                    'shard=None.'.format(name, base, rank, base))
            if hook in post:
                raise ValueError(
                    '{} as a post-update hook is not supported with shard= '
                    '(rank {}); register it before the update.'.format(
                        name, rank))
            continue
        if not getattr(hook, 'call_for_each_param', False):
            raise ValueError(
                'optimizer hook {} needs every gradient at once, which '
                'shard= cannot give it (GradientClipping is supported) '
                '(rank {}); use shard=None.'.format(name, rank))
        if unit != 'parameter' and \
                not _elementwise(hook, ELEMENTWISE_HOOKS):
            # An optimizer hook runs on every parameter: keeping them all
            # whole is shard_unit='parameter', which the user chooses.
            raise ValueError(
                'optimizer hook {} is not known to be element-wise, and '
                'shard_unit={!r} cuts parameters between ranks (rank {}): '
                '{}.'.format(name, unit, rank, fix_unit))
    for p in params:
        rule = p.update_rule
        if rule is None:
            continue
        if rule._use_fp32_update and p.dtype == numpy.float16:
            raise ValueError(
                'use_fp32_update() with float16 parameters ({}) is not '
                'supported with shard= (rank {}); use shard=None.'.format(
                    p.name, rank))
        if unit == 'parameter':
            continue
        if unit == 'auto':
            if cut is not None and id(p) not in cut:
                continue
            what = whole_reason(p)
            if what is not None:
                raise ValueError(
                    '{} of {} is not known to be element-wise and came '
                    'after the bucket layout, which cuts {} between ranks '
                    '(rank {}): {}.'.format(what, p.name, p.name, rank,
                                            fix_late))
            continue
        if not _elementwise(rule, ELEMENTWISE_RULES):
            raise ValueError(
                'the update rule of {} ({}) is not known to be element-wise, '
                "and shard_unit='element' cuts parameters between ranks "
                '(rank {}): {}.'.format(p.name, type(rule).__name__, rank,
                                        fix_unit))
        rule_pre, rule_post = _hooks(rule._hookable)
        for hook in rule_pre + rule_post:
            if not _elementwise(hook, ELEMENTWISE_HOOKS):
                raise ValueError(
                    'update-rule hook {} of {} is not known to be '
                    "element-wise, and shard_unit='element' cuts parameters "
                    'between ranks (rank {}): {}.'.format(
                        type(hook).__name__, p.name, rank, fix_unit))


def _frozen(hyperparam):
    """A hyperparameter object holding today's values, with no parent."""
    h = optimizer_module.Hyperparameter()
    h.__dict__.update(hyperparam.get_dict())
    return h


class Snapshot(object):
    """What one iteration's shard updates run with.

    Made on the main thread; read by the communication thread.  It does not
    touch the rules: :meth:`commit` counts the step on them at
    ``update()``.

    Args:
        actual: the wrapped optimizer.
        params: the sharded parameters.
        scale_from_optimizer (bool): the rules unscale the gradients by the
            optimizer's loss scale now (made in this iteration, after or
            during its backward: the scale that ``update(lossfun)`` passes
            to backward, as a loop does with ``loss.backward(loss_scale=
            optimizer._loss_scale)``), not by ``param._loss_scale``.  For
            ``shard='gradients'`` and ``'parameters'``: no gradient reaches
            the parameter, so Chainer's backward does not set its scale.
    """

    # A step that runs (see .scaling.SkippedStep for one that does not).
    skipped = False

    def __init__(self, actual, params, scale_from_optimizer=False):
        pre, post = _hooks(actual._hookable)
        self.scale_from_optimizer = scale_from_optimizer
        self.loss_scale = actual._loss_scale
        self.global_pre = any(isinstance(h, GLOBAL_HOOKS) for h in pre)
        # Dynamic loss scaling: the step may be skipped, which is known
        # once every shard is reduced (.scaling).
        self.dynamic = bool(actual._loss_scaling_is_dynamic)
        self.pre = pre
        self.post = post
        # Set once the pre-update hooks ran on the main thread (a global
        # hook is among them).
        self.pre_done = False
        self.rules = {}
        self._real = []
        for p in params:
            rule = p.update_rule
            if rule is None or not rule.enabled:
                continue
            shadow = copy.copy(rule)
            shadow.hyperparam = _frozen(rule.hyperparam)
            self.rules[id(p)] = shadow
            self._real.append((p, rule))

    def commit(self):
        """Counts the step on the real rules (``t``), as
        ``UpdateRule.update`` does: what users and serializers read.

        MSVAG's rule also counts steps in its own ``beta_power``, which
        its ``update_core`` advances on the copy that ran: advanced here
        too, or every step would run with the first step's.
        """
        for p, rule in self._real:
            rule.t += 1
            if isinstance(rule, optimizers.msvag.MSVAGRule):
                rule.beta_power *= self.rules[id(p)].hyperparam.beta

    def changes(self, actual, params):
        """What differs now from when the snapshot was made, or None.

        Returns:
            str or None: e.g. ``"the hyperparameter lr of /l1/W: 0.1 then,
            0.05 now"``.
        """
        pre, post = _hooks(actual._hookable)
        if [id(h) for h in pre] != [id(h) for h in self.pre] or \
                [id(h) for h in post] != [id(h) for h in self.post]:
            return 'the optimizer hooks'
        if bool(actual._loss_scaling_is_dynamic) != self.dynamic:
            return 'the loss scaling (dynamic or not)'
        enabled = {id(p) for p in params if p.update_rule is not None
                   and p.update_rule.enabled}
        if enabled != set(self.rules):
            return 'the set of enabled update rules'
        for p, rule in self._real:
            if p.update_rule is not rule:
                return 'the update rule of {}'.format(p.name)
            then = self.rules[id(p)].hyperparam.__dict__
            now = rule.hyperparam.get_dict()
            for key in sorted(set(then) | set(now)):
                a, b = then.get(key), now.get(key)
                if a is b:
                    continue
                try:
                    same = bool(numpy.all(a == b))
                except (TypeError, ValueError):
                    same = False
                if not same:
                    return 'the hyperparameter {} of {}: {!r} then, {!r} ' \
                        'now'.format(key, p.name, a, b)
        return None

    def run_pre(self, hooks_params):
        """Runs the pre-update hooks in order over ``(rule, proxy)`` pairs.

        ``hooks_params``: the prepared proxies of every shard (main
        thread, after every shard was reduced).
        """
        for hook in self.pre:
            if isinstance(hook, GLOBAL_HOOKS):
                continue   # applied by the caller (needs an allreduce)
            for rule, proxy in hooks_params:
                hook(rule, proxy)

    def update(self, param, proxy):
        """The update of one parameter's shard (proxy prepared)."""
        shadow = self.rules.get(id(param))
        if shadow is None:
            return
        if not self.pre_done:
            for hook in self.pre:
                hook(shadow, proxy)
        if self.scale_from_optimizer and self.loss_scale is not None:
            # (Without one set on the optimizer, a loop's own
            # backward(loss_scale=...) set param._loss_scale, a constant.)
            proxy._loss_scale = self.loss_scale
        shadow.update(proxy)
        for hook in self.post:
            hook(shadow, proxy)


def make_proxy(param):
    """A parameter standing for a slice of ``param`` in its update."""
    proxy = chainer.Parameter(param.array.reshape(-1)[:0].copy(),
                              name=param.name)
    return proxy


def init_states(pieces):
    """Creates missing update-rule states, sized for the shards, and cuts
    whole states (loaded from a snapshot, or gathered for a new layout)
    down to this rank's slice.

    Run on the main thread: the communication thread's rule copies share
    the state dictionary, which therefore must exist beforehand.

    Args:
        pieces: ``(param, proxy, lo, hi)`` for every sharded parameter,
            the proxy prepared.
    """
    for param, proxy, lo, hi in pieces:
        rule = param.update_rule
        if rule is None:
            continue
        if rule.state is None:
            rule._state = {}
            with chainer.using_device(proxy.device):
                rule.init_state(proxy)
            continue
        for key, value in rule.state.items():
            if not isinstance(value, chainer.get_array_types()):
                continue
            if value.ndim == 1 and value.size == hi - lo:
                continue   # this shard's (or the whole of a 1-D one)
            if value.shape != param.shape:
                raise RuntimeError(
                    'the state {!r} of {} has shape {}, neither the '
                    "parameter's {} nor its shard's ({},): it was cut for "
                    'another layout.'.format(key, param.name, value.shape,
                                             param.shape, hi - lo))
            rule.state[key] = value.reshape(-1)[lo:hi].copy()


def warn_kept_whole(infos, buckets):
    """Warns (a ``FallbackWarning``) which parameters ``shard_unit='auto'``
    keeps whole, why, and what it costs in balance; returns whether any is.

    Args:
        infos: the layout's parameter infos (``.param``, ``.name``).
        buckets: the layout's buckets (``.bounds``: each rank's range).
    """
    whole = {}
    for info in infos:
        why = whole_reason(info.param)
        if why is not None:
            whole.setdefault(why, []).append(info.name)
    if not whole:
        return False
    shares = [sum(b - a for a, b in (bucket.bounds[r] for bucket in buckets))
              for r in range(len(buckets[0].bounds))]
    what = '; '.join('{} on {} ({} parameter{})'.format(
        cls, ', '.join(names[:3]) + (', ...' if len(names) > 3 else ''),
        len(names), 's' if len(names) > 1 else '')
        for cls, names in sorted(whole.items()))
    warnings.warn(
        "shard_unit='auto' keeps whole, each updated by one rank, the "
        'parameters whose update rule or rule hook is not known to be '
        'element-wise: {}. Results are exact; the cost is balance: the '
        'ranks own {} to {} elements. If the class is element-wise, '
        'declare it with chainermn_overlap.register_elementwise(cls) to '
        "cut them evenly; shard_unit='element' refuses it instead."
        .format(what, min(shares), max(shares)), FallbackWarning,
        stacklevel=2)
    return True
