"""The optimizer's modes: each builds its reducer, policy and tracker whole.

A mode is what ``create_overlapped_optimizer``'s options select: no
sharding (with the exact mean, a narrow wire dtype or a compression as the
bucket operation) or ``shard='optimizer' | 'gradients' | 'parameters'``.
:meth:`Mode.build` constructs the three parts with everything they need;
after that no other part assigns their fields (a unit test reads the
package's source and checks it).  The policy's class says the shape of the
round the reducer posts (:class:`._policy.Policy`), and the parts call one
another only through the optimizer's wiring (:class:`Wiring`), which owns
them::

    GradientTracker --on_ready/on_backward_start--> wiring --> reducer
    BucketReducer --before_reuse/after_post/before_new_buffer/
                    before_first_post--> wiring --> policy / layout
    Policy --wait_bucket/mean_grad/engine--> reducer
"""
from chainermn_overlap.optimizers import _reducer
from chainermn_overlap.optimizers._policy import UpdatePolicy
from chainermn_overlap.optimizers._reducer import BucketReducer
from chainermn_overlap.optimizers._tracker import GradientTracker
from chainermn_overlap.optimizers._tracker import Iteration

__all__ = ['Mode', 'Wiring']


class Wiring(object):
    """What the parts call on the optimizer's wiring (``_OverlapState``).

    Each method forwards to the part that owns the work; the wiring holds
    ``policy``, ``reducer``, ``tracker`` and ``layout`` once built.
    """

    def on_ready(self, info, grad):
        """A gradient is final (tracker): pack it, post what can go."""
        raise NotImplementedError

    def on_backward_start(self):
        """The first tap of the iteration fired (tracker)."""
        raise NotImplementedError

    def before_reuse(self, bucket):
        """A bucket's buffer is about to be overwritten (reducer)."""
        self.policy.flush_bucket(bucket)

    def before_first_post(self):
        """Before every post; the first of an iteration posts the control
        message (reducer)."""
        raise NotImplementedError

    def after_post(self, bucket):
        self.policy.after_post(bucket)

    def before_new_buffer(self):
        self.policy.before_new_buffer()


class Mode(object):
    """One way of reducing and updating, chosen by the options.

    Args:
        shard: the :class:`.sharding.options.ShardOptions`, or None.
        allreduce_grad_dtype: the wire dtype (None: the parameters').
        compression: a gradient compression (e.g. ``PowerSGD``), or None.
    """

    def __init__(self, shard=None, allreduce_grad_dtype=None,
                 compression=None):
        self.options = shard
        self.shard = shard.mode if shard is not None else None
        self.allreduce_grad_dtype = allreduce_grad_dtype
        self.compression = compression
        # shard='gradients' and 'parameters' keep no full gradient.
        self.release_grads = self.shard in ('gradients', 'parameters')

    def policy_class(self):
        from chainermn_overlap.optimizers.sharding import params
        from chainermn_overlap.optimizers.sharding import policy
        return {None: UpdatePolicy, 'optimizer': policy.ShardedPolicy,
                'gradients': policy.ShardedPolicy,
                'parameters': params.ParameterShardedPolicy}[self.shard]

    def operation(self, rank):
        """What is done to a bucket on the wire."""
        if self.shard is None:
            return _reducer.choose_operation(self.allreduce_grad_dtype,
                                             self.compression)
        from chainermn_overlap.optimizers.sharding import policy
        return policy.ReduceScatterMean(rank)

    def build(self, wiring, actual, wait, rank, size, mpi_comm, timeline,
              layout):
        """Returns ``(iteration, reducer, policy, tracker)``, each whole.

        ``wiring`` (a :class:`Wiring`) is what the parts call back;
        ``layout`` the :class:`._layout.LayoutManager` (its ``control`` is
        the round's control message).
        """
        cls = self.policy_class()
        iteration = Iteration()
        reducer = BucketReducer(
            None, size, wait, timeline, before_reuse=wiring.before_reuse,
            before_first_post=wiring.before_first_post,
            operation=self.operation(rank),
            items_per_bucket=cls.items_per_bucket,
            extra_items=cls.extra_items, transient=cls.transient,
            keep_packed=not self.release_grads,
            before_new_buffer=wiring.before_new_buffer,
            after_post=wiring.after_post)
        if self.shard is None:
            policy = cls(actual, wait, reducer, timeline, mpi_comm)
        else:
            opts = self.options
            extra = ({'prefetch_bytes': opts.prefetch}
                     if self.shard == 'parameters' else {})
            policy = cls(
                actual, wait, reducer, timeline, rank, opts.unit,
                self.shard != 'optimizer', mpi_comm, iteration=iteration,
                control=lambda: layout.control, update_at=opts.update,
                in_flight=opts.in_flight if self.release_grads else None,
                **extra)
        tracker = GradientTracker(
            rank, timeline, on_ready=wiring.on_ready,
            on_backward_start=wiring.on_backward_start, policy=policy,
            iteration=iteration, release_grads=self.release_grads)
        return iteration, reducer, policy, tracker
