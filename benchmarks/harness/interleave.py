"""Several trainer jobs on one bed, taking turns round by round.

:func:`run_interleaved` starts every job at once on a :class:`NetBed`
(each rank of each job in its namespace, pinned to its core), lets each
warm up in turn, then gives each its rounds in the alternating order of
:func:`benchmarks.harness.turns.alternating`, and finally stops them.  Only one
job computes at any time; the others wait blocked in a read.  The jobs speak
the protocol of :mod:`benchmarks.harness.turns`
(:mod:`benchmarks.harness.trainer`, and a peer framework's worker).
:func:`compare` turns two jobs' rounds into paired per-round comparisons
with intervals.
"""
import os
import tempfile
import time

from benchmarks.harness import bedrun, stats, trainer, turns


def _tail(path, n=3000):
    try:
        with open(path, errors='replace') as f:
            return f.read()[-n:]
    except OSError:
        return ''


def run_interleaved(bed, jobs, rounds, turn_timeout, log):
    """Runs ``jobs`` on ``bed`` in interleaved rounds.

    Args:
        bed: a :class:`testbed.netbed.NetBed` (inside its ``with``).
        jobs (dict): name -> ``{'command': [...], 'env': {...}}``; each job
            runs ``command`` on every rank of the bed.
        rounds (int): rounds of every job.
        turn_timeout (float): seconds one turn (a warm-up or a round of
            one job) may take.
        log: a function of one line.

    Returns:
        dict: name -> ``{'warmup': answers, 'rounds': [answers of each
        round]}`` (answers: one per rank, in rank order).
    """
    names = list(jobs)
    out = {n: {'warmup': None, 'rounds': []} for n in names}
    procs, files = {}, {}
    with turns.Conductor({n: bed.ranks for n in names}) as conductor:
        try:
            for n in names:
                so = tempfile.NamedTemporaryFile('w+', prefix='cmo_%s_' % n,
                                                 suffix='.out', delete=False)
                se = tempfile.NamedTemporaryFile('w+', prefix='cmo_%s_' % n,
                                                 suffix='.err', delete=False)
                files[n] = (so, se)
                env = dict(jobs[n].get('env') or {}, **conductor.env(n))
                procs[n] = bed.start_mpi(jobs[n]['command'], env=env,
                                         stdout=so, stderr=se)

            def alive(n):
                def check():
                    code = procs[n].poll()
                    if code is None:
                        return True
                    return 'exit {}; stderr ends with:\n{}'.format(
                        code, _tail(files[n][1].name))
                return check

            for n in names:
                t0 = time.time()
                out[n]['warmup'] = conductor.turn(
                    n, {'op': 'warmup'}, turn_timeout, alive(n))
                log('  {} warmed up in {:.0f} s'.format(n, time.time() - t0))
            for r, order in enumerate(turns.alternating(names, rounds)):
                t0 = time.time()
                for n in order:
                    out[n]['rounds'].append(conductor.turn(
                        n, {'op': 'round', 'round': r}, turn_timeout,
                        alive(n)))
                log('  round {}/{} ({}) in {:.0f} s'.format(
                    r + 1, rounds, ' '.join(order), time.time() - t0))
            for n in names:
                conductor.turn(n, {'op': 'stop'}, turn_timeout, alive(n))
            for n in names:
                procs[n].wait(timeout=turn_timeout)
                if procs[n].returncode != 0:
                    raise turns.TurnError(
                        'job {!r} exited with {} after its rounds; stderr '
                        'ends with:\n{}'.format(n, procs[n].returncode,
                                                _tail(files[n][1].name)))
        finally:
            for n, proc in procs.items():
                if proc.poll() is None:
                    bed.stop_mpi(proc)
            for so, se in files.values():
                for f in (so, se):
                    f.close()
                    os.unlink(f.name)
    return out


def job_summary(answers, modes):
    """Per-mode summaries (it/s, per-round scalability with its interval)
    of one job's rounds, as :func:`benchmarks.harness.bedrun.run_bed` gives."""
    raw = trainer.result_from_answers(answers, modes)
    summary = bedrun.summaries(raw)
    if 'alone' in summary:
        bedrun.add_scalability(summary)
    return summary


def compare(summary_a, summary_b, pairs):
    """Paired per-round comparisons of two jobs' modes.

    Args:
        summary_a, summary_b: :func:`job_summary` of each job (the same
            rounds: round ``i`` of one ran next to round ``i`` of the
            other).
        pairs (list): ``(mode_a, mode_b)`` to compare.

    Returns:
        dict: ``'<mode_a>/<mode_b>'`` -> ``scalability`` (B - A per round,
        and B / A: :func:`benchmarks.harness.stats.paired`) and ``speed`` (each
        round's median it/s of B over A's, with its interval).
    """
    out = {}
    for ma, mb in pairs:
        a, b = summary_a[ma], summary_b[mb]
        speed = stats.per_round_ratio(b['round_seconds'], a['round_seconds'])
        row = {'speed_ratio': stats.interval(speed)}
        if 'scalability_rounds' in a and 'scalability_rounds' in b:
            row['scalability'] = stats.paired(a['scalability_rounds'],
                                              b['scalability_rounds'])
        out['{}/{}'.format(ma, mb)] = row
    return out
