"""Figures with their uncertainty: per-round ratios and bootstrap intervals.

Every benchmark that compares runs on the test bed measures in *rounds*:
each round times every variant once, back to back, in an order that
alternates between rounds.  A figure is then computed per round (a ratio of
two medians of that round's iteration times), so that what drifts over the
run (the machine's speed, other load, the link) cancels within a round, and
the figure reported is the median over rounds with a 95 % bootstrap
interval (percentile method, resampling rounds; a fixed seed, so the same
data give the same interval).  A difference is claimed only when its
interval excludes zero (a ratio: excludes one).
"""
import statistics

import numpy as np

LEVEL = 0.95
RESAMPLES = 10000


def bootstrap_interval(values, stat=np.median, level=LEVEL,
                       resamples=RESAMPLES, seed=0):
    """Percentile bootstrap interval of ``stat`` over ``values``.

    Returns:
        tuple: ``(low, high)``; both equal the value itself for one value,
        and None, None for none.
    """
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return None, None
    if v.size == 1:
        return float(v[0]), float(v[0])
    rng = np.random.RandomState(seed)
    idx = rng.randint(0, v.size, size=(resamples, v.size))
    stats = stat(v[idx], axis=1)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(stats, [tail, 1.0 - tail])
    return float(lo), float(hi)


def interval(values, level=LEVEL):
    """The median of ``values`` with its bootstrap interval, as a dict.

    Keys: ``median``, ``ci`` ([low, high]), ``half_width`` (the larger
    distance from the median to an end), ``n``, ``level``, ``values``.
    """
    values = [float(x) for x in values if x is not None]
    if not values:
        return {'median': None, 'ci': [None, None], 'half_width': None,
                'n': 0, 'level': level, 'values': []}
    med = statistics.median(values)
    lo, hi = bootstrap_interval(values, level=level)
    return {'median': med, 'ci': [lo, hi],
            'half_width': max(med - lo, hi - med), 'n': len(values),
            'level': level, 'values': values}


def per_round_ratio(numerator_rounds, denominator_rounds):
    """Per round: median of the denominator's times / the numerator's.

    With iteration *times*, ``per_round_ratio(mode, alone)`` is each
    round's scalability (it/s of the mode over it/s alone).  Rounds where
    either side has no time are skipped.
    """
    out = []
    for num, den in zip(numerator_rounds, denominator_rounds):
        if num and den:
            out.append(statistics.median(den) / statistics.median(num))
    return out


def excludes(ci, value):
    """Whether the interval ``ci`` ([low, high]) lies wholly off ``value``:
    the rule for claiming a difference (0) or a ratio (1)."""
    lo, hi = ci
    return lo is not None and (lo > value or hi < value)


def paired(a, b):
    """Paired per-round comparison of two per-round figures.

    Args:
        a, b (list of float): the same figure of A and B, one per round
            (round ``i`` of A was measured next to round ``i`` of B).

    Returns:
        dict: ``difference`` (B - A per round) and ``ratio`` (B / A), each
        an :func:`interval`, and ``claimed``: whether the difference's
        interval excludes zero.
    """
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    diff = interval([y - x for x, y in pairs])
    ratio = interval([y / x for x, y in pairs if x])
    return {'difference': diff, 'ratio': ratio,
            'claimed': excludes(diff['ci'], 0.0)}


def fmt(iv, digits=3):
    """``0.863 [0.851, 0.872]`` for an :func:`interval`."""
    if iv['median'] is None:
        return 'n/a'
    f = '{:.%df}' % digits
    return (f + ' [' + f + ', ' + f + ']').format(iv['median'], *iv['ci'])
