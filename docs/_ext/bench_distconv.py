"""Performance tables of the distconv benchmarks (see :mod:`benchtables`).
"""
from benchcore import (RESULTS, Table, f2, load, mbit, ms, pct, ratio_x,
                       table)


# ----------------------------------------------------------------------------
# distconv
# ----------------------------------------------------------------------------

def _spatial_runs(d, scaling):
    return {r['processes']: r for r in d['runs'] if r['scaling'] == scaling}


@table('spatial')
def spatial_table(results=RESULTS):
    d = load('spatial.json', results)
    strong, weak = _spatial_runs(d, 'strong'), _spatial_runs(d, 'weak')
    cores = d['machine'].get('cpu_count')
    rows = []
    for p in sorted(strong):
        s, w = strong[p], weak.get(p)
        label = str(p)
        if cores and p > cores:
            label += ' (oversubscribed)'
        rows.append([
            label, f2(s['speedup_median_of_ratios']),
            f2(s['efficiency_vs_serial_on_block'])
            if 'efficiency_vs_serial_on_block' in s else '-',
            ratio_x(s['memory']['peak_ratio_vs_serial']),
            ratio_x(s['memory']['held_ratio_vs_serial']),
            f2(w['weak_efficiency_median_of_ratios']) if w else ''])
    c = d['config']
    return Table('Conv stack, image split over (P, 1)',
                 ['P', 'strong speed-up, %dx%d vs Chainer'
                  % (c['insize'], c['insize']),
                  'Chainer on one block / distconv',
                  'peak memory per process', 'held after forward',
                  'weak efficiency, %dx%d per process'
                  % (c['weak_insize'], c['weak_insize'])], rows,
                 ['spatial.json'])


HALO_SETTINGS = ('blocking', 'overlap_no_progress', 'overlap_progress')
HALO_HEADER = ['blocking', 'overlap, no progress calls',
               'overlap + progress calls', 'complete before wait']


def _halo_cells(halo):
    cells = ['%s ms' % _short_ms(halo[k]['median_exposed_halo_s_per_step'])
             for k in HALO_SETTINGS]
    done = halo['overlap_progress']['exchanges_complete_before_wait']
    return cells + [pct(done) if done is not None else '']


def _short_ms(seconds):
    v = 1000.0 * seconds
    if v >= 100:
        return '%.0f' % v
    if v >= 1:
        return '%.1f' % v
    return '%.2f' % v


@table('spatial-halo')
def spatial_halo_table(results=RESULTS):
    d = load('spatial.json', results)
    cores = d['machine'].get('cpu_count')
    rows = []
    for p, r in sorted(_spatial_runs(d, 'strong').items()):
        if 'halo' not in r:
            continue
        label = str(p) + (' (oversubscribed)' if cores and p > cores else '')
        rows.append([label] + _halo_cells(r['halo']))
    return Table('Exposed halo wait per step over shared memory (strong '
                 'scaling)', ['P'] + HALO_HEADER, rows, ['spatial.json'])


@table('spatial-netbed')
def spatial_netbed_table(results=RESULTS):
    d = load('spatial.json', results)['halo_netbed']
    rows = [[mbit(r['rate_bit_per_s'])] + _halo_cells(r['halo'])
            for r in sorted(d['runs'], key=lambda r: -r['rate_bit_per_s'])]
    return Table('Exposed halo wait per step over the shaped link, P = 2',
                 ['link'] + HALO_HEADER, rows, ['spatial.json'])


LATE_SETTINGS = [
    ('chainer_1p', 'plain Chainer, 1 process'),
    ('distconv_1p', 'distconv on a 1x1 grid, 1 process'),
    ('filter_channel', '2 processes, filter/channel parallel'),
    ('filter_channel_serial', '... with `grid.channel_overlap = False`'),
    ('filter_channel_whole_io', '... whole channels in and out'),
    ('spatial', '2 processes, split spatially'),
]


@table('late-stage')
def late_stage_table(results=RESULTS):
    d = load('channel_tiling.json', results)['late']
    run, summary = d['run']['settings'], d['summary']
    rows = []
    for key, label in LATE_SETTINGS:
        s = run[key]
        speed = summary['speedup'].get(key)
        rows.append([label, ms(s['median_step_s']),
                     ratio_x(speed) if speed is not None else '',
                     '%.2f' % (max(s['param_bytes_per_process']) / 1e6),
                     '%.2f' % (max(s['held_after_forward_bytes_per_process'])
                               / 1e6),
                     '%.2f' % (max(s['peak_bytes_per_process']) / 1e6)])
    c = d['config']
    return Table('One res4 bottleneck, %dx%d, %d channels, batch %d, '
                 'forward + backward (machine bound for 2 processes: %s)'
                 % (c['insize'], c['insize'], c['channels'], c['batchsize'],
                    ratio_x(summary['twin_bound'])),
                 ['setting', 'step ms', 'speed-up', 'weights MB/process',
                  'held after forward MB', 'peak MB'], rows,
                 ['channel_tiling.json'])


TILING_SETTINGS = ['layer', '1', '2', '4', 'all']


@table('tiling')
def tiling_table(results=RESULTS):
    d = load('channel_tiling.json', results)['tiling']
    rows = []
    for r in sorted(d['runs'], key=lambda r: r['link']['delay_s']):
        st = r['settings']
        best = r['tuner']['best']
        depth = 'all' if best.get('depth') is None else str(best['depth'])
        rows.append(['%g ms' % (1000 * r['link']['delay_s']),
                     '%.2f ms' % (1000 * r['link']['rtt']['median_s'])]
                    + [ms(st[k]['median_exposed_exchange_s'])
                       for k in TILING_SETTINGS]
                    + ['%s -> %s' % (ms(st['layer']['median_step_s']),
                                     ms(st['all']['median_step_s'])),
                       depth])
    c = d['config']
    return Table('%d-layer 3x3 stack, %dx%d, %d channels, 2 ranks: exposed '
                 'exchange ms per step' % (c['layers'], c['insize'],
                                           c['insize'], c['channels']),
                 ['one-way delay', 'ping RTT', 'layer by layer',
                  'depth 1', 'depth 2', 'depth 4', 'depth all',
                  'step ms, layer -> all', 'tuner chose'], rows,
                 ['channel_tiling.json'])
