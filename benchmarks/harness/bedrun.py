"""Optimizer jobs on the test bed: timing, summaries, link calibration.

Shared by the benchmarks that time training modes on two ranks joined by a
shaped link (``overlap_bench``, ``compression_bench``, ``sharding_bench``,
``ab``, ``peers_bench``).  A job is :mod:`benchmarks.harness.trainer`'s worker;
its result gives, per mode, the iteration times of every round.  From them:

* ``it_per_s_median``: 1 / the median of all timed iterations;
* ``scalability``: the median over rounds of that round's scalability
  (median iteration time alone, of the slower rank, / median time of the
  mode, both in the same round), with its 95 % bootstrap interval
  ``scalability_ci`` (:mod:`benchmarks.harness.stats`).
"""
import os
import statistics
import tempfile

from benchmarks.harness import launch, stats, trainer
from testbed import netbed

# The anchor's regime: blocking reaches 66.72 % (ResNet-50, 16 nodes,
# 10 Gb/s).  Calibration aims at it and accepts a link within
# TARGET_TOLERANCE (a subset of TARGET_BLOCKING): figures compared with the
# anchor are then taken at the anchor's comm/compute ratio.
TARGET_BLOCKING = (0.60, 0.72)
TARGET_CENTER = 0.6672
TARGET_TOLERANCE = 0.025


def flatten(rounds):
    return [x for r in rounds for x in r]


def summarize(mode_result):
    """it/s median (min, max) over all timed iterations, plus the mean
    including each round's tail."""
    rounds = mode_result['round_seconds']
    times = flatten(rounds)
    total = sum(times) + sum(mode_result.get('tail_seconds') or [0.0])
    return {'it_per_s_median': 1.0 / statistics.median(times),
            'it_per_s_min': 1.0 / max(times),
            'it_per_s_max': 1.0 / min(times),
            'it_per_s_mean_incl_tail': len(times) / total,
            'iterations': len(times), 'rounds': len(rounds),
            'round_seconds': rounds}


def slowest_rank_rounds(mode_summary):
    """Per round, the times of the rank whose median was the slowest.

    The reference of a synchronous job: every iteration waits for its
    slowest rank, so two ranks alone on cores of unequal speed (on the bed,
    a core that also takes interrupts ran 0.8-3.4 % slower) bound it by the
    slower one.  Taking rank 0's would count that core's slowness as a cost
    of communication.
    """
    by_rank = mode_summary.get('round_seconds_by_rank')
    if not by_rank:
        return mode_summary['round_seconds']
    out = []
    for rounds in zip(*by_rank):
        out.append(max((r for r in rounds if r), key=statistics.median,
                       default=[]))
    return out


def add_scalability(summary):
    """Per-round scalability of every mode against ``alone`` (its slowest
    rank: :func:`slowest_rank_rounds`), its median and interval;
    ``scalability_min``/``_max`` are the extreme rounds."""
    base = slowest_rank_rounds(summary['alone'])
    for s in summary.values():
        per_round = stats.per_round_ratio(s['round_seconds'], base)
        iv = stats.interval(per_round)
        s['scalability_rounds'] = per_round
        s['scalability'] = iv['median']
        s['scalability_ci'] = iv['ci']
        s['scalability_half_width'] = iv['half_width']
        s['scalability_min'] = min(per_round)
        s['scalability_max'] = max(per_round)
    return summary


def summaries(raw):
    """:func:`summarize` of each mode of a job's result, with its
    communication statistics and every rank's times."""
    out = {}
    for m, r in raw['modes'].items():
        out[m] = summarize(r)
        out[m]['communication_stats'] = r.get('communication_stats')
        out[m]['round_seconds_by_rank'] = r.get('round_seconds_by_rank')
    return out


def expected_seconds(cfg, t_compute, modes_factor=2.5):
    """A generous bound on a job's duration: every iteration at most
    ``modes_factor`` x compute, plus start-up and model construction."""
    per_mode = ((cfg['warmup'] + cfg['rounds'] * (cfg.get('settle', 1)
                                                  + cfg['iterations']))
                * t_compute * modes_factor + 15 + 3 * cfg['rounds'])
    return len(cfg['modes']) * per_mode + 60


def run_on(bed, cfg, t_compute, what):
    """One trainer job on an existing ``bed``; its raw result."""
    timeout = 2 * expected_seconds(cfg, t_compute)
    res = bed.run_mpi(launch.worker_command(trainer.MODULE, cfg),
                      timeout=timeout, env=launch.worker_env())
    if res['returncode'] != 0:
        # The whole output goes to a file: both ranks' errors, which the
        # message's tail may cut.
        fd, path = tempfile.mkstemp(prefix='bench-job-', suffix='.log')
        with os.fdopen(fd, 'w') as f:
            f.write('stdout:\n{}\nstderr:\n{}'.format(res['stdout'],
                                                       res['stderr']))
        raise RuntimeError(
            'benchmark job ({}) failed (exit {}; whole output in {}).\n'
            'stdout:\n{}\nstderr:\n{}'
            .format(what, res['returncode'], path, res['stdout'][-3000:],
                    res['stderr'][-3000:]))
    return launch.read_result(res['stdout'], trainer.RESULT_TAG, what), res


