"""The documentation's own machinery, checked without building the site.

``make docs`` builds the site with warnings as errors; these tests keep the
parts it relies on honest and fast to check in ``make test``: the README's
size, links and figures, the API-reference completeness check, the
performance tables and figures written into the pages (each the same as
``benchmarks/results`` gives), the internal link checker and the toctree
fallback for new pages.
"""
import os
import re
import runpy
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DOCS = os.path.join(ROOT, 'docs')
sys.path.insert(0, os.path.join(DOCS, '_ext'))

import apiref  # NOQA: E402
import benchregions  # NOQA: E402
import benchtables  # NOQA: E402
import check_links  # NOQA: E402


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding='utf-8') as f:
        return f.read()


def _pages():
    out = {}
    for name in sorted(os.listdir(DOCS)):
        if name.endswith('.md'):
            out[name] = _read('docs', name)
    return out


# ---------------------------------------------------------------------------
# README
# ---------------------------------------------------------------------------

def test_readme_is_at_most_10_kb():
    size = len(_read('README.md').encode('utf-8'))
    assert size <= 10000, 'README.md is %d bytes; move detail into docs/' \
        % size


def test_readme_keeps_the_two_set_up_commands():
    text = _read('README.md')
    assert re.search(r'^make demo\b', text, re.M)
    assert re.search(r'^make test\b', text, re.M)


def _relative_links(text):
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
        if not re.match(r'^[a-z]+:', target) and not target.startswith('#'):
            yield target.split('#')[0]


