"""Performance tables of the optimizer benchmarks (see :mod:`benchtables`).
"""
from benchcore import (RESULTS, Table, f2, f3, interval_text, load, mbit,
                       pct, scal, signed_pct, table)


# ----------------------------------------------------------------------------
# Gradient reduction
# ----------------------------------------------------------------------------

OVERLAP_MODES = [
    ('alone', 'one rank alone'),
    ('blocking', 'ChainerMN blocking'),
    ('double_buffering', 'double buffering (stale by one step)'),
    ('overlap_update', "ours, `wait='update'`"),
    ('overlap_forward', "ours, `wait='forward'`"),
]


@table('overlap')
def overlap_table(results=RESULTS):
    d = load('overlap.json', results)
    cal = d['calibrated']
    rows = []
    for key, label in OVERLAP_MODES:
        m = cal['modes'][key]
        stats = m.get('communication_stats')
        hidden = (pct(stats['hidden_fraction'])
                  if stats and stats.get('hidden_fraction') is not None
                  else '')
        rows.append([label, '%s (%s, %s)' % (f3(m['it_per_s_median']),
                                             f3(m['it_per_s_min']),
                                             f3(m['it_per_s_max'])),
                     scal(m), hidden])
    return Table('ResNet-50 on 2 ranks over the calibrated link (%s)'
                 % mbit(cal['rate_bit_per_s']),
                 ['mode', 'it/s median (min, max)',
                  'scalability [95% interval]', 'reduction time hidden'],
                 rows, ['overlap.json'])


@table('overlap-settings')
def overlap_settings_table(results=RESULTS):
    d = load('overlap.json', results)
    runs = sorted(d['sweep'], key=lambda s: s['rate_bit_per_s'])
    header = ['mode'] + [mbit(s['rate_bit_per_s']) for s in runs] + [
        'emulation (16 nodes, 10 Gb/s, scaled)']
    rows = []
    for key, label in OVERLAP_MODES[1:]:
        rows.append([label] + [f3(s['modes'][key]['scalability'])
                               for s in runs]
                    + [scal(d['emulation']['modes'][key])])
    return Table('Scalability at other link rates and in the emulation',
                 header, rows, ['overlap.json'])


OVERHEAD_VARIANTS = [
    ('plain', 'plain Chainer optimizer'),
    ('chainermn_blocking', 'ChainerMN blocking'),
    ('double_buffering', 'double buffering'),
    ('overlap_update', "ours, `wait='update'`"),
    ('overlap_forward', "ours, `wait='forward'`"),
]


@table('overhead')
def overhead_table(results=RESULTS):
    d = load('overhead.json', results)
    rows = [[label, f3(d['median_seconds'][k]), f3(d['min_seconds'][k]),
             f3(d['max_seconds'][k]), signed_pct(d['overhead_vs_plain'][k])]
            for k, label in OVERHEAD_VARIANTS]
    c = d['config']
    return Table('One rank, %s, batch %d at %dx%d: seconds per iteration'
                 % (c['arch'], c['batchsize'], c['insize'], c['insize']),
                 ['variant', 'median', 'min', 'max', 'vs plain'], rows,
                 ['overhead.json'])


@table('buckets')
def buckets_table(results=RESULTS):
    d = load('overlap_buckets.json', results)['bucket_sweep']
    rows = [[r['label'], f3(r['scalability']['overlap_update']),
             f3(r['scalability']['overlap_forward'])] for r in d['rows']]
    return Table('Fusion bucket size at %s (one job per size)'
                 % mbit(d['rate_bit_per_s']),
                 ['bucket size', "`wait='update'`", "`wait='forward'`"],
                 rows, ['overlap_buckets.json'])


