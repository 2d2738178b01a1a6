"""What the library changes outside itself, and that it is undone.

``chainermn_overlap._patches`` installs the Chainer and ChainerMN patches
when their first user appears and removes them when the last is gone; the
import of the package changes nothing global.  (The same with real
optimizers, closed one after the other: ``tests/mpi/test_autosync.py``.)
"""
import json
import os
import subprocess
import sys
import textwrap
import threading

import chainer

from chainermn_overlap import _patches
from chainermn_overlap import config
from chainermn_overlap.hooks import taps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# Run in a fresh interpreter: snapshot everything the library could change,
# import it (every subpackage), compare; then show that the comparison sees
# a change (the patches of a user), and that releasing undoes it.
_IMPORT_SCRIPT = textwrap.dedent('''
    import atexit, json, sys, threading
    import chainer, chainermn, mpi4py.MPI
    from chainer import computational_graph, device_resident, link
    from chainermn.extensions import _multi_node_snapshot

    OWNERS = [link.Link, link.Chain, link.ChainList,
              device_resident.DeviceResident, computational_graph,
              _multi_node_snapshot._MultiNodeSnapshot]
    MISSING = object()

    def state():
        return ([dict(vars(o)) for o in OWNERS], atexit._ncallbacks(),
                sys.excepthook, threading.excepthook,
                dict(chainer.get_function_hooks()))

    def changes(a, b):
        out = []
        for owner, x, y in zip(OWNERS, a[0], b[0]):
            out += ['{}.{}'.format(owner.__name__, k) for k in set(x) | set(y)
                    if x.get(k, MISSING) is not y.get(k, MISSING)]
        out += [what for what, i in (('atexit', 1), ('sys.excepthook', 2),
                                     ('threading.excepthook', 3))
                if a[i] != b[i]]
        if a[4].keys() != b[4].keys():
            out.append('function hooks')
        return sorted(out)

    before = state()
    import chainermn_overlap
    import chainermn_overlap.distconv, chainermn_overlap.extensions
    import chainermn_overlap.launch, chainermn_overlap.testing
    from chainermn_overlap import _patches
    after_import = changes(before, state())
    from chainermn_overlap.communication import engine
    registered = sorted(engine._BACKENDS)
    found = engine.get_backend('mpi_thread').__name__
    uncovered = [str(o) for o, _ in _patches.targets()
                 if not any(o is x for x in OWNERS)]

    class User(object):
        pass
    user = User()
    _patches.acquire('optimizer', user)
    _patches.acquire('multi_node_snapshot', user)
    from chainermn_overlap.hooks import taps
    taps.ensure_param_use_hook()
    _patches.at_exit(lambda: None, order=0)
    while_used = changes(before, state())
    _patches.release('optimizer', user)
    _patches.release('multi_node_snapshot', user)
    after_release = changes(before, state())
    print(json.dumps({'after_import': after_import, 'uncovered': uncovered,
                      'registered': registered, 'found': found,
                      'targets': len(_patches.targets()),
                      'while_used': while_used,
                      'after_release': after_release}))
''')


def test_import_changes_nothing_global():
    got = _run(_IMPORT_SCRIPT)
    assert got['after_import'] == []
    # No engine registered by the import; built-in ones found by name.
    assert got['registered'] == []
    assert got['found'] == 'MpiThreadBackend'
    # Every owner of a patched attribute was compared.
    assert got['uncovered'] == []
    # The comparison sees the patches: every target, the function hook and
    # the exit handler (its atexit registration) while a user holds them.
    assert len(got['while_used']) == got['targets'] + 2
    assert 'function hooks' in got['while_used']
    assert 'atexit' in got['while_used']
    # Released: every patched attribute is the original again (the exit
    # handler, once registered, stays).
    assert got['after_release'] == ['atexit']


