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

``'emulated'`` itself uses :data:`DEFAULTS`, overridden by the environment
variable ``CHAINERMN_OVERLAP_EMULATION`` (``"nodes=16,bandwidth=10gbit,
latency=25us"``).  ChainerMN's blocking optimizer does not use backends; wrap
its communicator in :class:`EmulatedCommunicator` to time it by the same
model.
"""
import functools
import os
import re
import threading
import time

from chainermn_overlap.communication import backends

ENV_VAR = 'CHAINERMN_OVERLAP_EMULATION'
# The anchor setting: 16 nodes on 10 Gb/s Ethernet.  25 us per ring step is
# a typical TCP small-message latency on such a network.
DEFAULTS = {'nodes': 16, 'bandwidth': 10e9, 'latency': 25e-6}


# ----------------------------------------------------------------------------
# The model: pure functions.

def ring_allreduce_seconds(nbytes, nodes, alpha, beta):
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


def wire_bytes(nbytes, nodes):
    """Bytes each node sends in a ring allreduce: ``2 (N-1)/N * nbytes``."""
    return 2.0 * (nodes - 1) / nodes * nbytes


def schedule(posts, nodes, alpha, beta, free_at=float('-inf')):
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


def scale_bandwidth(bandwidth, anchor_compute_s, local_compute_s):
    """Bandwidth that keeps the anchor's communication/computation ratio.

    Communication time scales as ``1 / bandwidth``; to keep
    ``t_comm / t_compute`` of the anchor on a machine whose iteration
    computes in ``local_compute_s`` instead of ``anchor_compute_s``, the link
    must be slower by the same factor.

    Returns:
        float: ``bandwidth * anchor_compute_s / local_compute_s``.
    """
    if anchor_compute_s <= 0 or local_compute_s <= 0:
        raise ValueError('compute times must be positive')
    return bandwidth * anchor_compute_s / local_compute_s


def anchor_compute_seconds(nbytes, nodes, bandwidth, blocking_scalability,
                           latency=0.0):
    """Per-iteration compute time implied by a blocking scalability figure.

    With blocking communication an iteration takes ``t_c + t_comm``, so the
    scalability is ``s = t_c / (t_c + t_comm)`` and
    ``t_c = t_comm * s / (1 - s)``, with ``t_comm`` from the ring model.

    Args:
        nbytes (int): gradient bytes reduced per iteration.
        nodes (int): nodes of the anchor.
        bandwidth (float): anchor link rate in bit/s.
        blocking_scalability (float): the anchor's blocking figure, in (0, 1).
        latency (float): per-step latency in seconds.
    """
    if not 0 < blocking_scalability < 1:
        raise ValueError('blocking_scalability must be in (0, 1), got {}'
                         .format(blocking_scalability))
    t_comm = ring_allreduce_seconds(nbytes, nodes, latency, bandwidth / 8.0)
    return t_comm * blocking_scalability / (1.0 - blocking_scalability)


def parse_settings(text):
    """Parses ``"nodes=16,bandwidth=10gbit,latency=25us"`` into a dict."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(','))):
        key, sep, value = item.partition('=')
        key = key.strip()
        if not sep or key not in DEFAULTS:
            raise ValueError(
                '{}: cannot read {!r}; expected comma-separated key=value '
                'with keys {}'.format(ENV_VAR, item, ', '.join(DEFAULTS)))
        if key == 'nodes':
            out[key] = int(value)
        elif key == 'bandwidth':
            out[key] = _parse_rate(value)
        else:
            out[key] = _parse_seconds(value)
    return out


def _parse_rate(value):
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r'\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmg]?bit)?\s*',
                     value.lower())
    if m is None:
        raise ValueError('bandwidth {!r} is not understood; give bit/s or '
                         'e.g. "10gbit"'.format(value))
    unit = {None: 1, 'bit': 1, 'kbit': 1e3, 'mbit': 1e6, 'gbit': 1e9}
    return float(m.group(1)) * unit[m.group(2)]


def _parse_seconds(value):
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r'\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(s|ms|us)?\s*',
                     value.lower())
    if m is None:
        raise ValueError('latency {!r} is not understood; give seconds or '
                         'e.g. "25us"'.format(value))
    return float(m.group(1)) * {None: 1, 's': 1, 'ms': 1e-3,
                                'us': 1e-6}[m.group(2)]


