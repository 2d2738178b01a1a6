"""GradientClipping's norm when some parameters live on part of the ranks.

A distconv channel block (a parameter with ``param.reduction_group``,
:mod:`chainermn_overlap.distconv.params`) is held by the members of its
group only, and each group holds another block.  Chainer's
``GradientClipping``, run on one rank, sums the squares of the gradients
that rank holds: the replicated parameters (the same on every rank) and
its own blocks.  The norm, and so the rate, would differ between ranks
(the replicated parameters would drift apart) and match no rank of the
single-process model.  The single-process norm counts every element once::

    |g|^2 = sum over replicated parameters of g.g          (every rank alike)
          + sum over ranks of sum over its blocks of g.g / group size

the second term one small allreduce over the optimizer's communicator
(every member of a group holds the same reduced block, hence the division).

* :func:`blocks_sqnorm`: this rank's share of the second term;
* :func:`rate`: the factor ``GradientClipping`` applies (None: no clipping);
* :func:`across_groups`: while ``actual.update()`` runs, each
  ``GradientClipping`` of the optimizer takes that norm (the unsharded
  policy; the sharded one adds the term to its own norm allreduce).

A model without channel blocks is left to Chainer's hook as it is.
"""
import contextlib

import numpy

from chainer import optimizer_hooks

__all__ = ['across_groups', 'blocks', 'blocks_sqnorm', 'rate', 'sqnorm']


def blocks(params):
    """The parameters of ``params`` that are channel blocks (with a
    gradient)."""
    return [p for p in params
            if getattr(p, 'reduction_group', None) is not None
            and p.grad is not None]


def sqnorm(grads):
    """The sum of squares of ``grads``, as a Python float (float64)."""
    total = 0.0
    for g in grads:
        g = g.ravel()
        total += float(g.dot(g))
    return total


def blocks_sqnorm(params):
    """This rank's share of the blocks' squared norm: each block's
    ``g.g`` over the size of its group."""
    return sum(sqnorm([p.grad]) / p.reduction_group.size
               for p in blocks(params))


def rate(threshold, total, dtype):
    """``threshold / sqrt(total)`` in ``dtype``, or None where it is at
    least 1 (``GradientClipping`` leaves the gradients as they are)."""
    r = dtype.type(threshold) / numpy.sqrt(dtype.type(total))
    return None if r >= 1 else r


class _AcrossGroups(object):
    """Stands for one ``GradientClipping`` during an update."""

    def __init__(self, hook, mpi_comm, wait, label):
        self.hook = hook
        self.mpi_comm = mpi_comm
        self.wait = wait
        self.label = label
        self.timing = getattr(hook, 'timing', 'pre')
        self.call_for_each_param = False

    def __call__(self, opt):
        from mpi4py import MPI
        params = [p for p in opt.target.params(False) if p.grad is not None]
        share = numpy.array([blocks_sqnorm(params)], dtype=numpy.float64)
        self.wait([self.mpi_comm.Iallreduce(MPI.IN_PLACE, share,
                                            op=MPI.SUM)], self.label)
        replicated = [p.grad for p in params
                      if getattr(p, 'reduction_group', None) is None]
        if not params:
            return
        r = rate(self.hook.threshold, sqnorm(replicated) + float(share[0]),
                 params[0].grad.dtype)
        if r is None:
            return
        for p in params:
            p.grad *= r


@contextlib.contextmanager
def across_groups(actual, mpi_comm, wait, iteration=None):
    """While the block runs, ``actual``'s ``GradientClipping`` hooks take
    the whole model's norm (see the module docstring), if its target has
    channel blocks.

    Args:
        actual: the wrapped optimizer (set up).
        mpi_comm: the optimizer's communicator (every rank updates).
        wait (callable): ``wait(requests, label)``, a bounded wait.
        iteration (int): for messages.
    """
    target = getattr(actual, 'target', None)
    hookable = getattr(actual, '_hookable', None)
    if target is None or hookable is None or not blocks(target.params()):
        yield
        return
    label = ('the allreduce of the channel blocks\' gradient norm for '
             'GradientClipping{}'.format(
                 '' if iteration is None else
                 ' of iteration {}'.format(iteration)))
    swapped = []
    for hooks in (hookable._pre_update_hooks, hookable._post_update_hooks):
        for name, hook in list(hooks.items()):
            if isinstance(hook, optimizer_hooks.GradientClipping):
                hooks[name] = _AcrossGroups(hook, mpi_comm, wait, label)
                swapped.append((hooks, name, hook))
    try:
        yield
    finally:
        for hooks, name, hook in swapped:
            hooks[name] = hook
