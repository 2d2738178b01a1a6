"""The overlapped multi-node optimizer (layer-wise non-blocking allreduce).

One iteration with ``wait='forward'``::

    forward:  link L pre-hook -> wait for L's buckets -> apply the update
              rule to L's parameters -> L.forward (parameters tapped)
    backward: tap(L.W) fires -> W's gradient is final? -> W joins its bucket
              -> bucket complete and all earlier buckets posted? -> post it
    update(): close the iteration: pack what is left, post it, return

With ``wait='update'`` ``update()`` waits for everything and runs the
actual optimizer, as DDP and Horovod do.  Either way every rank posts the
same buckets in the same order (index order, from rank 0's layout), however
its control flow went, so collectives always match.  This module is the
wiring of four parts, each in its own module::

    hooks (hooks/taps.py) --events--> GradientTracker (_tracker.py)
        gradient final --> BucketReducer (_reducer.py: pack, post in order,
          wait, mean via a BucketOperation) --> engine (communication/)
        next forward / update() --> Policy (_policy.py; sharded: sharding/)
    LayoutManager (_layout.py): bucket layout, model checks, broadcast,
        the per-iteration control message (skip / relayout)

The options choose a mode (_modes.py), which builds the tracker, reducer
and policy whole; this module only calls them.
"""
import contextlib
import time
from typing import Any, Optional, Union

import numpy

import chainer

from chainermn_overlap import _autosync
from chainermn_overlap import _host
from chainermn_overlap import _patches
from chainermn_overlap import config
from chainermn_overlap.communication import backends
from chainermn_overlap.communication import timeline as timeline_module
from chainermn_overlap.compression import PowerSGD
from chainermn_overlap.hooks import taps
from chainermn_overlap.optimizers import _modes
from chainermn_overlap.optimizers import _wrapper
from chainermn_overlap.optimizers._layout import LayoutManager
from chainermn_overlap.optimizers._layout import SKIP
from chainermn_overlap.optimizers._layout import UNCHANGED
from chainermn_overlap.optimizers.sharding import options as sharding_options
from chainermn_overlap.optimizers.sharding import writers
from chainermn_overlap.optimizers.sharding.options import ShardOptions


__all__ = ['DEFAULT_BUCKET_SIZE', 'SUPPORTS_REDUCTION_GROUPS',
           'create_overlapped_optimizer']

DEFAULT_BUCKET_SIZE = 16 * 1024 * 1024
_SHARD_DEFAULTS = sharding_options.DEFAULTS

