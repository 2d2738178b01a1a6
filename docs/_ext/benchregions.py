"""The generated regions of the pages: tables, machine lines and figures
written into ``docs/*.md`` from ``benchmarks/results/*.json``.

A page holds a figure as plain Markdown between two HTML comments, which
GitHub and the built site both leave invisible, so the page reads the same
in the repository and in the site:

.. code-block:: markdown

    <!-- bench-table overlap -->
    **Title of the table**

    | mode | ... |
    |---|---|
    | ... |

    <!-- /bench-table -->

    <!-- bench-machine overlap.json -->
    From `benchmarks/results/overlap.json`: ...
    <!-- /bench-machine -->

    ... written like <!-- fig compression_float32 -->0.915 [0.894,
    0.940]<!-- /fig --> in a sentence.

The two block forms have their markers on lines of their own.  An inline
figure must not start a line: a line that starts with an HTML comment
starts an HTML block in CommonMark, which would hide the figure.

:func:`refresh` rewrites every region from the results
(``make docs-figures``); :func:`check` reports a region that differs from
what the results give, a table a result no longer builds (a key it reads
is gone), a marker without its pair, and the directives and substitutions
of the earlier pages (``{bench-table}``, ``{{ name }}``), which show as raw
text on GitHub.  ``make docs`` warns of each (an error under ``-W``) and
``tests/unit/test_docs.py`` fails on each.
"""
import os
import re

import benchtables
from benchcore import RESULTS, TABLES, machine_text

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.dirname(HERE)

BLOCK_KINDS = ('bench-table', 'bench-machine')
MARKER = re.compile(r'<!--[ \t]*(/?)(bench-table|bench-machine|fig)'
                    r'(?:[ \t]+(\S+))?[ \t]*-->')
# What the earlier pages used instead, and a page must no longer hold.
LEFTOVERS = [(re.compile(r'^[ \t]*(`{3,}|:{3,})[ \t]*\{(bench-table|'
                         r'bench-machine)\}', re.M),
              'a {%s} directive shows as raw text on GitHub; write the '
              'region instead'),
             (re.compile(r'\{\{[ \t]*(\w+)[ \t]*\}\}'),
              'a {{ %s }} substitution shows as raw text on GitHub; write '
              '<!-- fig NAME -->...<!-- /fig --> instead')]
FIX = 'run `make docs-figures` (docs/_ext/benchtables.py --write)'


class UnknownName(Exception):
    """A region names a table or figure that is not registered."""


class Region(object):
    """One region of a page: its kind, name, line and text span."""

    def __init__(self, kind, name, line, start, end):
        self.kind, self.name, self.line = kind, name, line
        self.start, self.end = start, end   # the text between the markers

    def __repr__(self):
        return '<%s %s at line %d>' % (self.kind, self.name, self.line)


def _line(text, pos):
    return text.count('\n', 0, pos) + 1


def _alone_on_line(text, m):
    before = text.rfind('\n', 0, m.start()) + 1
    after = text.find('\n', m.end())
    after = len(text) if after < 0 else after
    return not text[before:m.start()].strip() and \
        not text[m.end():after].strip()


def regions(text):
    """The regions of a page and what is wrong with their markers.

    Returns:
        tuple: (list of Region, list of ``(line, message)``).
    """
    out, problems, opened = [], [], None
    for m in MARKER.finditer(text):
        closing, kind, name = m.group(1) == '/', m.group(2), m.group(3)
        line = _line(text, m.start())
        if kind in BLOCK_KINDS and not _alone_on_line(text, m):
            problems.append((line, 'the %s marker must be alone on its '
                             'line' % kind))
        if not closing:
            if opened is not None:
                problems.append((opened[0], '%s %s is not closed before '
                                 'line %d' % (opened[1], opened[2], line)))
            if name is None:
                problems.append((line, '%s marker without a name' % kind))
                opened = None
                continue
            if kind == 'fig' and not text[
                    text.rfind('\n', 0, m.start()) + 1:m.start()].strip():
                problems.append((line, 'fig %s starts a line, where an '
                                 'HTML comment starts an HTML block that '
                                 'hides the figure; rewrap the sentence'
                                 % name))
            opened = (line, kind, name, m.end())
        elif opened is None or opened[1] != kind:
            problems.append((line, 'closing %s marker without its opening '
                             'one' % kind))
            opened = None
        else:
            if kind == 'fig' and '\n' in text[opened[3]:m.start()]:
                problems.append((opened[0], 'fig %s spans lines; keep '
                                 'the figure and its markers on one line'
                                 % opened[2]))
            out.append(Region(kind, opened[2], opened[0], opened[3],
                              m.start()))
            opened = None
    if opened is not None:
        problems.append((opened[0], '%s %s is not closed'
                         % (opened[1], opened[2])))
    return out, problems


