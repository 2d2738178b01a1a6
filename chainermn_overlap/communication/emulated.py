"""Network emulation: real reductions, completion timed by an α–β model.

The setting a user cares about (say 16 nodes at 10 Gb/s) often cannot run on
the machine at hand.  This backend runs the *real* computation and the real
reduction over the processes that exist (one process: the identity), so
results stay correct, but each collective completes when a model of a ring
allreduce over ``nodes`` virtual nodes says it would:

* one collective of ``n`` bytes takes
  ``2 (N - 1) alpha + 2 (N - 1) / N * n / beta`` seconds (a ring allreduce:
  ``N - 1`` reduce-scatter and ``N - 1`` allgather steps, each paying the
  latency ``alpha`` and moving ``n / N`` bytes over a link of ``beta``
  bytes/s);
* collectives are serialised on the one link, as a NIC does: a collective
  starts when it was posted or when the previous one finished, whichever is
  later.

Anything measured with it is an **emulation**, and must say so.

The model itself is pure functions (:func:`ring_allreduce_seconds`,
:func:`schedule`) plus :class:`LinkModel`, which only keeps the time at which
the link becomes free.  Use it with the optimizers by name::

    name = emulated.configure(nodes=16, bandwidth='10gbit', latency=25e-6)
    opt = chainermn_overlap.create_overlapped_optimizer(
        actual, comm, backend=name)

``'emulated'`` itself uses
:data:`~chainermn_overlap.config.EMULATION_DEFAULTS`, overridden by the
environment variable ``CHAINERMN_OVERLAP_EMULATION`` (``"nodes=16,
bandwidth=10gbit,latency=25us"``).  ChainerMN's blocking optimizer does not
use engines; the benchmarks time it by the same model with their own
``benchmarks.harness.anchor.EmulatedCommunicator``.
"""
import functools
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from chainermn_overlap import config
from chainermn_overlap.communication import blocking
from chainermn_overlap.communication import engine as engine_module

__all__ = ['LinkModel', 'configure', 'emulated_backend',
           'ring_allreduce_seconds', 'schedule', 'sleep_until']



# ----------------------------------------------------------------------------
# The model: pure functions.

def ring_allreduce_seconds(nbytes: float, nodes: int, alpha: float,
                           beta: float) -> float:
    """Duration of one ring allreduce under the α–β model.

    Args:
        nbytes (int): size of the reduced array in bytes.
        nodes (int): number of nodes in the ring.
        alpha (float): latency of one step, in seconds.
        beta (float): link bandwidth in bytes per second (each direction).

    Returns:
        float: seconds; 0 for a single node (nothing to send).
    """
    if nodes < 1:
        raise ValueError('nodes must be at least 1, got {}'.format(nodes))
    if beta <= 0 or alpha < 0:
        raise ValueError('need beta > 0 and alpha >= 0, got beta={}, '
                         'alpha={}'.format(beta, alpha))
    if nodes == 1:
        return 0.0
    steps = 2 * (nodes - 1)
    return steps * alpha + steps / float(nodes) * nbytes / beta


def schedule(posts: Sequence[Tuple[float, float]], nodes: int, alpha: float,
             beta: float, free_at: float = float('-inf')
             ) -> List[Tuple[float, float]]:
    """Start and finish times of collectives serialised on one link.

    Args:
        posts: ``(posted_at, nbytes)`` pairs in posting order.
        nodes, alpha, beta: as in :func:`ring_allreduce_seconds`.
        free_at (float): time at which the link becomes free.

    Returns:
        list: ``(start, finish)`` per collective.  A collective starts when
        it was posted or when the previous one finished, whichever is later.
    """
    out = []
    for posted_at, nbytes in posts:
        start = max(posted_at, free_at)
        free_at = start + ring_allreduce_seconds(nbytes, nodes, alpha, beta)
        out.append((start, free_at))
    return out


class LinkModel(object):
    """One node's link: collectives are timed by the ring model, in order.

    Args:
        nodes (int): virtual nodes in the ring.
        bandwidth (float or str): link rate in bit/s (or ``'10gbit'``).
        latency (float or str): α, seconds per ring step (or ``'25us'``).
    """

    def __init__(self, nodes: int, bandwidth: Union[float, str],
                 latency: Union[float, str]) -> None:
        self.nodes = int(nodes)
        self.bandwidth = config.parse_rate(bandwidth, 'bandwidth')
        self.latency = config.parse_duration(latency, 'latency')
        # Validates the arguments once, here, rather than in the thread.
        ring_allreduce_seconds(0, self.nodes, self.latency,
                               self.bandwidth / 8.0)
        self.free_at = float('-inf')
        self._lock = threading.Lock()

    def duration(self, nbytes: float) -> float:
        """Seconds one collective of ``nbytes`` takes on this link."""
        return ring_allreduce_seconds(nbytes, self.nodes, self.latency,
                                      self.bandwidth / 8.0)

    def reserve(self, posted_at: float, nbytes: float
                ) -> Tuple[float, float]:
        """Books the link for one collective; returns ``(start, finish)``."""
        with self._lock:
            (start, finish), = schedule([(posted_at, nbytes)], self.nodes,
                                        self.latency, self.bandwidth / 8.0,
                                        self.free_at)
            self.free_at = finish
        return start, finish

    def label(self) -> str:
        """A one-line description, marked as an emulation."""
        return ('emulation: ring allreduce over {} virtual nodes, {:g} Gbit/s,'
                ' alpha {:g} us'.format(self.nodes, self.bandwidth / 1e9,
                                        self.latency * 1e6))

    def describe(self) -> Dict[str, Any]:
        """The model's settings as a JSON-able dict."""
        return {'emulation': True, 'model': 'alpha-beta ring allreduce, '
                'collectives serialised on one link',
                'nodes': self.nodes, 'bandwidth_bit_per_s': self.bandwidth,
                'latency_s': self.latency, 'label': self.label()}


