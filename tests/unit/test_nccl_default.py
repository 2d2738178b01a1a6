"""The NCCL engine is opt-in until a GPU run has shown it to work (issue 43).

``backend=None`` gives GPU parameters the host-staged MPI engine, decided
on each rank alone (no collective), even where NCCL would serve; the rule
that picks ``'nccl'`` is kept behind ``NCCL_BY_DEFAULT``.
"""
import types

import chainer
import numpy as np

from chainermn_overlap.communication import nccl
from chainermn_overlap.communication import streams
from chainermn_overlap.optimizers import _wrapper


class _NoComm(object):
    """A communicator any use of which fails the test."""

    def __getattr__(self, name):
        raise AssertionError('default_engine communicated ({}) although '
                             'NCCL is not chosen by default'.format(name))


def test_gpu_parameters_get_the_host_staged_engine_by_default(monkeypatch):
    fake_cupy = types.SimpleNamespace(__name__='cupy')
    monkeypatch.setattr(chainer.backend, 'get_array_module',
                        lambda *a: fake_cupy)
    monkeypatch.setattr(streams, 'nccl_available', lambda: True)
    link = chainer.links.Linear(3, 2)
    assert nccl.NCCL_BY_DEFAULT is False
    assert _wrapper.default_engine(link, _NoComm()) == 'mpi_priority'


def test_cpu_parameters_get_the_host_staged_engine():
    link = chainer.links.Linear(3, 2)
    assert isinstance(link.W.array, np.ndarray)
    assert _wrapper.default_engine(link, _NoComm()) == 'mpi_priority'
