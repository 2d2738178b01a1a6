"""Performance tables and figures from ``benchmarks/results/*.json``.

Each table is a function of the results directory registered under a name
with :func:`table`; :func:`figures` gives the numbers the prose and the
README quote, by name.  The pages hold them written in, as plain Markdown
between HTML comments (``<!-- bench-table overlap -->``; the forms are in
:mod:`benchregions`), so that they read the same on GitHub and in the
site.  After a benchmark rerun rewrote its JSON::

    python docs/_ext/benchtables.py --write     # make docs-figures

rewrites every region of ``docs/*.md``; ``--check`` only reports.  A region
that differs from what the results give, or a result file that lost a key
a table reads, is a warning of ``make docs`` (an error under ``-W``: the
``source-read`` hook of :func:`setup`) and a failure of
``tests/unit/test_docs.py``, which also checks the README's figures.

The tables live in :mod:`bench_optimizer`, :mod:`bench_distconv` and
:mod:`bench_peers_sharding`, the machinery in :mod:`benchcore`.  The
functions need only the standard library, so tests and the command line
use them without Sphinx.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchcore import (  # noqa: E402,F401
    RESULTS, TABLES, Table, f2, f3, interval_text, load, machine_text, mbit,
    pct, ratio_x, scal, signed_pct, table)
from bench_distconv import _spatial_runs  # noqa: E402
from bench_optimizer import (  # noqa: E402,F401
    MODEL_NAMES, SHARD_MEMORY_EXTRA, SHARD_MODES, SHARD_STAGE3_EXTRA,
    overlap_table)
# Registers its table once benchmarks/results/peers_sharding.json exists.
import bench_peers_sharding  # noqa: E402
# Registers the scaling study's tables once benchmarks/results/scale.json
# exists.
import bench_scale  # noqa: E402


# ----------------------------------------------------------------------------
# Figures quoted in prose and in the README
# ----------------------------------------------------------------------------

def figures(results=RESULTS):
    """Named figures, formatted as the pages quote them.

    Scalability figures carry their 95 % interval where the result has one
    (``0.863 [0.851, 0.872]``).

    Returns:
        dict: name -> string.
    """
    ov = load('overlap.json', results)
    cal = ov['calibrated']['modes']
    comp = load('compression.json', results)['models']
    c50, c18 = comp['resnet50'], comp['resnet18']
    crow = c50['links']['calibrated']['rows']
    srow = c50['links']['slow']['rows']
    lrow = c18['links']['calibrated']['rows']
    lslow = c18['links']['slow']['rows']
    peers = load('peers.json', results)
    acc = load('accuracy.json', results)
    sp = _spatial_runs(load('spatial.json', results), 'strong')
    late = load('channel_tiling.json', results)['late']['summary']
    cost = load('comm_cost.json', results)['summary']
    shard = load('sharding.json', results)
    soak_all = load('hosts_soak.json', results)
    soak = soak_all['summary']

    def soak_end(kinds):
        ends = [f['to_attempt_end_s'] for f in soak_all['faults']
                if f['fault'] in kinds]
        return '%.1f-%.1f s' % (min(ends), max(ends))
    losses = acc['resnet']['losses']
    # What moving the gradients costs the rank's core (comm_cost.json), per
    # iteration of the overlap benchmark's model, and the bound it sets.
    t_c = 1.0 / cal['alone']['it_per_s_median']
    move_s = ov['gradient_bytes'] / 1e6 / cost['reducing'][
        'allreduce_MB_per_s_median']
    cost_s = cost['reducing']['slowdown'] * move_s

    def peer_diff(theirs, ours):
        return interval_text(peers['comparison']['%s/%s' % (theirs, ours)][
            'scalability']['difference'], signed=True)
    return {
        'overlap_alone_s': '%.2f' % t_c,
        'comm_cost_per_iteration_s': '%.2f' % cost_s,
        'comm_cost_bound': f2(t_c / (t_c + cost_s)),
        'gradient_mb': '%.0f' % (ov['gradient_bytes'] / 1e6),
        'accuracy_resnet_float32': '%.3f -> %.3f' % (losses['float32'][0],
                                                     losses['float32'][-1]),
        'accuracy_resnet_powersgd4': '%.3f -> %.3f' % (
            losses['powersgd4'][0], losses['powersgd4'][-1]),
        'accuracy_resnet_iterations': str(len(losses['float32'])),
        'overlap_rate': mbit(ov['calibrated']['rate_bit_per_s']),
        'overlap_blocking': scal(cal['blocking']),
        'overlap_forward': scal(cal['overlap_forward']),
        'overlap_update': scal(cal['overlap_update']),
        'overlap_double_buffering': scal(cal['double_buffering']),
        'overlap_forward_hidden': pct(
            cal['overlap_forward']['communication_stats']['hidden_fraction']),
        'emulation_forward': scal(ov['emulation']['modes']['overlap_forward']),
        'emulation_blocking': scal(ov['emulation']['modes']['blocking']),
        'compression_rate': mbit(c50['links']['calibrated']['rate_bit_per_s']),
        'compression_slow_rate': mbit(c50['links']['slow']['rate_bit_per_s']),
        'compression_rounds': str(c50['config']['rounds']),
        'compression_blocking': scal(crow['blocking']),
        'compression_float32': scal(crow['overlap_forward']),
        'compression_float16': scal(crow['overlap_forward_float16']),
        'compression_powersgd4': scal(crow['overlap_forward_powersgd4']),
        'compression_slow_float32': scal(srow['overlap_forward']),
        'compression_slow_powersgd4': scal(srow['overlap_forward_powersgd4']),
        'compression_cost_ms_per_mb': '%.1f' % (
            c50['cost']['seconds_per_byte'] * 1e9),
        'light_rate': mbit(c18['links']['calibrated']['rate_bit_per_s']),
        'light_powersgd4': scal(lrow['overlap_forward_powersgd4']),
        'light_slow_powersgd4': scal(lslow['overlap_forward_powersgd4']),
        'light_float32': scal(lrow['overlap_forward']),
        'light_powersgd4_bound': f3(
            lrow['overlap_forward_powersgd4']['bound']),
        'peers_rate': mbit(peers['rate_bit_per_s']),
        'peers_batch': str(peers['peer_batch']),
        'peers_our_batch': str(peers['config']['batch']),
        'peers_model': model_text(peers['config']),
        'peers_float32': peer_diff('ddp_fp32', 'overlap_forward'),
        'peers_float16': peer_diff('ddp_fp16', 'overlap_forward_float16'),
        'peers_powersgd1': peer_diff('ddp_powersgd1',
                                     'overlap_forward_powersgd1'),
        'peers_powersgd4': peer_diff('ddp_powersgd4',
                                     'overlap_forward_powersgd4'),
        'soak_faults': str(soak['checks']['faults']),
        **sharding_figures(shard),
        **snapshot_figures(load('snapshot.json', results)),
        **bench_peers_sharding.figures(results),
        **bench_scale.figures(results),
        'soak_cut_end': soak_end(('cut',)),
        'soak_kill_end': soak_end(('kill', 'lose')),
        'soak_median_s': '%.1f' % soak['recovery_less_watchdog_median_s'],
        'soak_max_s': '%.1f' % soak['recovery_less_watchdog_max_s'],
        'accuracy_max_gap_points': '%.2f' % acc['max_gap_points'],
        'spatial_speedup_p2': f2(sp[2]['speedup_median_of_ratios']) + (
            ' [%.2f, %.2f]' % tuple(sp[2]['ratio_ci'])
            if sp[2].get('ratio_ci') else ''),
        'spatial_peak_p2': ratio_x(sp[2]['memory']['peak_ratio_vs_serial']),
        'late_speedup': ratio_x(late['speedup']['filter_channel']),
        'late_bound': ratio_x(late['twin_bound']),
        'late_weights': ratio_x(late['param_bytes_ratio']['filter_channel']),
        'comm_cost_slowdown': signed_pct(cost['reducing']['slowdown']),
        'comm_cost_rate': '%.1f' % cost['reducing'][
            'allreduce_MB_per_s_median'],
    }


def model_text(config):
    """``ResNet-18 at 128x128, batch 8 per rank`` from a result's config."""
    return '%s at %dx%d, batch %d per rank' % (
        MODEL_NAMES.get(config['model'], config['model']), config['insize'],
        config['insize'], config['batch'])