# Two optimizers at one rank (one sharded), closed one after the other, in
# a fresh interpreter (no other optimizer alive).
_OPTIMIZERS_SCRIPT = textwrap.dedent('''
    import json, pickle
    import chainer, chainermn, numpy as np
    import chainer.functions as F
    import chainermn_overlap
    from chainermn_overlap import _patches
    from chainermn_overlap.hooks import taps
    from chainermn_overlap.testing import models

    def replaced(recorded):
        return ['{}.{}'.format(getattr(o, '__name__', o), n)
                for o, n, orig in recorded
                if vars(o).get(n, _patches.MISSING) is not orig]

    comm = chainermn.create_communicator('naive')
    out, opts = {}, []
    for shard in (None, 'optimizer'):
        model = models.MLP(4, 6, 3, n_layers=2, activation=F.tanh,
                           loss=models.sum_of_squares)
        opt = chainermn_overlap.create_overlapped_optimizer(
            chainer.optimizers.Adam(), comm, shard=shard).setup(model)
        for i in range(2):
            opt.update(model, np.random.RandomState(i).randn(5, 4).astype(
                np.float32))
        opts.append((opt, model))
    recorded = _patches.installed()
    out['recorded'] = len(recorded)
    out['replaced'] = len(replaced(recorded))
    out['hook'] = taps.ParamUseHook.name in chainer.get_function_hooks()
    pickle.dumps(opts[0][1])
    opts[0][0].close()
    out['after_first'] = len(replaced(recorded))
    opts[1][0].close()
    out['after_last'] = replaced(recorded)
    out['installed'] = len(_patches.installed())
    out['hook_after'] = (taps.ParamUseHook.name
                         in chainer.get_function_hooks())
    print(json.dumps(out))
''')


def _run(script):
    env = dict(os.environ)
    env.pop(config.ABORT_ON_EXCEPTION_ENV, None)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    out = subprocess.run([sys.executable, '-c', script], env=env,
                         cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_closing_the_last_optimizer_restores_chainer():
    got = _run(_OPTIMIZERS_SCRIPT)
    # Both groups: Chainer's methods and ChainerMN's multi_node_snapshot.
    assert got['recorded'] == len(_patches.targets())
    assert got['replaced'] == got['recorded']
    assert got['hook']
    # The sharded optimizer still holds every patch.
    assert got['after_first'] == got['recorded']
    assert got['after_last'] == []
    assert got['installed'] == 0
    assert not got['hook_after']


class _User(object):
    pass


def _current(owner, name):
    return vars(owner).get(name)


def test_patches_are_counted_and_undone():
    assert not _patches.active('optimizer')
    first, second = _User(), _User()
    _patches.acquire('optimizer', first)
    try:
        recorded = _patches.installed()
        assert recorded
        # Installed: no attribute is the original.
        assert all(_current(owner, name) is not original
                   for owner, name, original in recorded)
        _patches.acquire('optimizer', second)
        _patches.acquire('optimizer', second)   # idempotent per user
        _patches.release('optimizer', first)
        assert _patches.installed() == recorded
        _patches.release('optimizer', first)    # idempotent: still held
        assert _patches.active('optimizer')
    finally:
        _patches.release('optimizer', first)
        _patches.release('optimizer', second)
    assert not _patches.active('optimizer')
    assert _patches.installed() == []
    for owner, name, original in recorded:
        if original is _patches.MISSING:
            assert name not in vars(owner)
        else:
            assert _current(owner, name) is original, (owner, name)


def test_function_hook_leaves_every_thread():
    user = _User()
    hooks_seen = []

    def run():
        taps.ensure_param_use_hook()
        hooks_seen.append(chainer.get_function_hooks())

    # Not installed while no optimizer is set up.
    run()
    assert taps.ParamUseHook.name not in hooks_seen.pop()
    _patches.acquire('optimizer', user)
    try:
        run()
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert len(hooks_seen) == 2 and hooks_seen[0] is not hooks_seen[1]
        assert all(taps.ParamUseHook.name in h for h in hooks_seen)
    finally:
        _patches.release('optimizer', user)
    assert all(taps.ParamUseHook.name not in h for h in hooks_seen)


def test_a_later_replacement_is_left_alone():
    # Something else wrapped a patched method after us: removing ours must
    # not drop theirs (it calls ours, which then does nothing of its own).
    from chainer import link as link_module
    original = vars(link_module.Link)['copy']
    user = _User()
    _patches.acquire('optimizer', user)
    ours = vars(link_module.Link)['copy']

    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)
    link_module.Link.copy = theirs
    try:
        _patches.release('optimizer', user)
        assert vars(link_module.Link)['copy'] is theirs
    finally:
        link_module.Link.copy = original
