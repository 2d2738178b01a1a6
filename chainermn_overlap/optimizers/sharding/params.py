"""``shard='parameters'``: whole parameters only while they are used.

Between uses a rank holds only its piece of each bucket's parameters (its
"master" piece, which its update rules update); ``param.array`` is a
placeholder of the right shape and dtype that holds no memory (a
zero-stride view of one element, read-only).  A parameter is made whole:

* for its link's forward: the link hook fetches the bucket from its owners
  (:mod:`.server`) and swaps the parameter for a tap whose output is the
  whole array; the next bucket in the previous iteration's order is
  fetched meanwhile;
* for the backward of a function that retained it: the tap's output node
  gave its array back after the forward (Chainer's function nodes keep
  their inputs for backward through the input node's data, so swapping
  ``param.array`` alone would free nothing); a function hook fetches the
  bucket again just before that backward, the previous bucket in forward
  order meanwhile, and drops it after;
* for anything that reads parameters through Chainer (serializers,
  ``copy``, evaluation through the link, ``synchronize()``): every bucket
  is fetched, ``param.array`` becomes whole again and stays so until the
  next ``update()``, which writes this rank's piece back (so an edit made
  alike on every rank is kept) and releases it.

At most two buckets are whole at a time besides what a function holds
during its own forward or backward.  The first update after a layout is
built runs as ``shard='gradients'`` does and decides, with one small
allreduce, which buckets stay whole for good: those with a parameter used
outside its link's call (``F.linear(x, l.W)`` in a parent), which cannot be
made whole in time.  A parameter first used that way later raises an error
that says so.
"""
import collections
import time
import weakref

import numpy

import chainer

from chainermn_overlap.optimizers.sharding import policy as sharded
from chainermn_overlap.optimizers.sharding import prefetch
from chainermn_overlap.optimizers.sharding import server as server_module

__all__ = ['ParameterShardedPolicy', 'placeholder']


def placeholder(param):
    """An array of ``param``'s shape and dtype that holds one element."""
    xp = chainer.backend.get_array_module(param.array)
    return xp.broadcast_to(xp.zeros((), dtype=param.dtype), param.shape)


def is_placeholder(array):
    return array is not None and array.size > 0 and all(
        s == 0 for s in array.strides)


