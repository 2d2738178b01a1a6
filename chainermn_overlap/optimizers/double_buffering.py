"""Double buffering on CPU/MPI: update with last iteration's gradients.

ChainerMN's ``create_multi_node_optimizer(..., double_buffering=True)`` needs
NCCL and a GPU.  This is the same method for any MPI communicator, with the
reduction run by a communication thread (a backend of
:mod:`chainermn_overlap.communication.backends`)::

    iteration k:  forward/backward -> local gradients g_k
                  pack g_k, post its allreduce (runs in the background
                  during the update and iteration k+1's forward/backward)
                  wait for the allreduce of g_{k-1} (posted one iteration ago)
                  update the parameters with mean(g_{k-1})

Communication therefore overlaps a whole iteration, at the price of
*stale* gradients: the update of iteration k uses gradients computed at the
parameters of iteration k-1.  The semantics are exactly ChainerMN's
``_DoubleBufferingOptimizer``'s:

* the first update (and every update at which the set of initialised
  parameters changed) broadcasts rank 0's parameters and skips the step;
* the next update only posts its gradients;
* from then on the update of iteration k applies the mean of iteration
  k-1's gradients.

That is, it equals ChainerMN's blocking optimizer fed, from the third
iteration on, with each rank's gradients of the previous iteration
(``tests/mpi/test_double_buffering.py`` checks exactly this).  The gradients
of the last iteration are never applied (as in ChainerMN).
"""
import time

import numpy

import chainer
import chainermn

from chainermn_overlap.communication import backends
from chainermn_overlap.optimizers import _wrapper


def _wire_dtype(dtype):
    # float16 sums lose precision quickly; ChainerMN reduces them in float32.
    return numpy.dtype(numpy.float32) if dtype == numpy.float16 else dtype


class _Group(object):
    """The parameters of one wire dtype and their two flat buffers."""

    __slots__ = ('dtype', 'params', 'offsets', 'buffers')

    def __init__(self, dtype, params):
        self.dtype = dtype
        self.params = params
        sizes = [p.array.size for p in params]
        self.offsets = numpy.concatenate([[0], numpy.cumsum(sizes)]).tolist()
        total = self.offsets[-1]
        self.buffers = [numpy.empty(total, dtype=dtype),
                        numpy.empty(total, dtype=dtype)]

    def pack(self, k):
        buf = self.buffers[k]
        for p, lo, hi in zip(self.params, self.offsets, self.offsets[1:]):
            # A gradient missing on this rank counts as zeros: every rank
            # must contribute the same arrays for the collectives to match.
            if p.grad is None:
                buf[lo:hi] = 0
            else:
                buf[lo:hi] = p.grad.ravel()
        return buf

    def unpack_mean(self, k, size):
        buf = self.buffers[k]
        for p, lo, hi in zip(self.params, self.offsets, self.offsets[1:]):
            src = buf[lo:hi].reshape(p.array.shape)
            if p.grad is None or p.grad.shape != p.array.shape:
                p.grad = (src / size).astype(p.array.dtype, copy=False)
            else:
                # In place: p.grad held this rank's current gradient, which
                # is already packed; no allocation per iteration.
                numpy.divide(src, size, out=p.grad, casting='unsafe')


class _Stats(object):
    def __init__(self):
        self.reset()

    def reset(self):
        self.collectives = 0
        self.bytes = 0
        self.comm_seconds = 0.0
        self.wait_seconds = 0.0

    def as_dict(self):
        hidden = (1.0 - self.wait_seconds / self.comm_seconds
                  if self.comm_seconds > 0 else None)
        return {'buckets': self.collectives, 'bytes': self.bytes,
                'comm_seconds': self.comm_seconds,
                'wait_seconds': self.wait_seconds, 'hidden_fraction': hidden}