@table('comm-cost')
def comm_cost_table(results=RESULTS):
    d = load('comm_cost.json', results)
    s = d['summary']
    rows = []
    for key, label in (('alone', 'compute loop alone'),
                       ('reducing', 'with a thread reducing 4 MiB buffers'),
                       ('reducing_nice19', 'the same thread at `nice 19`')):
        r = s[key]
        rows.append([label, f3(r['compute_seconds_median']),
                     signed_pct(r['slowdown']),
                     ('%.1f' % r['allreduce_MB_per_s_median']
                      if 'allreduce_MB_per_s_median' in r else ''),
                     (pct(r['thread_cpu_fraction_median'])
                      if 'thread_cpu_fraction_median' in r else '')])
    return Table('Cost of moving bytes on the bed (%s)'
                 % mbit(d['bed']['rate_bit_per_s']),
                 ['setting', 'compute s (median)', 'slowdown',
                  'allreduce MB/s', 'reducing thread CPU'], rows,
                 ['comm_cost.json'])


COMPRESSION_MODES = [
    ('blocking', 'ChainerMN blocking'),
    ('overlap_forward', 'ours, float32'),
    ('overlap_forward_float16', 'ours, float16'),
    ('overlap_forward_powersgd1', 'ours, PowerSGD r=1'),
    ('overlap_forward_powersgd4', 'ours, PowerSGD r=4'),
    ('overlap_update_powersgd4', "ours, PowerSGD r=4, `wait='update'`"),
]


def _mb(nbytes):
    return ('%.2f' % (nbytes / 1e6) if nbytes < 1e7
            else '%.1f' % (nbytes / 1e6))


def compression_table_of(model, results=RESULTS, source='compression.json'):
    """Modes of ``source`` per link; a mode one link did not run shows
    a dash there."""
    d = load(source, results)['models'][model]
    cal, slow = d['links']['calibrated'], d['links']['slow']
    rows = []
    for key, label in COMPRESSION_MODES:
        a, b = cal['rows'].get(key), slow['rows'].get(key)
        if a is None and b is None:
            continue
        cpu = [x['compression_seconds_per_iteration'] for x in (a, b)
               if x is not None]
        rows.append([label, _mb((a or b)['bytes_per_iteration']),
                     scal(a) if a else '-', f3(a['bound']) if a else '-',
                     scal(b) if b else '-', f3(b['bound']) if b else '-',
                     '' if max(cpu) == 0 else ' / '.join(map(f3, cpu))])
    c = d['config']
    return Table('%s, batch %d at %d px, 2 ranks, %d rounds: scalability '
                 '[95%% interval] and the bed\'s bound per link'
                 % (c['model'], c['batch'], c['insize'], c['rounds']),
                 ['mode', 'MB/it', mbit(cal['rate_bit_per_s']), 'bound',
                  mbit(slow['rate_bit_per_s']), 'bound',
                  'compression CPU s/it (per link)'], rows, [source])


@table('compression')
def compression_table(results=RESULTS):
    return compression_table_of('resnet50', results)


@table('compression-40-rounds')
def compression_40_rounds_table(results=RESULTS):
    return compression_table_of('resnet50', results,
                                'compression_40_rounds.json')


@table('compression-light')
def compression_light_table(results=RESULTS):
    return compression_table_of('resnet18', results)


ACCURACY_MODES = [('float32', 'float32'), ('float16', 'float16'),
                  ('powersgd1', 'PowerSGD r=1'), ('powersgd2', 'PowerSGD r=2'),
                  ('powersgd4', 'PowerSGD r=4')]


@table('accuracy')
def accuracy_table(results=RESULTS):
    d = load('accuracy.json', results)
    rows = []
    for key, label in ACCURACY_MODES:
        c = d['digits']['curves'][key]
        nbytes = int(round(c['bytes_per_iteration']))
        rows.append([label, '{:,}'.format(nbytes),
                     pct(d['final_accuracy'][key], 2),
                     pct(max(c['test_accuracy']), 2)])
    cfg = d['config']['digits']
    return Table('UCI digits, %d epochs, global batch %d, 2 ranks'
                 % (cfg['epochs'], cfg['batch']),
                 ['mode', 'bytes reduced per iteration',
                  'final test accuracy', 'best'], rows, ['accuracy.json'])


