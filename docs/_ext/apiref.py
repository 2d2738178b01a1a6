"""API reference generated from ``__all__``, and a check that it is complete.

The ``autoall`` directive documents every name in a module's ``__all__``
with the matching autodoc directive (classes with their members, functions,
exceptions, data; submodules listed in ``__all__`` as sections of their
own), so a name added to ``__all__`` appears in the reference without
editing a page.  A name that is the same object as one of the top-level
package's names is listed as an alias of it instead of being documented
twice.

After reading, every public module (:func:`public_modules`: the package,
its subpackages and modules not starting with ``_`` that define
``__all__``) is checked: each name of its ``__all__`` must have been
documented, under any module.  An undocumented name, or a public module no
``autoall`` directive covers, is a Sphinx warning, so ``make docs`` (``-W``)
fails.  The pure parts (:func:`public_modules`, :func:`undocumented`) are
tested without Sphinx in ``tests/unit/test_docs.py``.
"""
import importlib
import inspect
import pkgutil
import types

TOP = 'chainermn_overlap'


# Public modules that are neither packages nor listed in a package's
# ``__all__``: the trainer extensions and the launcher, used by their module
# name (``chainermn_overlap.extensions.auto_snapshot``, ``python -m
# chainermn_overlap.launch``).  Were they to become packages they would be
# found as packages anyway.
ENTRY_MODULES = ('chainermn_overlap.extensions', 'chainermn_overlap.launch')


def _is_package(mod):
    return hasattr(mod, '__path__')


def public_modules(top=TOP, extra=ENTRY_MODULES):
    """Names of the modules whose ``__all__`` is the public API.

    These are ``top``, each of its subpackages (recursively) whose dotted
    name has no part starting with ``_``, each module named in the
    ``__all__`` of one of these (``distconv.geometry``), and ``extra``.
    Implementation modules of a package (``distconv.grid``) are not: what
    of them is public, the package re-exports.  A subpackage whose import
    fails for want of an optional dependency is skipped.

    Returns:
        list of str: Dotted module names, ``top`` first, then sorted.
    """
    pkg = importlib.import_module(top)
    names = {top}
    for info in pkgutil.walk_packages(pkg.__path__, top + '.'):
        parts = info.name.split('.')[1:]
        if not info.ispkg or any(p.startswith('_') for p in parts):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:
            continue
        names.add(info.name)
    for name in list(names):
        mod = importlib.import_module(name)
        for n in getattr(mod, '__all__', ()):
            obj = _resolve(mod, n)
            if isinstance(obj, types.ModuleType) and \
                    obj.__name__.startswith(top + '.'):
                names.add(obj.__name__)
    names.update(extra)
    return [top] + sorted(names - {top})


def _key(name, obj):
    return name.rsplit('.', 1)[-1], id(obj)


def undocumented(modules, documented, covered):
    """What the reference misses.

    Args:
        modules (list of str): Public module names (:func:`public_modules`).
        documented (set): ``(short name, id(object))`` of every object
            autodoc documented.
        covered (set of str): Modules named by an ``autoall`` directive.

    Returns:
        list of str: One line per problem, empty when complete.
    """
    problems = []
    for modname in modules:
        mod = importlib.import_module(modname)
        if modname not in covered:
            problems.append(
                'public module %s has no autoall directive in the API '
                'reference (docs/api/): add ".. autoall:: %s" to a page'
                % (modname, modname))
            continue
        for name in mod.__all__:
            obj = _resolve(mod, name)
            if isinstance(obj, types.ModuleType):
                if obj.__name__ not in covered and \
                        _key(obj.__name__, obj) not in documented:
                    problems.append('%s.%s (a module) is not documented'
                                    % (modname, name))
            elif _key(name, obj) not in documented:
                problems.append(
                    '%s.%s is in __all__ but not documented (autodoc saw no '
                    'object of that name)' % (modname, name))
    return problems


def _resolve(mod, name):
    if hasattr(mod, name):
        return getattr(mod, name)
    return importlib.import_module(mod.__name__ + '.' + name)


def _kind(obj):
    if isinstance(obj, types.ModuleType):
        return 'module'
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return 'exception'
        return 'class'
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return 'function'
    return 'data'


def _ancestors(modname):
    parts = modname.split('.')
    return ['.'.join(parts[:i]) for i in range(1, len(parts))]


