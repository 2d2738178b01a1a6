"""Fusion buckets: which gradients travel together, and their flat buffers.

The plan (:func:`plan_buckets`) is a pure function of an ordered list of
parameter entries, so every rank that is given the same list computes the
same buckets.  The optimizer builds the list on rank 0 and broadcasts it,
which makes the bucket layout identical on all ranks by construction.
"""
import collections

import numpy

import chainer


BucketPlan = collections.namedtuple(
    'BucketPlan', ('dtype', 'entries', 'nelems'))
BucketPlan.__doc__ = """One planned bucket.

Attributes:
    dtype (numpy.dtype): dtype of the flat buffer (the wire dtype).
    entries (tuple): ``(name, offset, size)`` for each member, in order.
    nelems (int): total number of elements.
"""


def wire_dtype(param_dtype, allreduce_grad_dtype=None):
    """dtype in which a gradient of ``param_dtype`` is reduced.

    float16 gradients are reduced in float32 unless asked otherwise, as
    ChainerMN's MPI communicators do, so that summing many ranks does not
    overflow or lose precision.
    """
    if allreduce_grad_dtype is not None:
        return numpy.dtype(allreduce_grad_dtype)
    param_dtype = numpy.dtype(param_dtype)
    if param_dtype == numpy.float16:
        return numpy.dtype(numpy.float32)
    return param_dtype


def plan_buckets(entries, bucket_size, allreduce_grad_dtype=None, tail=()):
    """Groups parameters into fusion buckets.

    Args:
        entries: iterable of ``(name, size, dtype)`` in the order in which
            gradients are expected to become ready (posting order).
        bucket_size (int): target size of a bucket in bytes.  A bucket is
            closed as soon as adding the next member would exceed it; a
            member larger than ``bucket_size`` gets a bucket of its own.
        allreduce_grad_dtype: dtype on the wire, or ``None`` for the
            parameter's own dtype (float32 for float16 parameters).
        tail: byte limits of the *last* buckets, last first (e.g. ``(1 MiB,
            2 MiB)``); then ``bucket_size``.  With the layer-wise wait the
            last bucket posted holds the first layers, which the next
            forward needs first: keeping it small shortens that wait.

    Returns:
        list of :class:`BucketPlan`, in posting order.
    """
    if bucket_size <= 0:
        raise ValueError('bucket_size must be positive, got {}'
                         .format(bucket_size))
    entries = [(n, int(size), wire_dtype(dt, allreduce_grad_dtype))
               for n, size, dt in entries]
    if tail:
        # Greedy from the end, so the limits apply to the last buckets.
        groups, cur, cur_dtype, cur_n = [], [], None, 0
        for name, size, wdt in reversed(entries):
            limit = (tail[len(groups)] if len(groups) < len(tail)
                     else bucket_size)
            if cur and (wdt != cur_dtype or (cur_n + size) * wdt.itemsize
                        > min(limit, bucket_size)):
                groups.append((cur_dtype, cur[::-1]))
                cur, cur_n = [], 0
            cur_dtype = wdt
            cur.append((name, size))
            cur_n += size
        if cur:
            groups.append((cur_dtype, cur[::-1]))
        groups.reverse()
    else:
        groups, cur, cur_dtype, cur_n = [], [], None, 0
        for name, size, wdt in entries:
            if cur and (wdt != cur_dtype
                        or (cur_n + size) * wdt.itemsize > bucket_size):
                groups.append((cur_dtype, cur))
                cur, cur_n = [], 0
            cur_dtype = wdt
            cur.append((name, size))
            cur_n += size
        if cur:
            groups.append((cur_dtype, cur))
    plans = []
    for dtype, members in groups:
        out, off = [], 0
        for name, size in members:
            out.append((name, off, size))
            off += size
        plans.append(BucketPlan(dtype, tuple(out), off))
    return plans


class Bucket(object):
    """Runtime state of one bucket: its buffer and its in-flight handle.

    A sharded bucket (each rank owns a piece of it) is
    :class:`chainermn_overlap.optimizers.sharding.layout.ShardedBucket`.

    Args:
        index (int): position in the posting order.
        plan (BucketPlan): members and dtype.
        params (list): the :class:`chainer.Parameter` of each member, in plan
            order.
    """

    def __init__(self, index, plan, params):
        self.index = index
        self.plan = plan
        self.params = params
        self.names = tuple(e[0] for e in plan.entries)
        self.buffer = None
        self.handle = None
        self.n_ready = 0
        self.posted = False
        # True once the reduced sum has been turned into a mean.
        self.finalized = False

    # How the bucket is cut between ranks (none: every rank holds it whole);
    # part of the layout's fingerprint.
    shard_counts = ()

    def in_flight(self):
        """Whether a collective of the bucket is posted and not done (the
        communication thread then owns its memory)."""
        return self.handle is not None and not self.handle.done()

    @property
    def nbytes(self):
        return self.plan.nelems * self.plan.dtype.itemsize

    def ensure_buffer(self, xp):
        """(Re)allocates the flat buffer on the parameters' device."""
        if (self.buffer is None
                or chainer.backend.get_array_module(self.buffer) is not xp):
            self.buffer = xp.empty(self.plan.nelems, dtype=self.plan.dtype)
        return self.buffer

    def slot(self, i):
        """Flat view of member ``i`` in the buffer."""
        _, off, size = self.plan.entries[i]
        return self.buffer[off:off + size]

    def label(self, max_layers=6):
        """``bucket 3 (4 params of layers /l2, /l3; 0.01 MB)``, for messages.

        Names the layers (links) so that an error about a pending reduction
        says which part of the model it carries.
        """
        layers = []
        for name in self.names:
            layer = name.rsplit('/', 1)[0] or '/'
            if layer not in layers:
                layers.append(layer)
        shown = ', '.join(layers[:max_layers])
        if len(layers) > max_layers:
            shown += ', ... ({} more)'.format(len(layers) - max_layers)
        return 'bucket {} ({} params of layer{} {}; {:.2f} MB)'.format(
            self.index, len(self.names), 's' if len(layers) > 1 else '',
            shown, self.nbytes / 1e6)
