"""Bucket reduction: pack final gradients, post buckets in order, wait, mean.

The :class:`BucketReducer` sits between the gradient tracker and the
progress engine.  It packs each final gradient into its fusion bucket,
posts every complete bucket as soon as all earlier buckets are posted (so
all ranks post the same buckets in the same order, whatever their own
control flow), and, when a bucket's result is needed, waits for it and
turns the sum into a mean.  What is done to a bucket on the wire is a
:class:`BucketOperation`: one interface (a bucket in, its reduction
started; then finished into the mean in place) through which the plain
mean, low-precision wire formats and compression plug in without the
tracker or the update policy knowing.
"""
import functools
import time

import numpy

import chainer

from chainermn_overlap import _kernels
from chainermn_overlap.communication import ownership
from chainermn_overlap.communication import ring


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
        return {'buckets': self.buckets, 'bytes': self.bytes,
                'comm_seconds': self.comm_seconds,
                'wait_seconds': self.wait_seconds,
                'hidden_fraction': hidden_fraction(self.wait_seconds,
                                                   self.comm_seconds)}


def hidden_fraction(wait_seconds, comm_seconds):
    """``1 - wait / comm``: the share of communication hidden (None if 0)."""
    if comm_seconds <= 0:
        return None
    return 1.0 - wait_seconds / comm_seconds


class BucketOperation(object):
    """What happens to one bucket on the wire (one signature for all).

    ``start`` posts the bucket's reduction on the engine and returns its
    handle; ``finish`` is called once the handle completed and leaves the
    mean over ranks in ``bucket.buffer``, in place.
    """

    def start(self, engine, bucket, label, slot, priority):
        raise NotImplementedError

    def finish(self, bucket, size):
        raise NotImplementedError

    def step_done(self):
        """An update step completed (the count a compression warms up on)."""


class MeanAllreduce(BucketOperation):
    """The exact reduction: one allreduce (sum), then a scale by 1/size."""

    def start(self, engine, bucket, label, slot, priority):
        return engine.allreduce(bucket.buffer, 'sum', label=label, slot=slot,
                                priority=priority)

    def finish(self, bucket, size):
        if size > 1:
            bucket.buffer *= bucket.buffer.dtype.type(1.0 / size)


class LowPrecisionMean(BucketOperation):
    """A float16 (or other narrow) wire with float32 arithmetic.

    MPI's own float16 sum is software arithmetic, element by element; this
    runs :func:`~chainermn_overlap.communication.ring.ring_allreduce_mean`
    on the engine instead: the same bytes on the wire, every addition in
    float32 with numpy, the scale by ``1 / size`` folded in.
    """

    def start(self, engine, bucket, label, slot, priority):
        # The ring moves the bucket's bytes: it waits as the engine's
        # allreduces do.
        fn = functools.partial(ring.ring_allreduce_mean,
                               mpi_wait=getattr(engine, 'mpi_wait', 'poll'))
        return engine.run(fn, bucket.buffer, label=label, slot=slot,
                          priority=priority)

    def finish(self, bucket, size):
        pass  # the ring leaves the mean


class CompressedMean(BucketOperation):
    """A compression (e.g. :class:`chainermn_overlap.PowerSGD`) per bucket.

    Until the compression's warm-up is over, buckets go through ``exact``.
    The decision is made from the compression's iteration count, the same
    on every rank.
    """

    # Small allreduces whose waits are for the other ranks (their skew), not
    # for bytes: sleeping leaves the core to training (progress.py).  None
    # follows the engine.
    mpi_wait = 'sleep'

    def __init__(self, compression, exact):
        self.compression = compression
        self.exact = exact
        self._exact_buckets = set()

    def start(self, engine, bucket, label, slot, priority):
        c = self.compression
        if not c.active:
            self._exact_buckets.add(bucket.index)
            return self.exact.start(engine, bucket, label, slot, priority)
        self._exact_buckets.discard(bucket.index)
        shapes = [p.shape for p in bucket.params]

        mpi_wait = self.mpi_wait or getattr(engine, 'mpi_wait', 'poll')

        def reduce(comm, buf):
            c.reduce_bucket(comm, bucket, shapes, mpi_wait)
        return engine.run(
            reduce, bucket.buffer, label='{} ({!r})'.format(label, c),
            slot=slot, priority=priority, stage=False,
            nbytes=c.wire_elements(shapes) * bucket.plan.dtype.itemsize)

    def finish(self, bucket, size):
        if bucket.index in self._exact_buckets:
            self.exact.finish(bucket, size)

    def step_done(self):
        self.compression.step_done()


def choose_operation(allreduce_grad_dtype=None, compression=None):
    """The bucket operation for a wire dtype and an optional compression."""
    narrow = (allreduce_grad_dtype is not None
              and numpy.dtype(allreduce_grad_dtype).itemsize < 4)
    exact = LowPrecisionMean() if narrow else MeanAllreduce()
    if compression is None:
        return exact
    return CompressedMean(compression, exact)


