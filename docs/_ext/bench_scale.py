"""The tables of the scaling study (see :mod:`benchtables`), from
``scale.json`` (``benchmarks/scale_bench.py``).

``scale-projection``: per calibration and link rate, at every projected
node count, blocking, ours as recorded, ours without the communication
thread's CPU time and the overlap bound, for each long-message algorithm
the projection ran.  ``scale-measured`` (only where the file holds bed
measurements): per model and rank count, the dilation and each mode's
scalability with its interval, and the replay against the bed.

``scale-ring-chunks``, from ``scale_ring_chunks.json``
(``benchmarks/scale/ring_chunks.py``): the ring with the fixed 4 MiB chunk
against the chunk grown with N, beside MPICH's halving.

Registered only while the file exists (as :mod:`bench_peers_sharding`).
"""
import os

from benchcore import RESULTS, TABLES, Table, f3, interval_text, load, table

SOURCE = 'scale.json'
RING_CHUNKS = 'scale_ring_chunks.json'
CALIBRATIONS = (('reference_calibration', 'reference calibration'),
                ('gpu_class', 'GPU-class'))
ALGORITHMS = (('', 'MPICH halving/doubling'), ('_ring', 'ring'))
MODES = (('blocking', 'ChainerMN blocking'), ('overlap_forward', 'ours'),
         ('overlap_forward_float16', 'ours, float16 wire'),
         ('overlap_forward_powersgd4', 'ours, PowerSGD rank 4'))


def projection_table(results=RESULTS):
    d = load(SOURCE, results)
    p = d['projection']
    rows = []
    for key, label in CALIBRATIONS:
        for suffix, algo in ALGORITHMS:
            for r in p[key].get('rows' + suffix, []):
                rows.append([label, algo, '%d' % r['nodes'],
                             '%g' % (r['rate_bit_per_s'] / 1e9),
                             f3(r['blocking']), f3(r['ours']),
                             f3(r['ours_no_interference']), f3(r['bound']),
                             f3(r['bound'] - r['ours_no_interference'])])
    model = {'resnet50': 'ResNet-50', 'resnet18': 'ResNet-18'}.get(
        p.get('model'), p.get('model') or 'the traced model')
    return Table('%s projected by the SimGrid replay (compute per '
                 'iteration: reference calibration %.3f s, GPU-class %.3f s; '
                 'latency %g us)' % (
                     model, p['reference_calibration']['compute_s'],
                     p['gpu_class']['iteration_s'],
                     p['latency_s'] * 1e6),
                 ['compute', 'allreduce', 'nodes', 'Gb/s', 'blocking',
                  'ours', 'ours, no thread CPU', 'bound',
                  'bound - ours (no thread CPU)'], rows, [SOURCE])


def ring_chunks_table(results=RESULTS):
    d = load(RING_CHUNKS, results)
    rows = []
    for key, label in CALIBRATIONS:
        c = d[key]
        for fixed in c['ring_fixed_4mib']:
            at = (fixed['nodes'], fixed['rate_bit_per_s'])
            grown = _row(c['ring_grown'], *at)
            halving = _row(c['halving'], *at)
            rows.append([label, '%d' % at[0], '%g' % (at[1] / 1e9),
                         f3(fixed['ours']), f3(grown['ours']),
                         f3(grown['bound']), f3(halving['ours']),
                         f3(halving['bound'])])
    return Table('Ring chunks: ours as recorded with the fixed 4 MiB chunk '
                 '(before) and the chunk grown with N, max(4 MiB, 256 KiB N) '
                 '(after), against the ring\'s overlap bound and MPICH\'s '
                 'halving (latency %g us)' % (d['latency_s'] * 1e6),
                 ['compute', 'nodes', 'Gb/s', 'ring, 4 MiB', 'ring, grown',
                  'ring bound', 'halving', 'halving bound'], rows,
                 [RING_CHUNKS])


def ring_chunk_figures(results=RESULTS):
    """Before and after at 1,024 nodes on 10 Gb/s, GPU-class."""
    if not os.path.isfile(os.path.join(results, RING_CHUNKS)):
        return {}
    c = load(RING_CHUNKS, results)['gpu_class']
    out = {}
    for variant in ('ring_fixed_4mib', 'ring_grown', 'halving'):
        r = _row(c[variant], 1024, 10e9)
        out['ringchunk_gpu1024_10_' + variant] = f3(r['ours'])
    out['ringchunk_gpu1024_10_ring_bound'] = f3(
        _row(c['ring_grown'], 1024, 10e9)['bound'])
    return out


