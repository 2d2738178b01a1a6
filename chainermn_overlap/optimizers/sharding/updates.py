"""Item B of a sharded bucket: the update rules on this rank's piece, then
the allgather of the updated parameters.

:class:`UpdateItems` posts and runs B for :class:`.policy.ShardedPolicy`
(the rest of the policy: the layout, closing an iteration, the waits and
the bound on gradients in flight, is there).  B runs on the communication
thread (``communication/engine.py`` says which fields it may write); the
pre-update hooks that need every shard (``GradientClipping``) run on the
main thread, once every shard is in (:meth:`UpdateItems._run_pre_hooks`).
"""
import numpy

import chainer

from chainermn_overlap.communication import ownership
from chainermn_overlap.communication import watchdog
from chainermn_overlap.errors import CollectiveMismatchError
from chainermn_overlap.optimizers import _clipping
from chainermn_overlap.optimizers import _layout
from chainermn_overlap.optimizers.sharding import collectives
from chainermn_overlap.optimizers.sharding import rules

__all__ = ['EMPTY', 'UpdateItems', 'Piece', 'xp_of']

EMPTY = numpy.empty(0, dtype=numpy.float32)


def xp_of(bucket):
    return chainer.backend.get_array_module(bucket.params[0].array)


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


def _with_config(fn, values):
    """``fn`` run under the main thread's ``chainer.config`` values of
    when B was posted (the rules and hooks run on the communication
    thread, whose ``chainer.config`` is its own)."""
    def run(comm, array):
        with ownership.using_config(values):
            return fn(comm, array)
    return run


class Piece(object):
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


class UpdateItems(object):
    """Posting and running B, mixed into the sharded policy.

    It reads the policy's layout (``buckets``, ``pieces``, ``infos``,
    ``rank``, ``wait``), its ``reducer`` (engine, round) and its round
    (``iteration``, ``control``, ``snap``, ``posted``), which
    :class:`.policy.ShardedPolicy` owns.
    """

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
            _with_config(fn, ownership.capture_config()), EMPTY,
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
            xp = xp_of(bucket)
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
