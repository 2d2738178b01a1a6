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

from chainermn_overlap.optimizers import _policy
from chainermn_overlap.optimizers import _reducer
from chainermn_overlap.optimizers.sharding import collectives
from chainermn_overlap.optimizers.sharding import layout as shard_layout
from chainermn_overlap.optimizers.sharding import options
from chainermn_overlap.optimizers.sharding import rules
from chainermn_overlap.optimizers.sharding import scaling
from chainermn_overlap.optimizers.sharding import shards
from chainermn_overlap.optimizers.sharding import state as sharding_state
from chainermn_overlap.optimizers.sharding import updates
from chainermn_overlap.optimizers.sharding import writers

__all__ = ['ReduceScatterMean', 'ShardedPolicy']


def _mpi_wait(engine):
    return getattr(engine, 'mpi_wait', 'poll')


class ReduceScatterMean(_reducer.BucketOperation):
    """Item A of a bucket: this rank's piece of the mean.

    The piece goes to ``bucket.shard_grad`` (the parameters' dtype); the
    bucket's full buffer is released as soon as it is reduced.
    """

    def __init__(self, rank):
        self.rank = rank

    def start(self, engine, bucket, label, slot, priority):
        mpi_wait = _mpi_wait(engine)
        a, b = bucket.bounds[self.rank]

        def reduce_scatter(comm, _):
            xp = updates.xp_of(bucket)
            out = xp.empty(b - a, dtype=bucket.param_dtype)
            collectives.reduce_scatter_mean(comm, bucket.buffer, out,
                                            bucket.bounds, mpi_wait)
            bucket.shard_grad = out
            bucket.buffer = None
        return engine.run(reduce_scatter, updates.EMPTY, label=label, slot=slot,
                          priority=priority, stage=False,
                          nbytes=bucket.nbytes)

    def finish(self, bucket, size):
        pass   # the mean is taken on the communication thread


class ShardedPolicy(updates.UpdateItems, _policy.Policy):
    """Runs the update rules on the shards; see the module docstring.

    Args:
        actual, wait, reducer, timeline, mpi_comm: as
            :class:`~chainermn_overlap.optimizers._policy.Policy`.
        rank (int): this rank.
        unit (str): ``'element'`` or ``'parameter'`` (:mod:`.layout`).
        release_grads (bool): drop ``param.grad`` when an iteration closes
            (``shard='gradients'``: no full gradient is kept).
        iteration (callable): the optimizer's iteration (the round key).
        control (callable): the round's control message, ``(buffer,
            handle)``, once posted (gates updates posted in backward).
        update_at (str): ``'backward'`` or ``'update'`` (module docstring).
        in_flight: how many full gradient buffers may wait for their
            reduce-scatter while backward goes on: ``(n, 'bytes' or
            'buckets')`` (:meth:`throttle`, :meth:`settle`), ``'auto'``
            (:meth:`settle` only) or None (no bound).
    """

    # A round: each bucket's A and B (the reducer is built with these).
    items_per_bucket = 2
    transient = True
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

    def __init__(self, actual, wait, reducer, timeline, rank, unit,
                 release_grads, mpi_comm, iteration, control=None,
                 update_at='update', in_flight=None):
        super().__init__(actual, wait, reducer, timeline, mpi_comm)
        # A one-writer multi_node_snapshot of it is refused on every rank.
        writers.register(actual)
        self.rank = rank
        self.unit = unit
        self.release_grads = release_grads
        self.iteration = iteration
        self.control = control
        self.update_at = update_at
        self.in_flight = in_flight
        # This iteration's snapshot once made in backward (False: not in
        # backward this iteration), and the buckets whose B is posted.
        self.snap = None
        self.posted = set()
        self.buckets = []
        self.pieces = {}
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
            start, stop = bucket.bounds[self.rank]
            pieces = []
            for info, (_, off, size) in zip(
                    self.by_bucket[bucket.index], bucket.plan.entries):
                lo, hi, at = shard_layout.owned_range(off, size, start, stop)
                pieces.append(updates.Piece(info, lo, hi, at))
                if any(off < a < off + size for a, _ in bucket.bounds):
                    self.cut.add(id(info.param))
            self.pieces[bucket.index] = pieces
        if self.unit == 'auto' and self.rank == 0 and not self._warned_whole:
            # Rank 0 says once which parameters it keeps whole, and why.
            self._warned_whole = rules.warn_kept_whole(self.infos,
                                                       self.buckets)
        self._reconcile()
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

    def before_relayout(self):
        """Gathers the states whole: the new layout cuts them anew."""
        sharding_state.consolidate(self, 'a new bucket layout')
        self.states_sharded = False

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
            self.loaded_ranges = sharding_state.load(self, actual,
                                                     serializer)
            self.states_sharded = False
            if self.buckets:
                self._reconcile()
        elif self.save_shards and (self.states_sharded or
                                   self.loaded_ranges is not None):
            shards.write(self, actual, serializer)
            return
        else:
            if self.states_sharded:
                writers.check_every_rank_writes(self.rank)
            sharding_state.consolidate(self, 'serialize()')
            self.states_sharded = False
            actual.serialize(serializer)
        if self.buckets:
            self.cut_states()

    def _reconcile(self):
        loaded, self.loaded_ranges = self.loaded_ranges, None
        shards.reconcile(self, loaded)

    def save_slices(self, on):
        """Whether ``serialize`` writes this rank's slices (.shards)."""
        self.save_shards = bool(on)

    def before_new_buffer(self):
        if self.in_flight not in (None, 'auto'):
            self.throttle()

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

    # ------------------------------------------------------------------
    # Waiting

    def _wait(self, bucket):
        handle = bucket.update_handle
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
