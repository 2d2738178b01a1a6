"""Automatic ``synchronize()`` wherever Chainer reads parameters wholesale.

With ``wait='forward'`` a parameter's update is applied just before its link
next runs, so between iterations some parameters are one update behind.
Chainer code that reads parameters without running the links (serializers,
``copy``/``copyparams``, device moves, pickling and ``copy.deepcopy``) must
see the finished values: those ``Link`` methods are wrapped, once, so that
they first synchronize the optimizer that manages the link, if any.  Links
not managed by an overlapped optimizer pay one dictionary lookup.

``cleargrads``/``zerograds`` are wrapped too: they tell the optimizer that a
parameter's gradient restarts from zero, which is what allows a backward to
declare it final.
"""
import functools
import weakref

import chainer
from chainer import device_resident
from chainer import link as link_module

_REGISTRY = weakref.WeakKeyDictionary()
_PATCHED = []

_READERS = ("copy", "copyparams")
_MOVERS = ('to_device', 'to_cpu', 'to_gpu', 'to_intel64', 'to_chx',
           'from_chx')


def register(target, state):
    """Makes every link under ``target`` synchronize ``state`` on reads."""
    _install()
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


def _wrap_reader(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        _sync(self)
        # copyparams(link) reads the other link.
        if args and isinstance(args[0], link_module.Link):
            _sync(args[0])
        return fn(self, *args, **kwargs)
    wrapper.__chainermn_overlap__ = True
    return wrapper


def _wrap_serialize(fn):
    @functools.wraps(fn)
    def wrapper(self, serializer):
        state = _sync(self)
        fn(self, serializer)
        if (state is not None
                and isinstance(serializer, chainer.serializer.Deserializer)):
            # Loaded parameters are broadcast at the next update (which is
            # not skipped when every rank loaded).
            state.mark_loaded()
    wrapper.__chainermn_overlap__ = True
    return wrapper


def _wrap_cleargrads(fn, fills):
    @functools.wraps(fn)
    def wrapper(self):
        state = _REGISTRY.get(self)
        if fills and state is not None:
            # zerograds fills param.grad in place, and param.grad may be
            # the reduction buffer holding a pending update's mean.
            state.before_zerograds(self)
        fn(self)
        if state is not None:
            state.on_cleargrads(self)
    wrapper.__chainermn_overlap__ = True
    return wrapper


def _getstate(self):
    _sync(self)
    return self.__dict__


def _install():
    if _PATCHED:
        return
    classes = [link_module.Link, link_module.Chain, link_module.ChainList]
    for cls in classes:
        for name in _READERS:
            fn = cls.__dict__.get(name)
            if fn is not None and not hasattr(fn, '__chainermn_overlap__'):
                setattr(cls, name, _wrap_reader(fn))
                _PATCHED.append((cls, name, fn))
        fn = cls.__dict__.get('serialize')
        if fn is not None and not hasattr(fn, '__chainermn_overlap__'):
            setattr(cls, 'serialize', _wrap_serialize(fn))
            _PATCHED.append((cls, 'serialize', fn))
    for name in _MOVERS:
        for cls in (device_resident.DeviceResident, link_module.Link):
            fn = cls.__dict__.get(name)
            if fn is not None and not hasattr(fn, '__chainermn_overlap__'):
                setattr(cls, name, _wrap_reader(fn))
                _PATCHED.append((cls, name, fn))
    for name in ('cleargrads', 'zerograds'):
        fn = link_module.Link.__dict__[name]
        if not hasattr(fn, '__chainermn_overlap__'):
            setattr(link_module.Link, name,
                    _wrap_cleargrads(fn, name == 'zerograds'))
            _PATCHED.append((link_module.Link, name, fn))
    if '__getstate__' not in link_module.Link.__dict__:
        link_module.Link.__getstate__ = _getstate
        _PATCHED.append((link_module.Link, '__getstate__', None))