def test_readme_links_point_to_files_of_the_checkout():
    missing = [t for t in _relative_links(_read('README.md'))
               if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, missing


# The README's table quotes these; a rerun that changes them must update it.
README_FIGURES = ['compression_rate', 'compression_blocking',
                  'compression_float32', 'compression_float16',
                  'compression_powersgd4', 'compression_slow_float32',
                  'compression_slow_powersgd4',
                  'scale_ref16_10_blocking', 'scale_ref16_10_ours',
                  'scale_ref16_10_ours_no_interference',
                  'peers_model', 'peers_float32', 'peers_float16',
                  'peers_powersgd1', 'peers_powersgd4',
                  'sharding_ranks', 'sharding_bytes_none',
                  'sharding_bytes_optimizer', 'sharding_bytes_gradients',
                  'sharding_bytes_parameters',
                  'sharding_resnet50_optimizer', 'sharding_resnet50_gradients',
                  'sharding_resnet50_parameters',
                  'sharding_resnet50_parameters_unbounded',
                  'spatial_speedup_p2', 'spatial_peak_p2']


def test_readme_figures_are_the_current_results():
    text, figures = _read('README.md'), benchtables.figures()
    stale = ['%s = %s' % (k, figures[k]) for k in README_FIGURES
             if figures[k] not in text]
    assert not stale, ('README.md lacks the current figures (from '
                       'benchmarks/results): %s' % stale)


# ---------------------------------------------------------------------------
# Performance tables and quoted figures
# ---------------------------------------------------------------------------

@pytest.mark.parametrize('name', sorted(benchtables.TABLES))
def test_table_builds_from_the_current_results(name):
    t = benchtables.TABLES[name]()
    assert t.rows and all(len(r) == len(t.header) for r in t.rows)
    for source in t.sources:
        assert os.path.isfile(os.path.join(benchtables.RESULTS, source))


def _regions(kind):
    out = []
    for name, text in _pages().items():
        out += [(name, r.name) for r in benchregions.regions(text)[0]
                if r.kind == kind]
    return out


def test_the_pages_show_every_table_once_and_only_those():
    # Most tables are on the performance page; a topic's own page (the
    # multi-host soak on multihost.md) may hold its table instead.
    used = [name for _, name in _regions('bench-table')]
    assert sorted(used) == sorted(benchtables.TABLES)
    # Each table's result files are named by a machine line on its page.
    machines = set(_regions('bench-machine'))
    for page, name in _regions('bench-table'):
        for source in benchtables.TABLES[name]().sources:
            assert (page, source) in machines, (page, name, source)


@pytest.mark.parametrize('page', sorted(_pages()))
def test_every_region_of_the_pages_is_what_the_results_give(page):
    # A stale or hand-edited figure, a marker without its pair, a figure
    # hidden by starting a line, and the directives and substitutions
    # that show raw on GitHub all fail here (and warn in make docs).
    problems = benchregions.check(_pages()[page])
    assert not problems, '\n'.join(
        'docs/%s:%d: %s' % (page, line, msg) for line, msg in problems)


def test_the_pages_hold_their_figures_written_in():
    figs = _regions('fig')
    assert len(figs) >= 20 and {'performance.md', 'multihost.md',
                               'compression.md'} <= {p for p, _ in figs}
    for text in _pages().values():
        assert not re.search(r'\{bench-(table|machine)\}|\{\{', text)


def _copy_results(tmp_path):
    import shutil
    for name in os.listdir(benchtables.RESULTS):
        if name.endswith('.json'):
            shutil.copy(os.path.join(benchtables.RESULTS, name), tmp_path)


def test_a_tampered_figure_in_a_page_is_reported():
    text = _read('docs', 'performance.md')
    assert benchregions.check(text) == []
    fig = benchtables.figures()['compression_float32']
    marked = '<!-- fig compression_float32 -->%s<!-- /fig -->' % fig
    assert marked in text
    tampered = text.replace(marked, marked.replace(fig, '0.999'), 1)
    problems = benchregions.check(tampered)
    assert len(problems) == 1
    line, message = problems[0]
    assert 'fig compression_float32 differs' in message
    assert tampered.splitlines()[line - 1].count('0.999') == 1
    # A table cell edited by hand, and the rewrite that repairs both.
    row = '| ChainerMN blocking | 0.253 (0.239, 0.257) | 0.667 |  |'
    assert row in text
    tampered = tampered.replace(row, row.replace('0.667', '0.700'))
    problems = benchregions.check(tampered)
    assert [m.split(' differs')[0] for _, m in problems] == [
        'fig compression_float32', 'bench-table overlap']
    assert benchregions.refresh(tampered)[0] == text


def test_a_result_that_lost_a_key_is_reported(tmp_path):
    import json
    _copy_results(tmp_path)
    text = _read('docs', 'performance.md')
    assert benchregions.check(text, str(tmp_path)) == []
    path = tmp_path / 'overhead.json'
    d = json.loads(path.read_text())
    del d['median_seconds']
    path.write_text(json.dumps(d))
    problems = benchregions.check(text, str(tmp_path))
    assert len(problems) == 1
    assert 'bench-table overhead: cannot build it' in problems[0][1]
    assert "KeyError: 'median_seconds'" in problems[0][1]


def test_marker_mistakes_are_reported():
    fig = benchtables.figures()['gradient_mb']
    cases = {
        # starts a line: an HTML block, which hides the figure
        'a\n<!-- fig gradient_mb -->%s<!-- /fig --> MB\n' % fig:
            'starts a line',
        'a <!-- fig gradient_mb -->%s MB\n' % fig: 'is not closed',
        'a %s<!-- /fig --> MB\n' % fig: 'without its opening',
        'a <!-- fig gradient_mb -->\n%s<!-- /fig -->\n' % fig: 'spans lines',
        'a <!-- fig no_such_figure -->1<!-- /fig -->\n': 'no figure',
        'x <!-- bench-table overlap -->\n<!-- /bench-table -->\n':
            'alone on its line',
        '```{bench-table} overlap\n```\n': '{bench-table} directive',
        'like {{ gradient_mb }} MB\n': '{{ gradient_mb }} substitution',
    }
    for text, expected in cases.items():
        messages = [m for _, m in benchregions.check(text)]
        assert any(expected in m for m in messages), (text, messages)
    ok = 'a <!-- fig gradient_mb -->%s<!-- /fig --> MB\n' % fig
    assert benchregions.check(ok) == []


def test_the_command_line_rewrites_and_checks(tmp_path):
    page = tmp_path / 'page.md'
    page.write_text('# P\n\n<!-- bench-machine overlap.json -->\n'
                    '<!-- /bench-machine -->\n\nsome '
                    '<!-- fig gradient_mb -->1<!-- /fig --> MB\n')
    assert benchtables.main(['--check', str(page)]) == 1
    assert benchtables.main(['--write', str(page)]) == 0
    text = page.read_text()
    assert 'From `benchmarks/results/overlap.json`: ' in text
    assert '<!-- fig gradient_mb -->%s<!-- /fig -->' % \
        benchtables.figures()['gradient_mb'] in text
    assert benchtables.main(['--check', str(page)]) == 0


def test_tables_follow_the_json(tmp_path):
    # A changed result changes the table: copy the results, alter one
    # figure, rebuild.
    import json
    _copy_results(tmp_path)
    before = benchtables.overlap_table(str(tmp_path)).rows[1][2]
    path = tmp_path / 'overlap.json'
    d = json.loads(path.read_text())
    d['calibrated']['modes']['blocking']['scalability'] = 0.5
    path.write_text(json.dumps(d))
    assert before != '0.500'
    assert benchtables.overlap_table(str(tmp_path)).rows[1][2] == '0.500'
    # ... and so the page that shows it no longer matches.
    problems = benchregions.check(_read('docs', 'performance.md'),
                                  str(tmp_path))
    assert [m.split(' differs')[0] for _, m in problems] == [
        'bench-table overlap']


# ---------------------------------------------------------------------------
# Glossary
# ---------------------------------------------------------------------------

def _slug(heading):
    # The anchor GitHub and MyST both give a heading.
    return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def test_glossary_terms_are_defined_once_and_links_to_them_resolve():
    terms = re.findall(r'^## (.+)$', _read('docs', 'glossary.md'), re.M)
    slugs = [_slug(t) for t in terms]
    assert len(slugs) >= 15 and len(set(slugs)) == len(slugs)
    assert 'reference-figures' in slugs and 'test-bed' in slugs
    links = []
    for name, text in _pages().items():
        # Links into the glossary, and the glossary's links to itself.
        prefix = '#' if name == 'glossary.md' else 'glossary.md#'
        links += [(name, a) for a in re.findall(
            r'\]\(%s([\w-]+)\)' % re.escape(prefix), text)]
    assert len(links) > 10
    bad = [(page, a) for page, a in links if a not in slugs]
    assert not bad, bad


def test_no_page_refers_to_internal_tickets():
    for name, text in _pages().items():
        assert not re.search(r'\bissue\b|\bissue\'s\b|\bthe target\b',
                             text, re.I), name


# ---------------------------------------------------------------------------
# API reference
# ---------------------------------------------------------------------------

def test_public_modules_are_the_packages_and_entry_modules():
    mods = apiref.public_modules()
    for name in ('chainermn_overlap', 'chainermn_overlap.distconv',
                 'chainermn_overlap.distconv.geometry',
                 'chainermn_overlap.extensions', 'chainermn_overlap.launch',
                 'chainermn_overlap.hooks', 'chainermn_overlap.testing'):
        assert name in mods
    # Implementation modules are not (the packages re-export what is public).
    assert 'chainermn_overlap.distconv.grid' not in mods
    assert not any('._' in m for m in mods)


def _autoall_pages():
    covered = set()
    for name in os.listdir(os.path.join(DOCS, 'api')):
        text = _read('docs', 'api', name)
        covered.update(re.findall(r'^\.\. autoall::\s+(\S+)', text, re.M))
    return covered


def test_every_public_module_has_an_api_page():
    covered = set(_autoall_pages())
    for name in list(covered):
        covered.update(apiref.autoall_lines(name)[1])
    missing = [m for m in apiref.public_modules() if m not in covered]
    assert not missing, ('no ".. autoall::" in docs/api/ for %s' % missing)


def test_completeness_check_reports_what_is_missing():
    import chainermn_overlap
    mods = ['chainermn_overlap']
    documented = {apiref._key(n, apiref._resolve(chainermn_overlap, n))
                  for n in chainermn_overlap.__all__}
    covered = {'chainermn_overlap', 'chainermn_overlap.distconv'}
    assert apiref.undocumented(mods, documented, covered) == []
    # Negative controls: a name autodoc did not see, a module not covered.
    documented.discard(apiref._key(
        'PowerSGD', chainermn_overlap.PowerSGD))
    problems = apiref.undocumented(mods, documented, covered)
    assert len(problems) == 1 and 'chainermn_overlap.PowerSGD' in problems[0]
    problems = apiref.undocumented(['chainermn_overlap.hooks'], documented,
                                   covered)
    assert len(problems) == 1 and 'no autoall directive' in problems[0]


def test_autoall_documents_each_name_once():
    lines, subs = apiref.autoall_lines('chainermn_overlap.distconv')
    text = '\n'.join(lines)
    assert '.. autoclass:: chainermn_overlap.distconv.SpatialGrid' in text
    assert 'chainermn_overlap.distconv.geometry' in subs
    # tuner.tune is distconv.tune: a reference, not a second entry.
    assert '.. autofunction:: chainermn_overlap.distconv.tuner.tune' \
        not in text
    assert ':py:obj:`chainermn_overlap.distconv.tune`' in text


def test_wrapped_parameter_names_are_joined():
    lines = ['Summary.', '', 'Args:', '    grid (SpatialGrid): The grid.',
             '    a, b,', '    c: As in Chainer.', '    d (int): D,',
             '        wrapped.', '', 'Returns:', '    x, y,']
    apiref.join_wrapped_names(lines)
    assert lines == ['Summary.', '', 'Args:',
                     '    grid (SpatialGrid): The grid.',
                     '    a, b, c: As in Chainer.', '    d (int): D,',
                     '        wrapped.', '', 'Returns:', '    x, y,']


# ---------------------------------------------------------------------------
# Internal link check of the built site
# ---------------------------------------------------------------------------

def test_link_checker_finds_broken_files_and_anchors(tmp_path):
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'index.html').write_text(
        '<a href="page.html#here">ok</a> <a href="page.html#gone">bad</a>'
        '<a href="missing.html">bad</a> <a href="https://x.org/y">ext</a>'
        '<a href="#top" id="top">self</a> <img src="sub/pic.png">')
    (tmp_path / 'page.html').write_text('<h1 id="here">x</h1>'
                                        '<a href="index.html">up</a>')
    problems = check_links.broken_links(str(tmp_path))
    assert len(problems) == 3, problems
    assert any('#gone' in p and 'no anchor' in p for p in problems)
    assert any('missing.html' in p and 'no such file' in p for p in problems)
    assert any('pic.png' in p for p in problems)
    (tmp_path / 'sub' / 'pic.png').write_bytes(b'')
    (tmp_path / 'index.html').write_text('<a href="page.html#here">ok</a>')
    (tmp_path / 'missing.html').write_text('')
    assert check_links.broken_links(str(tmp_path)) == []