def run_bed(rate, cfg, t_compute, log):
    """All ``cfg['modes']`` on a 2-rank bed at ``rate``; summary + record."""
    load_before = os.getloadavg()
    with netbed.NetBed(2, rate) as bed:
        record = bed.describe()
        log('  link {:.1f} Mbit/s, modes {} ({} warm-up, then {} rounds of '
            '{} untimed + {} timed iterations each)'.format(
                rate / 1e6, ', '.join(cfg['modes']), cfg['warmup'],
                cfg['rounds'], cfg.get('settle', 1), cfg['iterations']))
        raw, res = run_on(bed, cfg, t_compute,
                          'link {:.1f} Mbit/s'.format(rate / 1e6))
    summary = summaries(raw)
    if 'alone' in summary:
        add_scalability(summary)
    return {'rate_bit_per_s': rate, 'bed': record, 'modes': summary,
            'seconds': res['seconds'],
            'loadavg_before': load_before, 'loadavg_after': os.getloadavg()}


def measure_alone(cfg, iterations=3, warmup=1):
    """Compute time per iteration of one pinned process (for a first guess)."""
    c = dict(cfg, modes=['alone'], iterations=iterations, warmup=warmup,
             rounds=1, settle=0, trace=None)
    stdout = launch.run_pinned(launch.worker_command(trainer.MODULE, c),
                               'timing one rank alone', timeout=900)
    raw = launch.read_result(stdout, trainer.RESULT_TAG, 'one rank alone')
    return statistics.median(flatten(raw['modes']['alone']['round_seconds']))


def gradient_bytes(model_name):
    from benchmarks.harness import workloads
    model = workloads.build_model(model_name)
    return sum(p.array.nbytes for p in model.params())


def rate_for(target_s, t_compute, t_comm_per_bit):
    """Link rate at which blocking would reach scalability ``target_s``.

    Blocking takes ``t_c + t_comm`` per iteration with ``t_comm`` inversely
    proportional to the rate: ``t_comm = t_comm_per_bit / rate``.
    """
    t_comm = t_compute * (1.0 / target_s - 1.0)
    return t_comm_per_bit / t_comm


def next_rate(rate, s, t_alone, t_block, lo, hi):
    """The next link rate to try when calibrating; pure, for testing.

    Blocking scalability grows with the rate.  ``lo``/``hi`` bracket the
    target (rates known to give too low / too high a figure, or None).  The
    α–β estimate (communication time scales as 1/rate) proposes a rate; it
    is kept inside the bracket and within 8x of the current rate, because a
    noisy measurement can make it absurd (blocking faster than alone).
    """
    t_comm = t_block - t_alone
    if t_comm > 0.02 * t_alone:
        proposal = rate_for(TARGET_CENTER, t_alone, t_comm * rate)
    else:
        proposal = rate / 4.0   # no visible communication: link too fast
    proposal = min(max(proposal, rate / 8.0), rate * 8.0)
    if lo is not None and hi is not None:
        if not lo < proposal < hi:
            proposal = (lo * hi) ** 0.5
    elif lo is not None and proposal <= lo:
        proposal = lo * 2.0
    elif hi is not None and proposal >= hi:
        proposal = hi / 2.0
    return max(proposal, 1e5)


def calibrate(cfg, t_compute, nbytes, log, attempts=5):
    """Finds a link rate where blocking lands at the anchor's 0.667.

    A rate is accepted when blocking lands within ``TARGET_TOLERANCE`` of
    ``TARGET_CENTER``; if no attempt does, the attempt closest to the centre
    among those inside 0.60-0.72 is used (else the last proposal).

    Starts from the model (2 ranks: each sends the gradient size once, at
    about 96 % of the tbf rate as measured for MPICH over TCP here), then
    corrects with the measured blocking time, bracketing the target so that
    noise cannot send the search off.

    Returns:
        tuple: the rate (bit/s) and the list of attempts.
    """
    rate = rate_for(TARGET_CENTER, t_compute, nbytes * 8 / 0.96)
    history = []
    lo = hi = None
    for attempt in range(attempts):
        c = dict(cfg, modes=['alone', 'blocking'], rounds=3,
                 iterations=2, warmup=min(cfg['warmup'], 2), trace=None)
        run = run_bed(rate, c, t_compute, log)
        s = run['modes']['blocking']['scalability']
        t_alone = 1.0 / run['modes']['alone']['it_per_s_median']
        t_block = 1.0 / run['modes']['blocking']['it_per_s_median']
        history.append({'rate_bit_per_s': rate, 'blocking_scalability': s,
                        'alone_s': t_alone, 'blocking_s': t_block})
        log('  calibration {}: {:.1f} Mbit/s -> blocking {:.3f}'.format(
            attempt + 1, rate / 1e6, s))
        if abs(s - TARGET_CENTER) <= TARGET_TOLERANCE:
            return rate, history
        if s < TARGET_CENTER:
            lo = rate if lo is None else max(lo, rate)
        else:
            hi = rate if hi is None else min(hi, rate)
        rate = next_rate(rate, s, t_alone, t_block, lo, hi)
    inside = [h for h in history
              if TARGET_BLOCKING[0] <= h['blocking_scalability']
              <= TARGET_BLOCKING[1]]
    if inside:
        best = min(inside, key=lambda h: abs(h['blocking_scalability']
                                             - TARGET_CENTER))
        rate = best['rate_bit_per_s']
    log('  calibration did not land within {:.3f} of {:.3f} in {} attempts '
        '(noise?); using {:.1f} Mbit/s'.format(
            TARGET_TOLERANCE, TARGET_CENTER, attempts, rate / 1e6))
    return rate, history
