"""The anchor's configuration, for the benchmarks that replay it.

What only the benchmarks need of the emulation: the compute time an anchor's
published blocking figure implies, the scaling of its link to this machine,
and a ChainerMN communicator whose blocking averaging is timed by the link
model (for ChainerMN's own optimizer under emulation).  The library's
emulated engine itself is ``chainermn_overlap.communication.emulated``.
"""
import time
from typing import Any

from chainermn_overlap.communication import emulated
from chainermn_overlap.communication.emulated import ring_allreduce_seconds


def wire_bytes(nbytes: float, nodes: int) -> float:
    """Bytes each node sends in a ring allreduce: ``2 (N-1)/N * nbytes``."""
    return 2.0 * (nodes - 1) / nodes * nbytes


def scale_bandwidth(bandwidth: float, anchor_compute_s: float,
                    local_compute_s: float) -> float:
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


def anchor_compute_seconds(nbytes: float, nodes: int, bandwidth: float,
                           blocking_scalability: float,
                           latency: float = 0.0) -> float:
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

    def multi_node_mean_grad(self, model: Any, zero_fill: bool = False
                             ) -> None:
        """Averages the gradients, returning when the model says."""
        nbytes = 0
        for param in model.params():
            if param.array is None:
                continue
            if param.grad is not None or zero_fill:
                nbytes += param.array.nbytes
        posted = time.perf_counter()
        self._comm.multi_node_mean_grad(model, zero_fill)
        _, finish = self.link.reserve(posted, nbytes)
        emulated.sleep_until(finish)

    def __getattr__(self, name):
        return getattr(self._comm, name)
