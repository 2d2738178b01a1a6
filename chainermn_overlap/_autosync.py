"""Automatic ``synchronize()`` wherever Chainer reads parameters wholesale.

With ``wait='forward'`` a parameter's update is applied just before its link
next runs, so between iterations some parameters are one update behind.
Chainer code that reads parameters without running the links (serializers,
``copy``/``copyparams``, device moves, pickling and ``copy.deepcopy``) must
see the finished values: those ``Link`` methods are wrapped, while an
overlapped optimizer is set up (:mod:`chainermn_overlap._patches` installs
and removes the wrappers defined here), so that they first synchronize the
optimizer that manages the link, if any.  Links not managed by an
overlapped optimizer pay one dictionary lookup.

``cleargrads``/``zerograds`` are wrapped too: they tell the optimizer that a
parameter's gradient restarts from zero, which is what allows a backward to
declare it final.
"""
import functools
import weakref

import chainer
from chainer import link as link_module

_REGISTRY = weakref.WeakKeyDictionary()

# Patched by chainermn_overlap._patches (which installs and removes them).
READERS = ("copy", "copyparams")
MOVERS = ('to_device', 'to_cpu', 'to_gpu', 'to_intel64', 'to_chx',
          'from_chx')


def register(target, state):
    """Makes every link under ``target`` synchronize ``state`` on reads
    (while ``state`` holds the ``'optimizer'`` patches of :mod:`._patches`).
    """
    for link in target.links():
        _REGISTRY[link] = state


def register_link(link, state):
    _REGISTRY[link] = state


def unregister(target):
    for link in target.links():
        if link in _REGISTRY:
            del _REGISTRY[link]


def _sync(link):
    state = _REGISTRY.get(link)
    if state is not None:
        state.synchronize()
    return state


def wrap_reader(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        _sync(self)
        # copyparams(link) reads the other link.
        if args and isinstance(args[0], link_module.Link):
            _sync(args[0])
        return fn(self, *args, **kwargs)
    return wrapper


def wrap_serialize(fn):
    @functools.wraps(fn)
    def wrapper(self, serializer):
        state = _sync(self)
        fn(self, serializer)
        if (state is not None
                and isinstance(serializer, chainer.serializer.Deserializer)):
            # Loaded parameters are broadcast at the next update (which is
            # not skipped when every rank loaded).
            state.mark_loaded()
    return wrapper


def wrap_cleargrads(fn):
    # zerograds fills param.grad in place, and param.grad may be the
    # reduction buffer holding a pending update's mean.
    fills = fn.__name__ == 'zerograds'

    @functools.wraps(fn)
    def wrapper(self):
        state = _REGISTRY.get(self)
        if fills and state is not None:
            state.before_zerograds(self)
        fn(self)
        if state is not None:
            state.on_cleargrads(self)
    return wrapper


def make_getstate(fn):
    """``Link.__getstate__`` (pickling, ``copy.deepcopy``) that synchronizes
    first; ``fn``: the class's own ``__getstate__``, or None."""
    def __getstate__(self):
        _sync(self)
        return self.__dict__ if fn is None else fn(self)
    return __getstate__