def markdown_table(t):
    """A :class:`benchcore.Table` as its title and a GFM pipe table."""
    def row(cells):
        return '| ' + ' | '.join(c.replace('|', '\\|') for c in cells) + \
            ' |'
    lines = ['**%s**' % t.title, '', row(t.header),
             '|' + '---|' * len(t.header)]
    return '\n'.join(lines + [row(r) for r in t.rows])


class Generator(object):
    """What each region should hold, from one results folder (the figures
    computed once)."""

    def __init__(self, results=RESULTS):
        self.results = results
        self.label = ('benchmarks/results'
                      if os.path.abspath(results) == RESULTS else results)
        self._figures = None

    def figures(self):
        # Built once; a result that lacks a key fails every figure alike.
        if self._figures is None:
            try:
                self._figures = benchtables.figures(self.results)
            except (OSError, LookupError, ValueError, TypeError) as e:
                self._figures = e
        if isinstance(self._figures, Exception):
            raise self._figures
        return self._figures

    def text(self, kind, name):
        """The region's text between its markers.

        Raises:
            UnknownName: ``name`` is not a table or figure.
            OSError, KeyError, IndexError, ValueError, TypeError: A result
                file is missing or lacks what the region reads.
        """
        if kind == 'bench-table':
            if name not in TABLES:
                raise UnknownName('no table %r; known: %s'
                                  % (name, ', '.join(sorted(TABLES))))
            return '\n' + markdown_table(TABLES[name](self.results)) + '\n\n'
        if kind == 'bench-machine':
            return '\nFrom %s\n' % machine_text(name, self.results)
        figures = self.figures()
        if name not in figures:
            raise UnknownName('no figure %r; known: %s'
                              % (name, ', '.join(sorted(figures))))
        return figures[name]


def _expected(gen, region, problems):
    try:
        return gen.text(region.kind, region.name)
    except UnknownName as e:
        problems.append((region.line, '%s %s: %s'
                         % (region.kind, region.name, e)))
        return None
    except (OSError, LookupError, ValueError, TypeError) as e:
        error = e
    problems.append((region.line, '%s %s: cannot build it from %s: %s: %s'
                     % (region.kind, region.name, gen.label,
                        type(error).__name__, error)))
    return None


def _first_difference(have, want):
    a, b = have.splitlines(), want.splitlines()
    for x, y in zip(a, b):
        if x != y:
            return 'has %r, the results give %r' % (x, y)
    return 'has %d line(s), the results give %d' % (len(a), len(b))


def check(text, results=RESULTS, gen=None):
    """Everything wrong with a page's generated regions.

    Returns:
        list: ``(line, message)``, sorted by line; empty when every region
        is what ``results`` gives.
    """
    gen = gen or Generator(results)
    found, problems = regions(text)
    for r in found:
        want = _expected(gen, r, problems)
        have = text[r.start:r.end]
        if want is not None and have != want:
            problems.append((r.line, '%s %s differs from %s (%s); %s'
                             % (r.kind, r.name, gen.label,
                                _first_difference(have, want), FIX)))
    for pattern, message in LEFTOVERS:
        for m in pattern.finditer(text):
            problems.append((_line(text, m.start()),
                             message % m.group(m.lastindex)))
    return sorted(problems)


def refresh(text, results=RESULTS, gen=None):
    """The page with every region rewritten from ``results``.

    Returns:
        tuple: (new text, list of ``(line, message)`` of what it could not
        rewrite: markers out of pairs, unknown names, results that do not
        build).  A marker without its pair is left as it is.
    """
    gen = gen or Generator(results)
    found, problems = regions(text)
    out, pos = [], 0
    for r in found:
        want = _expected(gen, r, problems)
        out.append(text[pos:r.start])
        out.append(text[r.start:r.end] if want is None else want)
        pos = r.end
    out.append(text[pos:])
    return ''.join(out), problems


def pages(docs=DOCS):
    """The Markdown pages of the site (not ``_build``, ``_notes``,
    ``_ext``)."""
    out = []
    for folder, dirs, names in os.walk(docs):
        dirs[:] = sorted(d for d in dirs if not d.startswith(('_', '.')))
        out += [os.path.join(folder, n) for n in sorted(names)
                if n.endswith('.md')]
    return out
