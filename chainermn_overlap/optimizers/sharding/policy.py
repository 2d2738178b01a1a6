"""Sharded updates: reduce-scatter, update the shard, allgather.

The sharded counterpart of :mod:`chainermn_overlap.optimizers._policy`,
with the same interface to the optimizer's wiring.  Each bucket of an
iteration is two items of the engine's round::

    backward (bucket final)  -> A: Reduce_scatter the bucket into this
                                   rank's piece of the mean; the bucket's
                                   full buffer is released
    right after A is posted  -> B: run the update rules on the piece
    (or at update())               (:mod:`.rules`), then Allgatherv the
                                   updated parameters into every rank

Both run on the communication thread, in an order every rank agrees on
(the engine's round: item ``1 + b`` is A of bucket ``b``, item
``1 + n + b`` its B; B's priority is just below its A's, so a bucket is
reduced before it is updated and the first layers' parameters, which the
next forward needs first, are gathered first with ``wait='forward'``).
With ``wait='forward'`` a link's forward waits for its bucket's B; with
``wait='update'``, ``update()`` waits for every B.

By default B is posted at ``update()`` (``update_at='update'``), so the
updates and gathers overlap the next forward.  With
``update_at='backward'`` B is posted as soon as A is, so they overlap the
rest of backward too.  That needs what the update runs with to be known in
backward: the rules' hyperparameters and the optimizer hooks are frozen at
the first bucket (:class:`.rules.Snapshot`) and checked at ``update()``,
and B runs only if the round's control message (item 0, run before any B)
found the layout unchanged; otherwise B does nothing and ``update()``
rebuilds the layout as without sharding.  ``GradientClipping`` and dynamic
loss scaling need every shard first: with either, every B is posted at
``update()`` (with dynamic loss scaling, after the one allreduce of an
overflow flag that decides whether the step is skipped: :mod:`.scaling`).
On a bed whose link is the bottleneck and whose ranks have one core each,
posting in backward was slower: B holds the one communication thread while
later reductions wait behind it, and backward stops in the throttle
(:meth:`ShardedPolicy.throttle`) for longer.
"""
import numpy

import chainer

from chainermn_overlap.communication import watchdog
from chainermn_overlap.errors import CollectiveMismatchError
from chainermn_overlap.optimizers import _clipping
from chainermn_overlap.optimizers import _layout
from chainermn_overlap.optimizers.sharding import collectives
from chainermn_overlap.optimizers.sharding import layout as shard_layout
from chainermn_overlap.optimizers.sharding import options
from chainermn_overlap.optimizers.sharding import rules
from chainermn_overlap.optimizers.sharding import scaling
from chainermn_overlap.optimizers.sharding import shards
from chainermn_overlap.optimizers.sharding import state as sharding_state
from chainermn_overlap.optimizers.sharding import writers

__all__ = ['ReduceScatterMean', 'ShardedPolicy']

_EMPTY = numpy.empty(0, dtype=numpy.float32)


def _xp(bucket):
    return chainer.backend.get_array_module(bucket.params[0].array)


def _mpi_wait(engine):
    return getattr(engine, 'mpi_wait', 'poll')


class ReduceScatterMean(object):
    """Item A of a bucket: this rank's piece of the mean (a BucketOperation).

    The piece goes to ``bucket.shard_grad`` (the parameters' dtype); the
    bucket's full buffer is released as soon as it is reduced.
    """

    def __init__(self, rank):
        self.rank = rank

    def start(self, engine, bucket, label, slot, priority):
        mpi_wait = _mpi_wait(engine)
        a, b = bucket.bounds[self.rank]

        def reduce_scatter(comm, _):
            xp = _xp(bucket)
            out = xp.empty(b - a, dtype=bucket.param_dtype)
            collectives.reduce_scatter_mean(comm, bucket.buffer, out,
                                            bucket.bounds, mpi_wait)
            bucket.shard_grad = out
            bucket.buffer = None
        return engine.run(reduce_scatter, _EMPTY, label=label, slot=slot,
                          priority=priority, stage=False,
                          nbytes=bucket.nbytes)

    def finish(self, bucket, size):
        pass   # the mean is taken on the communication thread

    def step_done(self):
        pass


def _gated(fn, noop, control, bucket, rank, size):
    """A B posted in backward: ``fn`` if the round's control message found
    the layout unchanged and agreed on, else ``noop`` (``update()`` then
    rebuilds the layout, or raises the disagreement)."""
    buf, handle = control

    def gated(comm, array):
        # The control message is item 0 with the highest priority: on
        # every rank it ran before any B of its round.
        if not handle.done():
            raise RuntimeError('the update of {} ran before the control '
                               'message of its round'.format(bucket.label()))
        agreed = int(buf[0]) == _layout.UNCHANGED
        if agreed:
            try:
                watchdog.check_control(buf, rank, size)
            except CollectiveMismatchError:
                agreed = False
        return (fn if agreed else noop)(comm, array)
    return gated


