"""The table machinery of the performance pages: the registry of tables
(:func:`table`) and the helpers the tables share.  What the tables are
for and how a page shows them is in :mod:`benchtables`'s docstring.

The functions here need only the standard library, so tests import them
without Sphinx.
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(os.path.dirname(HERE)), 'benchmarks',
                       'results')

TABLES = {}


class Table(object):
    """A table: a title, a header row, body rows of strings, its sources."""

    def __init__(self, title, header, rows, sources):
        self.title = title
        self.header = list(header)
        self.rows = [list(r) for r in rows]
        self.sources = list(sources)
        for r in self.rows:
            if len(r) != len(self.header):
                raise ValueError('row %r has %d cells, the header %d'
                                 % (r, len(r), len(self.header)))

    def markdown(self):
        """The table as a markdown pipe table (for tests and the README)."""
        lines = ['| ' + ' | '.join(self.header) + ' |',
                 '|' + '---|' * len(self.header)]
        lines += ['| ' + ' | '.join(r) + ' |' for r in self.rows]
        return '\n'.join(lines)


def table(name):
    """Registers a table function under ``name``."""
    def register(fn):
        TABLES[name] = fn
        return fn
    return register


def load(name, results=RESULTS):
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def f2(x):
    return '%.2f' % x


def f3(x):
    return '%.3f' % x


def pct(x, digits=0):
    return '%.*f%%' % (digits, 100.0 * x)


def ms(seconds, digits=1):
    return '%.*f' % (digits, 1000.0 * seconds)


def signed_pct(x):
    return '%+.1f%%' % (100.0 * x)


def mbit(bit_per_s):
    return '%.0f Mbit/s' % (bit_per_s / 1e6)


def ratio_x(x):
    return '%.2fx' % x


# ----------------------------------------------------------------------------
# Machines
# ----------------------------------------------------------------------------

def machine_text(name, results=RESULTS):
    """One sentence describing where ``name`` (a JSON file) was measured."""
    m = load(name, results).get('machine') or {}
    parts = []
    cpu = m.get('cpu') or m.get('processor')
    cores = m.get('cores', m.get('cpu_count'))
    if cpu:
        parts.append(cpu)
    if cores:
        parts.append('%d cores' % cores)
    for key, label in (('python', 'Python'), ('chainer', 'Chainer'),
                       ('numpy', 'NumPy')):
        if m.get(key):
            parts.append('%s %s' % (label, m[key]))
    if m.get('mpi'):
        parts.append(' '.join(m['mpi'].replace('Version:', '').split()))
    if m.get('platform'):
        parts.append(m['platform'])
    load_avg = (m.get('loadavg_at_start') or m.get('loadavg')
                or m.get('loadavg_at_end'))
    text = '`benchmarks/results/%s`: %s' % (name, ', '.join(parts))
    if load_avg:
        when = ('at start' if ('loadavg_at_start' in m or 'loadavg' in m)
                else 'at end')
        text += '; load average %s %.2f' % (when, load_avg[0])
    return text + '.'


def scal(m, digits=3):
    """A mode's scalability with its 95 % interval where the result has one
    (``0.863 [0.851, 0.872]``)."""
    ci = m.get('scalability_ci')
    if ci and ci[0] is not None:
        return '%.*f [%.*f, %.*f]' % (digits, m['scalability'], digits,
                                      ci[0], digits, ci[1])
    return '%.*f' % (digits, m['scalability'])


def interval_text(iv, digits=3, signed=False):
    """``+0.051 [+0.032, +0.070]`` for a :mod:`benchmarks.harness.stats`
    interval."""
    f = '%+.*f' if signed else '%.*f'
    return (f + ' [' + f + ', ' + f + ']') % (
        digits, iv['median'], digits, iv['ci'][0], digits, iv['ci'][1])