def measured_table(results=RESULTS):
    d = load(SOURCE, results)
    rows = []
    for model, runs in sorted(d['measured'].items()):
        replays = {e['ranks']: e for e in d['replay_vs_bed'].get(model, [])}
        for run in runs:
            m = run['modes']
            rep = replays.get(run['ranks'], {})
            cells = [model, '%d' % run['ranks'], '%g' % run['k']]
            for mode, _ in MODES:
                cells.append(interval_text({'median': m[mode]['scalability'],
                                            'ci': m[mode]['scalability_ci']})
                             if mode in m else '')
            cells.append(', '.join('%s %+.3f' % (k, rep[k]['error'])
                                   for k in ('ours', 'blocking') if k in rep))
            rows.append(cells)
    return Table('Measured on the dilated bed: scalability [95 %% interval] '
                 'at dilation k; %s' % load_words(d),
                 ['model', 'ranks', 'k'] + [l for _, l in MODES]
        + ['replay - bed'], rows, [SOURCE])


def load_words(d):
    return ('quiet machine' if d.get('note', '').startswith('quiet')
            else 'taken under load')


def validation_table(results=RESULTS):
    """The dilation check: 2 ranks at every k, each mode's pooled
    per-round scalability, and the spread between the k."""
    v = load(SOURCE, results)['validation']
    ks = sorted(v['by_k'], key=float)
    modes = [m for m, _ in MODES if m in v['by_k'][ks[0]]]
    rows = []
    for mode in modes:
        rows.append([dict(MODES)[mode]] + [
            interval_text({'median': v['by_k'][k][mode]['scalability'],
                           'ci': v['by_k'][k][mode]['ci']}) for k in ks]
            + ['%d' % len(v['by_k'][ks[0]][mode]['rounds']),
               f3(v['largest_difference_between_k'][mode])])
    return Table('Dilation check: %s, 2 ranks, scalability [95 %% interval] '
                 'at each dilation k; %s' % (v['model'], load_words(
                     load(SOURCE, results))),
                 ['mode'] + ['k = %s' % k for k in ks]
                 + ['rounds per k', 'largest difference'], rows, [SOURCE])


def _row(rows, nodes, rate):
    for r in rows:
        if r['nodes'] == nodes and r['rate_bit_per_s'] == rate:
            return r
    raise KeyError('no projected row at %d nodes, %g Gb/s' % (nodes,
                                                             rate / 1e9))


def figures(results=RESULTS):
    """The figures the pages and the README quote from the study; none
    without the file."""
    if not os.path.isfile(os.path.join(results, SOURCE)):
        return ring_chunk_figures(results)
    d = load(SOURCE, results)
    p = d['projection']
    ref, gpu = (p['reference_calibration']['rows'], p['gpu_class']['rows'])
    out = ring_chunk_figures(results)
    for name, rows, nodes, rate in (('ref16_10', ref, 16, 10e9),
                                    ('ref256_25', ref, 256, 25e9),
                                    ('ref1024_10', ref, 1024, 10e9),
                                    ('gpu16_10', gpu, 16, 10e9),
                                    ('gpu256_10', gpu, 256, 10e9),
                                    ('gpu1024_10', gpu, 1024, 10e9)):
        r = _row(rows, nodes, rate)
        for key in ('blocking', 'ours', 'ours_no_interference', 'bound'):
            out['scale_%s_%s' % (name, key)] = f3(r[key])
    gaps = [r['bound'] - r['ours_no_interference'] for r in ref + gpu]
    out['scale_max_gap_no_interference'] = f3(max(gaps))
    v = d.get('replay_vs_trace_run') or {}
    for mode in ('ours', 'blocking'):
        if 'error' in v.get(mode, {}):
            out['scale_replay2_%s' % mode] = f3(v[mode]['replay'])
            out['scale_bed2_%s' % mode] = f3(v[mode]['measured'])
            out['scale_error2_%s' % mode] = '%+.3f' % v[mode]['error']
    return out


def register(results=RESULTS):
    """Registers the tables while ``results`` holds the file."""
    if os.path.isfile(os.path.join(results, RING_CHUNKS)):
        table('scale-ring-chunks')(ring_chunks_table)
    else:
        TABLES.pop('scale-ring-chunks', None)
    path = os.path.join(results, SOURCE)
    if not os.path.isfile(path):
        TABLES.pop('scale-projection', None)
        TABLES.pop('scale-measured', None)
        TABLES.pop('scale-validation', None)
        return False
    table('scale-projection')(projection_table)
    d = load(SOURCE, results)
    for name, fn, key in (('scale-measured', measured_table, 'measured'),
                          ('scale-validation', validation_table,
                           'validation')):
        if d.get(key):
            table(name)(fn)
        else:
            TABLES.pop(name, None)
    return True


register()