class _DoubleBufferingState(object):
    """All state of the wrapper, kept apart from the actual optimizer's."""

    def __init__(self, actual, communicator, backend_name):
        self.actual = actual
        self.communicator = communicator
        self.size = communicator.size
        self.rank = communicator.rank
        self.backend_name = backend_name
        self.backend = None
        self.target = None
        self.structure = None   # (name, shape, dtype) of initialised params
        self.groups = []
        self.k = 0              # buffer that receives this iteration's grads
        self.in_flight = None   # (k, handles) of the previous iteration
        self.stats = _Stats()

    def structure_of(self, target):
        return [(name, p.array.shape, str(p.array.dtype))
                for name, p in sorted(target.namedparams())
                if p.array is not None]

    def rebuild(self, target):
        self.drain()
        by_dtype = {}
        for name, p in sorted(target.namedparams()):
            if p.array is None:
                continue
            if not isinstance(p.array, numpy.ndarray):
                raise RuntimeError(
                    'the double-buffering optimizer of chainermn_overlap runs '
                    'on CPU (numpy) parameters; {} is a {}. On GPUs use '
                    'chainermn.create_multi_node_optimizer(..., '
                    'double_buffering=True) with a pure_nccl communicator.'
                    .format(name, type(p.array).__name__))
            by_dtype.setdefault(_wire_dtype(p.array.dtype), []).append(p)
        # Sorted by dtype name: the same posting order on every rank.
        self.groups = [_Group(dt, by_dtype[dt])
                       for dt in sorted(by_dtype, key=str)]
        self.structure = self.structure_of(target)

    def post(self):
        k = self.k
        handles = []
        for g in self.groups:
            buf = g.pack(k)
            handles.append(self.backend.allreduce(
                buf, 'sum', label='double-buffered {} gradients'.format(
                    g.dtype)))
            self.stats.collectives += 1
            self.stats.bytes += buf.nbytes
        previous, self.in_flight = self.in_flight, (k, handles)
        self.k = 1 - k
        return previous

    def wait(self, posted):
        k, handles = posted
        t0 = time.perf_counter()
        for h in handles:
            try:
                h.wait()
            except backends.CommunicationError as e:
                raise RuntimeError(
                    'rank {}: the double-buffered gradient reduction failed: '
                    '{}'.format(self.rank, e)) from e
            self.stats.comm_seconds += h.busy_seconds()
        self.stats.wait_seconds += time.perf_counter() - t0
        return k

    def drain(self):
        """Finishes the reduction in flight and forgets its result."""
        if self.in_flight is not None:
            posted, self.in_flight = self.in_flight, None
            self.wait(posted)