class _OverlapState(_modes.Wiring):
    """The optimizer's parts and the wiring between them.

    The wrapper (:class:`_OverlappedOptimizer`) keeps this one object as its
    own state; :mod:`chainermn_overlap._autosync` calls ``synchronize``,
    ``mark_loaded`` and ``on_cleargrads``.  The mode (:mod:`._modes`) builds
    the reducer, the update policy and the tracker.
    """

    def __init__(self, actual, communicator, wait, bucket_size, zero_fill,
                 allreduce_grad_dtype, backend, backend_options,
                 timeline=None, compression=None, shard=None):
        self.actual = actual
        self.communicator = communicator
        self.mpi_comm = communicator.mpi_comm
        self.rank = communicator.rank
        self.size = communicator.size
        self.wait = wait
        self.zero_fill = zero_fill
        self.compression = compression
        self.backend_name = backend
        self.backend_options = backend_options
        # Watchdog options (timeout, stall_warning, debug); see
        # communication/engine.py.
        self.watch_options = {}
        self.engine = None
        self.target = None
        self.timeline = timeline or timeline_module.NullTimeline()
        # shard: the sharding_options.ShardOptions (None: no sharding).
        mode = _modes.Mode(shard, allreduce_grad_dtype, compression)
        self.shard = mode.shard
        self.layout = LayoutManager(
            self.mpi_comm, bucket_size, allreduce_grad_dtype, wait,
            shard_unit=shard.unit if shard is not None else None)
        self.clock, self.reducer, self.policy, self.tracker = mode.build(
            self, actual, wait, self.rank, self.size, self.mpi_comm,
            self.timeline, self.layout)

    # What tests, benchmarks and the wrapper read.
    stats = property(lambda self: self.reducer.stats)
    buckets = property(lambda self: self.reducer.buckets)
    pending_count = property(lambda self: self.policy.pending_count)

    @property
    def iteration(self):
        return self.tracker.iteration

    @iteration.setter
    def iteration(self, value):
        self.clock.value = value

    # ------------------------------------------------------------------
    # Set-up

    def attach(self, target):
        if self.engine is None:
            if self.backend_name is None:
                self.backend_name = _wrapper.default_engine(target,
                                                            self.mpi_comm)
            self.engine = _wrapper.make_engine(
                self.backend_name, self.mpi_comm, self.backend_options,
                self.watch_options)
            self.reducer.bind_engine(self.engine)
        self.target = target
        # Chainer's patches stay installed while an optimizer is set up.
        _patches.acquire('optimizer', self)
        self._hook_links()
        taps.install_param_use_hook(self.tracker)

    def detach(self, synchronize=True):
        if synchronize:
            self.synchronize()
        self.tracker.unhook_all()
        taps.uninstall_param_use_hook(self.tracker)
        if self.target is not None:
            _autosync.unregister(self.target)
        _patches.release('optimizer', self)
        self.target = None
        self.tracker.clear_layout()
        self.reducer.set_buckets([])

    def write_timeline(self):
        return self.timeline.write()

    def close(self):
        # Never waits without limit (each wait is bounded by the watchdog),
        # and after a timeout (the engine is stuck) waits for nothing; the
        # engine and the policy's resources are released even if a wait
        # raises.
        stuck = self.engine is not None and self.engine.stuck is not None
        try:
            try:
                if self.target is not None:
                    self.detach(synchronize=not stuck)
            finally:
                self.policy.close()
                writers.unregister(self.actual)   # if it was sharded
        finally:
            self.write_timeline()
            if self.engine is not None:
                self.engine.close()
                self.engine = None

    def _hook_links(self):
        self.tracker.hook_links(self.target)
        _autosync.register(self.target, self)

    # ------------------------------------------------------------------
    # Events

    def on_cleargrads(self, link):
        self.tracker.on_cleargrads(link)

    def before_zerograds(self, link):
        """Applies the link's pending updates before its gradients are
        zero-filled in place (they may be views of a pending mean)."""
        info_by_pid = self.tracker.info_by_pid
        todo = [info for info in map(info_by_pid.get, map(id, link.params()))
                if info is not None and info.pending]
        if todo:
            self.policy.apply(todo)

    def on_ready(self, info, grad):
        self.reducer.pack(info, grad)
        self.reducer.try_post(self.tracker.iteration)

    def on_backward_start(self):
        """First tap of the iteration: forward is complete on this rank."""
        self.before_first_post()
        for info in self.tracker.unsent():
            self.reducer.pack(info, info.param.grad)
        self.reducer.try_post(self.tracker.iteration)

    def before_first_post(self):
        self.layout.post_control(self.engine, self.target,
                                 self.reducer.buckets, self.tracker.iteration,
                                 n_items=self.reducer.round_items)

    # ------------------------------------------------------------------
    # Closing an iteration (update())

    def close_iteration(self):
        t0 = time.perf_counter()
        try:
            self._close_iteration()
        finally:
            self.timeline.span('update()', 'update', t0, time.perf_counter())

    def _close_iteration(self):
        tracker, reducer = self.tracker, self.reducer
        tracker.restore_all_swaps()
        if not tracker.has_layout:
            self._relayout()
            return
        self._hook_links()
        self.before_first_post()
        for info in tracker.infos:
            if not info.ready:
                reducer.pack(info, info.param.grad)
            elif tracker.changed_after_send(info):
                tracker.raise_changed(info)
        reducer.try_post(tracker.iteration)
        if not reducer.all_posted:  # a bug: the peers would wait forever
            raise RuntimeError('rank {}: update() posted {} of {} buckets'
                               .format(self.rank, reducer.next_post,
                                       len(reducer.buckets)))
        level, all_loaded = self.layout.wait_control()
        if level != UNCHANGED:
            self.policy.abandon_round()
            self._relayout(skip=level == SKIP and not all_loaded)
            return
        self._reduce_groups()
        self.policy.finish_iteration(self.target, self._grouped_params())
        self.reducer.operation.step_done()
        self._next_iteration()

    def _next_iteration(self):
        self.tracker.next_iteration()
        self.reducer.next_iteration()
        self.layout.next_iteration()

    def _relayout(self, skip=None):
        """Rebuilds the layout (blocking, on every rank at the same point).

        ``skip=None`` (no layout yet, or ``setup()`` was called again)
        lets the layout decide, with the rule the control message applies.
        """
        self.reducer.drain()
        self.policy.before_relayout()
        self._hook_links()
        buckets, infos, skip = self.layout.build(
            self.target, self.tracker.observed, skip)
        self.reducer.set_buckets(buckets)
        self.tracker.set_layout(infos)
        self.policy.set_layout(infos)
        self._next_iteration()
        if skip:
            # As ChainerMN does after a broadcast: no update rule runs, and
            # the gradients of this step (reduced in the old layout, if
            # any) are dropped.
            return
        # The set of parameters is unchanged (setup() again, a parameter
        # replaced by one of the same name) or every rank resumed from the
        # same snapshot: this step's gradients are valid.
        for info in infos:
            self.reducer.pack(info, info.param.grad)
        self.reducer.try_post(self.tracker.iteration)
        self._reduce_groups()
        self.policy.complete_in_update(self._grouped_params())
        self.reducer.operation.step_done()
        self._next_iteration()

    def _grouped_params(self):
        return [p for _, p, _ in self.layout.grouped]

    def _reduce_groups(self):
        """Reduces the parameters that live on part of the processes: each
        summed over its group (``param.reduction_group``: the processes
        holding the same block), scaled by its ``sum_scale``, in name order
        (the same sequence on every member of every group), bounded by the
        watchdog.  ``param.grad`` then holds the result."""
        from mpi4py import MPI
        for name, p, group in self.layout.grouped:
            if p.grad is None:
                p.grad = p.array * 0
            host, finish = _host.stage_to_host(p.grad)
            buf = numpy.ascontiguousarray(host)
            self.policy.wait_requests(
                [group.mpi_comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)],
                'the reduction of {} over its distconv group'.format(name))
            buf *= buf.dtype.type(group.sum_scale)
            if buf is not host:
                host[...] = buf
            if finish is not None:
                finish()

    def synchronize(self):
        """Finishes every posted reduction and applies pending updates."""
        self.tracker.restore_all_swaps()
        if not self.tracker.has_layout:
            return
        self.layout.sync_control()
        for bucket in self.reducer.buckets:
            if bucket.posted:
                # Posted in the open iteration: let it finish, keep result.
                self.policy.wait_posted(bucket)
            elif bucket.handle is not None:
                self.before_reuse(bucket)
        if self.shard == 'parameters' and not self.policy.save_shards:
            self.policy.materialize()   # (saving: shards.write_params)

    def mark_loaded(self):
        """Parameters were deserialized: broadcast them at the next update."""
        self.layout.mark_loaded()


