"""What every multi-node optimizer wrapper of this library shares.

The wrapper class (delegation to the actual optimizer, ``update(lossfun)``
prologue), the checks of the arguments both factories take, and the
construction of the progress engine with its watchdog options.
"""
import numpy

import chainer
import chainermn

from chainermn_overlap import _mpi_json
from chainermn_overlap import config
from chainermn_overlap.communication import backends
from chainermn_overlap.communication.chunking import DEFAULT_CHUNK_BYTES
from chainermn_overlap.communication.chunking import ring_chunk_bytes


class OptimizerWrapper(object):
    """Delegates to the actual optimizer; keeps its own state in one object.

    ChainerMN's wrappers delegate with ``__getattr__``/``__setattr__`` and
    then need ``super().__setattr__`` for each field of their own; keeping
    all of the wrapper's own state in one object avoids that.

    Args:
        state: the wrapper's state; must have ``actual`` (the wrapped
            optimizer), ``communicator``, ``target`` (the link set up),
            ``stats`` and ``compression`` (or None).
    """

    def __init__(self, state):
        object.__setattr__(self, '_state', state)

    @property
    def actual_optimizer(self):
        return self._state.actual

    @property
    def communicator(self):
        return self._state.communicator

    def __getattr__(self, name):
        if name == '_state':  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self._state.actual, name)

    def __setattr__(self, name, value):
        setattr(self._state.actual, name, value)

    def communication_stats(self, reset=False):
        """Gradient communication counters since setup (or the last reset).

        Returns:
            dict: ``buckets``, ``bytes``, ``comm_seconds`` (time spent
            reducing), ``wait_seconds`` (time training waited for
            reductions) and ``hidden_fraction`` (``1 - wait/comm``); with
            a compression also ``compression_seconds`` (its own compute,
            on the communication thread).
        """
        st = self._state
        out = st.stats.as_dict()
        if st.compression is not None:
            out['compression_seconds'] = st.compression.compute_seconds
        if reset:
            st.stats.reset()
            if st.compression is not None:
                st.compression.compute_seconds = 0.0
        return out

    def _backward(self, lossfun, args, kwds):
        """``update()``'s prologue, exactly as ChainerMN's optimizers do it.

        Checks that ``setup()`` ran, then (with ``lossfun``) computes the
        loss, clears the gradients and runs backward.
        """
        st = self._state
        if st.target is None:
            raise RuntimeError(
                'update() was called before setup(); call '
                'optimizer.setup(model) first (on every rank).')
        if lossfun is None:
            return
        use_cleargrads = getattr(st.actual, '_use_cleargrads', True)
        loss = lossfun(*args, **kwds)
        if use_cleargrads:
            st.target.cleargrads()
        else:
            st.target.zerograds()
        loss.backward(loss_scale=st.actual._loss_scale)
        del loss


def check_arguments(factory, actual_optimizer, communicator):
    """The checks every factory makes, with errors that say the fix."""
    if not isinstance(communicator,
                      chainermn.communicators.CommunicatorBase):
        raise TypeError(
            '{} needs a ChainerMN communicator, e.g. '
            'chainermn.create_communicator("naive"); got {}.'
            .format(factory, type(communicator).__name__))
    if getattr(communicator, 'mpi_comm', None) is None:
        raise TypeError(
            '{} has no mpi_comm; use an MPI-based ChainerMN communicator '
            '(naive, flat, non_cuda_aware, pure_nccl).'
            .format(type(communicator).__name__))
    if not isinstance(actual_optimizer, chainer.Optimizer):
        raise TypeError(
            'actual_optimizer must be a chainer.Optimizer such as '
            'chainer.optimizers.MomentumSGD(); got {}.'
            .format(type(actual_optimizer).__name__))


def check_wire_dtype(allreduce_grad_dtype):
    """``allreduce_grad_dtype`` as a numpy dtype (None stays None)."""
    if allreduce_grad_dtype is None:
        return None
    dt = numpy.dtype(allreduce_grad_dtype)
    if dt not in (numpy.float16, numpy.float32, numpy.float64):
        raise ValueError(
            'allreduce_grad_dtype must be float16, float32 or float64, '
            'got {}'.format(dt))
    return dt


