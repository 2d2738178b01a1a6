"""The public surface: ``__all__`` lists what exists, hints resolve, and the
package is marked as typed (PEP 561)."""
import importlib
import importlib.util
import inspect
import os
import typing

import pytest


PUBLIC_MODULES = [
    'chainermn_overlap',
    'chainermn_overlap.errors',
    'chainermn_overlap.testing',
    'chainermn_overlap.testing.device',
    'chainermn_overlap.testing.equivalence',
    'chainermn_overlap.testing.models',
    'chainermn_overlap.distconv',
    'chainermn_overlap.distconv.exchange',
    'chainermn_overlap.distconv.functions',
    'chainermn_overlap.distconv.geometry',
    'chainermn_overlap.distconv.grid',
    'chainermn_overlap.distconv.links',
    'chainermn_overlap.distconv.normalization',
    'chainermn_overlap.distconv.redistribute',
    'chainermn_overlap.distconv.tuner',
    'chainermn_overlap.hooks',
    'chainermn_overlap.hooks.taps',
]


@pytest.mark.parametrize('name', PUBLIC_MODULES)
def test_all_lists_existing_names_once(name):
    mod = importlib.import_module(name)
    assert isinstance(mod.__all__, list)
    assert len(set(mod.__all__)) == len(mod.__all__)
    # Submodules listed in __all__ are imported by ``import *``.
    missing = [n for n in mod.__all__ if not hasattr(mod, n)
               and importlib.util.find_spec(name + '.' + n) is None]
    assert not missing, missing


@pytest.mark.parametrize('name', ['chainermn_overlap',
                                  'chainermn_overlap.distconv',
                                  'chainermn_overlap.hooks'])
def test_package_exports_what_it_imports(name):
    # A name re-exported by the package's __init__ (a class or function of
    # the package) but left out of __all__ would be missing from
    # ``import *`` and from the documented API.
    mod = importlib.import_module(name)
    exported = {n for n, v in vars(mod).items()
                if not n.startswith('_')
                and (inspect.isclass(v) or inspect.isfunction(v))
                and v.__module__.startswith('chainermn_overlap')}
    assert exported <= set(mod.__all__), exported - set(mod.__all__)


def test_star_import_gives_the_public_api():
    ns = {}
    exec('from chainermn_overlap import *', ns)
    assert 'create_overlapped_optimizer' in ns
    assert 'distconv' in ns and hasattr(ns['distconv'], 'SpatialGrid')
    assert 'abort' not in ns and 'optimizers' not in ns


def _hinted_callables(mod):
    for n in mod.__all__:
        obj = getattr(mod, n)
        if inspect.isfunction(obj):
            yield n, obj
        elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
            for m, fn in vars(obj).items():
                if inspect.isfunction(fn) and (not m.startswith('_')
                                               or m == '__init__'):
                    yield '%s.%s' % (n, m), fn


@pytest.mark.parametrize('name', [m for m in PUBLIC_MODULES
                                  if not m.endswith(('overlap', 'distconv',
                                                     'hooks', 'testing'))])
def test_type_hints_resolve(name):
    # Hints are not evaluated at run time (postponed annotations); resolve
    # them here so that a misspelt name fails a test.  Names imported only
    # for type checkers are supplied.
    from chainermn_overlap.distconv.grid import SpatialGrid
    mod = importlib.import_module(name)
    ns = dict(vars(mod))
    ns.setdefault('SpatialGrid', SpatialGrid)
    # chainer.types.NdArray names cuda/chainerx types only for checkers.
    ns.setdefault('NdArray', typing.Any)
    ns.setdefault('Input', typing.Any)
    ns.setdefault('IntOrTuple', typing.Any)
    for qualname, fn in _hinted_callables(mod):
        typing.get_type_hints(fn, globalns=ns)


def test_public_functions_are_annotated():
    from chainermn_overlap.distconv import functions, geometry, redistribute
    for mod in (functions, geometry, redistribute):
        for n in mod.__all__:
            obj = getattr(mod, n)
            if inspect.isfunction(obj):
                assert 'return' in obj.__annotations__, '%s.%s' % (
                    mod.__name__, n)


def test_package_is_marked_typed():
    # Checked on the installed package: the wheel check runs this against a
    # wheel, where a py.typed left out of the package data is missing.
    import chainermn_overlap
    pkg = os.path.dirname(chainermn_overlap.__file__)
    assert os.path.isfile(os.path.join(pkg, 'py.typed'))


def test_version_is_the_installed_distributions():
    # One place for the version (chainermn_overlap/__init__.py, read by
    # pyproject.toml); the installed metadata must carry the same.
    from importlib import metadata
    import chainermn_overlap
    assert chainermn_overlap.__version__ == metadata.version(
        'chainermn_overlap')