# Parameters with a ``reduction_group`` (distconv's channel blocks) are
# reduced within their group (see _OverlapState._reduce_groups).
SUPPORTS_REDUCTION_GROUPS = True

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
        self._backward(lossfun, args, kwds)
        self._overlap.close_iteration()

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
        with self._overlap.tracker.no_sync():
            yield

    def serialize(self, serializer):
        st = self._overlap
        st.synchronize()
        st.policy.serialize(st.actual, serializer)
        if st.compression is not None:
            st.compression.serialize(serializer['compression'])
        if isinstance(serializer, chainer.serializer.Deserializer):
            st.mark_loaded()

    def close(self):
        """Releases the communication thread and the hooks."""
        self._overlap.close()

    def write_timeline(self):
        """Writes the timeline now (if enabled); returns its path."""
        return self._overlap.write_timeline()


def create_overlapped_optimizer(
        actual_optimizer: chainer.Optimizer, communicator: Any,
        wait: str = 'forward', bucket_size: Union[int, str, None] = None,
        zero_fill: bool = True, allreduce_grad_dtype: Any = None,
        backend: Optional[str] = None,
        chunk_size: Union[int, str, None] = None,
        timeline: Optional[str] = None,
        timeout: Union[float, str, None] = None,
        stall_warning: Union[float, str, None] = None,
        debug: Optional[bool] = None,
        compression: Optional[PowerSGD] = None,
        shard: Union[None, str, ShardOptions] = None,
        shard_unit: str = _SHARD_DEFAULTS['unit'],
        shard_update: str = _SHARD_DEFAULTS['update'],
        shard_in_flight: Union[int, str, None] = _SHARD_DEFAULTS['in_flight'],
        shard_prefetch: Union[int, str, None] = _SHARD_DEFAULTS['prefetch']
) -> '_OverlappedOptimizer':
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
            string such as ``'25MB'``.  Default 16 MiB (with a float16
            wire the ring runs a bucket whole: the ring's chunk, 4 MiB up to
            16 ranks, ``min(16 MiB, 256 KiB * N)`` above).  With
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
            on a duplicated communicator: ``'mpi_priority'`` (the default)
            slices buckets into chunks and runs first what is needed first
            (with ``wait='forward'``, the first layers' gradients), in an
            order all ranks agree on; ``'mpi_thread'`` is first-in-first-
            out; ``'nccl'`` reduces on a CUDA side stream ordered by events
            (opt-in until it has run on a GPU: docs/gpu.md).
        timeline (str): if given, a Chrome-trace/Perfetto JSON per rank is
            written there (``{rank}`` in the path is replaced by the rank,
            else ``.rank<r>`` is inserted): forward per link, waits,
            deferred updates, each bucket's reduction.  Written by
            ``close()``/``write_timeline()`` and at exit; the first 200000
            events are kept.
        chunk_size (int or str): largest piece reduced in one call by
            ``'mpi_priority'`` and ``'nccl'`` (a higher-priority bucket can
            start at every chunk boundary).  Default 4 MiB; ``'nccl'``'s
            ring: ``max(4 MiB, 256 KiB * N)``.  A given value is kept.
        timeout (float): watchdog: seconds any wait for a reduction may
            take before :class:`chainermn_overlap.CommunicationTimeout` is
            raised, naming the pending bucket, instead of hanging.  Default
            ``CHAINERMN_OVERLAP_TIMEOUT`` or 600; 0 disables.
        stall_warning (float): stall diagnosis: after this many seconds of
            waiting (and again every as many), a
            :class:`chainermn_overlap.StallWarning` says which ranks have
            not posted which bucket and where their main thread is.
            Default ``CHAINERMN_OVERLAP_STALL_WARNING`` or off.
        debug (bool): check before every reduction (every chunk with
            ``'mpi_priority'``) that all ranks post the same one (one extra
            tiny allreduce each).  The bucket layout and iteration are checked at every
            iteration regardless.  Default ``CHAINERMN_OVERLAP_DEBUG``.
        compression: a gradient compression such as
            ``chainermn_overlap.PowerSGD(rank=4, warmup_iterations=100)``
            (default: none, results exactly ChainerMN's).  Its state is
            part of the optimizer's snapshot.
        shard (str or ShardOptions): keep on each rank only its share of
            what every rank otherwise holds in full (ZeRO): ``'optimizer'`` (the update
            rules' state: each rank updates its piece of every bucket,
            after a reduce-scatter, and the updated parameters are
            allgathered), ``'gradients'`` (also no full gradient is kept:
            ``param.grad`` is released once packed), ``'parameters'``
            (also each rank keeps only its piece of the parameters between
            uses; they are gathered for each link's forward and backward)
            or ``None`` (default).  The same bytes travel as without it
            (``'parameters'``: plus the gathers).  Parameters reduced
            within a group (distconv's channel blocks) are not sharded.
            Not with ``compression`` or ``backend='nccl'``.  A
            :class:`~chainermn_overlap.ShardOptions` gives the mode and the
            options below in one object (``ShardOptions('parameters',
            prefetch='64MB')``); then give none of the ``shard_*``
            keywords.
        shard_unit (str): how buckets are cut between ranks:
            ``'auto'`` (default; even pieces, a parameter may be split,
            except one whose update rule or rule hooks are not known to be
            element-wise, such as ChainerCV's ``GradientScaling``: it is
            kept whole and updated by one rank; a ``FallbackWarning`` on
            rank 0 names them once), ``'element'`` (even pieces; refuses
            rules and hooks not known to be element-wise) or
            ``'parameter'`` (whole parameters per rank, any rule).
        shard_update (str): when ``'optimizer'`` and ``'gradients'``
            update a bucket's shard and gather it: ``'update'`` (default;
            at ``update()``, overlapping the next forward) or
            ``'backward'`` (as soon as the bucket is reduced, overlapping
            the rest of backward, with the hyperparameters and hooks the
            optimizer holds at the first bucket: changing them between
            backward and ``update()`` raises an error).  ``'backward'``
            was slower on a one-core-per-rank bed whose link is the
            bottleneck (see the performance page); it is for links that
            idle during backward.
        shard_in_flight (int or str): with ``'gradients'`` and
            ``'parameters'``: the bytes of full gradient buckets a rank may
            hold waiting for their reduce-scatter before backward waits for
            the oldest, and when ``update()`` returns (``'32MB'``...).
            Default ``'auto'``: ``update()`` returns once less than 1/8 of
            the parameters' bytes waits; backward never waits.  ``None``:
            never waits (stage 1's memory between steps, ``'forward'``).
        shard_prefetch (int or str): with ``'parameters'``: the bytes of
            whole parameters a rank holds besides the bucket in use,
            fetched ahead in the order of the last iteration's uses
            (forward, then backward) and kept while their next use is
            within it (the last of forward are the first of backward).
            ``None``: no bound.  Default ``'auto'``: one rank's share of
            the parameters (at least two buckets), so that stage 3 holds
            at most twice its share whole.

    Returns:
        The wrapped optimizer.  Attribute access goes to the actual
        optimizer.
    """
    _wrapper.check_arguments('create_overlapped_optimizer',
                             actual_optimizer, communicator)
    if wait not in ('forward', 'update'):
        raise ValueError("wait must be 'forward' or 'update', got {!r}"
                         .format(wait))
    allreduce_grad_dtype = _wrapper.check_wire_dtype(allreduce_grad_dtype)
    shard_opts = sharding_options.resolve(
        shard, shard_unit, shard_update, shard_in_flight, shard_prefetch,
        compression, backend)
    shard = shard_opts.mode
    bucket_size = _wrapper.resolve_bucket_size(
        bucket_size, shard, allreduce_grad_dtype, compression, chunk_size,
        DEFAULT_BUCKET_SIZE, communicator.size)
    _wrapper.check_compression(compression, allreduce_grad_dtype)
    if backend is not None:
        backends.get_backend(backend)
    backend_options = {}
    if chunk_size is not None:
        if backend not in (None, 'mpi_priority', 'nccl'):
            raise ValueError("chunk_size applies to backend='mpi_priority' "
                             "and 'nccl' only, not {!r}".format(backend))
        backend_options['chunk_bytes'] = config.parse_size(chunk_size)
    watch_options = _wrapper.check_watch_options(timeout, stall_warning,
                                                 debug)
    tl = (timeline_module.Timeline(str(timeline), communicator.rank)
          if timeline is not None else None)
    if shard is not None and backend is None:
        backend = 'mpi_priority'
    state = _OverlapState(actual_optimizer, communicator, wait, bucket_size,
                          zero_fill, allreduce_grad_dtype, backend,
                          backend_options, tl, compression,
                          shard_opts if shard is not None else None)
    state.watch_options = state.layout.watch_options = watch_options
    state.layout.options = _wrapper.collective_options(
        wait=wait, allreduce_grad_dtype=allreduce_grad_dtype,
        compression=compression, backend=backend, chunks=backend_options,
        shard=shard, shard_update=shard_opts.update if shard else None)
    if tl is not None:
        tl.write_at_exit()
    return _OverlappedOptimizer(state)