class ParameterShardedPolicy(sharded.ShardedPolicy):
    """Sharded parameters (see the module docstring)."""

    # Items of a round besides two per bucket: the collective after which
    # the updates of a closed iteration may start (every rank closed it).
    extra_items = 1
    # Updates are posted at update(): the owners' versions change there.
    early = False
    # The tracker asks it to make released parameters whole for a use.
    gathers_params = True

    def __init__(self, *args, prefetch_bytes='auto', **kwargs):
        super().__init__(*args, **kwargs)
        # Bytes of whole buckets held besides the one in use: fetched
        # ahead, or kept for a use soon (prefetch.UsePlan); 'auto' or None
        # (no bound): see prefetch.budget.
        self.prefetch_bytes = prefetch_bytes
        self.server = None
        self.master = {}        # bucket index -> this rank's piece
        self.released = set()   # buckets whose params are placeholders
        self.whole = set()      # buckets kept whole (decided once)
        self.observed = False
        self.version = 0        # updates the released buckets have had
        self.live = collections.OrderedDict()   # bucket -> whole array
        self.fetching = {}      # bucket -> Fetch
        self.plan = None        # which buckets to hold (prefetch.UsePlan)
        self.materialized = set()
        self.nodes = weakref.WeakKeyDictionary()   # tap output node -> info
        self._restored = []
        self.closed = None      # the close of the last closed iteration
        self.by_index = {}

    # ------------------------------------------------------------------
    # Layout

    def set_layout(self, infos):
        self.materialize()
        super().set_layout(infos)
        if self.server is None and self.buckets:
            for p in self.infos:
                if chainer.backend.get_array_module(p.param.array) \
                        is not numpy:
                    raise ValueError(
                        "shard='parameters' keeps parameters in host memory "
                        'for now; {} is a device array (rank {}). Use '
                        "shard='gradients'.".format(p.name, self.rank))
            # Its waits have the optimizer's limit (the watchdog's; None
            # there is no limit, 0 to the server).
            limit = self._watchdog().timeout
            self.server = server_module.ShardServer(
                self.mpi_comm, self.rank, 0 if limit is None else limit)
            # An optimizer dropped without close() must not leave its
            # server polling.
            weakref.finalize(self, self.server.stop)
        elif self.server is not None:
            self.server.reset()
        self.master, self.released, self.whole = {}, set(), set()
        self.materialized = set()
        self.observed = False
        self.version = 0
        self._forget_fetched()
        self.by_index = {b.index: b for b in self.buckets}
        sizes = {b.index: b.plan.nelems * numpy.dtype(b.param_dtype).itemsize
                 for b in self.buckets}
        self.plan = prefetch.UsePlan(sizes, prefetch.budget(
            self.prefetch_bytes, sizes, self.mpi_comm.size))

    def _values(self, bucket):
        return self.master.get(bucket.index) if (
            bucket.index in self.released) else None

    def close(self):
        """Makes every parameter whole and stops the server (collective:
        no server may stop while another rank still fetches from it).

        Every wait is bounded by the optimizer's timeout; after a timeout
        (the engine is stuck, e.g. a peer was lost) nothing is waited for:
        the server just stops.
        """
        if self.server is None:
            return
        engine = self.reducer.engine
        try:
            if engine is None or engine.stuck is None:
                self.materialize()
                self.wait_requests(
                    [self.mpi_comm.Ibarrier()], "the barrier of close()",
                    hint="With shard='parameters' close() is collective (no "
                    'rank stops serving its parameters while another may '
                    'still fetch them): call it on every rank.')
        finally:
            self.server.close()
            self.server = None

    # ------------------------------------------------------------------
    # Closing an iteration

    def finish_iteration(self, target, immediate=()):
        self._settle_fetches()
        for index in sorted(self.materialized):
            self._release(self.by_index[index], write_back=True)
        self.materialized.clear()
        self._forget_fetched()
        if self.plan is not None:
            self.plan.next_iteration()
        if not self.observed:
            # This update runs as shard='gradients' does (the parameters
            # are whole), and decides which buckets stay whole.
            self._decide_whole()
            wait, self.wait = self.wait, 'update'
            try:
                super().finish_iteration(target, immediate)
            finally:
                self.wait = wait
            for bucket in self.buckets:
                if bucket.index not in self.whole:
                    self._release(bucket, write_back=True, first=True)
            self.observed = True
            return
        self.version += 1
        super().finish_iteration(target, immediate)

    def _decide_whole(self):
        from mpi4py import MPI
        flags = numpy.zeros(len(self.buckets), dtype=numpy.int32)
        for i, bucket in enumerate(self.buckets):
            flags[i] = any(info.tainted or info.late
                           for info in self.by_bucket[bucket.index])
        self.wait_requests(
            [self.mpi_comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)],
            "the allreduce that decides which buckets stay whole (shard="
            "'parameters', the first update of a layout) of iteration {}"
            .format(self.iteration()))
        self.whole = {b.index for b, f in zip(self.buckets, flags) if f}

    def _release(self, bucket, write_back, first=False):
        """Keeps this rank's piece, makes the parameters placeholders."""
        a, b = bucket.bounds[self.rank]
        if first:
            piece = numpy.empty(b - a, dtype=bucket.param_dtype)
            self.master[bucket.index] = piece
        else:
            piece = self.master[bucket.index]
            self.server.before_update(bucket.index)
        if write_back:
            for p in self.pieces[bucket.index]:
                flat = p.info.param.array.reshape(-1)
                piece[p.at:p.at + p.hi - p.lo] = flat[p.lo:p.hi]
        if first:
            self.server.publish(bucket.index, piece, self.version)
        for info in self.by_bucket[bucket.index]:
            info.param.array = placeholder(info.param)
        self.released.add(bucket.index)

    def _post_updates(self, snap):
        reducer = self.reducer
        n = len(reducer.buckets)
        first = reducer.first_item
        self.closed = reducer.engine.allreduce(
            numpy.zeros(1, dtype=numpy.int32), 'max',
            label='close of iteration {}'.format(self.iteration()),
            slot=(self.iteration(), first + n, reducer.round_items),
            priority=float(1 << 30))
        super()._post_updates(snap, offset=1)

    def _update_fn(self, bucket, snap, mpi_wait):
        if bucket.index not in self.released:
            return super()._update_fn(bucket, snap, mpi_wait)
        pieces = self.pieces[bucket.index]
        master = self.master[bucket.index]
        closed = self.closed

        def update_piece(comm, _):
            # Every rank closed the iteration: nobody asks for the previous
            # version any more once its answers are sent.  (The close ran
            # first: it has the round's highest priority.)
            if not closed.done():
                raise RuntimeError('the update of {} ran before the close '
                                   'of its iteration'.format(bucket.label()))
            if snap is not None:
                self.server.before_update(bucket.index)
                for piece in pieces:
                    proxy = piece.prepare(bucket, master)
                    snap.update(piece.info.param, proxy)
                    proxy.grad = None
                self.server.updated(bucket.index)
            else:
                for piece in pieces:
                    piece.proxy.grad = None
            bucket.shard_grad = None
        return update_piece

    def abandon_round(self):
        self._settle_fetches()
        super().abandon_round()

    def before_relayout(self):
        self.materialize()
        super().before_relayout()

    # ------------------------------------------------------------------
    # Whole parameters on demand

    def _own(self, bucket):
        def fill(full):
            self._wait(bucket)   # this rank's own update applied
            a, b = bucket.bounds[self.rank]
            full[a:b] = self.master[bucket.index]
        return fill

    def _start(self, bucket):
        if bucket.index not in self.live and bucket.index not in \
                self.fetching:
            self.fetching[bucket.index] = self.server.fetch(
                bucket, self.version, self._own(bucket))
            self.timeline.instant('fetch bucket {}'.format(bucket.index),
                                  'fetch')

    def _acquire(self, bucket, keep=(), why='forward'):
        """The bucket's whole flat array; of the others only those in
        ``keep`` stay, and those are fetched ahead, in order."""
        index = bucket.index
        full = self.live.get(index)
        if full is None:
            t0 = time.perf_counter()
            self._start(bucket)
            full = self.fetching.pop(index).wait(watchdog=self._watchdog())
            self.live[index] = full
            self.timeline.span('{} wait for bucket {}'.format(why, index),
                               'fetch wait', t0, time.perf_counter())
        for other in list(self.live):
            if other != index and other not in keep:
                del self.live[other]
        for other in keep:
            if other != index:
                self._start(self.by_index[other])
        return full

    def _view(self, info, full):
        _, off, size = info.bucket.plan.entries[info.index]
        return full[off:off + size].reshape(info.param.shape)

    def gather(self, info):
        """Whole value of a released parameter for its link's forward (None
        if the parameter is whole anyway)."""
        bucket = info.bucket
        if bucket.index not in self.released:
            return None
        keep = self.plan.use(bucket.index)
        return self._view(info, self._acquire(bucket, keep))

    def tapped(self, node, info):
        """A tap's output node for the released ``info``: drop its array
        after the link's forward, fetch it again for its backward."""
        self.nodes[node] = info

    def release_nodes(self, nodes):
        for node in nodes:
            node._data = None

    def before_backward(self, function):
        keep = function._input_indexes_to_retain or ()
        for i in keep:
            node = function.inputs[i]
            info = self.nodes.get(node)
            if info is None or node._data is not None:
                continue
            bucket = info.bucket
            full = self._acquire(bucket, self.plan.use(bucket.index),
                                 why='backward')
            node._data = self._view(info, full)
            self._restored.append(node)

    def after_backward(self, function):
        if self._restored:
            self.release_nodes(self._restored)
            self._restored = []

    def raw_use(self, info):
        if info.bucket.index in self.released:
            raise RuntimeError(
                "parameter {} was used outside its link's call (rank {}), "
                "e.g. F.linear(x, link.W) in a parent link: with shard="
                "'parameters' it is whole only during its link's forward. "
                'Use it through its link, or call optimizer.setup(model) '
                'again after the first such use (the first update of a '
                'layout keeps those parameters whole).'.format(info.name,
                                                              self.rank))

    def materialize(self):
        """Makes every released parameter whole (``param.array``)."""
        if not self.released:
            return
        self._settle_fetches()
        for index in sorted(self.released):
            bucket = self.by_index[index]
            full = self._acquire(bucket, why='whole')
            for info in self.by_bucket[index]:
                info.param.array = self._view(info, full).copy()
            self.materialized.add(index)
        self.released -= self.materialized
        self._forget_fetched()

    def _watchdog(self):
        # The optimizer's timeout= (the engine's watchdog) bounds fetches.
        return self.reducer.engine.watchdog

    def _settle_fetches(self):
        watchdog = self._watchdog()
        for fetch in self.fetching.values():
            fetch.wait(watchdog=watchdog)
        self.fetching = {}

    def _forget_fetched(self):
        self.live.clear()
        self.fetching = {}