def autoall_lines(modname, level_chars='-~^'):
    """reST lines documenting every name of ``modname.__all__``.

    A name that is the same object as the same name of an ancestor package
    becomes a cross-reference to it (the ancestor's page documents it).  A
    subpackage in ``__all__`` is left to its own page; a plain module in
    ``__all__`` becomes a section of this page.

    Args:
        modname (str): The module.
        level_chars (str): Underline characters of the section levels used
            for the modules in ``__all__``.

    Returns:
        tuple: ``(lines, modules)``: the lines, and the dotted names of the
        modules documented as sections (which count as covered).
    """
    mod = importlib.import_module(modname)
    ancestors = [importlib.import_module(a) for a in _ancestors(modname)]
    lines = ['.. automodule:: %s' % modname, '   :no-members:', '']
    aliases, submodules = [], []
    for name in mod.__all__:
        obj = _resolve(mod, name)
        kind = _kind(obj)
        if kind == 'module':
            if not _is_package(obj):
                submodules.append(obj.__name__)
            continue
        owner = next((a.__name__ for a in ancestors
                      if getattr(a, name, None) is obj), None)
        if owner is not None:
            aliases.append((name, owner))
            continue
        target = '%s.%s' % (modname, name)
        if kind == 'class':
            lines += ['.. autoclass:: %s' % target, '   :members:',
                      '   :show-inheritance:', '']
        elif kind == 'exception':
            lines += ['.. autoexception:: %s' % target,
                      '   :show-inheritance:', '']
        elif kind == 'function':
            lines += ['.. autofunction:: %s' % target, '']
        else:
            lines += ['.. autodata:: %s' % target, '']
    if aliases:
        lines += ['Also here, documented with the package that re-exports '
                  'them:', '']
        lines += ['* ``%s``: :py:obj:`%s.%s`' % (n, owner, n)
                  for n, owner in aliases]
        lines.append('')
    nested = []
    for sub in submodules:
        title = '``%s``' % sub
        lines += [title, level_chars[0] * len(title), '']
        sub_lines, deeper = autoall_lines(sub, level_chars[1:] or level_chars)
        lines += sub_lines
        nested += deeper
    return lines, submodules + nested


_ARG_SECTIONS = ('Args:', 'Arguments:', 'Parameters:', 'Keyword Args:',
                 'Keyword Arguments:')


def join_wrapped_names(lines):
    """Joins a parameter-name list wrapped over several docstring lines.

    Google style puts ``a, b, c: description`` on one line; some docstrings
    wrap a long list of names (``a, b,`` then ``c: ...`` on the next line),
    which napoleon reads as a parameter without description followed by
    stray text.  Inside an argument section, a line that ends with ``,``
    and has no ``:`` is joined with the line after it.

    Args:
        lines (list of str): Docstring lines (edited in place).
    """
    in_args, i = False, 0
    while i < len(lines):
        text = lines[i].strip()
        if text in _ARG_SECTIONS:
            in_args = True
        elif text.endswith(':') and not lines[i].startswith((' ', '\t')):
            in_args = False
        elif (in_args and text.endswith(',') and ':' not in text
              and i + 1 < len(lines) and lines[i + 1].strip()):
            lines[i] = lines[i].rstrip() + ' ' + lines.pop(i + 1).strip()
            continue
        i += 1


def setup(app):
    from docutils.parsers.rst import Directive
    from docutils.statemachine import StringList
    from docutils import nodes
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    state = {'documented': set(), 'covered': set()}

    class AutoAll(Directive):
        """``.. autoall:: module``: document ``module.__all__``."""
        required_arguments = 1

        def run(self):
            modname = self.arguments[0]
            lines, subs = autoall_lines(modname)
            state['covered'].add(modname)
            state['covered'].update(subs)
            source = self.state_machine.get_source(self.lineno)
            node = nodes.container()
            self.state.nested_parse(StringList(lines, source), 0, node,
                                    match_titles=True)
            return node.children

    def on_docstring(app, what, name, obj, options, lines):
        state['documented'].add(_key(name, obj))
        # A constant without a doc comment would show its type's docstring
        # (int's, str's); its name and value say more.
        if what == 'data' and getattr(obj, '__doc__', None) == \
                getattr(type(obj), '__doc__', None):
            del lines[:]

    def on_consistency(app, env):
        for problem in undocumented(public_modules(), state['documented'],
                                    state['covered']):
            logger.warning(problem, type='apiref', subtype='undocumented')

    app.add_directive('autoall', AutoAll)
    app.connect('autodoc-process-docstring', on_docstring)
    # Before napoleon (priority 500) turns the sections into fields.
    app.connect('autodoc-process-docstring',
                lambda app, what, name, obj, options, lines:
                join_wrapped_names(lines), priority=400)
    app.connect('env-check-consistency', on_consistency)
    return {'parallel_read_safe': False, 'parallel_write_safe': True}