def sharding_figures(d):
    """Bytes per parameter each rank holds after an update and at the peak
    of a step, at the largest rank count of the result; each mode's speed
    against the unsharded optimizer."""
    mem = d['memory']
    top = max(mem, key=int)
    rows = mem[top]['rows']
    out = {'sharding_ranks': str(top)}
    for key, _ in SHARD_MODES + SHARD_MEMORY_EXTRA:
        row = rows.get(key + ':update')
        if row is None:
            continue     # results from before the row existed
        out['sharding_bytes_' + key] = '%.1f' % row[
            'bytes_per_param_after_update']
        out['sharding_peak_' + key] = '%.1f' % row['peak_bytes_per_param']
        row = rows.get(key + ':forward')
        if row is not None:
            out['sharding_peak_forward_' + key] = '%.1f' % row[
                'peak_bytes_per_param']
    # Each mode minus the unsharded optimizer, paired by round, with the
    # interval, per model (``sharding_resnet50_gradients``), and each
    # model's link and rounds, as the pages quote them.
    for model, res in d.get('speed', {}).items():
        if 'rows' not in res:
            continue     # a run that failed: its table row says so
        out['sharding_%s_mbit' % model] = '%.0f' % (
            res['rate_bit_per_s'] / 1e6)
        speed = res['rows']
        base = speed.get('overlap_forward', {})
        if base.get('scalability_rounds'):
            out['sharding_%s_rounds' % model] = str(
                len(base['scalability_rounds']))
            out['sharding_%s_none_scalability' % model] = '%.3f' % base[
                'scalability']
        for key, _ in SHARD_MODES[2:] + SHARD_STAGE3_EXTRA:
            r = speed.get('overlap_forward_shard_' + key, {})
            if r.get('minus_unsharded') is not None:
                out['sharding_%s_%s' % (model, key)] = \
                    '%+.3f [%+.3f, %+.3f]' % (r['minus_unsharded'],
                                              *r['minus_unsharded_ci'])
                out['sharding_%s_%s_scalability' % (model, key)] = \
                    '%.3f' % r['scalability']
    return out