# ---------------------------------------------------------------------------
# Toctree: a new page never breaks the build
# ---------------------------------------------------------------------------

@pytest.fixture(scope='module')
def conf():
    old = os.environ.get('CHAINERMN_OVERLAP_DOCS_OFFLINE')
    os.environ['CHAINERMN_OVERLAP_DOCS_OFFLINE'] = '1'
    try:
        return runpy.run_path(os.path.join(DOCS, 'conf.py'))
    finally:
        if old is None:
            del os.environ['CHAINERMN_OVERLAP_DOCS_OFFLINE']
        else:
            os.environ['CHAINERMN_OVERLAP_DOCS_OFFLINE'] = old


def test_every_page_is_in_the_index_toctrees(conf):
    # A page added without its toctree line still builds ("More topics"),
    # but the pages of this checkout each have their place.
    assert conf['_unlisted_pages'](_read('docs', 'index.md')) == []


def test_a_new_page_is_added_to_more_topics(conf):
    index = _read('docs', 'index.md')
    without = index.replace('\ndistconv\n', '\n')
    assert conf['_unlisted_pages'](without) == ['distconv']
    source = [without]
    conf['_add_unlisted'](None, 'index', source)
    assert ':caption: More topics' in source[0]
    assert 'distconv' in conf['_toctree_entries'](source[0])
    assert conf['intersphinx_mapping'] == {}   # offline: no inventories
