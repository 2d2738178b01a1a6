"""The overlapped multi-node optimizer (layer-wise non-blocking allreduce).

One iteration with ``wait='forward'``::

    forward:  link L pre-hook -> wait for L's buckets -> apply the update
              rule to L's parameters -> L.forward (parameters tapped)
    backward: tap(L.W) fires -> W's gradient is final? -> W joins its bucket
              -> bucket complete and all earlier buckets posted? -> post it
    update(): close the iteration: pack what is left, post it, return

With ``wait='update'`` the same posting happens during backward and
``update()`` waits for everything and runs the actual optimizer, the way
DDP and Horovod do.  Either way every rank posts the same buckets in the
same order (bucket index order, from a layout broadcast by rank 0), however
its own control flow went, so collectives always match.

This module keeps all per-iteration state in :class:`_OverlapState`; the
hooks in :mod:`chainermn_overlap.hooks` only report events to it, and the
communication itself is behind :mod:`chainermn_overlap.communication`.
"""
import atexit
import contextlib
import re
import time
import warnings
import weakref

import numpy

import chainer
import chainermn
from chainer import optimizer as optimizer_module

from chainermn_overlap import _autosync
from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import backends
from chainermn_overlap.optimizers import _wrapper
from chainermn_overlap.communication import buckets as buckets_module
from chainermn_overlap.communication import watchdog as watchdog_module
from chainermn_overlap.communication import timeline as timeline_module
from chainermn_overlap.errors import FallbackWarning
from chainermn_overlap.hooks import taps


DEFAULT_BUCKET_SIZE = 16 * 1024 * 1024
# Levels of the control message's first slot (reduced with MAX).
_UNCHANGED, _RELAYOUT, _SKIP = 0, 1, 2
# With wait='forward', limits of the last buckets (last first): they hold the
# first layers, whose reduction the next forward waits for first.
TAIL_BUCKETS = (1 << 20, 2 << 20, 4 << 20, 8 << 20)

_SIZE_UNITS = {'': 1, 'b': 1, 'kb': 10 ** 3, 'mb': 10 ** 6, 'gb': 10 ** 9,
               'kib': 2 ** 10, 'mib': 2 ** 20, 'gib': 2 ** 30}


def parse_size(value):
    """Parses a bucket size: bytes as a number, or a string like ``'25MB'``."""
    if isinstance(value, str):
        m = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*', value)
        if m is None or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(
                'size {!r} is not understood; give a number of bytes '
                'or a string such as "25MB" or "4MiB"'.format(value))
        value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError('a size must be a number of bytes or a string '
                         'such as "25MB", got {!r}'.format(value))
    if not value >= 1:
        raise ValueError('a size must be at least 1 byte, got {!r}'
                         .format(value))
    return int(value)


# ----------------------------------------------------------------------------
# Parameters move as raw bytes (JSON for metadata, see _mpi_json): nothing
# received from a peer is ever unpickled.

def _bcast_array(mpi_comm, array, root):
    """Broadcasts an array in place (as bytes; staged on the host for GPU)."""
    from mpi4py import MPI
    xp = chainer.backend.get_array_module(array)
    host = array if xp is numpy else chainer.backend.CpuDevice().send(array)
    if not host.flags.c_contiguous:
        host = numpy.ascontiguousarray(host)
    mpi_comm.Bcast([host.view(numpy.uint8).reshape(-1), MPI.BYTE], root=root)
    if host is not array:
        array[...] = xp.asarray(host)


def _describe(sig):
    shape, dtype = sig
    if shape is None:
        return 'uninitialised'
    return 'shape {} {}'.format(tuple(shape), dtype)


# ----------------------------------------------------------------------------