def resolve_bucket_size(bucket_size, shard, wire_dtype, compression,
                        chunk_size, default, nodes=2):
    """The fusion bucket size in bytes (see create_overlapped_optimizer)."""
    if bucket_size is not None:
        return config.parse_size(bucket_size)
    chunk = config.parse_size(chunk_size) if chunk_size is not None else None
    if shard is not None:
        # A sharded bucket's reduce-scatter and update run whole (the
        # engine cannot slice them): buckets of one chunk keep what the
        # next forward needs from waiting behind a large one.
        return chunk if chunk is not None else DEFAULT_CHUNK_BYTES
    if wire_dtype is not None and wire_dtype.itemsize < 4 and (
            compression is None):
        # The float16 ring runs a bucket whole, as one chunk: the ring's
        # chunk for ``nodes`` ranks (the default chunk up to 16), at
        # most the float32 bucket (larger would cost overlap).
        return (chunk if chunk is not None
                else min(default, ring_chunk_bytes(nodes)))
    return default


def check_compression(compression, allreduce_grad_dtype):
    """A compression must be one of ours, with a float32/float64 wire."""
    if compression is None:
        return
    from chainermn_overlap.compression import PowerSGD
    if not isinstance(compression, PowerSGD):
        raise TypeError(
            'compression must be a chainermn_overlap.PowerSGD(...) (or '
            'None), got {}.'.format(type(compression).__name__))
    if (allreduce_grad_dtype is not None
            and numpy.dtype(allreduce_grad_dtype).itemsize < 4):
        raise ValueError(
            'PowerSGD computes its low-rank factors in the wire dtype, and '
            '{} is too narrow for that: drop allreduce_grad_dtype (the '
            'factors are already far smaller than the gradients).'
            .format(numpy.dtype(allreduce_grad_dtype)))


def check_watch_options(timeout, stall_warning, debug):
    """Validates the watchdog options now (a bad value fails at creation,
    not at setup()); they are resolved with the environment by the engine.
    """
    config.resolve_timeout(timeout)
    config.resolve_stall_warning(stall_warning)
    return {'timeout': timeout, 'stall_warning': stall_warning,
            'debug': debug}


def default_engine(target, mpi_comm):
    """The host-staged MPI engine; ``'nccl'`` only once it may be chosen.

    While :data:`chainermn_overlap.communication.nccl.NCCL_BY_DEFAULT` is
    off (the NCCL engine has not run on a GPU yet), every rank takes
    ``'mpi_priority'`` without communicating.  Once on, it is collective
    over ``mpi_comm`` for GPU parameters: ``'nccl'`` where NCCL can serve
    (whether ranks share a device, which NCCL refuses, is agreed by an
    allgather).
    """
    from chainermn_overlap.communication import nccl, streams
    arrays = [p.array for p in target.params() if p.array is not None]
    xp = (chainer.backend.get_array_module(arrays[0]) if arrays
          else numpy)
    if xp is numpy or not nccl.NCCL_BY_DEFAULT:
        return nccl.default_backend(xp, False)
    available = streams.nccl_available()
    bus = None
    if available:
        import cupy
        bus = cupy.cuda.Device().pci_bus_id
    # JSON, never pickle, from peers.
    every = _mpi_json.allgather_json(mpi_comm, {'nccl': available,
                                                'bus': bus})
    buses = [e['bus'] for e in every]
    return nccl.default_backend(xp, all(e['nccl'] for e in every),
                                len(set(buses)) < len(buses))


def collective_options(**options):
    """The options that decide which collectives an optimizer runs, as
    JSON, compared between ranks when a layout is built
    (:class:`._layout.LayoutManager`): an object by its class and its plain
    settings, never by ``repr`` (which may hold an address)."""
    def plain(value):
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        if isinstance(value, dict):
            return {k: plain(v) for k, v in sorted(value.items())}
        if isinstance(value, numpy.dtype):
            return str(value)
        if isinstance(value, type):
            return value.__qualname__
        settings = {k: v for k, v in sorted(vars(value).items())
                    if not k.startswith('_') and (
                        v is None or isinstance(v, (str, bool, int, float)))}
        return [type(value).__qualname__, settings]
    return {k: plain(v) for k, v in options.items()}


def make_engine(name, mpi_comm, options, watch_options):
    """Starts the progress engine ``name`` with its watchdog options."""
    return backends.get_backend(name)(mpi_comm, **dict(options,
                                                       **watch_options))
