"""Which whole buckets ``shard='parameters'`` holds: a window on the uses
of the previous iteration.

A rank makes a bucket whole for each use: a link's forward, the backward
of a function that retained one of its parameters.  Within an iteration
the uses come in an order (forward, then backward about in reverse) that
the next iteration repeats, unless the network's control flow changes.
:class:`UsePlan` records that order, and at each use says which buckets
to hold: the one in use and those of the next uses, in order, as long as
their bytes fit the budget.  This one rule does what FSDP does with three:

* it fetches ahead (forward and backward prefetch), as far as the budget
  reaches: the last layers of a ResNet hold most of the parameters and
  compute least, so their fetches must start during the first layers';
* it bounds the parameters in flight or held (FSDP's limit on
  all-gathers) by bytes, not by a count of units of unequal size;
* a bucket whose next use is within the window stays: the last buckets of
  forward are the first of backward, and are not fetched again.

Where this iteration departs from the last (a rank-dependent branch, a new
layer), the plan finds the use further on, or holds just the bucket in use
until the uses agree again: a fetch is then made when it is needed, as
without a plan; the results never depend on the plan, only the waits.
"""

__all__ = ['UsePlan', 'budget']


def budget(setting, sizes, ranks):
    """The plan's budget in bytes for ``shard_prefetch`` = ``setting``.

    Args:
        setting: bytes, ``'auto'`` or None (no bound).
        sizes (dict): bucket -> bytes of its whole parameters.
        ranks (int): how many ranks share the parameters.

    ``'auto'`` is one rank's share of the parameters, and at least two of
    the largest bucket: stage 3 then holds at most twice its share whole
    (its own pieces, and that much fetched), memory that still falls as
    ranks are added, while the fetches of the last layers, which hold most
    of the parameters and compute least, start during the first layers'.
    """
    if setting is None:
        return float('inf')
    if setting == 'auto':
        largest = max(sizes.values(), default=0)
        return max(sum(sizes.values()) // max(ranks, 1), 2 * largest)
    return setting


class UsePlan(object):
    """The uses of the last iteration and where this one stands in them.

    Args:
        sizes (dict): bucket index -> bytes of its whole parameters.
        budget (int): bytes of whole buckets held besides the one in use;
            at least the next bucket is always fetched ahead.
    """

    def __init__(self, sizes, budget):
        self.sizes = dict(sizes)
        self.budget = budget
        self.previous = []   # the last iteration's uses, in order
        self.uses = []       # this iteration's so far
        self.at = -1         # where the last use stands in ``previous``

    def next_iteration(self):
        """Starts a new iteration: the uses just recorded become the plan."""
        if self.uses:
            self.previous = self.uses
        self.uses = []
        self.at = -1

    def use(self, index):
        """Records a use of bucket ``index``; returns the buckets to hold,
        in the order of their next uses (``index`` first)."""
        if self.uses and self.uses[-1] == index:
            return self._window(index)
        self.uses.append(index)
        prev = self.previous
        try:
            self.at = prev.index(index, self.at + 1)
        except ValueError:
            # Off the plan: ahead of it by a skipped use, or a use the
            # last iteration did not make.
            return [index]
        return self._window(index)

    def _window(self, index):
        # The bucket in use counts as soon as a later use in the window
        # names it again: it then stays held after this use, beside the
        # others (without that, a window could shrink behind a fetch
        # already started and hold more than the budget).
        out = [index]
        held = 0
        counted = set()
        prev = self.previous
        for nxt in prev[self.at + 1:] if self.at >= 0 else ():
            if nxt in counted:
                continue
            size = self.sizes.get(nxt, 0)
            if len(out) > 1 and held + size > self.budget:
                break
            counted.add(nxt)
            held += size
            if nxt != index:
                out.append(nxt)
        return out