class LinkModel(object):
    """One node's link: collectives are timed by the ring model, in order.

    Args:
        nodes (int): virtual nodes in the ring.
        bandwidth (float or str): link rate in bit/s (or ``'10gbit'``).
        latency (float or str): α, seconds per ring step (or ``'25us'``).
    """

    def __init__(self, nodes, bandwidth, latency):
        self.nodes = int(nodes)
        self.bandwidth = _parse_rate(bandwidth)
        self.latency = _parse_seconds(latency)
        # Validates the arguments once, here, rather than in the thread.
        ring_allreduce_seconds(0, self.nodes, self.latency,
                               self.bandwidth / 8.0)
        self.free_at = float('-inf')
        self._lock = threading.Lock()

    def duration(self, nbytes):
        return ring_allreduce_seconds(nbytes, self.nodes, self.latency,
                                      self.bandwidth / 8.0)

    def reserve(self, posted_at, nbytes):
        """Books the link for one collective; returns ``(start, finish)``."""
        with self._lock:
            (start, finish), = schedule([(posted_at, nbytes)], self.nodes,
                                        self.latency, self.bandwidth / 8.0,
                                        self.free_at)
            self.free_at = finish
        return start, finish

    def label(self):
        return ('emulation: ring allreduce over {} virtual nodes, {:g} Gbit/s,'
                ' alpha {:g} us'.format(self.nodes, self.bandwidth / 1e9,
                                        self.latency * 1e6))

    def describe(self):
        return {'emulation': True, 'model': 'alpha-beta ring allreduce, '
                'collectives serialised on one link',
                'nodes': self.nodes, 'bandwidth_bit_per_s': self.bandwidth,
                'latency_s': self.latency, 'label': self.label()}


def _sleep_until(deadline):
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
    """Stands in for a backend's duplicated communicator.

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
        _sleep_until(finish)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _default_base():
    # The engine the overlapped optimizer uses by default, so that an
    # emulation measures the same scheduling as a real run.
    return 'mpi_priority' if 'mpi_priority' in backends._BACKENDS \
        else 'mpi_thread'


def emulated_backend(mpi_comm, base=None, nodes=None, bandwidth=None,
                     latency=None, **kwargs):
    """A backend whose collectives complete as :class:`LinkModel` says.

    The real engine ``base`` (same ordering, chunking, priorities, watchdog
    and error handling) runs on a communicator whose ``Allreduce`` first
    reduces for real over the processes that exist, then waits for the
    model.  If the real reduction is slower than the model, completion is as
    late as the real one (counted in ``backend.comm.late``).

    Args:
        mpi_comm: ``mpi4py`` communicator (``MPI.COMM_SELF`` for one
            process).
        base (str): the engine to time, a registered backend name; default
            ``'mpi_priority'`` (the optimizer's default) when registered,
            else ``'mpi_thread'``.
        nodes, bandwidth, latency: the link, as in :class:`LinkModel`;
            default :data:`DEFAULTS` overridden by ``CHAINERMN_OVERLAP_
            EMULATION``.
        **kwargs: options of the base engine (e.g. ``chunk_bytes``).

    Returns:
        The base backend, with ``link`` (the model) and ``emulation`` (its
        description, labelled as an emulation) attributes.
    """
    settings = dict(DEFAULTS)
    settings.update(parse_settings(os.environ.get(ENV_VAR, '')))
    for key, value in (('nodes', nodes), ('bandwidth', bandwidth),
                       ('latency', latency)):
        if value is not None:
            settings[key] = value
    link = LinkModel(**settings)
    base = base or _default_base()
    if base == 'emulated' or base.startswith('emulated:'):
        raise ValueError('the base of an emulated backend must be a real '
                         'engine such as mpi_thread, not {!r}'.format(base))
    backend = backends.get_backend(base)(mpi_comm, **kwargs)
    # Nothing is posted before this returns, so the communication thread
    # only ever uses the modelled communicator.
    backend.comm = _ModelledComm(backend.comm, link)
    backend.link = link
    backend.emulation = dict(link.describe(), base=base)
    return backend


backends.register_backend('emulated', emulated_backend)


def configure(nodes, bandwidth, latency=DEFAULTS['latency'], base=None):
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
        backends.get_backend(base)  # an unknown name fails here
        name += ',base={}'.format(base)
    backends.register_backend(name, functools.partial(
        emulated_backend, base=base, nodes=link.nodes,
        bandwidth=link.bandwidth, latency=link.latency))
    return name


class EmulatedCommunicator(object):
    """A ChainerMN communicator whose gradient averaging is timed by a model.

    For ChainerMN's blocking optimizer, which calls
    ``communicator.multi_node_mean_grad`` directly: the real averaging runs,
    then the call returns when one fused ring allreduce of all gradients
    would have finished on ``link`` (as ChainerMN's ``flat`` communicator
    packs them; the ``naive`` one would pay the latency once per array).
    Everything else is delegated to the wrapped communicator.

    Args:
        communicator: a ChainerMN communicator.
        link (LinkModel): the emulated link.
    """

    def __init__(self, communicator, link):
        object.__setattr__(self, '_comm', communicator)
        object.__setattr__(self, 'link', link)

    def multi_node_mean_grad(self, model, zero_fill=False):
        nbytes = 0
        for param in model.params():
            if param.array is None:
                continue
            if param.grad is not None or zero_fill:
                nbytes += param.array.nbytes
        posted = time.perf_counter()
        self._comm.multi_node_mean_grad(model, zero_fill)
        _, finish = self.link.reserve(posted, nbytes)
        _sleep_until(finish)

    def __getattr__(self, name):
        return getattr(self._comm, name)
