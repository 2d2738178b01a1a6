"""Gradient taps (backward), forward pre-hooks and parameter-use detection.

Chainer sets leaf gradients only at the very end of ``Variable.backward``,
so there is no per-parameter "gradient ready" event.  A tap is an identity
``FunctionNode`` placed between a parameter and its consumer for one call of
its link: its ``backward`` receives exactly that call's gradient
contribution, and returns it unchanged (results stay bit-identical).

The link's input is given to the tap as a second, dummy input.  Without it
the tap would have rank 0 and Chainer's backward, which processes nodes in
decreasing rank order, would run every tap at the very end; with it the tap
runs right after its consumer, in reverse layer order.  The tap's *output*
keeps the parameter's rank, 0 (:meth:`GradTap.tap`), so that every other
node has the rank it has without taps: Chainer sums the gradients of a
variable read by several functions in the order it runs them, and a higher
rank for the consumers changed that order (a few ulp from ChainerMN).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Sequence

import chainer
from chainer import computational_graph
from chainer import function_hook
from chainer import function_node
from chainer import link_hook
from chainer import variable

from chainermn_overlap import _patches

__all__ = [
    'GradTap', 'GradientSink', 'InertLinkHook', 'OverlapLinkHook',
    'ParamUseHook', 'contract_taps', 'ensure_param_use_hook',
    'first_variable', 'install_param_use_hook', 'uninstall_param_use_hook',
    'wrap_graph_builder',
]


class GradientSink(object):
    """What the hooks report to (the optimizer's gradient tracker).

    The link hook calls :meth:`before_forward`/:meth:`after_forward`, each
    :class:`GradTap` calls :meth:`on_tap` in backward, and the function hook
    calls :meth:`on_raw_use` and :meth:`apply_pending` with the per-parameter
    state found in :attr:`array_lookup`.
    """

    #: ``{id(param.array): state}`` of the tracked parameters.
    array_lookup = {}
    #: Number of deferred updates not applied yet.
    pending_count = 0

    def before_forward(self, link: chainer.Link, args: tuple,
                       kwargs: dict) -> None:
        """``link`` is about to run: apply its updates, tap its parameters."""
        raise NotImplementedError

    def after_forward(self, link: chainer.Link) -> None:
        """``link`` ran: put its parameters back."""
        raise NotImplementedError

    def on_tap(self, param: chainer.Parameter, so_far: Any, gy: Any,
               iteration: Any) -> Any:
        """One use's gradient ``gy`` of ``param``; returns the new total."""
        raise NotImplementedError

    def on_raw_use(self, state: Any) -> None:
        """A function received the parameter's array itself (not a tap)."""
        raise NotImplementedError

    def apply_pending(self, state: Any) -> None:
        """Applies the parameter's pending deferred update now."""
        raise NotImplementedError


class GradTap(function_node.FunctionNode):
    """Identity on a parameter that reports the gradient flowing through it.

    Args:
        sink (GradientSink): its ``on_tap`` is called during backward and
            returns the accumulated gradient.
        iteration: the sink's iteration when the tap was made.
        param (chainer.Parameter): the tapped parameter.
        value: what the tap outputs instead of the parameter's array (its
            whole value, when the array is a placeholder of a sharded
            parameter); None: a view of the array.
    """

    def __init__(self, sink: GradientSink, param: chainer.Parameter,
                 iteration: Any = None, value: Any = None) -> None:
        self.sink = sink
        self.param = param
        self.iteration = iteration
        # The parameter's whole value when its array is not (sharded
        # parameters); None: the array itself.
        self.value = value

    def tap(self, inputs: tuple) -> variable.Variable:
        """Applies the tap to ``(param,)`` or ``(param, dummy)``; returns
        the variable that stands for the parameter in its link's call.

        Chainer's backward runs nodes by decreasing rank, equal ranks in
        the order they were queued, and sums the gradients a variable gets
        from its consumers in that order.  Left at ``rank(dummy) + 1``,
        the output would raise the rank of the consumer and of everything
        computed from it, by one per tapped link on the way: where a
        variable has three or more consumers (an SSD feature map read by
        its two heads and the next layer) their order, hence the rounding
        of the sum, changed.  With the parameter's own rank, 0, every node
        but the taps keeps the rank and queue order of a run without taps,
        so gradients are bit-identical; the tap keeps the dummy's rank and
        still runs right after its consumer, which queues it.
        """
        out = self.apply(inputs)[0]
        # VariableNode.rank is read-only; Chainer 7 keeps it in _rank.
        out.node._rank = 0
        return out

    def forward(self, inputs):
        # A view, not the array itself: consumers must not see the raw
        # parameter array, which is how uses outside a link are detected.
        if self.value is not None:
            value, self.value = self.value, None
            return value.view(),
        return inputs[0].view(),

    def backward_accumulate(self, target_input_indexes, grad_outputs,
                            grad_inputs):
        # Chainer hands over what the parameter's gradient holds so far (its
        # gradient from before this backward plus the contributions of taps
        # that already fired); the sink adds ours, keeps track of the total
        # and returns the sum, exactly the addition Chainer would do.
        gy = grad_outputs[0]
        out = []
        for i, g in zip(target_input_indexes, grad_inputs):
            if i == 0:
                g = self.sink.on_tap(self.param, g, gy, self.iteration)
            out.append(g)
        return tuple(out)


def first_variable(args: Sequence[Any], kwargs: Mapping[str, Any]
                   ) -> Optional[variable.Variable]:
    """The first ``Variable`` among a call's arguments, or None."""
    for a in args:
        if isinstance(a, variable.Variable):
            return a
    for a in kwargs.values():
        if isinstance(a, variable.Variable):
            return a
    return None


class OverlapLinkHook(link_hook.LinkHook):
    """Forward pre/post hook registered on each link that owns parameters.

    Before the link runs, the sink applies the link's pending update (the
    wait of the layer-wise method), then each initialised parameter is
    swapped, through the link's ``__dict__``, for the output of a
    :class:`GradTap`; after the link ran, the parameters are put back.

    Copies of a hooked link (``copy.deepcopy``, pickling) get an inert hook,
    and links the sink does not track are ignored, so a model copied for
    evaluation is not tied to the optimizer.
    """

    name = 'chainermn_overlap'

    def __init__(self, sink: GradientSink) -> None:
        self.sink = sink

    def forward_preprocess(self, args):
        self.sink.before_forward(args.link, args.args, args.kwargs)

    def forward_postprocess(self, args):
        self.sink.after_forward(args.link)

    def __deepcopy__(self, memo):
        return InertLinkHook()

    def __reduce__(self):
        return InertLinkHook, ()


class InertLinkHook(link_hook.LinkHook):
    """What a copied or unpickled :class:`OverlapLinkHook` becomes."""

    name = 'chainermn_overlap'


class ParamUseHook(function_hook.FunctionHook):
    """Sees every function application, to catch raw parameter arrays.

    A parameter reaches a function either through its link (then the
    function receives a tap's view) or directly, e.g. ``F.linear(x, l.W)``
    in a parent's forward.  A direct use means (a) the parameter must be up
    to date before the function runs, and (b) part of its gradient bypasses
    the taps, so it is only final when backward ends.
    """

    name = 'chainermn_overlap_param_use'

    def __init__(self):
        self.sinks = []

    def forward_preprocess(self, function, in_data):
        if isinstance(function, GradTap):
            return
        for sink in self.sinks:
            lookup = sink.array_lookup
            if not lookup:
                continue
            for a in in_data:
                info = lookup.get(id(a))
                if info is not None:
                    sink.on_raw_use(info)

    def backward_postprocess(self, function, in_data, out_grad):
        for sink in self.sinks:
            whole = getattr(sink, 'shard_params', None)
            if whole is not None:
                whole.after_backward(function)

    def backward_preprocess(self, function, in_data, out_grad):
        for sink in self.sinks:
            # Whole parameters for a backward that retained them, where
            # they are sharded.
            whole = getattr(sink, 'shard_params', None)
            if whole is not None:
                whole.before_backward(function)
        # A backward reads the parameters its forward retained.  If one has
        # an update pending (a second optimizer's loss back-propagating
        # through a network already updated, as in GAN training), the
        # blocking optimizer would have updated those very arrays in place
        # already: apply the update now so that results match it.
        for sink in self.sinks:
            if not sink.pending_count:
                continue
            lookup = sink.array_lookup
            for a in in_data:
                if a is None:
                    continue
                info = lookup.get(id(a))
                if info is None:
                    base = getattr(a, 'base', None)
                    if base is None:
                        continue
                    info = lookup.get(id(base))
                if info is not None and info.pending:
                    sink.apply_pending(info)

    def __deepcopy__(self, memo):
        return self


_PARAM_USE_HOOK = ParamUseHook()


def install_param_use_hook(sink: GradientSink) -> None:
    """Registers ``sink`` with the process-wide function hook.

    Function hooks are thread-local in Chainer; this installs the hook in
    the calling thread (``ensure_param_use_hook`` re-checks cheaply from the
    link hook, so training in another thread is covered too).  The hook is
    part of :mod:`chainermn_overlap._patches`'s ``'optimizer'`` group: it is
    installed while that group is active, and taken out of every thread's
    hooks when the group's last user is gone.
    """
    if sink not in _PARAM_USE_HOOK.sinks:
        _PARAM_USE_HOOK.sinks.append(sink)
    ensure_param_use_hook()


def uninstall_param_use_hook(sink: GradientSink) -> None:
    if sink in _PARAM_USE_HOOK.sinks:
        _PARAM_USE_HOOK.sinks.remove(sink)


def ensure_param_use_hook() -> None:
    hooks = chainer.get_function_hooks()
    if ParamUseHook.name not in hooks:
        _patches.install_function_hook(hooks, ParamUseHook.name,
                                       _PARAM_USE_HOOK)


# ----------------------------------------------------------------------------
# Graph dumps.  A tap is an identity on a parameter; in a dump of the
# computational graph (chainer.computational_graph, the DumpGraph extension)
# it would show as an extra function node with an unnamed output variable
# per parameter and call.  While an optimizer is set up the builder is
# wrapped (chainermn_overlap._patches) to contract every tap: its consumers
# read the parameter itself again, so the dump is the one a run without
# this library gives.

def contract_taps(graph: computational_graph.ComputationalGraph
                  ) -> computational_graph.ComputationalGraph:
    """Removes the gradient taps from a ``ComputationalGraph`` in place."""
    taps = {n for n in graph.nodes if isinstance(n, GradTap)}
    if not taps:
        return graph
    # The tap's output variable nodes stand for its parameter.
    alias = {}
    for src, dst in graph.edges:
        if src in taps:
            alias[dst] = src.inputs[0]
    edges = []
    seen = set()
    for src, dst in graph.edges:
        if src in taps or dst in taps:
            continue
        edge = (alias.get(src, src), alias.get(dst, dst))
        if edge not in seen:
            seen.add(edge)
            edges.append(edge)
    used = {n for edge in edges for n in edge}
    nodes = [n for n in graph.nodes
             if n not in taps and n not in alias
             and (n in used or not isinstance(n, variable.VariableNode))]
    graph.nodes, graph.edges = nodes, edges
    return graph


def wrap_graph_builder(build):
    """``build_computational_graph`` that contracts the taps of its graph."""
    @functools.wraps(build)
    def build_computational_graph(*args, **kwargs):
        return contract_taps(build(*args, **kwargs))
    return build_computational_graph