def sleep_until(deadline: float) -> None:
    """Sleeps until ``time.perf_counter()`` reaches ``deadline``."""
    # time.sleep releases the GIL, so the training thread keeps computing.
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


# ----------------------------------------------------------------------------
# The backend.

def _nbytes(buf):
    # mpi4py accepts an array or a [array, datatype, ...] specification.
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    return getattr(buf, 'nbytes', 0)


class _ModelledComm(object):
    """The communicator an emulated engine is constructed with.

    Each ``Allreduce`` runs for real, then returns when the link model says
    that collective would have finished.  A backend's communication thread
    issues one collective at a time, so the link is booked from the moment
    of the call: a collective (a bucket, a chunk of one, or a scheduler's
    small control exchange, which thereby pays its latency) starts when the
    previous one finished or when it is issued, whichever is later.  Every
    other call passes through unmodelled.
    """

    def __init__(self, comm, link):
        self._comm = comm
        self._link = link
        self.late = 0   # collectives whose real reduction outlasted the model

    def Allreduce(self, sendbuf, recvbuf, op=None):
        issued = time.perf_counter()
        if op is None:
            self._comm.Allreduce(sendbuf, recvbuf)
        else:
            self._comm.Allreduce(sendbuf, recvbuf, op=op)
        _, finish = self._link.reserve(issued, _nbytes(recvbuf))
        if time.perf_counter() > finish:
            self.late += 1
        sleep_until(finish)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _default_base():
    # The engine the overlapped optimizer uses by default, so that an
    # emulation measures the same scheduling as a real run.
    return 'mpi_priority'


def emulated_backend(mpi_comm: Any, *, timeout: Any = None,
                     stall_warning: Any = None, debug: Optional[bool] = None,
                     base: Optional[str] = None,
                     link: Optional['LinkModel'] = None,
                     nodes: Optional[int] = None,
                     bandwidth: Union[None, float, str] = None,
                     latency: Union[None, float, str] = None,
                     **base_options: Any) -> engine_module.Engine:
    """An engine whose collectives complete as :class:`LinkModel` says.

    The real engine ``base`` (same ordering, chunking, priorities, watchdog
    and error handling) is constructed with a communicator whose
    ``Allreduce`` first reduces for real over the processes that exist,
    then waits for the model.  If the real reduction is slower than the
    model, completion is as late as the real one (counted in
    ``engine.comm.late``).

    Args:
        mpi_comm: ``mpi4py`` communicator (``MPI.COMM_SELF`` for one
            process); collective over it.
        timeout, stall_warning, debug: as for every engine (see
            :class:`~chainermn_overlap.communication.engine.Engine`).
        base (str): the engine to time, a registered backend name; default
            ``'mpi_priority'`` (the optimizer's default) when registered,
            else ``'mpi_thread'``.
        link (LinkModel): the emulated link; or give
        nodes, bandwidth, latency: the link, as in :class:`LinkModel`;
            default :data:`~chainermn_overlap.config.EMULATION_DEFAULTS`
            overridden by ``CHAINERMN_OVERLAP_EMULATION``.
        **base_options: policy options of the base engine (e.g.
            ``chunk_bytes``).

    Returns:
        The base engine, with ``link`` (the model) and ``emulation`` (its
        description, labelled as an emulation) attributes.
    """
    if link is None:
        link = LinkModel(**config.resolve_emulation(nodes, bandwidth,
                                                    latency))
    elif (nodes, bandwidth, latency) != (None, None, None):
        raise ValueError('give the emulated link either as link= or as '
                         'nodes=, bandwidth= and latency=, not both')
    base = base or _default_base()
    if base == 'emulated' or base.startswith('emulated:'):
        raise ValueError('the base of an emulated backend must be a real '
                         'engine such as mpi_thread, not {!r}'.format(base))
    factory = engine_module.get_backend(base)
    comm = _ModelledComm(blocking.dup(
        mpi_comm, "the emulated engine's communicator", timeout), link)
    try:
        engine = factory(mpi_comm, timeout=timeout,
                         stall_warning=stall_warning, debug=debug, comm=comm,
                         **base_options)
    except BaseException:
        comm.Free()
        raise
    engine.link = link
    engine.emulation = dict(link.describe(), base=base)
    return engine



_DEFAULT_LATENCY = config.EMULATION_DEFAULTS['latency']


def configure(nodes: int, bandwidth: Union[float, str],
              latency: Union[float, str] = _DEFAULT_LATENCY,
              base: Optional[str] = None) -> str:
    """Registers an emulated backend with these settings; returns its name.

    Args:
        nodes (int): virtual nodes in the ring.
        bandwidth (float or str): link rate in bit/s, or e.g. ``'10gbit'``.
        latency (float or str): seconds per ring step, or e.g. ``'25us'``.
        base (str): the real engine to time (see :func:`emulated_backend`).

    Returns:
        str: a backend name for ``backend=`` of the optimizers, e.g.
        ``'emulated:nodes=16,bandwidth=1e+10,latency=2.5e-05'``.
    """
    link = LinkModel(nodes, bandwidth, latency)  # validates
    name = 'emulated:nodes={},bandwidth={:g},latency={:g}'.format(
        link.nodes, link.bandwidth, link.latency)
    if base is not None:
        engine_module.get_backend(base)  # an unknown name fails here
        name += ',base={}'.format(base)
    engine_module.register_backend(name, functools.partial(
        emulated_backend, base=base, nodes=link.nodes,
        bandwidth=link.bandwidth, latency=link.latency))
    return name
