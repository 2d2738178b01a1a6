"""Double buffering on CPU/MPI: update with last iteration's gradients.

ChainerMN's ``create_multi_node_optimizer(..., double_buffering=True)`` needs
NCCL and a GPU.  This is the same method for any MPI communicator, built
from the overlapped optimizer's parts (the bucket layout and its checks,
the bucket reducer, the progress engines, statistics and errors)::

    iteration k:  forward/backward -> local gradients g_k
                  pack g_k into buffer set k % 2, post its buckets (they
                  reduce in the background during the update and iteration
                  k+1's forward/backward)
                  wait for the buckets of g_{k-1} (posted one iteration ago)
                  update the parameters with mean(g_{k-1})

Communication therefore overlaps a whole iteration, at the price of
*stale* gradients: the update of iteration k uses gradients computed at the
parameters of iteration k-1.  The semantics are exactly ChainerMN's
``_DoubleBufferingOptimizer``'s:

* the first update (and every update at which the parameters changed)
  broadcasts rank 0's parameters and skips the step;
* the next update only posts its gradients;
* from then on the update of iteration k applies the mean of iteration
  k-1's gradients.

That is, it equals ChainerMN's blocking optimizer fed, from the third
iteration on, with each rank's gradients of the previous iteration
(``tests/mpi/test_double_buffering.py`` checks exactly this).  The gradients
of the last iteration are never applied (as in ChainerMN).  As in ChainerMN,
each rank decides from its own model whether the parameters changed: every
rank must change its model at the same iteration.
"""
from typing import Any, Optional, Union

import chainer

from chainermn_overlap import config
from chainermn_overlap.communication import backends
from chainermn_overlap.communication import timeline as timeline_module
from chainermn_overlap.compression import PowerSGD
from chainermn_overlap.optimizers import _wrapper
from chainermn_overlap.optimizers._layout import LayoutManager
from chainermn_overlap.optimizers._reducer import BucketReducer
from chainermn_overlap.optimizers._reducer import CommunicationStats
from chainermn_overlap.optimizers._reducer import choose_operation
from chainermn_overlap.optimizers._tracker import ParamState

__all__ = ['create_double_buffering_optimizer']

DEFAULT_BUCKET_SIZE = 64 * 1024 * 1024


class _DoubleBufferingState(object):
    """All state of the wrapper, kept apart from the actual optimizer's."""

    def __init__(self, actual, communicator, backend_name, bucket_size,
                 allreduce_grad_dtype, watch_options, timeline,
                 compression=None):
        self.actual = actual
        self.communicator = communicator
        self.mpi_comm = communicator.mpi_comm
        self.size = communicator.size
        self.backend_name = backend_name
        self.watch_options = watch_options
        self.timeline = timeline
        self.engine = None
        self.target = None
        self.layout = LayoutManager(self.mpi_comm, bucket_size,
                                    allreduce_grad_dtype, 'update',
                                    allow_groups=False)
        self.layout.watch_options = watch_options
        self.stats = CommunicationStats()
        self.compression = compression
        # Two buffer sets: one receives this iteration's gradients while
        # the other's reduction (posted one iteration ago) completes.  Each
        # has its own bucket operation (the float16 ring, or a compression
        # sharing one PowerSGD state: the engine runs the sets' reductions
        # one after the other, in posting order).
        self.reducers = [
            BucketReducer(None, self.size, 'update', timeline,
                          before_reuse=self._forget,
                          before_first_post=lambda: None,
                          operation=choose_operation(allreduce_grad_dtype,
                                                     compression),
                          stats=self.stats, control=False)
            for _ in range(2)]
        self.infos = [[], []]
        self.k = 0              # buffer set that takes this iteration's
        self.in_flight = None   # buffer set posted one iteration ago
        self.iteration = 0      # update() calls so far

    @staticmethod
    def _forget(bucket):
        bucket.handle.wait()
        bucket.handle = None

    def start(self, target):
        self.drain()
        if self.engine is None:
            self.engine = _wrapper.make_engine(
                self.backend_name, self.mpi_comm, {}, self.watch_options)
            for r in self.reducers:
                r.bind_engine(self.engine)
        self.target = target
        self.layout.structure = None

    def rebuild(self):
        """New or changed parameters: rank 0's values, a new layout."""
        self.drain()
        buckets, infos, _ = self.layout.build(self.target, [], skip=True)
        for k, r in enumerate(self.reducers):
            if k:
                # The second set: same plan, buffers of its own.
                buckets = [type(b)(b.index, b.plan, b.params)
                           for b in buckets]
                infos = [ParamState(i.name, i.param, buckets[i.bucket.index],
                                    i.index) for i in infos]
            r.set_buckets(buckets)
            self.infos[k] = infos
        self.k = 0

    def post(self, iteration):
        """Packs and posts this iteration's gradients; returns the set
        posted one iteration ago (None if there is none)."""
        k, reducer = self.k, self.reducers[self.k]
        for info in self.infos[k]:
            # A gradient missing on this rank counts as zeros: every rank
            # must contribute the same arrays for the collectives to match.
            reducer.pack(info, info.param.grad)
        reducer.try_post(iteration)
        reducer.operation.step_done()   # a compression counts its warm-up
        previous, self.in_flight = self.in_flight, k
        self.k = 1 - k
        return previous

    def apply_mean(self, k):
        """Waits for set ``k`` and puts its mean gradients in param.grad."""
        reducer = self.reducers[k]
        reducer.mean_grads_to_params(self.infos[k])
        reducer.next_iteration()

    def wait(self):
        """Waits for the set in flight; its gradients stay pending."""
        if self.in_flight is not None:
            for bucket in self.reducers[self.in_flight].buckets:
                if bucket.handle is not None:
                    bucket.handle.wait()

    def drain(self):
        """Finishes the reduction in flight and forgets its result."""
        if self.in_flight is not None:
            k, self.in_flight = self.in_flight, None
            reducer = self.reducers[k]
            for bucket in reducer.buckets:
                reducer.wait_bucket(bucket)   # counted in the statistics
                bucket.handle = None
            reducer.next_iteration()


