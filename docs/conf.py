"""Sphinx configuration of the chainermn_overlap documentation.

Built by ``make docs`` (HTML into ``docs/_build/html``, warnings as
errors).  Topic pages are MyST markdown (``docs/*.md``); the API reference
(``docs/api/``) is generated from the packages' ``__all__`` by the local
extension ``_ext/apiref.py``.  The performance tables and figures are
written into the pages (``make docs-figures``) from
``benchmarks/results/*.json``; ``_ext/benchtables.py`` warns of any that
differ from the results.
"""
import os
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, '_ext'))
# The package documented is the one importable from this Python (the
# editable install of ``make venv``); the checkout is a fallback.
try:
    import chainermn_overlap
except ImportError:
    sys.path.insert(0, ROOT)
    import chainermn_overlap

project = 'chainermn_overlap'
copyright = 'chainermn_overlap contributors (MIT licence)'
release = chainermn_overlap.__version__
version = release

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'sphinx.ext.intersphinx',
    'apiref',
    'benchtables',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
root_doc = 'index'
# _notes: working notes kept beside the pages, not part of the site.
exclude_patterns = ['_build', '_notes', '_ext', 'requirements.txt',
                    'Thumbs.db', '.DS_Store']

myst_enable_extensions = ['colon_fence', 'deflist']
# Headings up to level 3 get anchors, so ``page.md#a-heading`` links work
# (and a broken one is a warning, hence an error).
myst_heading_anchors = 3

autodoc_member_order = 'bysource'
autodoc_typehints = 'description'
autodoc_default_options = {'undoc-members': False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes sections as fields: autodoc documents the attributes (e.g. a
# namedtuple's fields) as members already.
napoleon_use_ivar = True
# Methods that override Chainer's (link hooks) without a docstring of their
# own are left out rather than shown with Chainer's text, whose references
# point into Chainer's documentation.
autodoc_inherit_docstrings = False

html_theme = 'alabaster'
html_title = 'chainermn_overlap %s' % release
html_static_path = []
html_theme_options = {'description': 'Overlapped gradient reduction and '
                      'spatial parallelism for Chainer/ChainerMN',
                      'fixed_sidebar': True}


# -- intersphinx -------------------------------------------------------------
# Chainer's and NumPy's inventories are used when reachable.  Each is fetched
# here once, with a short timeout, into docs/_build/inventories and handed
# to intersphinx as a local file, so a build offline (CI) has no mapping and
# no warning, and a build online never fetches twice.
# CHAINERMN_OVERLAP_DOCS_OFFLINE=1 skips the attempt.
INVENTORIES = {
    'python': 'https://docs.python.org/3/',
    'numpy': 'https://numpy.org/doc/1.26/',
    'chainer': 'https://docs.chainer.org/en/v7.8.1/',
    'mpi4py': 'https://mpi4py.readthedocs.io/en/stable/',
}


def _fetch_inventories(timeout=3.0):
    mapping = {}
    if os.environ.get('CHAINERMN_OVERLAP_DOCS_OFFLINE') == '1':
        return mapping
    cache = os.path.join(HERE, '_build', 'inventories')
    os.makedirs(cache, exist_ok=True)
    for name, url in INVENTORIES.items():
        path = os.path.join(cache, name + '.inv')
        try:
            with urllib.request.urlopen(url + 'objects.inv',
                                        timeout=timeout) as r:
                data = r.read()
        except (OSError, ValueError):
            continue
        if not data.startswith(b'# Sphinx inventory version'):
            continue
        with open(path, 'wb') as f:
            f.write(data)
        mapping[name] = (url, path)
    return mapping


intersphinx_mapping = _fetch_inventories()
intersphinx_timeout = 5
intersphinx_disabled_reftypes = ['std:doc']


# -- pages not yet in a toctree ----------------------------------------------
# A page added to docs/ (e.g. docs/sharding.md) is shown under "More topics"
# until a line in one of index.md's toctrees places it, so that adding a
# page never breaks the build ("document isn't included in any toctree").


def _toctree_entries(text):
    entries, inside = set(), False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith('```{toctree}'):
            inside = True
        elif inside and s.startswith('```'):
            inside = False
        elif inside and s and not s.startswith(':'):
            entries.add(s.split('<')[-1].rstrip('>').strip())
    return entries


def _unlisted_pages(index_text):
    pages = set()
    for name in os.listdir(HERE):
        stem, ext = os.path.splitext(name)
        if ext in ('.md', '.rst') and stem != 'index':
            pages.add(stem)
    return sorted(pages - _toctree_entries(index_text))


def _add_unlisted(app, docname, source):
    if docname != 'index':
        return
    unlisted = _unlisted_pages(source[0])
    if unlisted:
        source[0] += ('\n```{toctree}\n:caption: More topics\n:maxdepth: 2'
                      '\n\n' + '\n'.join(unlisted) + '\n```\n')


def setup(app):
    app.connect('source-read', _add_unlisted)
