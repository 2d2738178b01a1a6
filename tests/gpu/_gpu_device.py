"""Which device the GPU suites run on: ``CHAINERMN_OVERLAP_TEST_DEVICE``.

``make test-gpu`` sets it (``@cupy:0``); unset, every GPU test module skips
with one line.  ``@numpy`` runs the suites' code on the CPU (checks the
tests, not the GPU).
"""
import os

from chainermn_overlap.testing import device
from chainermn_overlap.testing import equivalence as eq

ENV_VAR = 'CHAINERMN_OVERLAP_TEST_DEVICE'
HOW = ('GPU tests need a GPU: run `make test-gpu` (or `bash benchmarks/'
       'gpu_check.sh`) on a machine with one, or set {}=@cupy:0'
       .format(ENV_VAR))


def require():
    """This rank's device; skips the calling module when none is set."""
    return device.require(os.environ.get(ENV_VAR),
                          eq.get_communicator().rank, HOW)
