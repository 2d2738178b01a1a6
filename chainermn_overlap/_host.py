"""Host staging: MPI moves host memory, arrays may live on a GPU.

No CUDA-aware MPI is assumed, so every package that hands arrays to MPI
(the progress engines, distconv) stages device arrays through host memory
with these helpers; numpy arrays are used in place whenever MPI can take
them as they are.
"""
from typing import Any, Callable, Optional, Tuple

import numpy

import chainer

__all__ = ['is_host', 'stage_to_host', 'to_host']


def is_host(array: Any) -> bool:
    """True when ``array`` is in host memory (a numpy array)."""
    return chainer.backend.get_array_module(array) is numpy


def to_host(array: Any) -> numpy.ndarray:
    """A C-contiguous host copy of ``array`` (or ``array`` itself).

    A C-contiguous numpy array of one or more dimensions is returned as it
    is; anything else (a device array, a strided view) is copied.
    """
    if is_host(array):
        return numpy.ascontiguousarray(array)
    return numpy.ascontiguousarray(chainer.backend.CpuDevice().send(array))


def stage_to_host(array: Any
                  ) -> Tuple[numpy.ndarray, Optional[Callable[[], None]]]:
    """Host buffer for an in-place operation on ``array``, and its copy-back.

    numpy arrays are used in place (no copy, nothing to copy back).  Device
    arrays are copied out now; the returned callable copies the host buffer
    back into ``array`` (call it once the operation is complete).

    Returns:
        tuple: ``(host, finish)``; ``finish`` is None when ``host`` is
        ``array`` itself.
    """
    xp = chainer.backend.get_array_module(array)
    if xp is numpy:
        return array, None
    host = to_host(array)

    def finish():
        array[...] = xp.asarray(host)
    return host, finish