class CommunicationStats(object):
    """Counters of gradient communication, for users and benchmarks.

    ``comm_seconds`` is the time the progress engine spent reducing buckets;
    ``wait_seconds`` the time training was blocked waiting for them.  The
    fraction of communication hidden behind computation is
    ``1 - wait_seconds / comm_seconds``.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.buckets = 0
        self.bytes = 0
        self.comm_seconds = 0.0
        self.wait_seconds = 0.0

    def record(self, handle, waited):
        self.buckets += 1
        self.bytes += handle.nbytes
        self.comm_seconds += handle.busy_seconds()
        self.wait_seconds += waited

    def as_dict(self):
        hidden = (1.0 - self.wait_seconds / self.comm_seconds
                  if self.comm_seconds > 0 else None)
        return {'buckets': self.buckets, 'bytes': self.bytes,
                'comm_seconds': self.comm_seconds,
                'wait_seconds': self.wait_seconds,
                'hidden_fraction': hidden}


class _ParamInfo(object):
    """Per-parameter state of the current iteration and the pending update."""

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


class _OverlapState(object):
    """Everything the overlapped optimizer knows, in one place."""

    def __init__(self, actual, communicator, wait, bucket_size, zero_fill,
                 allreduce_grad_dtype, backend, backend_options):
        self.actual = actual
        self.communicator = communicator
        self.mpi_comm = communicator.mpi_comm
        self.rank = communicator.rank
        self.size = communicator.size
        self.wait = wait
        self.bucket_size = bucket_size
        self.zero_fill = zero_fill
        self.allreduce_grad_dtype = allreduce_grad_dtype
        self.backend_name = backend
        self.backend_options = backend_options
        self.backend = None
        # Watchdog options (timeout, stall_warning, debug); see
        # communication/watchdog.py.
        self.watch_options = (None, None, None)

        self.target = None
        self.link_hook = taps.OverlapLinkHook(self)
        self.hooked_links = weakref.WeakSet()
        self.name_by_pid = {}
        # Layout (None until the first update broadcasts it).
        self.buckets = None
        self.infos = []
        self.info_by_pid = {}
        self.array_lookup = {}
        self.structure = None
        # Current iteration.
        self.iteration = 0
        self.next_post = 0
        self.control = None
        self.backward_started = False
        self.observed = []
        self.observed_set = set()
        self.loaded = False
        self.no_sync_depth = 0
        self.swaps = {}
        # Updates of the last closed iteration not applied yet.
        self.pending_count = 0
        self.hyperparams = None
        # Optimizer hooks as they were when the deferred updates' iteration
        # closed: a hook added later must not apply to them (ChainerMN had
        # already run that update when the hook was added).
        self.deferred_hooks = None
        self.warned_fallback = False
        self.stats = CommunicationStats()
        self.timeline = None
        self.link_names = {}
        self.forward_started = {}

    # ------------------------------------------------------------------
    # Set-up

    def attach(self, target):
        if self.backend is None:
            self.backend = backends.get_backend(self.backend_name)(
                self.mpi_comm, **self.backend_options)
            timeout, stall_warning, debug = self.watch_options
            self.backend.configure(timeout, stall_warning, debug,
                                   mpi_comm=self.mpi_comm)
        self.target = target
        self._hook_links()
        taps.install_param_use_hook(self)
        taps.install_graph_dump_filter()
        _autosync.register(target, self)

    def detach(self):
        self.synchronize()
        for link in list(self.hooked_links):
            self._unhook(link)
        taps.uninstall_param_use_hook(self)
        if self.target is not None:
            _autosync.unregister(self.target)
        self.target = None
        self.buckets = None
        self.infos = []
        self.info_by_pid = {}
        self.array_lookup = {}

    def _unhook(self, link):
        if link.local_link_hooks.get(self.link_hook.name) is self.link_hook:
            link.delete_hook(self.link_hook.name)
        self.hooked_links.discard(link)
        _autosync.unregister(link)

    def write_timeline(self):
        if self.timeline is not None:
            return self.timeline.write()
        return None

    def close(self):
        if self.target is not None:
            self.detach()
        self.write_timeline()
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def _hook_links(self):
        current = set(self.target.links())
        for link in list(self.hooked_links):
            if link not in current:
                # Removed from the model (delete_link): no longer ours.
                self._unhook(link)
        for link in current:
            if link in self.hooked_links or not link._params:
                continue
            hooks = link.local_link_hooks
            if isinstance(hooks.get(self.link_hook.name), taps.InertLinkHook):
                # A copy of a link set up before (copy.deepcopy, pickling).
                link.delete_hook(self.link_hook.name)
            if self.link_hook.name in hooks:
                if hooks[self.link_hook.name] is not self.link_hook:
                    raise ValueError(
                        'link {} is already managed by another overlapped '
                        'optimizer; a link can be set up with only one.'
                        .format(type(link).__name__))
            else:
                link.add_hook(self.link_hook)
            self.hooked_links.add(link)
        self.name_by_pid = {id(p): n for n, p in self.target.namedparams()}
        if self.timeline is not None:
            self.link_names = {id(l): n or '/'
                               for n, l in self.target.namedlinks()}
        _autosync.register(self.target, self)

    # ------------------------------------------------------------------
    # Events from the hooks

    def _real_params(self, link):
        stack = self.swaps.get(id(link))
        d = link.__dict__
        if stack:
            base = stack[0][1]
            return [(n, base.get(n, d[n])) for n in link._params]
        return [(n, d[n]) for n in link._params]

    def before_forward(self, link, args, kwargs):
        if link not in self.hooked_links:
            return
        taps.ensure_param_use_hook()
        if self.timeline is not None:
            self.forward_started.setdefault(id(link), []).append(
                time.perf_counter())
        params = self._real_params(link)
        if self.pending_count:
            todo = []
            for _, p in params:
                info = self.info_by_pid.get(id(p))
                if info is not None and info.pending:
                    todo.append(info)
            if todo:
                self._apply(todo)
        if self.no_sync_depth:
            return
        cfg = chainer.config
        recomputing = cfg.in_recomputing
        will_recompute = cfg._will_recompute
        if not (cfg.enable_backprop or will_recompute):
            return
        dummy = _first_variable_input(args, kwargs)
        new = {}
        for name, p in params:
            if p.array is None:
                continue
            info = self.info_by_pid.get(id(p))
            if will_recompute and not recomputing:
                # First pass of F.forget: no graph now, the gradient comes
                # from the recomputation in backward; count the use once.
                if info is not None:
                    self._count_use(info)
                new[name] = chainer.Variable(p.array.view(),
                                             requires_grad=False)
                continue
            if info is not None and not recomputing:
                self._count_use(info)
            tap = taps.GradTap(self, p, self.iteration)
            inputs = (p,) if dummy is None else (p, dummy)
            new[name] = tap.apply(inputs)[0]
        if new:
            d = link.__dict__
            saved = {n: d[n] for n in new}
            self.swaps.setdefault(id(link), []).append((link, saved))
            d.update(new)

    def after_forward(self, link):
        tl = self.timeline
        if tl is not None:
            starts = self.forward_started.get(id(link))
            if starts:
                tl.span('forward ' + self.link_names.get(id(link), '?'),
                        'forward', starts.pop(), time.perf_counter())
        stack = self.swaps.get(id(link))
        if stack:
            _, saved = stack.pop()
            link.__dict__.update(saved)
            if not stack:
                del self.swaps[id(link)]

    def _restore_all_swaps(self):
        # A forward that raised never ran its post-hooks.
        for key, stack in list(self.swaps.items()):
            while stack:
                link, saved = stack.pop()
                link.__dict__.update(saved)
            del self.swaps[key]

    def _count_use(self, info):
        if info.bucket.posted:
            # A forward after the gradient was sent (e.g. for logging).
            # Harmless unless a backward follows: its taps would then fire
            # on a sent gradient, which raises there.
            return
        if info.ready:
            info.ready = False
            info.bucket.n_ready -= 1
        info.expected += 1

    def on_cleargrads(self, link):
        """``link.cleargrads()``/``zerograds()``: gradients restart at 0."""
        if self.buckets is None:
            return
        for p in link.params():
            info = self.info_by_pid.get(id(p))
            if info is None:
                continue
            if info.ready:
                if info.bucket.posted:
                    raise RuntimeError(
                        'the gradient of {} was cleared after it was sent '
                        'for reduction in this iteration (rank {}); clear '
                        'gradients before backward, not between backward '
                        'and update().'.format(info.name, self.rank))
                info.ready = False
                info.bucket.n_ready -= 1
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
            if self.buckets is None:
                name = self.name_by_pid.get(id(param))
                if name is not None and name not in self.observed_set:
                    self.observed_set.add(name)
                    self.observed.append(name)
            return new
        if iteration != self.iteration or not info.armed:
            # A graph of an earlier iteration, or gradient that may still be
            # cleared: update() will take whatever param.grad holds then.
            return new
        if not self.backward_started:
            self._begin_backward()
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
            if self.timeline is not None:
                self.timeline.instant('grad ready ' + info.name, 'backward')
            total, info.total = info.total, None
            self._pack(info, None if total is None else total.array)
            self._try_post()
        return new

    def apply_pending(self, info):
        self._apply([info])

    def on_raw_use(self, info):
        if info.pending:
            self._apply([info])
        if self.no_sync_depth or self.buckets is None:
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
            self._raise_changed(info)
        if info.ready:
            info.ready = False
            info.bucket.n_ready -= 1
        info.tainted = True
        info.total = None

    def _raise_changed(self, info):
        raise RuntimeError(
            'the gradient of parameter {} changed after it was sent for '
            'reduction in this iteration (rank {}): a forward/backward ran '
            'after its backward and before update(). To accumulate gradients '
            'over several passes, run all but the last inside `with '
            'optimizer.no_sync():`, or call update() after each backward.'
            .format(info.name, self.rank))

    # ------------------------------------------------------------------
    # Packing and posting

    def _begin_backward(self):
        """First tap of the iteration: forward is complete on this rank."""
        self.backward_started = True
        self._post_control()
        # Parameters no tap will reach and nothing else used are final now:
        # ship them at once instead of holding up their bucket until update().
        for info in self.infos:
            if (info.expected == 0 and info.armed and not info.tainted
                    and not info.ready):
                self._pack(info, info.param.grad)
        self._try_post()

    def _pack(self, info, grad):
        bucket = info.bucket
        if bucket.handle is not None:
            # The buffer still holds last iteration's mean for parameters
            # whose links have not run yet: apply those updates first.
            self._flush_bucket(bucket)
        xp = chainer.backend.get_array_module(info.param.array)
        bucket.ensure_buffer(xp)
        slot = bucket.slot(info.index)
        if grad is None:
            slot.fill(0)
        else:
            slot[...] = grad.reshape(-1)
        info.packed = grad
        info.ready = True
        bucket.n_ready += 1

    def _try_post(self):
        bs = self.buckets
        while (self.next_post < len(bs)
               and bs[self.next_post].n_ready == len(bs[self.next_post].params)):
            self._post(bs[self.next_post])
            self.next_post += 1

    def _post(self, bucket):
        self._post_control()
        # Round items: 0 is the control message, bucket b is b + 1.  With
        # wait='forward' the last bucket posted holds the first layers, which
        # the next forward needs first.
        prio = bucket.index if self.wait == 'forward' else -bucket.index
        bucket.handle = self.backend.allreduce(
            bucket.buffer, 'sum',
            label='{} of iteration {}'.format(bucket.label(), self.iteration),
            slot=(self.iteration, bucket.index + 1, len(self.buckets) + 1),
            priority=prio)
        bucket.posted = True
        bucket.finalized = False
        if self.timeline is not None:
            self.timeline.instant('post bucket {}'.format(bucket.index),
                                  'post', args={'label': bucket.label()})

    def _post_control(self):
        """First collective of every iteration: did anything change?

        ChainerMN decides locally whether the set of initialised parameters
        changed; a lazily initialised link used on one rank only would then
        make ranks disagree and hang.  Reducing the flags first makes the
        decision global, by construction the same on all ranks.
        """
        if self.control is not None:
            return
        if self._changes_step():
            level = _SKIP
        elif self._structure_changed():
            level = _RELAYOUT
        else:
            level = _UNCHANGED
        # Also carries every rank's layout fingerprint and iteration number,
        # checked in close_iteration (see watchdog.control_message).
        buf = watchdog_module.control_message(
            level, self.loaded, self.rank, self.size,
            watchdog_module.layout_fingerprint(self.buckets), self.iteration)
        self.control = (buf, self.backend.allreduce(
            buf, 'max',
            label='control message of iteration {}'.format(self.iteration),
            slot=(self.iteration, 0, len(self.buckets) + 1),
            priority=float('inf')))

    def _local_structure(self):
        return [(n, p, None if p.array is None else p.shape,
                 None if p.array is None else str(p.dtype))
                for n, p in sorted(self.target.namedparams())]

    def _changes_step(self):
        """Whether this rank's update must broadcast and skip the step.

        ChainerMN's rule: the set of initialised parameters (names, and
        whether each holds an array) differs from the previous update's: a
        link added or removed, a lazily initialised link that ran.  Before
        the first update there is no previous set.  Parameters loaded on
        this rank (a resume) also change the step; whether it is skipped in
        the end is decided globally (not when every rank loaded).  How the
        change came about (``setup()`` again, ``add_link``, a first forward)
        does not matter.
        """
        if self.loaded or self.structure is None:
            return True
        cur = [(n, p.array is not None)
               for n, p in sorted(self.target.namedparams())]
        return cur != [(n, s is not None)
                       for n, _, s, _ in self.structure]

    def _structure_changed(self):
        """Whether the layout must be rebuilt (any parameter replaced)."""
        if self.structure is None:
            return True
        cur = self._local_structure()
        if len(cur) != len(self.structure):
            return True
        for (n1, p1, s1, d1), (n2, p2, s2, d2) in zip(cur, self.structure):
            if n1 != n2 or p1 is not p2 or s1 != s2 or d1 != d2:
                return True
        return False

    # ------------------------------------------------------------------
    # Closing an iteration (update())

    def close_iteration(self):
        if self.timeline is None:
            return self._close_iteration()
        t0 = time.perf_counter()
        try:
            self._close_iteration()
        finally:
            self.timeline.span('update()', 'update', t0, time.perf_counter())

    def _close_iteration(self):
        self._restore_all_swaps()
        if self.buckets is None:
            self._relayout()
            return
        self._hook_links()
        self._post_control()
        for info in self.infos:
            if not info.ready:
                self._pack(info, info.param.grad)
            elif (info.late and not info.nested
                  and info.param.grad is not info.packed):
                self._raise_changed(info)
        self._try_post()
        assert self.next_post == len(self.buckets)
        buf, handle = self.control
        handle.wait()
        watchdog_module.check_control(buf, self.rank, self.size)
        level, all_loaded = int(buf[0]), buf[1] == -1
        if level != _UNCHANGED:
            self._relayout(skip=level == _SKIP and not all_loaded)
            return
        self.loaded = False
        fallback = self._fallback_reason()
        if self.wait == 'update' or fallback:
            if fallback and self.wait == 'forward' and not self.warned_fallback:
                self.warned_fallback = True
                warnings.warn(
                    "wait='forward' falls back to waiting in update(): {}. "
                    'Results are exact, but communication overlaps only '
                    'with backward.'.format(fallback), FallbackWarning,
                    stacklevel=4)
            self._complete_in_update()
        else:
            self._defer_updates()
        self._reset_iteration()

    def _fallback_reason(self):
        actual = self.actual
        if not isinstance(actual, optimizer_module.GradientMethod):
            return '{} is not a GradientMethod'.format(type(actual).__name__)
        if (type(actual).update is not
                optimizer_module.GradientMethod.update):
            return '{} overrides update()'.format(type(actual).__name__)
        if actual._loss_scaling_is_dynamic:
            return 'dynamic loss scaling needs every gradient at once'
        hookable = actual._hookable
        for hooks in (hookable._pre_update_hooks,
                      hookable._post_update_hooks):
            for name, hook in hooks.items():
                if not getattr(hook, 'call_for_each_param', False):
                    return ('optimizer hook {!r} ({}) needs every gradient '
                            'at once'.format(name, type(hook).__name__))
        return None

    def _wait_bucket(self, bucket):
        if bucket.handle is not None and not bucket.finalized:
            handle = bucket.handle
            t0 = time.perf_counter()
            # Raises CommunicationError (naming the rank and bucket) on
            # failure, CommunicationTimeout past the watchdog's timeout.
            handle.wait()
            t1 = time.perf_counter()
            self.stats.record(handle, t1 - t0)
            tl = self.timeline
            if tl is not None:
                tl.span('wait bucket {}'.format(bucket.index), 'wait', t0, t1)
                # One span per piece the engine reduced (chunks of buckets
                # interleave under the priority engine).
                spans = handle.spans or [(handle.started_at,
                                          handle.finished_at)]
                for i, (a, b) in enumerate(spans):
                    if a is None or b is None:
                        continue
                    tl.span('allreduce bucket {}{}'.format(
                        bucket.index, '' if len(spans) == 1 else
                        ' chunk {}/{}'.format(i + 1, len(spans))), 'comm',
                        a, b, tid=tl.COMM,
                        args={'label': handle.label,
                              'bytes': handle.nbytes})
            if self.size > 1:
                bucket.buffer *= bucket.buffer.dtype.type(1.0 / self.size)
            bucket.finalized = True

    def _mean_grad(self, info):
        g = info.bucket.slot(info.index).reshape(info.param.shape)
        if g.dtype != info.param.dtype:
            g = g.astype(info.param.dtype)
        return g

    def _complete_in_update(self):
        """ChainerMN semantics: mean gradients in param.grad, then update."""
        for bucket in self.buckets:
            self._wait_bucket(bucket)
        for info in self.infos:
            g = self._mean_grad(info)
            cur = info.param.grad
            if (cur is not None and cur.shape == g.shape
                    and cur.dtype == g.dtype):
                cur[...] = g
            else:
                info.param.grad = g.copy()
        for bucket in self.buckets:
            bucket.handle = None
        self.actual.update()

    def _defer_updates(self):
        actual = self.actual
        self.hyperparams = actual.hyperparam.get_dict()
        hookable = actual._hookable
        self.deferred_hooks = (list(hookable._pre_update_hooks.values()),
                               list(hookable._post_update_hooks.values()))
        actual.t += 1
        for info in self.infos:
            info.pending = True
        self.pending_count = len(self.infos)
        # Parameters outside the layout (never initialised) still go through
        # their update rule, as GradientMethod.update would do.
        for n, p in self.target.namedparams():
            if id(p) not in self.info_by_pid and p.array is None:
                p.update()

    def _reset_iteration(self):
        for info in self.infos:
            info.reset()
        for bucket in self.buckets:
            bucket.n_ready = 0
            bucket.posted = False
        self.iteration += 1
        self.next_post = 0
        self.control = None
        self.backward_started = False
        self.array_lookup = {id(i.param.array): i for i in self.infos
                             if i.param.array is not None}

    # ------------------------------------------------------------------
    # Applying deferred updates (wait='forward')

    def _apply(self, infos):
        """Waits for the reductions of ``infos`` and runs their update."""
        t0 = time.perf_counter() if self.timeline is not None else None
        actual = self.actual
        hookable = actual._hookable
        if self.deferred_hooks is not None:
            pre, post = self.deferred_hooks
        else:
            pre = list(hookable._pre_update_hooks.values())
            post = list(hookable._post_update_hooks.values())
        with _hyperparams(actual.hyperparam, self.hyperparams):
            for info in infos:
                if not info.pending:
                    continue
                bucket = info.bucket
                self._wait_bucket(bucket)
                param = info.param
                saved = param.grad
                param.grad = self._mean_grad(info)
                rule = param.update_rule
                for hook in pre:
                    hook(rule, param)
                param.update()
                for hook in post:
                    hook(rule, param)
                param.grad = saved
                info.pending = False
                self.pending_count -= 1
        for info in infos:
            b = info.bucket
            if b.handle is not None and not any(i.pending for i in
                                                self._bucket_infos(b)):
                b.handle = None
        if t0 is not None:
            self.timeline.span('update ' + infos[0].name.rsplit('/', 1)[0],
                               'update', t0, time.perf_counter(),
                               args={'params': [i.name for i in infos]})

    def _bucket_infos(self, bucket):
        return [self.info_by_pid[id(p)] for p in bucket.params]

    def _flush_bucket(self, bucket):
        pending = [i for i in self._bucket_infos(bucket) if i.pending]
        if pending:
            self._apply(pending)
        else:
            self._wait_bucket(bucket)
        bucket.handle = None

    def synchronize(self):
        """Finishes every posted reduction and applies pending updates."""
        self._restore_all_swaps()
        if self.buckets is None:
            return
        if self.control is not None:
            self.control[1].wait()
        for bucket in self.buckets:
            if bucket.posted:
                # Posted in the open iteration: let it finish, keep result.
                bucket.handle.wait()
            elif bucket.handle is not None:
                self._flush_bucket(bucket)

    def mark_loaded(self):
        """Parameters were deserialized: broadcast them at the next update.

        The step after a resume is not skipped when every rank loaded, so a
        resumed run equals an uninterrupted one.
        """
        self.loaded = True

    # ------------------------------------------------------------------
    # (Re)building the layout: blocking, on every rank at the same point

    def _relayout(self, skip=None):
        """Rebuilds the layout; ``skip``: whether this step is skipped.

        ``skip=None`` (no layout yet, or ``setup()`` was called again)
        decides it here, with the same rule the control message applies.
        """
        comm = self.mpi_comm
        if self.buckets is not None:
            for bucket in self.buckets:
                if bucket.handle is not None:
                    bucket.handle.wait()
                    bucket.handle = None
        self._hook_links()
        named = sorted(self.target.namedparams())
        mine = {n: ([list(p.shape), str(p.dtype)] if p.array is not None
                    else [None, None]) for n, p in named}
        gathered = _mpi_json.allgather_json(
            comm, {'params': mine, 'loaded': bool(self.loaded),
                   'changes_step': self._changes_step(),
                   'order': self.observed})
        self._check_same_model(named, gathered)
        if skip is None:
            skip = (any(g['changes_step'] for g in gathered)
                    and not all(g['loaded'] for g in gathered))

        # Initialise what other ranks initialised (a lazily initialised link
        # that ran on some ranks only), then broadcast every parameter from
        # the lowest rank that has it (rank 0 whenever it does).
        for n, p in named:
            owners = [r for r, g in enumerate(gathered)
                      if g['params'][n][0] is not None]
            if not owners:
                continue
            if p.array is None:
                shape, dtype = gathered[owners[0]]['params'][n]
                p.initialize(tuple(shape))
                if str(p.dtype) != dtype:
                    raise ValueError(
                        'parameter {} initialises as {} on rank {} but as {} '
                        'on rank {}; give its initializer an explicit dtype.'
                        .format(n, p.dtype, self.rank, dtype, owners[0]))
            _bcast_array(comm, p.array, root=owners[0])

        # The layout: rank 0's observed gradient order (backward order),
        # then the rest in reverse name order; broadcast so it is identical.
        if self.rank == 0:
            order = [n for n in gathered[0]['order'] if n in mine]
            seen = set(order)
            order += [n for n, _ in reversed(named) if n not in seen]
            sizes = {n: p.size for n, p in named if p.array is not None}
            dtypes = {n: str(p.dtype) for n, p in named if p.array is not None}
            entries = [(n, sizes[n], dtypes[n]) for n in order if n in sizes]
            plan = [[str(b.dtype), [list(e) for e in b.entries]]
                    for b in buckets_module.plan_buckets(
                        entries, self.bucket_size, self.allreduce_grad_dtype,
                        tail=TAIL_BUCKETS if self.wait == 'forward' else ())]
        else:
            plan = None
        plan = _mpi_json.bcast_json(comm, plan)
        by_name = dict(named)
        self.buckets, self.infos, self.info_by_pid = [], [], {}
        for index, (dtype, entries) in enumerate(plan):
            bplan = buckets_module.BucketPlan(
                numpy.dtype(dtype), tuple(tuple(e) for e in entries),
                sum(e[2] for e in entries))
            params = [by_name[e[0]] for e in entries]
            bucket = buckets_module.Bucket(index, bplan, params)
            self.buckets.append(bucket)
            for i, (name, p) in enumerate(zip(bucket.names, params)):
                info = _ParamInfo(name, p, bucket, i)
                self.infos.append(info)
                self.info_by_pid[id(p)] = info
        self.structure = self._local_structure()
        self.observed, self.observed_set = [], set()
        self.pending_count = 0
        self.loaded = False
        self._reset_iteration()

        if skip:
            # As ChainerMN does after a broadcast: no update rule runs, and
            # the gradients of this step (reduced above in the old layout,
            # if any) are dropped.
            return
        # The set of parameters is unchanged (setup() again, a parameter
        # replaced by one of the same name) or every rank resumed from the
        # same snapshot: this step's gradients are valid.
        for info in self.infos:
            self._pack(info, info.param.grad)
        self._try_post()
        self._complete_in_update()
        self._reset_iteration()

    def _check_same_model(self, named, gathered):
        names0 = sorted(gathered[0]['params'])
        for r, g in enumerate(gathered):
            names = sorted(g['params'])
            if names != names0:
                extra = sorted(set(names) - set(names0))
                missing = sorted(set(names0) - set(names))
                raise ValueError(
                    'the model differs between ranks: rank {} has parameters '
                    '{} that rank 0 lacks and lacks {} (seen on rank {}). '
                    'Every rank must build the same model before '
                    'create_overlapped_optimizer(...).setup(model).'.format(
                        r, extra[:5], missing[:5], self.rank))
        for n, _ in named:
            seen = {}
            for r, g in enumerate(gathered):
                shape, dtype = g['params'][n]
                if shape is not None:
                    seen.setdefault((tuple(shape), dtype), r)
            if len(seen) > 1:
                desc = '; '.join('rank {}: {}'.format(r, _describe(k))
                                 for k, r in seen.items())
                raise ValueError(
                    'parameter {} differs between ranks ({}) (seen on rank '
                    '{}). Every rank must build the same model.'.format(
                        n, desc, self.rank))


_TIMELINES = weakref.WeakSet()


@atexit.register
def _write_timelines():
    for state in list(_TIMELINES):
        state.write_timeline()


def _first_variable_input(args, kwargs):
    return taps._first_variable(args, kwargs)


@contextlib.contextmanager
def _hyperparams(hp, snapshot):
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


class _OverlappedOptimizer(_wrapper.OptimizerWrapper):
    """Wraps an optimizer; see :func:`create_overlapped_optimizer`."""

    @property
    def _overlap(self):
        return self._state

    def setup(self, link):
        """Sets up the actual optimizer and hooks ``link``; returns self."""
        st = self._overlap
        if not isinstance(link, chainer.Link):
            raise TypeError('setup() expects a chainer.Link, got {}'
                            .format(type(link).__name__))
        # setup() again (e.g. after add_link): the next update re-broadcasts
        # and, as in ChainerMN, skips its step only if the set of initialised
        # parameters changed since the previous update (see _changes_step).
        if st.target is not None:
            st.detach()
        st.actual.setup(link)
        st.attach(link)
        return self

    def update(self, lossfun=None, *args, **kwds):
        """Like ``chainermn``'s multi-node optimizer's ``update``."""
        st = self._overlap
        if st.target is None:
            raise RuntimeError(
                'update() was called before setup(); call '
                'optimizer.setup(model) first (on every rank).')
        if lossfun is not None:
            use_cleargrads = getattr(st.actual, '_use_cleargrads', True)
            loss = lossfun(*args, **kwds)
            if use_cleargrads:
                st.target.cleargrads()
            else:
                st.target.zerograds()
            loss.backward(loss_scale=st.actual._loss_scale)
            del loss
        st.close_iteration()

    def synchronize(self):
        """Finishes every pending reduction and applies pending updates.

        Afterwards the parameters are exactly those a blocking optimizer
        would hold.  Called automatically when parameters are read through
        Chainer (serialization, copies, device moves; each link's forward
        applies its own pending update).
        """
        self._overlap.synchronize()

    @contextlib.contextmanager
    def no_sync(self):
        """Forward/backward passes inside accumulate gradients locally.

        For gradient accumulation: run all micro-batches but the last inside
        this context, then the last one and ``update()`` outside.
        """
        st = self._overlap
        st.no_sync_depth += 1
        try:
            yield
        finally:
            st.no_sync_depth -= 1

    def serialize(self, serializer):
        st = self._overlap
        st.synchronize()
        st.actual.serialize(serializer)
        if isinstance(serializer, chainer.serializer.Deserializer):
            st.mark_loaded()

    def close(self):
        """Releases the communication thread and the hooks."""
        self._overlap.close()

    def write_timeline(self):
        """Writes the timeline now (if enabled); returns its path."""
        return self._overlap.write_timeline()

    def communication_stats(self, reset=False):
        """Gradient communication counters since setup (or the last reset).

        Returns:
            dict: ``buckets``, ``bytes``, ``comm_seconds`` (time spent
            reducing), ``wait_seconds`` (time training waited for
            reductions) and ``hidden_fraction`` (``1 - wait/comm``).
        """
        stats = self._overlap.stats
        out = stats.as_dict()
        if reset:
            stats.reset()
        return out



def create_overlapped_optimizer(actual_optimizer, communicator,
                                wait='forward', bucket_size=None,
                                zero_fill=True, allreduce_grad_dtype=None,
                                backend='mpi_priority', chunk_size=None,
                                timeline=None, timeout=None,
                                stall_warning=None, debug=None):
    """Creates a multi-node optimizer that overlaps reduction with compute.

    A drop-in for :func:`chainermn.create_multi_node_optimizer`: gradients
    are averaged over all ranks and results equal the blocking optimizer's
    to floating-point tolerance (never stale).  During backward each
    parameter joins a fusion bucket as soon as its gradient is final, and a
    complete bucket is reduced at once in the background.

    Args:
        actual_optimizer (chainer.Optimizer): the optimizer to wrap.
        communicator: a ChainerMN communicator
            (``chainermn.create_communicator(...)``).
        wait (str): ``'forward'`` (default): each link waits for its own
            reduction and applies its update just before its next forward,
            so communication also overlaps the next forward.  ``'update'``:
            ``update()`` waits for all reductions and runs the actual
            optimizer (overlap with backward only, ChainerMN's state after
            every ``update()``).
        bucket_size (int or str): fusion bucket size, in bytes or as a
            string such as ``'25MB'``.  Default 16 MiB.  With
            ``wait='forward'`` the last four buckets (the first layers, which
            the next forward needs first) are limited to 1, 2, 4 and 8 MiB.
        zero_fill (bool): accepted for compatibility.  Missing gradients
            always count as zeros: it is the only rule that keeps every
            rank's collectives matched, and it equals ChainerMN's result
            wherever ChainerMN's does not hang.
        allreduce_grad_dtype: dtype of gradients on the wire (e.g.
            ``numpy.float16`` halves traffic; updates still run in the
            parameters' dtype).  Default: the parameter's dtype (float32 for
            float16 parameters).
        backend (str): communication engine, run by a communication thread
            on a duplicated communicator: ``'mpi_priority'`` (default)
            slices buckets into chunks and runs first what is needed first
            (with ``wait='forward'``, the first layers' gradients), in an
            order all ranks agree on; ``'mpi_thread'`` reduces buckets
            first-in-first-out.
        timeline (str): if given, a Chrome-trace/Perfetto JSON per rank is
            written there (``{rank}`` in the path is replaced by the rank,
            else ``.rank<r>`` is inserted): forward per link, waits,
            deferred updates, each bucket's reduction.  Written by
            ``close()``/``write_timeline()`` and at exit; the first 200000
            events are kept.
        chunk_size (int or str): largest piece reduced in one call by
            ``'mpi_priority'`` (a higher-priority bucket can start at every
            chunk boundary).  Default 4 MiB.
        timeout (float): watchdog: seconds any wait for a reduction may
            take before :class:`chainermn_overlap.CommunicationTimeout` is
            raised, naming the pending bucket, instead of hanging.  Default
            ``CHAINERMN_OVERLAP_TIMEOUT`` or 600; 0 disables.
        stall_warning (float): stall diagnosis: after this many seconds of
            waiting (and again every as many), a
            :class:`chainermn_overlap.StallWarning` says which ranks have
            not posted which bucket and where their main thread is.
            Default ``CHAINERMN_OVERLAP_STALL_WARNING`` or off.
        debug (bool): check before every reduction that all ranks post the
            same one (``'mpi_thread'`` backend; one extra tiny allreduce
            each).  The bucket layout and iteration are checked at every
            iteration regardless.  Default ``CHAINERMN_OVERLAP_DEBUG``.

    Returns:
        The wrapped optimizer.  Attribute access goes to the actual
        optimizer.
    """
    if not isinstance(communicator,
                      chainermn.communicators.CommunicatorBase):
        raise TypeError(
            'create_overlapped_optimizer needs a ChainerMN communicator, '
            'e.g. chainermn.create_communicator("naive"); got {}.'
            .format(type(communicator).__name__))
    if getattr(communicator, 'mpi_comm', None) is None:
        raise TypeError(
            '{} has no mpi_comm; use an MPI-based ChainerMN communicator '
            '(naive, flat, non_cuda_aware, pure_nccl).'
            .format(type(communicator).__name__))
    if not isinstance(actual_optimizer, chainer.Optimizer):
        raise TypeError(
            'actual_optimizer must be a chainer.Optimizer such as '
            'chainer.optimizers.MomentumSGD(); got {}.'
            .format(type(actual_optimizer).__name__))
    if wait not in ('forward', 'update'):
        raise ValueError("wait must be 'forward' or 'update', got {!r}"
                         .format(wait))
    bucket_size = (DEFAULT_BUCKET_SIZE if bucket_size is None
                   else parse_size(bucket_size))
    if allreduce_grad_dtype is not None:
        dt = numpy.dtype(allreduce_grad_dtype)
        if dt not in (numpy.float16, numpy.float32, numpy.float64):
            raise ValueError(
                'allreduce_grad_dtype must be float16, float32 or float64, '
                'got {}'.format(dt))
        allreduce_grad_dtype = dt
    backends.get_backend(backend)
    backend_options = {}
    if chunk_size is not None:
        if backend != 'mpi_priority':
            raise ValueError("chunk_size applies to backend='mpi_priority' "
                             'only, not {!r}'.format(backend))
        backend_options['chunk_bytes'] = parse_size(chunk_size)
    state = _OverlapState(actual_optimizer, communicator, wait, bucket_size,
                          zero_fill, allreduce_grad_dtype, backend,
                          backend_options)
    # Validated now, so that a bad value fails here rather than at setup();
    # resolved (with the environment) by the backend.
    watchdog_module.resolve_timeout(timeout)
    watchdog_module.resolve_stall_warning(stall_warning)
    state.watch_options = (timeout, stall_warning, debug)
    if timeline is not None:
        state.timeline = timeline_module.Timeline(str(timeline),
                                                  communicator.rank)
        _TIMELINES.add(state)
    return _OverlappedOptimizer(state)
