"""``scheduler.choose``: the pure decision behind the cross-rank order.

The priority engine runs, at every chunk boundary, the item that ``choose``
returns; every rank calls it with the same shared knowledge (the unfinished
items, the items a MIN-allreduce showed posted on every rank, and the
priorities of the round), so every rank must get the same answer, whatever
order its inputs were built in.  If it ever picked an item not known to be
posted everywhere, a rank could enter a collective that another rank has not
posted yet (a hang or a mismatched reduction).
"""
import itertools
import random

import pytest
from hypothesis import given, strategies as st

from chainermn_overlap.communication.scheduler import choose


def _expected(unfinished, known_posted, priorities):
    """Reference: highest priority among the ready items, lowest index on
    ties; None when none is ready."""
    ready = sorted(set(unfinished) & set(known_posted))
    if not ready:
        return None
    best = max(priorities[i] for i in ready)
    return min(i for i in ready if priorities[i] == best)


# ---------------------------------------------------------------------------
# Examples


def test_empty_round_needs_an_exchange():
    assert choose([], set(), {}) is None
    assert choose([], {0, 1}, {0: 1, 1: 2}) is None


def test_nothing_known_posted_everywhere_needs_an_exchange():
    # Items posted locally but not known to be posted on every rank must
    # not be chosen: the caller exchanges (or waits for the lowest index).
    assert choose([0, 1, 2], set(), {0: 0, 1: 5, 2: 9}) is None


def test_only_finished_items_known_posted():
    assert choose([2, 3], {0, 1}, {2: 0, 3: 0}) is None


def test_highest_priority_runs_first():
    assert choose([0, 1, 2], {0, 1, 2}, {0: 0, 1: 3, 2: 1}) == 1


def test_an_unposted_item_is_skipped_whatever_its_priority():
    # Item 2 has the top priority but is not known posted everywhere.
    assert choose([0, 1, 2], {0, 1}, {0: 0, 1: 1, 2: 100}) == 1


def test_finished_items_are_never_chosen_again():
    # 1 is known posted but finished (not in ``unfinished``).
    assert choose([0, 2], {0, 1, 2}, {0: 0, 1: 99, 2: 1}) == 2


def test_ties_go_to_the_lowest_index():
    assert choose([3, 1, 2], {1, 2, 3}, {1: 4, 2: 4, 3: 4}) == 1
    assert choose([5, 4], {4, 5}, {4: 0, 5: 0}) == 4


def test_negative_and_float_priorities():
    assert choose([0, 1, 2], {0, 1, 2}, {0: -1.5, 1: -0.5, 2: -2}) == 1


def test_priorities_of_items_not_ready_are_not_needed():
    # Only ready items are looked up.
    assert choose([0, 1], {1}, {1: 0}) == 1


def test_draining_a_round_follows_priority_then_index():
    # With everything posted everywhere (the state after update()), the
    # engine runs items in descending priority, index order among equals.
    prio = {0: 0, 1: 2, 2: 1, 3: 2, 4: 0, 5: 3}
    unfinished = list(prio)
    order = []
    while unfinished:
        nxt = choose(unfinished, set(prio), prio)
        order.append(nxt)
        unfinished.remove(nxt)
    assert order == [5, 1, 3, 2, 0, 4]


def test_newly_known_items_can_overtake():
    # A higher-priority item that becomes known posted everywhere (after an
    # exchange) is chosen before the lower-priority ones already known.
    prio = {0: 0, 1: 0, 2: 5}
    assert choose([0, 1, 2], {0, 1}, prio) == 0
    assert choose([1, 2], {0, 1, 2}, prio) == 2


# ---------------------------------------------------------------------------
# Properties

def _round(n):
    """``(n, done, known_posted, priorities)`` of a round of ``n`` items."""
    indices = st.sets(st.integers(0, n - 1)) if n else st.just(set())
    return st.tuples(st.just(n), indices, indices,
                     st.lists(st.integers(-3, 3), min_size=n, max_size=n))


rounds = st.integers(0, 12).flatmap(_round)