# ----------------------------------------------------------------------------
# Peers, sharding
# ----------------------------------------------------------------------------

MODEL_NAMES = {'resnet50': 'ResNet-50', 'resnet18': 'ResNet-18'}

PEER_PAIRS = [('ddp_fp32', 'overlap_forward', 'float32'),
              ('ddp_fp16', 'overlap_forward_float16', 'float16'),
              ('ddp_powersgd1', 'overlap_forward_powersgd1', 'PowerSGD r=1'),
              ('ddp_powersgd4', 'overlap_forward_powersgd4', 'PowerSGD r=4')]


def peers_table_of(name, results=RESULTS):
    d = load(name, results)
    ours, theirs = d['ours']['modes'], d['theirs']['modes']
    rows = []
    for t, o, label in PEER_PAIRS:
        cmp = d['comparison']['%s/%s' % (t, o)]['scalability']
        rows.append([label, scal(ours[o]), scal(theirs[t]),
                     interval_text(cmp['difference'], signed=True)])
    rows.append(['ChainerMN blocking', scal(ours['blocking']), '', ''])
    c = d['config']
    return Table('%s at %d px on 2 ranks over %s: ours (batch %d) and '
                 'PyTorch %s DDP (batch %d, compute-matched)'
                 % (MODEL_NAMES.get(c['model'], c['model']), c['insize'],
                    mbit(d['rate_bit_per_s']), c['batch'],
                    d.get('peer_version') or '', d['peer_batch']),
                 ['wire', 'ours', 'PyTorch DDP', 'ours - theirs'], rows,
                 [name])


@table('peers')
def peers_table(results=RESULTS):
    return peers_table_of('peers.json', results)


SHARD_MODES = [('chainermn', 'ChainerMN'), ('none', 'ours, unsharded'),
               ('optimizer', "`shard='optimizer'`"),
               ('gradients', "`shard='gradients'`"),
               ('parameters', "`shard='parameters'`")]


# Memory only: 'gradients' with the bound the default leaves off; memory
# and speed: stage 3 with no bound on whole parameters, and the least.
SHARD_STAGE3_EXTRA = [
    ('parameters_unbounded', "`'parameters'`, `shard_prefetch=None`"),
    ('parameters_lean', "`'parameters'`, `shard_prefetch=0`, "
     "`shard_in_flight='8MiB'`")]
SHARD_MEMORY_EXTRA = [('gradients_8MiB',
                       "`'gradients'`, `shard_in_flight='8MiB'`")
                      ] + SHARD_STAGE3_EXTRA


@table('sharding-memory')
def sharding_memory_table(results=RESULTS):
    d = load('sharding.json', results)['memory']
    ranks = sorted(d, key=int)
    rows = []
    for key, label in SHARD_MODES + SHARD_MEMORY_EXTRA:
        if key + ':update' not in d[ranks[-1]]['rows']:
            continue     # results from before the row existed
        row = d[ranks[-1]]['rows'][key + ':update']
        rows.append([label] + [
            f2(d[n]['rows'][key + ':update']['bytes_per_param_after_update'])
            for n in ranks] + [f2(row['ideal_bytes_per_param']),
                               f2(row['peak_bytes_per_param'])])
    return Table('Bytes per parameter each rank holds after an update (Adam, '
                 '%.1f M parameters; the largest rank)'
                 % (d[ranks[0]]['parameters'] / 1e6),
                 ['mode'] + ['%s rank(s)' % n for n in ranks]
                 + ['ideal at %s' % ranks[-1],
                    'peak during a step at %s' % ranks[-1]], rows,
                 ['sharding.json'])


# What each stage promises between steps, as a fraction of ChainerMN's
# bytes (docs/sharding.md): its ideal plus 0.07, the ideal counting the
# reduced gradient slice (4/N) that stage 1 too holds until its update.
SHARD_PROMISE_MARGIN = 0.07
SHARD_PROMISE_IDEAL = {'optimizer': lambda n: 8 + 12.0 / n,
                       'gradients': lambda n: 4 + 12.0 / n,
                       'parameters': lambda n: 16.0 / n}


