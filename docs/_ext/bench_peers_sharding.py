"""The table of our sharding against PyTorch's ZeRO and FSDP (see
:mod:`benchtables`), from ``peers_sharding.json``
(``benchmarks/peers_sharding.py``).

One row per pair the study compared: the stage, PyTorch's mode, each
side's scalability against its own rank alone with its 95 % interval, ours
minus theirs paired by round, and each side's bytes per parameter per rank
(persistent / peak) next to the stage's ideal.  A peer that did not run
shows its error instead of its figures.

The table is registered only while its results file exists
(:func:`register`): until the study's first real run there is nothing to
show, and a registered table must build and stand on a page
(``tests/unit/test_docs.py``).  Once the file is there, the tests ask for
its region and machine line on ``docs/performance.md`` (where a comment
marks the place); ``make docs-figures`` then writes them.
"""
import os

from benchcore import (RESULTS, TABLES, Table, interval_text, load, mbit,
                       table)
from bench_optimizer import MODEL_NAMES

SOURCE = 'peers_sharding.json'
PEER_LABELS = {
    'alone': 'one rank alone',
    'ddp_adam': 'DDP',
    'zero1': 'ZeroRedundancyOptimizer',
    'zero1_overlap': 'ZeroRedundancyOptimizer, `overlap_with_ddp`',
    'fsdp2_grad_op': 'FSDP2, `reshard_after_forward=False`',
    'fsdp1_grad_op': 'FSDP1 `SHARD_GRAD_OP`',
    'fsdp2_full': 'FSDP2, `reshard_after_forward=True`',
    'fsdp1_full': 'FSDP1 `FULL_SHARD`',
}
STAGE_LABELS = {None: 'one rank alone', 0: 'unsharded',
                1: "stage 1 (`shard='optimizer'`)",
                2: "stage 2 (`shard='gradients'`)",
                3: "stage 3 (`shard='parameters'`)"}
# Our modes whose row names more than their stage.
OUR_LABELS = {'overlap_forward_shard_parameters_unbounded':
              "stage 3, `shard_prefetch=None` (as FSDP's grad-op sharding)"}
DASH = '\u2014'


def _iv(iv, signed=False):
    if not iv or iv.get('median') is None:
        return DASH
    return interval_text(iv, signed=signed)


def _memory(row):
    if not row or 'error' in row:
        return DASH
    return '%.1f / %.1f' % (row['persistent_bytes_per_param'],
                            row['peak_bytes_per_param'])


def _error(text):
    """A peer's error on one line: its first line, at most 100 characters
    (the whole text is in the results file)."""
    line = text.strip().splitlines()[0] if text.strip() else text
    return 'did not run: %s' % (line if len(line) <= 100
                                else line[:99] + '\u2026')


def peers_sharding_rows(d):
    """The table's body rows from a result's ``stages``."""
    rows = []
    for r in d['stages']:
        if r['theirs_error']:
            theirs, diff = _error(r['theirs_error']), DASH
        else:
            theirs = _iv(r['theirs_scalability'])
            diff = _iv(r['difference'], signed=True)
        ideal = r['ideal_bytes_per_param']
        rows.append([OUR_LABELS.get(r['ours'], STAGE_LABELS[r['stage']]),
                     PEER_LABELS.get(r['theirs'], r['theirs']),
                     _iv(r['ours_scalability']), theirs, diff,
                     _memory(r.get('ours_memory')),
                     _memory(r.get('theirs_memory')),
                     '%.1f' % ideal])
    return rows


def peers_sharding_title(d):
    c = d['config']
    model = MODEL_NAMES.get(c['model'], c['model'])
    if d.get('rate_bit_per_s'):
        speed = ('%s at %d px, Adam, on 2 ranks over %s: ours (batch %d) and '
                 'PyTorch %s (batch %d, compute-matched)'
                 % (model, c['insize'], mbit(d['rate_bit_per_s']),
                    c['batch'], d.get('peer_version') or '',
                    d['peer_batch']))
    else:
        speed = '%s, Adam, 2 ranks (no speed run)' % model
    m = (d.get('memory') or {}).get('config')
    if not m:
        return speed
    return ('%s; bytes per parameter per rank at batch %d, %d px'
            % (speed, m['batch'], m['insize']))


def peers_sharding_table(results=RESULTS):
    d = load(SOURCE, results)
    return Table(peers_sharding_title(d),
                 ['stage', 'PyTorch peer', 'ours: scalability',
                  'PyTorch: scalability',
                  'ours - theirs', 'ours: B/param (persistent / peak)',
                  'PyTorch: B/param (persistent / peak)', 'ideal B/param'],
                 peers_sharding_rows(d), [SOURCE])


def figures(results=RESULTS):
    """The figures the pages quote from the study, by pair
    (``peers_sharding_<theirs>__<ours short>_diff``, ``..._ours``,
    ``..._theirs``, ``..._ours_mem``, ``..._theirs_mem``), and its link and
    rounds; none without the file."""
    if not os.path.isfile(os.path.join(results, SOURCE)):
        return {}
    d = load(SOURCE, results)
    out = {'peers_sharding_rate': mbit(d['rate_bit_per_s']),
           'peers_sharding_rounds': str(d['config']['rounds'])}
    for r in d['stages']:
        if r['theirs'] == 'alone':
            continue
        key = 'peers_sharding_%s__%s' % (
            r['theirs'], r['ours'].replace('overlap_forward_shard_', '')
            .replace('overlap_forward', 'none'))
        if not r['theirs_error']:
            out[key + '_diff'] = _iv(r['difference'], signed=True)
            out[key + '_theirs_mem'] = _memory(r.get('theirs_memory'))
            out[key + '_theirs'] = _iv(r['theirs_scalability'])
        out[key + '_ours_mem'] = _memory(r.get('ours_memory'))
        out[key + '_ours'] = _iv(r['ours_scalability'])
    return out


def register(results=RESULTS):
    """Registers the table as ``peers-sharding`` when ``results`` holds
    its file, and unregisters it otherwise.

    Returns:
        bool: whether it is registered.
    """
    if os.path.isfile(os.path.join(results, SOURCE)):
        table('peers-sharding')(peers_sharding_table)
        return True
    TABLES.pop('peers-sharding', None)
    return False


register()