class _Piece(object):
    """The part ``lo:hi`` of a parameter this rank owns, at ``at``."""

    __slots__ = ('info', 'lo', 'hi', 'at', 'proxy')

    def __init__(self, info, lo, hi, at):
        self.info = info
        self.lo = lo
        self.hi = hi
        self.at = at
        self.proxy = rules.make_proxy(info.param)

    def prepare(self, bucket, values=None):
        """Points the proxy at the parameter's slice and its gradient.

        ``values``: this rank's piece of the bucket's parameters, where the
        parameters are not whole (``shard='parameters'``).
        """
        param, proxy = self.info.param, self.proxy
        if values is None:
            proxy.array = param.array.reshape(-1)[self.lo:self.hi]
        else:
            proxy.array = values[self.at:self.at + self.hi - self.lo]
        if bucket.shard_grad is not None:
            proxy.grad = bucket.shard_grad[self.at:self.at + self.hi
                                           - self.lo]
        # Set by backward where the gradient reaches param (shard=
        # 'optimizer'); otherwise the snapshot sets the step's (.rules).
        proxy._loss_scale = param._loss_scale
        return proxy


class ShardedPolicy(object):
    """Runs the update rules on the shards; see the module docstring.

    Args:
        actual (chainer.Optimizer): the wrapped optimizer.
        wait (str): ``'forward'`` or ``'update'``.
        reducer (BucketReducer): its engine runs the items; its statistics
            count them.
        timeline: the optimizer's timeline.
        rank (int): this rank.
        unit (str): ``'element'`` or ``'parameter'`` (:mod:`.layout`).
        release_grads (bool): drop ``param.grad`` when an iteration closes
            (``shard='gradients'``: no full gradient is kept).
        mpi_comm: the communicator's ``mpi_comm`` (the small allreduce of
            a gradient norm).
        iteration (callable): the optimizer's iteration (the round key).
        control (callable): the round's control message, ``(buffer,
            handle)``, once posted (gates updates posted in backward).
        update_at (str): ``'backward'`` or ``'update'`` (module docstring).
    """

    # Whether B may be posted in backward (not with sharded parameters:
    # their versions change at update()).
    early = True
    # How B's allgather waits for MPI: sleeping between tests, whatever the
    # engine does.  It runs during the next forward, whose rank's core it
    # shares: MPICH's blocking call polls and takes that core.  On the bed
    # (ResNet-50, one core per rank, 4 rounds) stage 2 gained +0.081 [0.052,
    # 0.117] of scalability, and stage 1, also freed from the throttle, +0.196
    # [0.091, 0.268] (benchmarks/results/sharding_waits.json).
    gather_wait = 'sleep'
    # How many full gradient buffers may wait for their reduce-scatter while
    # backward goes on: (n, 'bytes' or 'buckets'), set by the optimizer from
    # shard_in_flight (throttle(), settle()); 'auto': settle() only.
    in_flight = None

    def __init__(self, actual, wait, reducer, timeline, rank, unit,
                 release_grads, mpi_comm, iteration, control=None,
                 update_at='update'):
        self.actual = actual
        # A one-writer multi_node_snapshot of it is refused on every rank.
        writers.register(actual)
        self.wait = wait
        self.reducer = reducer
        self.timeline = timeline
        self.rank = rank
        self.unit = unit
        self.release_grads = release_grads
        self.mpi_comm = mpi_comm
        self.iteration = iteration
        self.control = control
        self.update_at = update_at
        # This iteration's snapshot once made in backward (False: not in
        # backward this iteration), and the buckets whose B is posted.
        self.snap = None
        self.posted = set()
        self.infos = []
        self.buckets = []
        self.pieces = {}
        self.by_bucket = {}
        self.pending_count = 0
        self._checked = None
        # ids of the parameters the layout cuts between ranks.
        self.cut = set()
        # Whether rank 0 said which parameters shard_unit='auto' keeps
        # whole (once per optimizer).
        self._warned_whole = False
        # Whether the update rules' states are cut for this layout (see
        # sharding.state): not until the first update under it.
        self.states_sharded = False
        # Sharded snapshots (.shards): write slices while set; the ranges
        # of slices loaded, until the next layout reconciles them.
        self.save_shards = False
        self.loaded_ranges = None

    # ------------------------------------------------------------------
    # Layout

    def set_layout(self, infos):
        self.infos = infos
        self.by_bucket = {}
        buckets = {}
        for info in infos:
            self.by_bucket.setdefault(info.bucket.index, []).append(info)
            buckets[info.bucket.index] = info.bucket
        self.buckets = [buckets[i] for i in sorted(buckets)]
        self.pieces = {}
        self.cut = set()
        for bucket in self.buckets:
            bucket.bounds = shard_layout.bounds_from_counts(
                bucket.shard_counts)
            start, stop = bucket.bounds[self.rank]
            pieces = []
            for info, (_, off, size) in zip(
                    self.by_bucket[bucket.index], bucket.plan.entries):
                lo, hi, at = shard_layout.owned_range(off, size, start, stop)
                pieces.append(_Piece(info, lo, hi, at))
                if any(off < a < off + size for a, _ in bucket.bounds):
                    self.cut.add(id(info.param))
            self.pieces[bucket.index] = pieces
        if self.unit == 'auto' and self.rank == 0 and not self._warned_whole:
            # Rank 0 says once which parameters it keeps whole, and why.
            self._warned_whole = rules.warn_kept_whole(self.infos,
                                                       self.buckets)
        shards.reconcile(self)
        self.pending_count = 0
        self._checked = None
        # The round that builds a layout posts its updates at update().
        self.snap = False
        self.posted = set()

    def cut_states(self):
        """Each rule's state becomes its slice's (created if missing)."""
        rules.init_states([(p.info.param, p.prepare(b, self._values(b)),
                            p.lo, p.hi)
                           for b in self.buckets
                           for p in self.pieces[b.index]])
        self.states_sharded = True

    def _values(self, bucket):
        """This rank's piece of ``bucket``'s parameters if they are not
        whole, else None."""
        return None

    def close(self):
        """The optimizer is closed."""

    def before_relayout(self):
        """Gathers the states whole: the new layout cuts them anew."""
        sharding_state.consolidate(self, 'a new bucket layout')

    def serialize(self, actual, serializer):
        """The actual optimizer's ``serialize`` with whole states.

        Saving gathers them (collective: every rank must save at the same
        point; :mod:`.writers`), or within :func:`.shards.saving` writes
        this rank's slices; loading reads whole states or slices and
        replaces the states only once all is read and checked
        (:func:`.state.load`); either way each rank then keeps its slices
        only.
        """
        if isinstance(serializer, chainer.serializer.Deserializer):
            sharding_state.load(self, actual, serializer)
            self.states_sharded = False
            if self.buckets:
                shards.reconcile(self)
        elif self.save_shards and (self.states_sharded or
                                   self.loaded_ranges is not None):
            shards.write(self, actual, serializer)
            return
        else:
            if self.states_sharded:
                writers.check_every_rank_writes(self.rank)
            sharding_state.consolidate(self, 'serialize()')
            actual.serialize(serializer)
        if self.buckets:
            self.cut_states()

    def wait_requests(self, requests, label, hint=''):
        """Waits for MPI requests of a collective the main thread posted,
        bounded as the reductions are (the optimizer's ``timeout=``)."""
        self.reducer.engine.watchdog.wait_requests(requests, label,
                                                   hint=hint)

    def throttle(self):
        """Before a bucket's buffer is filled: while the full buffers still
        waiting for their reduce-scatter reach ``in_flight`` (bytes or
        buckets), wait for the oldest (what bounds the gradients a rank
        holds during backward when the link is slower than the compute)."""
        self._wait_in_flight(*self.in_flight)

    def settle(self):
        """When ``update()`` returns without waiting for the reductions
        (``wait='forward'``): leaves in flight less than the bound of
        ``shard_in_flight`` (its part of the parameters' bytes for
        ``'auto'``), waiting for the oldest reduce-scatters first.  The
        next forward's first links need the newest, which the link sends
        after those: the wait takes little from the overlap, and what a
        rank holds between steps stays within its stage's promise."""
        if self.in_flight == 'auto':
            total = sum(b.plan.nelems * numpy.dtype(b.param_dtype).itemsize
                        for b in self.buckets)
            self._wait_in_flight(
                total // options.AUTO_IN_FLIGHT_FRACTION, 'bytes')
        elif self.in_flight is not None:
            self._wait_in_flight(*self.in_flight)

    def _wait_in_flight(self, limit, unit):
        waiting = []
        for b in self.buckets:
            buf = b.buffer     # the communication thread drops it when done
            if buf is not None and b.handle is not None \
                    and not b.handle.done():
                waiting.append((b, buf.nbytes if unit == 'bytes' else 1))
        held = sum(n for _, n in waiting)
        while waiting and held >= limit:
            bucket, n = waiting.pop(0)
            self.reducer.wait_bucket(bucket)
            held -= n

    def _check(self):
        def ids(hookable):
            return (tuple(map(id, hookable._pre_update_hooks.values())),
                    tuple(map(id, hookable._post_update_hooks.values())))
        # A rule or rule hook may change after the layout too (a hook added
        # to a parameter the layout cuts).
        key = (ids(self.actual._hookable),
               tuple((id(r), ids(r._hookable)) if r is not None else None
                     for r in (i.param.update_rule for i in self.infos)))
        if key != self._checked:
            rules.check_optimizer(self.actual,
                                  [i.param for i in self.infos], self.unit,
                                  self.rank, self.cut)
            self._checked = key

    # ------------------------------------------------------------------
    # Closing an iteration

    def after_post(self, bucket):
        """A of ``bucket`` is posted (backward): post its B now if the
        update can be known now (see the module docstring)."""
        if self.snap is None:
            if (self.update_at != 'backward' or not self.early
                    or not self.states_sharded or self.control is None
                    or self.control() is None):
                self.snap = False
                return
            self._check()
            self.cut_states()
            snap = rules.Snapshot(self.actual, [i.param for i in self.infos],
                                  self.release_grads)
            self.snap = False if snap.global_pre or snap.dynamic else snap
        if self.snap:
            self._post_update(bucket, self.snap, self.control())

    def finish_iteration(self, target, immediate=()):
        """Every bucket's A is posted: post the updates (B) not yet
        posted."""
        actual = self.actual
        params = [i.param for i in self.infos]
        snap, self.snap = self.snap, None
        if snap:
            change = snap.changes(actual, params)
            if change is not None:
                self.posted = set()
                raise ValueError(
                    '{} changed between backward and update() (rank {}). '
                    'With shard=, each shard is updated as soon as its '
                    'gradients are reduced, during backward, with what the '
                    'optimizer held then: change it before backward (as '
                    "trainer extensions do), or pass shard_update='update'."
                    .format(change, self.rank))
        else:
            self._check()
            # States first: the snapshot's rule copies share them.
            self.cut_states()
            snap = rules.Snapshot(actual, params, self.release_grads)
        # Dynamic loss scaling: a step that overflows on any rank is skipped
        # on every rank, as GradientMethod.update does (.scaling).
        skip = scaling.overflowed(self, immediate)
        actual.t += 1
        if skip:
            snap, immediate = scaling.SKIPPED, ()
        else:
            snap.commit()
            in_layout = {id(p) for p in params}
            for p in target.params():
                if id(p) not in in_layout and p.array is None:
                    p.update()
        if self.release_grads:
            for p in params:
                p.grad = None
        if snap.global_pre:
            self._run_pre_hooks(snap, immediate)
        self._post_updates(snap)
        for param in immediate:
            # Reduced within their group and never sharded (distconv's
            # channel blocks): updated whole, now (GradientClipping took
            # them into its norm and rate above).
            shadow = param.update_rule
            for hook in snap.pre:
                if not isinstance(hook, rules.GLOBAL_HOOKS):
                    hook(shadow, param)
            param.update()
            for hook in snap.post:
                hook(shadow, param)
        actual.update_loss_scale()
        if self.wait == 'update':
            self.apply(self.infos)
        else:
            for info in self.infos:
                info.pending = True
            self.pending_count = len(self.infos)
            self.settle()

    def complete_in_update(self, immediate=()):
        """``update()`` of a rebuilt layout: post and wait for every B
        (``immediate``: the channel blocks, updated whole)."""
        wait, self.wait = self.wait, 'update'
        try:
            self.finish_iteration(self.actual.target, immediate)
        finally:
            self.wait = wait

    def abandon_round(self):
        """The iteration's step is dropped (a relayout): still post every
        bucket's B, as a no-op, so that the engine's round completes (a B
        posted in backward sees the control message and does nothing)."""
        self.snap = None
        self._post_updates(None)
        for bucket in self.buckets:
            self._wait(bucket)

    def _run_pre_hooks(self, snap, immediate=()):
        """Pre-update hooks on the main thread, once every shard is in
        (a hook needs all gradients: GradientClipping, whose norm counts
        the channel blocks ``immediate`` too)."""
        for bucket in self.buckets:
            self.reducer.wait_bucket(bucket)
        pairs = []
        for bucket in self.buckets:
            for piece in self.pieces[bucket.index]:
                shadow = snap.rules.get(id(piece.info.param))
                if shadow is not None:
                    pairs.append((shadow, piece.prepare(
                        bucket, self._values(bucket))))
        for hook in snap.pre:
            if isinstance(hook, rules.GLOBAL_HOOKS):
                self._clip(hook, [proxy for _, proxy in pairs], immediate)
            else:
                for shadow, proxy in pairs:
                    hook(shadow, proxy)
        snap.pre_done = True

    def _clip(self, hook, proxies, immediate=()):
        """``GradientClipping`` with the norm of the whole gradient: the
        shards' (each element on one rank) and the channel blocks' (each
        block on the members of its group, :mod:`.._clipping`)."""
        from mpi4py import MPI
        local = numpy.array([_clipping.sqnorm(p.grad for p in proxies)
                             + _clipping.blocks_sqnorm(immediate)])
        self.wait_requests(
            [self.mpi_comm.Iallreduce(MPI.IN_PLACE, local, op=MPI.SUM)],
            'the allreduce of the gradient norm for GradientClipping of '
            'iteration {}'.format(self.iteration()))
        grads = [p.grad for p in proxies] + [p.grad for p in immediate]
        if not grads:
            return
        rate = _clipping.rate(hook.threshold, local[0], grads[0].dtype)
        if rate is None:
            return
        for g in grads:
            g *= rate

    def _post_updates(self, snap, offset=0):
        """Posts B of every bucket whose B is not posted yet."""
        for bucket in self.buckets:
            if bucket.index not in self.posted:
                self._post_update(bucket, snap, None, offset)
        self.posted = set()

    def _post_update(self, bucket, snap, control, offset=0):
        reducer = self.reducer
        engine = reducer.engine
        n = len(reducer.buckets)
        first = reducer.first_item + offset
        iteration = self.iteration()
        prio = bucket.index if self.wait == 'forward' else -bucket.index
        fn = self._update_fn(bucket, snap, self.gather_wait)
        if control is not None:
            fn = _gated(fn, self._update_fn(bucket, None, None), control,
                        bucket, self.rank, reducer.size)
        bucket.update_handle = engine.run(
            fn, _EMPTY,
            label='update and allgather of {} of iteration {}'.format(
                bucket.label(), iteration),
            slot=(iteration, first + n + bucket.index, reducer.round_items),
            priority=prio - 0.5, stage=False,
            nbytes=bucket.plan.nelems * bucket.param_dtype.itemsize)
        self.posted.add(bucket.index)

    def _update_fn(self, bucket, snap, mpi_wait):
        pieces = self.pieces[bucket.index]

        def update_and_allgather(comm, _):
            if snap is None or snap.skipped:
                bucket.shard_grad = None
                for piece in pieces:
                    piece.proxy.grad = None
                return
            xp = _xp(bucket)
            out = xp.empty(bucket.plan.nelems, dtype=bucket.param_dtype)
            start = bucket.bounds[self.rank][0]
            for piece in pieces:
                proxy = piece.prepare(bucket)
                snap.update(piece.info.param, proxy)
                a = start + piece.at
                out[a:a + piece.hi - piece.lo] = proxy.array
                # The reduced shard is consumed: nothing may keep it.
                proxy.grad = None
            bucket.shard_grad = None
            collectives.allgather(comm, out, bucket.bounds, mpi_wait)
            for piece, (_, off, size) in zip(pieces, bucket.plan.entries):
                param = piece.info.param
                param.array[...] = out[off:off + size].reshape(param.shape)
        return update_and_allgather

    # ------------------------------------------------------------------
    # Waiting

    def _wait(self, bucket):
        handle = getattr(bucket, 'update_handle', None)
        if handle is None:
            return
        self.reducer.wait_bucket(bucket)
        self.reducer.wait_handle(handle)
        bucket.update_handle = None
        bucket.handle = None

    def apply(self, infos):
        """Waits until the parameters of ``infos`` hold their update."""
        done = set()
        for info in infos:
            b = info.bucket
            if b.index in done:
                continue
            done.add(b.index)
            self._wait(b)   # nothing to wait for if already waited
            for i in self.by_bucket[b.index]:
                if i.pending:
                    i.pending = False
                    self.pending_count -= 1

    def wait_posted(self, bucket):
        """A bucket posted in the open iteration (``synchronize()`` before
        ``update()``): its reduction finishes, and so does its update if
        posted in backward (the parameters then already hold it)."""
        if bucket.index in self.posted:
            self._wait(bucket)
        elif bucket.handle is not None:
            bucket.handle.wait()

    def flush_bucket(self, bucket):
        """Finishes a bucket of an earlier iteration before its reuse."""
        self.apply(self.by_bucket.get(bucket.index, ()))
        self._wait(bucket)