class BucketReducer(object):
    """Packs, posts in bucket order, waits and averages the buckets.

    Args:
        engine: the progress engine (``allreduce(...)`` returning handles).
        size (int): number of ranks.
        wait (str): ``'forward'`` gives the last bucket (the first layers)
            the highest priority, ``'update'`` the first.
        timeline: the optimizer's timeline (a ``NullTimeline`` if off).
        before_reuse (callable): ``before_reuse(bucket)`` is called before
            a bucket's buffer, still holding the previous iteration's mean,
            is overwritten (the update policy applies what is pending).
        before_first_post (callable): called before every post; the first
            call of an iteration posts the control message.
        operation (BucketOperation): default :class:`MeanAllreduce`.
        stats (CommunicationStats): where to count (default: a new one).
        control (bool): whether each iteration's round of collectives also
            holds a control message (item 0, posted by ``before_first_post``).
        items_per_bucket (int): items each bucket takes in a round (2 when
            sharded: reduce-scatter and update; see sharding.policy).
        extra_items (int): items of a round besides the buckets' and the
            control message.
        transient (bool): buffers are released once reduced (sharded);
            before a bucket gets a new one, ``before_new_buffer()`` is
            called (it may wait for earlier buckets).
        keep_packed (bool): keep a reference to each packed gradient (to
            notice a gradient changed after it was sent); not where
            gradients are released.
        before_new_buffer (callable): see ``transient``.
        after_post (callable): ``after_post(bucket)`` just after a bucket
            is posted (sharded: its update may be posted at once).

    The engine is given once it exists (:meth:`bind_engine`: the
    optimizer's ``setup()`` picks it from the model's device).
    """

    def __init__(self, engine, size, wait, timeline, before_reuse,
                 before_first_post, operation=None, stats=None,
                 control=True, items_per_bucket=1, extra_items=0,
                 transient=False, keep_packed=True, before_new_buffer=None,
                 after_post=None):
        self.engine = engine
        self.size = size
        self.wait = wait
        self.timeline = timeline
        self.before_reuse = before_reuse
        self.before_first_post = before_first_post
        self.operation = operation or MeanAllreduce()
        self.stats = stats if stats is not None else CommunicationStats()
        self.first_item = 1 if control else 0
        self.items_per_bucket = items_per_bucket
        self.extra_items = extra_items
        self.transient = transient
        self.keep_packed = keep_packed
        self.before_new_buffer = before_new_buffer or (lambda: None)
        self.after_post = after_post or (lambda bucket: None)
        self.buckets = []
        self.next_post = 0
        self._scratch = {}
        self._largest = 0

    def bind_engine(self, engine):
        """Gives the reducer its progress engine (made at ``setup()``, a
        new one if ``setup()`` follows ``close()``)."""
        self.engine = engine

    def set_buckets(self, buckets):
        self.buckets = buckets
        self.next_post = 0
        self._scratch = {}
        self._largest = max((e[2] for b in buckets for e in b.plan.entries),
                            default=0)

    @property
    def round_items(self):
        """Items of one iteration's round of collectives."""
        return (self.first_item + self.items_per_bucket * len(self.buckets)
                + self.extra_items)

    @property
    def all_posted(self):
        return self.next_post == len(self.buckets)

    def pack(self, info, grad):
        """Copies a final gradient (None: zeros) into its bucket's slot."""
        bucket = info.bucket
        if bucket.handle is not None:
            # The buffer still holds last iteration's mean for parameters
            # whose links have not run yet: apply those updates first.
            self.before_reuse(bucket)
        if self.engine is not None and self.engine.debug:
            ownership.check_main_write(
                bucket, 'packing the gradient of {}'.format(info.name))
        xp = chainer.backend.get_array_module(info.param.array)
        if self.transient and bucket.buffer is None:
            # Buffers that live only until reduced: bound how many exist.
            self.before_new_buffer()
            if (grad is not None and len(bucket.params) == 1
                    and grad.dtype == bucket.plan.dtype
                    and grad.flags.c_contiguous):
                # The gradient itself is the bucket: no copy, no buffer.
                bucket.buffer = grad.reshape(-1)
                info.packed = grad if self.keep_packed else None
                info.ready = True
                bucket.n_ready += 1
                return
        bucket.ensure_buffer(xp)
        slot = bucket.slot(info.index)
        if grad is None:
            slot.fill(0)
        else:
            # The cast to a narrow wire dtype is fused into the copy.
            _kernels.copy_cast(slot, grad.reshape(-1))
        info.packed = grad if self.keep_packed else None
        info.ready = True
        bucket.n_ready += 1

    def try_post(self, iteration):
        """Posts every complete bucket whose predecessors are all posted."""
        bs = self.buckets
        while (self.next_post < len(bs)
               and bs[self.next_post].n_ready == len(bs[self.next_post].params)):
            self._post(bs[self.next_post], iteration)
            self.next_post += 1

    def _post(self, bucket, iteration):
        self.before_first_post()
        # Round items: 0 is the control message, bucket b is b + 1 (without
        # control message: b).  With wait='forward' the last bucket posted
        # holds the first layers, which the next forward needs first.
        prio = bucket.index if self.wait == 'forward' else -bucket.index
        first = self.first_item
        bucket.handle = self.operation.start(
            self.engine, bucket,
            label='{} of iteration {}'.format(bucket.label(), iteration),
            slot=(iteration, bucket.index + first, self.round_items),
            priority=prio)
        bucket.posted = True
        bucket.finalized = False
        self.timeline.instant('post bucket {}'.format(bucket.index), 'post',
                              args={'label': bucket.label()})
        self.after_post(bucket)

    def wait_bucket(self, bucket):
        """Waits for a posted bucket; leaves the mean in its buffer."""
        if bucket.handle is None or bucket.finalized:
            return
        handle = bucket.handle
        t0 = time.perf_counter()
        # Raises CommunicationError (naming the rank and bucket) on
        # failure, CommunicationTimeout past the watchdog's timeout.
        handle.wait()
        t1 = time.perf_counter()
        self.stats.record(handle, t1 - t0)
        self._trace(bucket, handle, t0, t1)
        self.operation.finish(bucket, self.size)
        bucket.finalized = True

    def wait_handle(self, handle):
        """Waits for another handle of a bucket's round; counts it."""
        t0 = time.perf_counter()
        handle.wait()
        self.stats.record(handle, time.perf_counter() - t0)

    def _trace(self, bucket, handle, t0, t1):
        tl = self.timeline
        if not tl.enabled:
            return
        tl.span('wait bucket {}'.format(bucket.index), 'wait', t0, t1)
        # One span per piece the engine reduced (chunks of buckets
        # interleave under the priority engine).
        spans = handle.spans or [(handle.started_at, handle.finished_at)]
        for i, (a, b) in enumerate(spans):
            if a is None or b is None:
                continue
            tl.span('allreduce bucket {}{}'.format(
                bucket.index, '' if len(spans) == 1 else
                ' chunk {}/{}'.format(i + 1, len(spans))), 'comm',
                a, b, tid=tl.COMM,
                args={'label': handle.label, 'bytes': handle.nbytes})

    def mean_grad(self, info):
        """The parameter's mean gradient (a view of the bucket if possible).

        With a narrow wire dtype the gradient is cast into scratch memory
        that the next call reuses: use it (run the update rule) before
        asking for the next one.
        """
        g = info.bucket.slot(info.index)
        param = info.param
        if g.dtype == param.dtype:
            return g.reshape(param.shape)
        xp = chainer.backend.get_array_module(g)
        key = (xp, numpy.dtype(param.dtype))
        scratch = self._scratch.get(key)
        if scratch is None or scratch.size < g.size:
            scratch = self._scratch[key] = xp.empty(
                max(g.size, self._largest),
                dtype=param.dtype)
        out = scratch[:g.size]
        _kernels.copy_cast(out, g)
        return out.reshape(param.shape)

    def mean_grads_to_params(self, infos):
        """Waits for every bucket; puts the mean gradients in param.grad.

        ChainerMN's state after its reduction (see :meth:`grad_to_param`);
        the buckets' results are then consumed.
        """
        for bucket in self.buckets:
            self.wait_bucket(bucket)
        for info in infos:
            self.grad_to_param(info)
        for bucket in self.buckets:
            bucket.handle = None

    def alias_grad(self, info):
        """Makes ``param.grad`` a view of its (pending) mean in the bucket.

        Called when an iteration closes with the update deferred: the
        local gradient, already packed, is released, so a rank holds one
        gradient per parameter between iterations, as ChainerMN does, and
        ``param.grad`` is the mean once the update was applied
        (``synchronize()``).  Until then the view holds the reduction in
        progress.  A narrow wire's bucket has another dtype: the local
        gradient stays.
        """
        slot = info.bucket.slot(info.index)
        if slot.dtype == info.param.dtype:
            info.param.grad = slot.reshape(info.param.shape)

    def grad_to_param(self, info):
        """Makes ``param.grad`` the parameter's mean gradient.

        Where the wire dtype is the parameter's, ``param.grad`` becomes a
        view of the bucket: the local gradient, already packed, is
        released, so a rank holds one gradient per parameter between
        iterations, as ChainerMN does (not a local one and a reduced one).
        A narrow wire's mean is cast into ``param.grad``.
        """
        param = info.param
        slot = info.bucket.slot(info.index)
        if slot.dtype == param.dtype:
            param.grad = slot.reshape(param.shape)
            return
        cur = param.grad
        if (cur is not None and cur.shape == param.shape
                and cur.dtype == param.dtype and cur.flags.c_contiguous):
            _kernels.copy_cast(cur.reshape(-1), slot)
        else:
            param.grad = self.mean_grad(info).copy()

    def drain(self):
        """Waits for every in-flight bucket and forgets its result."""
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None

    def next_iteration(self):
        for bucket in self.buckets:
            bucket.n_ready = 0
            bucket.posted = False
        self.next_post = 0