def _inputs(n, done, known, prios):
    unfinished = [i for i in range(n) if i not in done]
    return unfinished, set(known), dict(enumerate(prios))


@given(rounds)
def test_matches_the_reference(r):
    unfinished, known, prio = _inputs(*r)
    assert choose(unfinished, known, prio) == _expected(unfinished, known,
                                                        prio)


@given(rounds)
def test_result_is_ready_or_none(r):
    unfinished, known, prio = _inputs(*r)
    got = choose(unfinished, known, prio)
    ready = set(unfinished) & known
    if ready:
        assert got in ready
        assert all(prio[i] <= prio[got] for i in ready)
    else:
        assert got is None


@given(rounds, st.randoms(use_true_random=False))
def test_same_choice_however_the_inputs_were_built(r, rnd):
    # Ranks build the same knowledge in different orders (posting times
    # differ): unfinished listed in another order, the set and the dict
    # filled in another order.  The choice must not depend on it.
    unfinished, known, prio = _inputs(*r)
    want = choose(unfinished, known, prio)
    for _ in range(4):
        u = list(unfinished)
        rnd.shuffle(u)
        k_items = list(known)
        rnd.shuffle(k_items)
        p_items = list(prio.items())
        rnd.shuffle(p_items)
        assert choose(u, set(k_items), dict(p_items)) == want
        # Any iterables of the same members will do for the caller.
        assert choose(tuple(u), frozenset(k_items), dict(p_items)) == want


@given(rounds, st.integers(-10, 10))
def test_priorities_of_unready_items_do_not_matter(r, new_priority):
    unfinished, known, prio = _inputs(*r)
    want = choose(unfinished, known, prio)
    for i in unfinished:
        if i not in known:
            changed = dict(prio)
            changed[i] = new_priority
            assert choose(unfinished, known, changed) == want


@given(rounds)
def test_learning_more_never_loses_the_choice_unless_outranked(r):
    # Growing shared knowledge (what an exchange does) either keeps the
    # choice or replaces it by a newly known item that outranks it.
    unfinished, known, prio = _inputs(*r)
    before = choose(unfinished, known, prio)
    after = choose(unfinished, known | set(unfinished), prio)
    if before is not None:
        assert after is not None
        if after != before:
            assert after not in known
            assert (prio[after], -after) > (prio[before], -before)


def test_every_rank_simulated_drains_in_the_same_order():
    # Three "ranks" post the same six items in index order, at different
    # speeds.  Between chunks each learns what all have posted (the MIN
    # exchange: the intersection of the posted sets) and calls choose; the
    # lowest unfinished index runs when nothing is known (the caller's
    # rule).  The sequences of items run must be identical.
    prio = {0: 0, 1: 0, 2: 1, 3: 1, 4: 3, 5: 3}
    n = len(prio)
    rng = random.Random(5)
    posted_count = [0, 0, 0]
    done = set()
    known = set()
    sequences = [[], [], []]
    while len(done) < n:
        for r in range(3):
            posted_count[r] = min(n, posted_count[r] + rng.randint(0, 2))
        shared = set(range(min(posted_count)))
        known |= shared
        unfinished = [i for i in range(n) if i not in done]
        picks = []
        for r in range(3):
            # Each rank's view: the same shared knowledge, built in its own
            # order.
            view = list(unfinished)
            rng.shuffle(view)
            nxt = choose(view, set(sorted(known, reverse=r % 2 == 1)), prio)
            picks.append(unfinished[0] if nxt is None else nxt)
        assert len(set(picks)) == 1, picks
        for r in range(3):
            sequences[r].append(picks[r])
        known.add(picks[0])
        done.add(picks[0])
    assert sequences[0] == sequences[1] == sequences[2]
    assert sorted(sequences[0]) == list(range(n))


@pytest.mark.parametrize('n', [1, 2, 5])
def test_all_permutations_of_priorities_pick_the_top(n):
    for perm in itertools.permutations(range(n)):
        prio = dict(enumerate(perm))
        assert choose(list(range(n)), set(range(n)), prio) == perm.index(
            n - 1)