class _DoubleBufferingOptimizer(_wrapper.OptimizerWrapper):
    """Wraps an optimizer; see :func:`create_double_buffering_optimizer`."""

    @property
    def _db(self):
        return self._state

    def setup(self, link):
        """Sets up the actual optimizer on ``link``; returns self."""
        st = self._db
        st.drain()
        st.actual.setup(link)
        if st.backend is None:
            st.backend = backends.get_backend(st.backend_name)(
                st.communicator.mpi_comm)
        st.target = link
        st.structure = None
        return self

    def update(self, lossfun=None, *args, **kwds):
        """Computes gradients (if ``lossfun``) and updates with stale ones.

        Like ChainerMN's double-buffering optimizer: the parameters are
        updated with the mean of the previous iteration's gradients, and
        this iteration's start reducing in the background.
        """
        st = self._db
        if st.target is None:
            raise RuntimeError(
                'update() was called before setup(); call '
                'optimizer.setup(model) first (on every rank).')
        target = st.target
        if lossfun is not None:
            use_cleargrads = getattr(st.actual, '_use_cleargrads', True)
            loss = lossfun(*args, **kwds)
            if use_cleargrads:
                target.cleargrads()
            else:
                target.zerograds()
            loss.backward(loss_scale=st.actual._loss_scale)
            del loss
        if st.structure != st.structure_of(target):
            # New or changed parameters: start over from rank 0's values,
            # and skip this step, as ChainerMN does.
            st.rebuild(target)
            st.communicator.bcast_data(target)
            return
        previous = st.post()
        if previous is None:
            return  # nothing reduced yet to update with
        k = st.wait(previous)
        for g in st.groups:
            g.unpack_mean(k, st.size)
        st.actual.update(None, *args, **kwds)

    def wait(self):
        """Waits for the reduction in flight; its gradients stay pending."""
        st = self._db
        if st.in_flight is not None:
            for h in st.in_flight[1]:
                h.wait()  # counted in the stats when update() waits

    def serialize(self, serializer):
        st = self._db
        self.wait()
        st.actual.serialize(serializer)
        if isinstance(serializer, chainer.serializer.Deserializer):
            # The gradients in flight belong to the run before the load;
            # the next update posts afresh and applies nothing (as after
            # the first broadcast).
            st.in_flight = None

    def close(self):
        """Finishes the reduction in flight and stops the backend thread."""
        st = self._db
        st.drain()
        if st.backend is not None:
            st.backend.close()
            st.backend = None

    def communication_stats(self, reset=False):
        """Counters since setup (or the last reset).

        Returns:
            dict: ``buckets`` (collectives), ``bytes``, ``comm_seconds``,
            ``wait_seconds`` and ``hidden_fraction`` (``1 - wait/comm``).
        """
        out = self._db.stats.as_dict()
        if reset:
            self._db.stats.reset()
        return out



def create_double_buffering_optimizer(actual_optimizer, communicator,
                                      zero_fill=True, backend='mpi_thread'):
    """Creates a multi-node optimizer that updates with stale gradients.

    CPU/MPI double buffering with the semantics of ChainerMN's
    ``create_multi_node_optimizer(..., double_buffering=True)`` (which needs
    NCCL): each ``update()`` posts this iteration's gradients to a
    background reduction and updates the parameters with the mean of the
    previous iteration's, so communication overlaps a whole iteration.  The
    update lags one iteration behind the gradients, which can affect
    accuracy; for exact (non-stale) overlap use
    :func:`chainermn_overlap.create_overlapped_optimizer`.

    Args:
        actual_optimizer (chainer.Optimizer): the optimizer to wrap.
        communicator: a ChainerMN communicator with an ``mpi_comm``.
        zero_fill (bool): accepted for compatibility.  A gradient missing on
            a rank always counts as zeros: every rank must reduce the same
            arrays.
        backend (str): communication engine, a name registered in
            :mod:`chainermn_overlap.communication.backends`
            (``'mpi_thread'``, ``'emulated'``, or a name from
            :func:`chainermn_overlap.communication.emulated.configure`).

    Returns:
        The wrapped optimizer; attribute access goes to the actual optimizer.
        ``wait()``, ``close()`` and ``communication_stats()`` are its own.
    """
    if not isinstance(communicator,
                      chainermn.communicators.CommunicatorBase):
        raise TypeError(
            'create_double_buffering_optimizer needs a ChainerMN '
            'communicator, e.g. chainermn.create_communicator("naive"); '
            'got {}.'.format(type(communicator).__name__))
    if getattr(communicator, 'mpi_comm', None) is None:
        raise TypeError(
            '{} has no mpi_comm; use an MPI-based ChainerMN communicator '
            '(naive, flat, non_cuda_aware).'
            .format(type(communicator).__name__))
    if not isinstance(actual_optimizer, chainer.Optimizer):
        raise TypeError(
            'actual_optimizer must be a chainer.Optimizer such as '
            'chainer.optimizers.MomentumSGD(); got {}.'
            .format(type(actual_optimizer).__name__))
    backends.get_backend(backend)  # an unknown name fails here, not later
    return _DoubleBufferingOptimizer(
        _DoubleBufferingState(actual_optimizer, communicator, backend))