class _DoubleBufferingOptimizer(_wrapper.OptimizerWrapper):
    """Wraps an optimizer; see :func:`create_double_buffering_optimizer`."""

    @property
    def _db(self):
        return self._state

    def setup(self, link):
        """Sets up the actual optimizer on ``link``; returns self."""
        st = self._db
        st.actual.setup(link)
        st.start(link)
        return self

    def update(self, lossfun=None, *args, **kwds):
        """Computes gradients (if ``lossfun``) and updates with stale ones.

        Like ChainerMN's double-buffering optimizer: the parameters are
        updated with the mean of the previous iteration's gradients, and
        this iteration's start reducing in the background.
        """
        self._backward(lossfun, args, kwds)
        st = self._db
        iteration, st.iteration = st.iteration, st.iteration + 1
        if st.layout.structure_changed(st.target):
            # New or changed parameters: start over from rank 0's values,
            # and skip this step, as ChainerMN does.
            st.rebuild()
            return
        previous = st.post(iteration)
        if previous is None:
            return  # nothing reduced yet to update with
        st.apply_mean(previous)
        st.actual.update(None, *args, **kwds)

    def synchronize(self):
        """Waits for the reduction in flight (its gradients stay pending:
        the next ``update()`` applies them, as double buffering does)."""
        self._db.wait()

    wait = synchronize

    def serialize(self, serializer):
        st = self._db
        st.wait()
        st.actual.serialize(serializer)
        if st.compression is not None:
            st.compression.serialize(serializer['compression'])
        if isinstance(serializer, chainer.serializer.Deserializer):
            # The gradients in flight belong to the run before the load;
            # the next update posts afresh and applies nothing (as after
            # the first broadcast).
            st.drain()

    def close(self):
        """Finishes the reduction in flight and stops the engine."""
        st = self._db
        st.drain()
        st.timeline.write()
        if st.engine is not None:
            st.engine.close()
            st.engine = None


def create_double_buffering_optimizer(
        actual_optimizer: chainer.Optimizer, communicator: Any,
        zero_fill: bool = True, backend: str = 'mpi_thread',
        bucket_size: Union[int, str, None] = None,
        allreduce_grad_dtype: Any = None,
        timeout: Union[float, str, None] = None,
        stall_warning: Union[float, str, None] = None,
        debug: Optional[bool] = None, timeline: Optional[str] = None,
        compression: Optional[PowerSGD] = None,
        shard: Optional[str] = None
) -> '_DoubleBufferingOptimizer':
    """Creates a multi-node optimizer that updates with stale gradients.

    CPU/MPI double buffering with the semantics of ChainerMN's
    ``create_multi_node_optimizer(..., double_buffering=True)`` (which needs
    NCCL): each ``update()`` posts this iteration's gradients to a
    background reduction and updates the parameters with the mean of the
    previous iteration's, so communication overlaps a whole iteration.  The
    update lags one iteration behind the gradients, which can affect
    accuracy; for exact (non-stale) overlap use
    :func:`chainermn_overlap.create_overlapped_optimizer`.

    Args:
        actual_optimizer (chainer.Optimizer): the optimizer to wrap.
        communicator: a ChainerMN communicator with an ``mpi_comm``.
        zero_fill (bool): accepted for compatibility.  A gradient missing on
            a rank always counts as zeros: every rank must reduce the same
            arrays.
        backend (str): communication engine, a name registered in
            :mod:`chainermn_overlap.communication.backends`
            (``'mpi_thread'``, ``'mpi_priority'``, ``'emulated'``, or a name
            from :func:`chainermn_overlap.communication.emulated.configure`).
        bucket_size (int or str): fusion bucket size (default 64 MiB).
        allreduce_grad_dtype, timeout, stall_warning, debug, timeline,
            compression: as for
            :func:`chainermn_overlap.create_overlapped_optimizer` (a float16
            wire reduces with float32 arithmetic; PowerSGD's error feedback
            and warm-up count the gradients posted, one update ahead of the
            parameters they are applied to).
        shard: not supported: accepted so that passing it says why.

    Returns:
        The wrapped optimizer; attribute access goes to the actual optimizer.
        ``synchronize()`` (alias ``wait()``), ``close()`` and
        ``communication_stats()`` are its own.
    """
    if shard is not None:
        raise ValueError(
            'double buffering cannot shard (shard={!r}): its update uses the '
            'previous iteration\'s whole mean gradient while the next one is '
            'reduced. Use create_overlapped_optimizer(..., shard={!r}), '
            'which overlaps as far without stale gradients.'.format(shard,
                                                                  shard))
    _wrapper.check_arguments('create_double_buffering_optimizer',
                             actual_optimizer, communicator)
    backends.get_backend(backend)  # an unknown name fails here, not later
    _wrapper.check_compression(compression, allreduce_grad_dtype)
    bucket_size = (DEFAULT_BUCKET_SIZE if bucket_size is None
                   else config.parse_size(bucket_size))
    tl = (timeline_module.Timeline(str(timeline), communicator.rank)
          if timeline is not None else timeline_module.NullTimeline())
    return _DoubleBufferingOptimizer(_DoubleBufferingState(
        actual_optimizer, communicator, backend, bucket_size,
        _wrapper.check_wire_dtype(allreduce_grad_dtype),
        _wrapper.check_watch_options(timeout, stall_warning, debug), tl,
        compression))
