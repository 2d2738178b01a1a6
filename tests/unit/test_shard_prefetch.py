"""The window of whole buckets that shard='parameters' holds
(chainermn_overlap.optimizers.sharding.prefetch), without MPI."""
import pytest

from chainermn_overlap.optimizers.sharding import prefetch

# A ResNet-like shape: the first layers small, the last large; forward
# uses 0..5, backward about in reverse (5 and 4 share a backward).
SIZES = {0: 1, 1: 2, 2: 4, 3: 8, 4: 16, 5: 32}
ITERATION = [0, 1, 2, 3, 4, 5, 4, 3, 2, 1, 0]


def _run(plan, uses):
    """Feeds one iteration's uses; returns each use's window."""
    plan.next_iteration()
    return [plan.use(u) for u in uses]


def _held_after(plan_windows, sizes):
    """The most bytes a rank holds besides the bucket in use when it keeps
    exactly each window (what the policy does)."""
    most = 0
    held = set()
    for window in plan_windows:
        held = set(window)   # dropped: whatever left the window
        most = max(most, sum(sizes[b] for b in held - {window[0]}))
    return most


def test_the_first_iteration_has_no_plan():
    plan = prefetch.UsePlan(SIZES, budget=100)
    assert _run(plan, ITERATION) == [[u] for u in ITERATION]


def test_no_bound_holds_every_next_use():
    plan = prefetch.UsePlan(SIZES, budget=float('inf'))
    _run(plan, ITERATION)
    windows = _run(plan, ITERATION)
    # At the first use, every other bucket is ahead, in the order of use.
    assert windows[0] == [0, 1, 2, 3, 4, 5]
    # At the end of forward, backward's buckets are all still wanted: none
    # is fetched again (each bucket's window holds it until its last use).
    assert windows[5] == [5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize('budget', [0, 3, 8, 24, 40, 63])
def test_a_budget_bounds_what_is_held(budget):
    plan = prefetch.UsePlan(SIZES, budget=budget)
    _run(plan, ITERATION)
    windows = _run(plan, ITERATION)
    largest_next = max(SIZES.values())
    # At most the budget, or one bucket ahead when that alone exceeds it.
    assert _held_after(windows, SIZES) <= max(budget, largest_next)
    for w in windows[:-1]:
        assert len(w) >= 2   # always at least the next use ahead


def test_the_budget_keeps_the_last_of_forward_for_backward():
    # 5 (32) is in use; the next uses are 4, 3, 2, 1, 0 (31 bytes): all fit
    # in 31, so the backward fetches none of them again.
    plan = prefetch.UsePlan(SIZES, budget=31)
    _run(plan, ITERATION)
    windows = _run(plan, ITERATION)
    assert windows[5] == [5, 4, 3, 2, 1, 0]
    # With 8 only the next ones that fit: 4 (16) alone, as the one ahead.
    plan = prefetch.UsePlan(SIZES, budget=8)
    _run(plan, ITERATION)
    assert _run(plan, ITERATION)[5] == [5, 4]


def test_a_use_off_the_plan_holds_only_itself_then_resumes():
    plan = prefetch.UsePlan(SIZES, budget=100)
    _run(plan, ITERATION)
    plan.next_iteration()
    assert plan.use(0)[:2] == [0, 1]
    assert plan.use(9) == [9]          # a bucket the last iteration lacked
    assert plan.use(2)[:2] == [2, 3]   # found further on: back on the plan
    for u in ITERATION[3:]:
        plan.use(u)
    # The next iteration skips 9 (a branch not taken): the plan finds 2
    # further on.
    plan.next_iteration()
    assert plan.use(0)[:3] == [0, 9, 2]
    assert plan.use(2)[:2] == [2, 3]


def test_repeated_uses_of_one_bucket_are_one_use():
    plan = prefetch.UsePlan(SIZES, budget=100)
    _run(plan, [0, 0, 1, 1, 1, 2])
    plan.next_iteration()
    assert plan.previous == [0, 1, 2]


def test_budget_settings():
    sizes = {0: 10, 1: 30, 2: 60}
    assert prefetch.budget(None, sizes, 2) == float('inf')
    assert prefetch.budget(5, sizes, 2) == 5
    # 'auto': one rank's share, at least two of the largest bucket.
    assert prefetch.budget('auto', sizes, 2) == 120
    assert prefetch.budget('auto', {i: 10 for i in range(100)}, 4) == 250
