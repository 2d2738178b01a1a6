"""The device the GPU variants of the test suites run on.

A device spec names a Chainer device, e.g. ``@cupy:0`` (several ranks may
share it) or ``@cupy:rank`` (device = rank modulo the number of GPUs);
``@numpy`` runs the GPU suites' code on the CPU, which checks the tests
themselves on a machine without a GPU.  The GPU suites read the spec from
an environment variable (``tests/gpu/_gpu_device.py``; ``make test-gpu``
sets it when a GPU is present) and skip with one line without it.

The GPU tests (``tests/gpu/``) reuse the CPU suites' models and checks:
they move the model and the inputs with :func:`to_device`, train, bring the
result back with :func:`to_host`, and compare with the CPU/numpy reference.
"""
from typing import Any, Optional, Tuple

import numpy

import chainer

from chainermn_overlap import _mpi_json

__all__ = ['compatibility', 'device_name', 'nccl_usable', 'require',
           'to_device', 'to_host', 'xp']

HOW = ('GPU tests need a GPU: run `make test-gpu` (or `bash benchmarks/'
       'gpu_check.sh`) on a machine with one')


def device_name(spec: Optional[str], rank: int = 0) -> Optional[str]:
    """This rank's device for ``spec`` (None or empty: no device)."""
    spec = (spec or '').strip()
    if not spec:
        return None
    if spec == '@cupy:rank':
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        return '@cupy:{}'.format(rank % max(1, n))
    return spec


def compatibility() -> Tuple[bool, str]:
    """Whether chainer and cupy work together here, and what failed if not.

    Imports cupy, checks that Chainer accepts it (chainer 7.8.1 was built
    for cupy 7.x and may refuse newer ones), and runs one small kernel.
    """
    try:
        import cupy
    except Exception as e:  # reported, not raised: this is a probe
        return False, 'import cupy failed: {}: {}'.format(type(e).__name__, e)
    if not chainer.backends.cuda.available:
        return False, (
            'chainer {} does not accept cupy {} (chainer.backends.cuda.'
            'available is False{}); install the cupy major version chainer '
            'supports, or a chainer that supports this cupy'.format(
                chainer.__version__, cupy.__version__,
                ': ' + str(getattr(chainer.backends.cuda,
                                   '_resolution_error', '')) if getattr(
                    chainer.backends.cuda, '_resolution_error', None)
                else ''))
    try:
        a = cupy.arange(4, dtype=cupy.float32)
        if float((a * 2).sum()) != 12.0:
            return False, 'a cupy kernel gave a wrong result'
    except Exception as e:  # a driver or toolkit mismatch shows up here
        return False, 'a cupy kernel failed: {}: {}'.format(
            type(e).__name__, e)
    return True, 'chainer {} with cupy {}'.format(chainer.__version__,
                                                  cupy.__version__)


def require(spec: Optional[str], rank: int = 0,
            how: str = HOW) -> str:
    """This rank's device for ``spec``; skips the calling module without one.

    Call at module level of a GPU test file.  The skip is the same on every
    rank (it depends on the environment only), so collective tests stay
    matched.

    Args:
        spec (str): the device spec (see the module docstring), or None.
        rank (int): this process's rank (for ``@cupy:rank``).
        how (str): the skip message: how to run the suite.
    """
    import pytest
    name = device_name(spec, rank)
    if name is None:
        pytest.skip(how, allow_module_level=True)
    if name == '@numpy':
        # Harness check on any machine: the GPU suites' code paths with
        # numpy "devices" (proves the tests, not the GPU).
        return name
    ok, why = compatibility()
    if not ok:
        pytest.fail('GPU tests asked for {} but the GPU stack does not '
                    'work: {}'.format(name, why), pytrace=False)
    return name


def to_device(obj: Any, name: str) -> Any:
    """A link (moved in place and returned) or an array, on ``name``."""
    if isinstance(obj, chainer.Link):
        return obj.to_device(name)
    return chainer.get_device(name).send(obj)


def to_host(obj: Any) -> Any:
    """A link (moved to the CPU in place) or an array as numpy."""
    if isinstance(obj, chainer.Link):
        return obj.to_cpu()
    if obj is None or isinstance(obj, numpy.ndarray):
        return obj
    return chainer.backend.CpuDevice().send(obj)


def xp(name: str) -> Any:
    """The array module of device ``name``."""
    return chainer.get_device(name).xp


def nccl_usable(comm: Any) -> Tuple[bool, str]:
    """Whether an NCCL communicator over ``comm`` can be made (collective).

    NCCL refuses ranks that share a GPU; the GPU suites then run the NCCL
    engine at one rank only and say so.
    """
    from chainermn_overlap.communication import streams
    if not streams.nccl_available():
        # The same collectives on every rank; JSON, never pickle.
        _mpi_json.allgather_json(comm, None, what='the GPU bus ids')
        return False, 'cupy has no NCCL or sees no GPU'
    import cupy
    dev = cupy.cuda.Device().id
    pci = cupy.cuda.runtime.deviceGetPCIBusId(dev)
    buses = _mpi_json.allgather_json(comm, pci, what='the GPU bus ids')
    if len(set(buses)) < len(buses):
        return False, ('{} ranks share {} GPU(s); NCCL refuses ranks that '
                       'share a GPU'.format(len(buses), len(set(buses))))
    return True, 'NCCL over {} GPU(s)'.format(len(buses))
