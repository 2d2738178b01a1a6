"""Stand-ins that let Chainer 7.8.1 import on Python 3.12 and 3.13.

Chainer 7.8.1 imports two modules at start-up that a current environment
may not have:

* ``numpy.distutils.system_info``: NumPy has no ``numpy.distutils`` on
  Python 3.12 and later.  Chainer calls its ``get_info('blas_opt')`` only on
  macOS, to warn about Accelerate;
* ``pkg_resources``: setuptools 82 and later have none (what an install
  of Chainer's dependencies without the project's constraints picks).
  Chainer uses ``require`` and ``get_distribution`` to warn when an optional package (CuPy, iDeep) has a
  version it was not tested with, and ``chainer.testing`` uses
  ``WorkingSet().require``.

``chainermn_overlap-compat.pth``, installed into ``site-packages`` by the
wheel and by the editable install, runs at every start of the environment's
Python, so it must cost nothing and change nothing when it is not needed.
Its one line appends a small finder to the *end* of ``sys.meta_path``
(unless ``CHAINERMN_OVERLAP_NO_COMPAT`` is set) and imports nothing: only
when a module named above is looked up does that finder import this module
and call :func:`find_spec`.  The import system asks a finder at the end only
about a module that no other finder found, so where the real module exists
it is found first and this module is never imported.  :func:`find_spec`
answers only for the two modules above, and only when the import comes from
Chainer's or ChainerMN's own code: any other program that probes for
``numpy.distutils`` or ``pkg_resources`` still finds them missing.

Turn it off with ``CHAINERMN_OVERLAP_NO_COMPAT=1`` in the environment, or by
deleting ``chainermn_overlap-compat.pth`` from ``site-packages``.

This is a top-level module, not part of the ``chainermn_overlap`` package,
because importing the package imports Chainer: the stand-ins must be in
place before that.
"""
import os
import sys

#: ``1`` leaves Chainer's imports alone (a flag as the package's others:
#: off when unset, empty, ``0``, ``false``, ``no`` or ``off``).  Read by the
#: start-up file (which spells it too) and :func:`install`, before the
#: package can be imported; listed in :mod:`chainermn_overlap.config`.
DISABLE_ENV = 'CHAINERMN_OVERLAP_NO_COMPAT'
_OFF = ('', '0', 'false', 'no', 'off')

# Who may be given a stand-in: modules of these packages (and their
# sub-modules) importing one of the names below.
_IMPORTERS = ('chainer', 'chainermn', 'chainerx', 'onnx_chainer')
_STAND_INS = ('numpy.distutils', 'numpy.distutils.system_info',
              'pkg_resources')


def _disabled():
    return os.environ.get(DISABLE_ENV, '').strip().lower() not in _OFF


def _importer():
    """The module name of the code that started the import under way."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get('__name__', '')
        # The import system's own frames: frozen importlib, the importlib
        # package (import_module), meta path finders that ask others, and
        # the start-up file's finder (a line of a .pth file runs with the
        # site module's globals).
        if not (frame.f_code.co_filename.startswith('<frozen ')
                or frame.f_code.co_name == 'find_spec'
                or name.startswith('importlib') or name == 'site'):
            return name
        frame = frame.f_back
    return ''


def _from_chainer(name):
    return any(name == p or name.startswith(p + '.') for p in _IMPORTERS)


def find_spec(fullname, path=None, target=None):
    """The spec of a stand-in for ``fullname`` when Chainer imports it.

    Called only for a module no other finder found (the finders that call
    it are last on ``sys.meta_path``); None for every other module or
    importer.
    """
    if fullname not in _STAND_INS or not _from_chainer(_importer()):
        return None
    import importlib.machinery
    return importlib.machinery.ModuleSpec(
        fullname, _Loader(), is_package=(fullname == 'numpy.distutils'))


class StandInFinder(object):
    """A meta path finder (the importlib protocol) for the stand-ins, as
    the start-up file's, for :func:`install`."""

    __chainermn_overlap_stand_ins__ = True

    def find_spec(self, fullname, path=None, target=None):
        return find_spec(fullname, path, target)

    def __repr__(self):
        return '<chainermn_overlap stand-ins for %s>' % ', '.join(_STAND_INS)


class _Loader(object):
    def create_module(self, spec):
        return None     # the default module object

    def exec_module(self, module):
        module.__chainermn_overlap_stand_in__ = True
        if module.__name__ == 'numpy.distutils':
            module.__doc__ = ('Stand-in for numpy.distutils (absent on Python '
                              '3.12+), for Chainer 7.8.1: only system_info.')
        elif module.__name__ == 'numpy.distutils.system_info':
            module.__doc__ = 'Stand-in: get_info finds nothing.'
            module.get_info = _get_info
        else:
            _fill_pkg_resources(module)


def _get_info(name, notfound_action=0):
    """Nothing found, as numpy.distutils says of an unconfigured library."""
    return {}


def _fill_pkg_resources(module):
    """What Chainer uses of pkg_resources, from importlib.metadata."""
    import importlib.metadata as metadata

    class ResolutionError(Exception):
        pass

    class DistributionNotFound(ResolutionError):
        pass

    class VersionConflict(ResolutionError):
        pass

    class Distribution(object):
        def __init__(self, name, version):
            self.project_name, self.key = name, name.lower()
            self.version = version

        def __repr__(self):
            return '%s %s' % (self.project_name, self.version)

    def _split(requirement):
        text = str(requirement).strip()
        for i, c in enumerate(text):
            if c in '<>=!~;[ ':
                return text[:i], text[i:].strip()
        return text, ''

    def get_distribution(requirement):
        name, _ = _split(requirement)
        try:
            return Distribution(name, metadata.version(name))
        except metadata.PackageNotFoundError:
            raise DistributionNotFound(name)

    def require(*requirements):
        found = []
        for requirement in requirements:
            dist = get_distribution(requirement)
            _, spec = _split(requirement)
            if spec and not _satisfies(dist.version, spec):
                raise VersionConflict(dist, requirement)
            found.append(dist)
        return found

    class WorkingSet(object):
        def require(self, *requirements):
            return require(*requirements)

    module.__doc__ = ('Stand-in for pkg_resources (absent from setuptools 82 '
                      'and later), for Chainer 7.8.1: require, '
                      'get_distribution, WorkingSet.require.')
    for value in (ResolutionError, DistributionNotFound, VersionConflict,
                  Distribution, WorkingSet):
        value.__module__ = 'pkg_resources'
        setattr(module, value.__name__, value)
    module.get_distribution = get_distribution
    module.require = require


def _satisfies(version, spec):
    """Whether ``version`` meets ``spec`` (e.g. ``>=7.7.0,<8.0.0``).

    Uses ``packaging`` where it is installed; without it the version is
    taken to fit, which only silences Chainer's warning about an optional
    package's version.
    """
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion
    except ImportError:
        return True
    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return True


_FINDER = StandInFinder()


def _ours(finder):
    return getattr(finder, '__chainermn_overlap_stand_ins__', False)


def install():
    """Appends a finder to ``sys.meta_path`` as the start-up file does
    (where none is there yet); a no-op when disabled."""
    if _disabled():
        return
    if not any(_ours(f) for f in sys.meta_path):
        sys.meta_path.append(_FINDER)


def uninstall():
    """Removes the finders, the start-up file's too (what has been imported
    through them stays)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not _ours(f)]