@table('sharding-memory-promise')
def sharding_memory_promise_table(results=RESULTS):
    d = load('sharding.json', results)['memory']
    ranks = [n for n in sorted(d, key=int) if int(n) > 1]
    rows = []
    for key, label in SHARD_MODES[2:]:
        cells = [label]
        for n in ranks:
            got = d[n]['rows']
            base = got['chainermn:update']['bytes_per_param_after_update']
            ideal = SHARD_PROMISE_IDEAL[key](int(n)) / base
            cells.append('%.2f (%.2f)' % (ideal,
                                          ideal + SHARD_PROMISE_MARGIN))
            cells += [f2(got[key + ':' + wait]
                         ['bytes_per_param_after_update'] / base)
                      for wait in ('forward', 'update')]
        rows.append(cells)
    head = ['mode']
    for n in ranks:
        head += ['%s ranks: ideal (promised)' % n,
                 "`wait='forward'`", "`wait='update'`"]
    return Table('Bytes each rank holds after `update()` returns, as a '
                 "fraction of ChainerMN's (Adam, %.1f M parameters; the "
                 'largest rank; defaults)' % (d[ranks[0]]['parameters']
                                              / 1e6),
                 head, rows, ['sharding.json'])


@table('sharding-speed')
def sharding_speed_table(results=RESULTS):
    d = load('sharding.json', results)['speed']
    rows = []
    for model, res in d.items():
        if 'failed' in res:
            # A run that failed is shown as such, with its first line.
            rows.append(['%s (%s)' % (model, res['optimizer']),
                         'the run failed: %s' % failure_line(res['failed']),
                         '', '', ''])
            continue
        for key, label in [('overlap_forward', 'ours, unsharded')] + [
                ('overlap_forward_shard_' + k, lbl)
                for k, lbl in SHARD_MODES[2:] + SHARD_STAGE3_EXTRA]:
            r = res['rows'].get(key)
            if r is None:
                continue     # results from before the row existed
            diff = r.get('minus_unsharded')
            ci = r.get('minus_unsharded_ci')
            rows.append(['%s (%s)' % (model, res['optimizer']), label,
                         '%.2f' % r['step_seconds'],
                         scal(r), '' if diff is None else
                         '%+.3f [%+.3f, %+.3f]' % (diff, ci[0], ci[1])])
    return Table('Step time and scalability on 2 ranks, calibrated link, '
                 "`wait='forward'`", ['model', 'mode', 's/step',
                                      'scalability [95% interval]',
                                      'minus unsharded (paired)'], rows,
                 ['sharding.json'])


def failure_line(text):
    """The line of a failed job's output that names the error."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if 'Error' in ln.split(':')[0] or 'Timeout' in ln.split(':')[0]:
            return ln[:300]
    return lines[0][:300] if lines else 'no output'


SOAK_KINDS = [('kill', 'every process of a host killed'),
              ('cut', "a host's link cut (the watchdog's timeout included)"),
              ('lose', 'a host lost (sshd and processes gone)')]


@table('hosts-soak')
def hosts_soak_table(results=RESULTS):
    d = load('hosts_soak.json', results)
    s = d['summary']
    rows = [[label, str(s['by_kind'][k]['n']),
             '%.1f s' % s['by_kind'][k]['median_s'],
             '%.1f s' % s['by_kind'][k]['max_s']]
            for k, label in SOAK_KINDS if k in s['by_kind']]
    rows.append(['all %d, less the watchdog\'s %.0f s for cuts'
                 % (s['checks']['faults'], s['watchdog_s']),
                 str(s['checks']['faults']),
                 '%.1f s' % s['recovery_less_watchdog_median_s'],
                 '%.1f s' % s['recovery_less_watchdog_max_s']])
    return Table('Recovery from fault to the first completed iteration '
                 '(%s)' % d['label'],
                 ['fault', 'n', 'recovery median', 'recovery max'], rows,
                 ['hosts_soak.json'])
