"""Chainer 7.8.1 on Python 3.12+: the start-up stand-ins and the Python picker.

``_chainermn_overlap_compat`` (run at start-up by
``chainermn_overlap-compat.pth``) serves ``numpy.distutils.system_info`` and
``pkg_resources`` to Chainer where they are missing.  On Python 3.12 and
3.13 ``numpy.distutils`` is really missing, and the tests below show the
failure without the stand-ins (``CHAINERMN_OVERLAP_NO_COMPAT=1``) before
they show it gone; on 3.11 a finder that hides a module reproduces the
absence (its negative control fails the same way).
"""
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

import _chainermn_overlap_compat as compat
from chainermn_overlap import config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
NEW_PYTHON = sys.version_info >= (3, 12)

# A finder put first on sys.meta_path that makes the named modules missing,
# as numpy.distutils is on Python 3.12+ and pkg_resources with setuptools 82+:
# only the start-up file's finder (at the end of sys.meta_path, as the
# import system would reach it) is asked about them, and only when SERVE
# (else they stay missing: the negative control; what this Python lacks
# anyway is served by that finder in both cases).
HIDE = textwrap.dedent('''
    import sys
    HIDDEN = %r
    SERVE = %r

    class Hide(object):
        def find_spec(self, name, path=None, target=None):
            if not any(name == h or name.startswith(h + '.') for h in HIDDEN):
                return None
            for finder in sys.meta_path if SERVE else ():
                if getattr(finder, '__chainermn_overlap_stand_ins__', False):
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        return spec
            raise ModuleNotFoundError('No module named %%r' %% name, name=name)

    for name in list(sys.modules):
        if any(name == h or name.startswith(h + '.') for h in HIDDEN):
            del sys.modules[name]
    sys.meta_path.insert(0, Hide())
''')

TRAIN = textwrap.dedent('''
    import chainer
    import chainer.functions as F
    import chainer.links as L
    import chainermn
    import numpy as np
    model = L.Linear(3, 2)
    opt = chainer.optimizers.Adam()
    opt.setup(model)
    x = np.ones((4, 3), np.float32)
    loss = F.sum(F.max_pooling_2d(
        F.convolution_2d(x.reshape(1, 1, 4, 3), np.ones((1, 1, 2, 2), np.float32)),
        2, cover_all=False)) + F.sum(model(x))
    model.cleargrads()
    loss.backward()
    opt.update()
    print('trained', chainer.__version__)
''')


def run(code, disable=True, env=None):
    environ = dict(os.environ, **(env or {}))
    environ.pop('PYTHONPATH', None)
    if disable:
        environ[config.NO_COMPAT_ENV] = '1'
    else:
        environ.pop(config.NO_COMPAT_ENV, None)
    return subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=environ,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=120)


@pytest.mark.parametrize('hidden', [
    ('numpy.distutils',), ('pkg_resources',),
    ('numpy.distutils', 'pkg_resources')])
def test_chainer_trains_with_the_modules_missing(hidden):
    without = run(HIDE % (hidden, False) + TRAIN, disable=False)
    assert without.returncode != 0
    assert "No module named '%s" % hidden[0] in without.stdout, without.stdout
    done = run(HIDE % (hidden, True) + TRAIN + textwrap.dedent('''
        for name in %r:
            assert sys.modules[name].__chainermn_overlap_stand_in__, name
    ''' % (hidden,)), disable=False)
    assert done.returncode == 0, done.stdout
    assert 'trained 7.8.1' in done.stdout


def test_other_importers_still_find_them_missing():
    hidden = ('numpy.distutils', 'pkg_resources')
    probe = run(HIDE % (hidden, True) + textwrap.dedent('''
        import importlib
        for name in ('numpy.distutils', 'numpy.distutils.system_info',
                     'pkg_resources'):
            for how in ('import', 'import_module'):
                try:
                    if how == 'import':
                        exec('import ' + name)
                    else:
                        importlib.import_module(name)
                except ImportError:
                    pass
                else:
                    raise SystemExit('%s served to a program by %s' % (name, how))
        import chainer
        print('missing for the program, served to chainer')
    '''), disable=False)
    assert probe.returncode == 0, probe.stdout
    assert 'missing for the program, served to chainer' in probe.stdout


def test_the_start_up_file_is_installed_and_installs_the_finder():
    purelib = sysconfig.get_paths()['purelib']
    assert os.path.isfile(os.path.join(purelib, 'chainermn_overlap-compat.pth'))
    # One finder, last; the module itself is not imported at start-up.
    check = ('import sys; '
             'print(sum(getattr(f, "__chainermn_overlap_stand_ins__", False) '
             'for f in sys.meta_path), '
             'getattr(sys.meta_path[-1], "__chainermn_overlap_stand_ins__", '
             'False), "_chainermn_overlap_compat" in sys.modules)')
    assert run(check, disable=False).stdout.split() == ['1', 'True', 'False']
    assert run(check, disable=True).stdout.split() == ['0', 'False', 'False']
    for off in ('0', 'off', ''):
        out = run(check, disable=False, env={config.NO_COMPAT_ENV: off})
        assert out.stdout.split() == ['1', 'True', 'False'], off
    # install() and the start-up file's finder are one: never two.
    twice = run('import sys, _chainermn_overlap_compat as c; c.install(); '
                'print(sum(c._ours(f) for f in sys.meta_path))', disable=False)
    assert twice.stdout.split() == ['1'], twice.stdout


def test_the_variable_is_the_configs():
    assert compat.DISABLE_ENV == config.NO_COMPAT_ENV


@pytest.mark.skipif(not NEW_PYTHON, reason='numpy.distutils exists on '
                    'Python < 3.12 (the tests above hide it instead)')
def test_on_this_python_chainer_needs_the_stand_in():
    without = run('import chainer')
    assert without.returncode != 0
    assert "No module named 'numpy.distutils'" in without.stdout
    done = run(TRAIN + textwrap.dedent('''
        import sys
        assert sys.modules['numpy.distutils'].__chainermn_overlap_stand_in__
        import chainermn_overlap
    '''), disable=False)
    assert done.returncode == 0, done.stdout
    assert 'trained 7.8.1' in done.stdout


def test_pkg_resources_stand_in_checks_versions():
    import types
    module = types.ModuleType('pkg_resources')
    compat._fill_pkg_resources(module)
    import numpy
    assert module.get_distribution('numpy').version == numpy.__version__
    assert [d.version for d in module.require('numpy>=1.0,<3')] == [
        numpy.__version__]
    assert module.WorkingSet().require('numpy')[0].project_name == 'numpy'
    with pytest.raises(module.DistributionNotFound):
        module.require('no-such-distribution-here>=1')
    try:
        import packaging.specifiers  # noqa: F401
    except ImportError:
        pytest.skip('packaging is not installed: versions are not compared')
    with pytest.raises(module.VersionConflict):
        module.require('numpy>=99')
    assert issubclass(module.VersionConflict, module.ResolutionError)


def test_numpy_has_a_blas():
    # On Python 3.13 pip builds NumPy below 2 from source, and without
    # OpenBLAS's development files that build has no BLAS (the ResNet-50
    # demo ran 20 times slower); make's tools/numpy_blas.sh rebuilds it.
    import numpy
    blas = numpy.show_config(mode='dicts')['Build Dependencies']['blas']
    assert blas.get('found'), blas
