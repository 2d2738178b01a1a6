"""Every change this library makes outside itself, made while it is used.

Importing ``chainermn_overlap`` changes nothing global.  What the
optimizers need from Chainer and ChainerMN is installed here when its
first user appears and undone when its last user is gone, counted per
group of patches:

``'optimizer'`` (held by each overlapped optimizer from ``setup()`` to
``close()``)
    * ``Link``, ``Chain``, ``ChainList`` and ``DeviceResident`` methods that
      read parameters wholesale (``copy``, ``copyparams``, ``serialize``,
      the device moves, ``__getstate__`` for pickling and ``deepcopy``)
      first synchronize the link's optimizer; ``cleargrads``/``zerograds``
      tell it that gradients restart from zero
      (:mod:`chainermn_overlap._autosync` holds the wrappers).
    * ``chainer.computational_graph.build_computational_graph`` leaves the
      gradient taps out of graph dumps (:func:`.taps.contract_taps`).
    * The function hook that sees parameters used outside their link
      (:class:`.taps.ParamUseHook`), in every thread that ran a hooked
      link (Chainer's function hooks are per thread).
``'multi_node_snapshot'`` (held by each sharded optimizer until it is
closed)
    * ``__init__``, ``initialize`` and ``__call__`` of ChainerMN's
      ``multi_node_snapshot`` extension refuse, on every rank, a snapshot
      that one rank would write for others (:mod:`.sharding.writers`).

Removing a patch puts back exactly what was there (or deletes the
attribute where there was none), unless something else has replaced the
attribute since: that replacement is left alone (it wraps ours, which then
does nothing for links no optimizer manages).

Exit handlers (:func:`at_exit`) are registered with :mod:`atexit` when the
first one is needed (the first engine, the first timeline), not at import.
"""
import atexit
import threading
import weakref
from typing import Any, Callable, Dict, List, Tuple

__all__ = ['MISSING', 'acquire', 'active', 'at_exit',
           'install_function_hook', 'installed', 'release', 'targets']

# What installed() reports as the original of an attribute that was absent.
MISSING = object()
_lock = threading.RLock()
# group -> the objects holding it (weakly: a user collected without
# release() no longer counts at the next release).
_users: Dict[str, 'weakref.WeakSet'] = {}
# group -> [(owner, name, original or MISSING, replacement)]
_installed: Dict[str, List[Tuple[Any, str, Any, Any]]] = {}
# Thread-local function-hook dicts holding a hook of ours: (dict, name, hook).
_function_hooks: List[Tuple[dict, str, Any]] = []
_exit_handlers: List[Tuple[int, Callable[[], None]]] = []


# ----------------------------------------------------------------------------
# The patches

def _optimizer_patches():
    """``(owner, name, replacement factory)`` of the ``'optimizer'`` group.

    A factory gets the original attribute and returns what replaces it.
    """
    from chainer import computational_graph
    from chainer import device_resident
    from chainer import link as link_module

    from chainermn_overlap import _autosync
    from chainermn_overlap.hooks import taps

    out = []
    for cls in (link_module.Link, link_module.Chain, link_module.ChainList):
        for name in _autosync.READERS:
            if name in vars(cls):
                out.append((cls, name, _autosync.wrap_reader))
        if 'serialize' in vars(cls):
            out.append((cls, 'serialize', _autosync.wrap_serialize))
    for name in _autosync.MOVERS:
        for cls in (device_resident.DeviceResident, link_module.Link):
            if name in vars(cls):
                out.append((cls, name, _autosync.wrap_reader))
    for name in ('cleargrads', 'zerograds'):
        out.append((link_module.Link, name, _autosync.wrap_cleargrads))
    out.append((link_module.Link, '__getstate__', _autosync.make_getstate))
    out.append((computational_graph, 'build_computational_graph',
                taps.wrap_graph_builder))
    return out


def _snapshot_patches():
    from chainermn_overlap.optimizers.sharding import writers
    return writers.patches()


_GROUPS = {'optimizer': _optimizer_patches,
           'multi_node_snapshot': _snapshot_patches}


def targets() -> List[Tuple[Any, str]]:
    """``(owner, name)`` of every attribute some group replaces when active
    (computed without installing anything)."""
    return [(owner, name) for group in _GROUPS.values()
            for owner, name, _ in group()]


# ----------------------------------------------------------------------------
# Reference counting

def acquire(group: str, user: Any) -> None:
    """``user`` needs ``group``'s patches: installs them if it is the first.

    Idempotent per user.
    """
    with _lock:
        users = _users.setdefault(group, weakref.WeakSet())
        users.add(user)
        if group not in _installed:
            _installed[group] = _install(_GROUPS[group]())


def release(group: str, user: Any) -> None:
    """``user`` is done with ``group``: removes its patches if no user is
    left.  Idempotent per user."""
    with _lock:
        users = _users.get(group)
        if users is not None:
            users.discard(user)
        if users:
            return
        _users.pop(group, None)
        _remove(_installed.pop(group, []))
        if group == 'optimizer':
            _remove_function_hooks()


def active(group: str) -> bool:
    """Whether ``group``'s patches are installed."""
    return group in _installed


def installed() -> List[Tuple[Any, str, Any]]:
    """``(owner, name, original)`` of every attribute replaced now."""
    with _lock:
        return [(owner, name, original)
                for done in _installed.values()
                for owner, name, original, _ in done]


def _install(table):
    done = []
    for owner, name, factory in table:
        original = vars(owner).get(name, MISSING)
        # Where the owner only inherits the attribute, the replacement
        # wraps the inherited one, and removing it deletes the attribute.
        replacement = factory(getattr(owner, name, None)
                              if original is MISSING else original)
        setattr(owner, name, replacement)
        done.append((owner, name, original, replacement))
    return done


def _remove(done):
    for owner, name, original, replacement in reversed(done):
        if vars(owner).get(name) is not replacement:
            continue   # replaced again by someone else since: theirs stays
        if original is MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


# ----------------------------------------------------------------------------
# Function hooks (one dict per thread in Chainer)

def install_function_hook(hooks: dict, name: str, hook: Any) -> None:
    """Puts ``hook`` in ``hooks`` (``chainer.get_function_hooks()`` of the
    calling thread) while the ``'optimizer'`` group is active; it is taken
    out of every such dict when the group's last user is gone."""
    with _lock:
        if 'optimizer' not in _installed or name in hooks:
            return
        hooks[name] = hook
        _function_hooks.append((hooks, name, hook))


def _remove_function_hooks():
    for hooks, name, hook in _function_hooks:
        if hooks.get(name) is hook:
            del hooks[name]
    del _function_hooks[:]


# ----------------------------------------------------------------------------
# Exit handlers

def at_exit(handler: Callable[[], None], order: int) -> None:
    """Runs ``handler`` at interpreter exit, before handlers of a higher
    ``order``; registers the one :mod:`atexit` handler on first use.

    Registered after ``mpi4py`` initialised MPI (a communicator exists by
    the time a handler is needed), it runs before MPI is finalized.
    """
    with _lock:
        if any(h is handler for _, h in _exit_handlers):
            return
        if not _exit_handlers:
            atexit.register(_run_exit_handlers)
        _exit_handlers.append((order, handler))


def _run_exit_handlers():
    # Each runs even if one before it raised (as separate atexit handlers
    # would); the first error is raised at the end, for atexit to report.
    error = None
    for _, handler in sorted(_exit_handlers, key=lambda item: item[0]):
        try:
            handler()
        except Exception as e:  # reported below, after the others ran
            error = error or e
    if error is not None:
        raise error