def snapshot_figures(d):
    """Disk bytes and save-time memory of sharded snapshots
    (snapshot.json)."""
    rows = d['rows']
    out = {'snapshot_ranks': str(d['config']['ranks']),
           'snapshot_params_m': '%.1f' % (
               rows['optimizer']['parameters'] / 1e6)}
    for key in ('optimizer', 'optimizer_whole_files', 'parameters',
                'parameters_whole_files'):
        r = rows[key]
        out['snapshot_disk_mb_' + key] = '%.0f' % (r['disk_bytes'] / 1e6)
        out['snapshot_state_copies_' + key] = '%.2f' % r[
            'state_copies_on_disk']
        out['snapshot_peak_mb_' + key] = '%.1f' % (
            max(r['save_peak_bytes_per_rank']) / 1e6)
        out['snapshot_copies_' + key] = '%.2f' % r[
            'disk_copies_of_params_and_state']
    return out


# ----------------------------------------------------------------------------
# Sphinx, and the command line
# ----------------------------------------------------------------------------

def setup(app):
    """Warns of every region of a page that the results do not give."""
    from sphinx.util import logging
    import benchregions

    logger = logging.getLogger(__name__)
    gen = {}

    def read(app, docname, source):
        if 'gen' not in gen:
            gen['gen'] = benchregions.Generator()
        for line, message in benchregions.check(source[0], gen=gen['gen']):
            logger.warning(message, location=(docname, line))

    app.connect('source-read', read)
    return {'parallel_read_safe': True, 'parallel_write_safe': True}


def main(argv=None):
    """``--write`` rewrites the regions of the pages from the results,
    ``--check`` reports what differs; the exit status is 1 on any problem
    left."""
    import argparse
    import benchregions

    parser = argparse.ArgumentParser(
        prog='docs/_ext/benchtables.py', description=main.__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument('--write', action='store_true')
    mode.add_argument('--check', action='store_true')
    parser.add_argument('--results', default=RESULTS,
                        help='the results folder (default: %(default)s)')
    parser.add_argument('pages', nargs='*', help='default: docs/*.md')
    args = parser.parse_args(argv)
    gen = benchregions.Generator(args.results)
    bad = 0
    for path in args.pages or benchregions.pages():
        with open(path, encoding='utf-8') as f:
            text = f.read()
        if args.write:
            new = benchregions.refresh(text, gen=gen)[0]
            if new != text:
                with open(path, 'w', encoding='utf-8') as f:
                    f.write(new)
                sys.stdout.write('rewrote %s\n' % os.path.relpath(path))
            text = new
        # What is left (or, with --check, what --write would change).
        problems = benchregions.check(text, gen=gen)
        for line, message in problems:
            sys.stderr.write('%s:%d: %s\n' % (os.path.relpath(path), line,
                                               message))
        bad += len(problems)
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
