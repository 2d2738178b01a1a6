"""Dynamic loss scaling with ``shard=``: one overflow flag for every rank.

Chainer's dynamic loss scaling (``optimizer.loss_scaling()``) checks every
gradient for inf and nan before the step (``check_nan_in_grads``), skips
the update of every parameter if it finds one, and then updates the scale
(``update_loss_scale``: halved after an overflow, grown after good steps).
A sharded optimizer holds no whole gradient.  So, once every bucket is
reduce-scattered, each rank checks the reduced gradients of its own shard
(and those of the parameters updated whole, distconv's channel blocks), and
one small allreduce (MAX) of each rank's flag, bounded by the optimizer's
``timeout=``, gives every rank the same answer (:func:`overflowed`).  Then
every rank does what ``GradientMethod.update`` does, with the policy
(:meth:`.policy.ShardedPolicy.finish_iteration`):

* an overflow skips the step: the optimizer's ``t`` counts it, but no
  update rule runs, so no parameter, no state and no rule's ``t`` changes.
  The updates of the round still run, as no-ops (:class:`SkippedStep`): the
  engine's round completes, and with ``shard='parameters'`` each bucket's
  version still advances (the owners publish the unchanged piece), so the
  next forward fetches as after any update.  The optimizer hooks do not run
  on a skipped step (Chainer runs them; the hooks ``shard=`` accepts change
  only the gradients, which the step drops);
* in any case the scale is then updated by the optimizer's own
  ``update_loss_scale()``.

The update rules unscale the gradients themselves, dividing by the loss
scale of the backward that made them, as without sharding: with
``shard='optimizer'`` the ``param._loss_scale`` that backward set (each
proxy takes it from its parameter); with ``'gradients'`` and
``'parameters'`` no gradient reaches the parameter, so backward does not
set it, and the snapshot gives the proxies the optimizer's scale of the
step (:class:`.rules.Snapshot`: what ``update(lossfun)`` passes to backward,
and what a loop passes with ``loss.backward(loss_scale=
optimizer._loss_scale)``; where the optimizer has none, the parameter's,
which a loop's own constant ``backward(loss_scale=...)`` set).  The updates are posted at ``update()`` with
dynamic scaling (like ``GradientClipping``, the flag needs every shard
first).
"""
import warnings

import numpy

import chainer

__all__ = ['SKIPPED', 'SkippedStep', 'overflowed']


class SkippedStep(object):
    """What the updates of a step that overflowed run with: nothing.

    Stands for a :class:`.rules.Snapshot` in the policy's update items.
    """

    skipped = True
    global_pre = False
    pre_done = True
    pre = ()
    post = ()
    rules = {}

    def update(self, param, proxy):
        """No update: the step is skipped."""


#: The one instance the policy uses.
SKIPPED = SkippedStep()


def _finite(array):
    xp = chainer.backend.get_array_module(array)
    return bool(xp.isfinite(array).all())


def _non_finite(policy, immediate):
    """Names of the parameters whose reduced gradient, in this rank's
    shard, holds an inf or a nan (every bucket's reduction waited for)."""
    found = []
    for bucket in policy.buckets:
        policy.reducer.wait_bucket(bucket)
        grad = bucket.shard_grad
        if grad is None or _finite(grad):
            continue
        for piece in policy.pieces[bucket.index]:
            if not _finite(grad[piece.at:piece.at + piece.hi - piece.lo]):
                found.append(piece.info.param.name)
    for param in immediate:
        if param.grad is not None and not _finite(param.grad):
            found.append(param.name)
    return found


def overflowed(policy, immediate=()):
    """Whether the step overflows on any rank (dynamic loss scaling).

    Collective when the actual optimizer's loss scaling is dynamic: one
    allreduce of a flag, on every rank at the same point of ``update()``;
    otherwise False, without communicating.  Sets the optimizer's
    ``_loss_scaling_isnan`` (and ``_loss_scaling_isnan_ever``) as Chainer's
    ``check_nan_in_grads`` does, and warns, as it does, for each parameter
    whose gradient in this rank's shard is not finite.

    Args:
        policy (ShardedPolicy): its buckets' reductions are posted.
        immediate: the parameters updated whole (their ``grad`` reduced).
    """
    actual = policy.actual
    actual._loss_scaling_isnan = False
    if not actual._loss_scaling_is_dynamic:
        return False
    from mpi4py import MPI
    found = _non_finite(policy, immediate)
    for name in found:
        warnings.warn(
            'Non finite number found in param.grad of {} (iteration: {}, '
            'loss_scale: {}; in the shard of rank {}): the step is skipped '
            'on every rank'.format(name, actual.t, actual._loss_scale,
                                   policy.rank))
    flag = numpy.array([1 if found else 0], dtype=numpy.int32)
    policy.wait_requests(
        [policy.mpi_comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MAX)],
        'the allreduce of the overflow flag of dynamic loss scaling of '
        'iteration {}'.format(policy.iteration()),
        hint='With dynamic loss scaling and shard=, every rank takes part '
        'in this allreduce in update(): call update() on every rank, and '
        'call loss_scaling() on every rank alike.')
    if flag[0]:
        actual._loss_scaling_isnan = True
        actual._loss_scaling_isnan_ever = True
    return bool(flag[0])
