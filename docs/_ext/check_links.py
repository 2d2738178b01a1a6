"""Check every internal link of a built HTML site: file and anchor exist.

Usage (``make docs`` runs it after the build)::

    python docs/_ext/check_links.py docs/_build/html

Sphinx's ``linkcheck`` builder fetches external URLs, which this project's
CI cannot reach; this checker reads the output instead.  For every
``href`` and ``src`` in every ``.html`` file that is not external
(``http:``, ``https:``, ``mailto:``, ...), the target file must exist in the
output and, for ``page.html#anchor``, ``page.html`` must have an element
with that ``id`` (or a ``name``).  Exit status 1 and one line per broken
link when any is broken.
"""
import html.parser
import os
import sys
import urllib.parse

EXTERNAL = ('http', 'https', 'mailto', 'ftp', 'data', 'javascript', 'file')


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ('id', 'name'):
            if attrs.get(key):
                self.ids.add(attrs[key])
        for key in ('href', 'src'):
            if attrs.get(key) is not None and not (
                    tag == 'link' and attrs.get('rel') == 'canonical'):
                self.links.append((tag, key, attrs[key], self.getpos()[0]))


def _parse(path, cache):
    if path not in cache:
        page = _Page()
        with open(path, encoding='utf-8', errors='replace') as f:
            page.feed(f.read())
        cache[path] = page
    return cache[path]


def broken_links(root):
    """Lists the broken internal links of the site under ``root``.

    Args:
        root (str): The output folder (``docs/_build/html``).

    Returns:
        list of str: ``file:line: link (why)`` for each broken link.
    """
    cache, problems = {}, []
    root = os.path.abspath(root)
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith('.html'):
                continue
            path = os.path.join(folder, name)
            page = _parse(path, cache)
            for tag, key, link, line in page.links:
                why = _check(root, path, link, page, cache)
                if why:
                    problems.append('%s:%d: %s="%s" (%s)' % (
                        os.path.relpath(path, root), line, key, link, why))
    return problems


def _check(root, page_path, link, page, cache):
    parts = urllib.parse.urlsplit(link)
    if parts.scheme in EXTERNAL or parts.netloc:
        return None
    if parts.scheme:
        return 'unknown scheme %r' % parts.scheme
    if not parts.path:
        target, target_page = page_path, page
    else:
        target = os.path.normpath(os.path.join(
            os.path.dirname(page_path),
            urllib.parse.unquote(parts.path)))
        if not target.startswith(root + os.sep) and target != root:
            return 'points outside the site'
        if os.path.isdir(target):
            target = os.path.join(target, 'index.html')
        if not os.path.isfile(target):
            return 'no such file'
        target_page = None
    if parts.fragment:
        if not target.endswith('.html'):
            return None
        if target_page is None:
            target_page = _parse(target, cache)
        if urllib.parse.unquote(parts.fragment) not in target_page.ids:
            return 'no anchor #%s in %s' % (parts.fragment,
                                             os.path.relpath(target, root))
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        sys.stderr.write('usage: check_links.py HTML_OUTPUT_FOLDER (an '
                         'existing folder; build the site first)\n')
        return 2
    problems = broken_links(argv[0])
    for p in problems:
        sys.stdout.write(p + '\n')
    pages = sum(len([f for f in fs if f.endswith('.html')])
                for _, _, fs in os.walk(argv[0]))
    sys.stdout.write('check_links: %d page(s), %d broken internal link(s)\n'
                     % (pages, len(problems)))
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
