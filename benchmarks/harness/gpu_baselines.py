"""The GPU check's MPI side: is MPI CUDA-aware, and the baseline to compare with.

ChainerMN's communicators hand MPI device pointers, which only a CUDA-aware
MPI reads; where MPI is not, the ResNet-50 comparison's blocking baseline is
:class:`HostStagedBlocking` (used by ``benchmarks/gpu_bench.py``).
"""
import json
import os
import re


def mpi_library_path():
    """The file of the MPI library this process loaded (``/proc/self/maps``)."""
    try:
        with open('/proc/self/maps') as f:
            for line in f:
                path = line.split()[-1]
                if re.search(r'/libmpi(_abi)?\.so', path):
                    return path
    except OSError:
        return None
    return None


def mpi_cuda_aware():
    """Whether the loaded MPI takes device pointers: ``(bool, why)``.

    Asks the library itself (MPICH's and Open MPI's
    ``MPIX_Query_cuda_support``, MPICH's ``MPIX_GPU_query_support``); an MPI
    that answers neither counts as not CUDA-aware.
    """
    import ctypes
    path = mpi_library_path()
    if path is None:
        return False, 'no MPI library found in this process'
    lib = ctypes.CDLL(path)
    if hasattr(lib, 'MPIX_Query_cuda_support'):
        on = bool(lib.MPIX_Query_cuda_support())
        return on, '{}: MPIX_Query_cuda_support() = {}'.format(path, int(on))
    if hasattr(lib, 'MPIX_GPU_query_support'):
        out = ctypes.c_int(0)
        lib.MPIX_GPU_query_support(0, ctypes.byref(out))  # 0: CUDA
        return bool(out.value), '{}: MPIX_GPU_query_support(CUDA) = {}'\
            .format(path, out.value)
    return False, '{} answers no CUDA-support query'.format(path)



class HostStagedBlocking(object):
    """The blocking baseline where MPI is not CUDA-aware: ours, no overlap.

    After backward, all gradients are packed into one device buffer, copied
    to the host, averaged by one MPI allreduce and copied back; then the
    actual optimizer updates.  ChainerMN's communicators hand MPI device
    pointers instead, which an MPI without CUDA support cannot read.
    """

    def __init__(self, actual, mpi_comm):
        self.actual = actual
        self.mpi_comm = mpi_comm
        self.target = None

    def setup(self, link):
        self.actual.setup(link)
        self.target = link
        return self

    def update(self, lossfun, *args):
        import cupy
        from mpi4py import MPI
        self.target.cleargrads()
        loss = lossfun(*args)
        loss.backward()
        params = [p for _, p in sorted(self.target.namedparams())
                  if p.grad is not None]
        flat = cupy.concatenate([p.grad.ravel() for p in params])
        host = cupy.asnumpy(flat)
        self.mpi_comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        host /= self.mpi_comm.Get_size()
        flat = cupy.asarray(host)
        off = 0
        for p in params:
            p.grad[...] = flat[off:off + p.grad.size].reshape(p.grad.shape)
            off += p.grad.size
        self.actual.update()


def choose_baseline(choice, json_path):
    """``('chainermn_blocking' | 'host_staged_blocking', why)``.

    ``auto`` takes ChainerMN only where the MPI is CUDA-aware (what
    ``mpi-probe`` recorded), since ChainerMN passes MPI device pointers.
    """
    if choice != 'auto':
        return choice, 'asked for'
    probe = {}
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            probe = json.load(f).get('mpi_probe', {})
    if 'cuda_aware' not in probe:
        return 'host_staged_blocking', (
            'no mpi-probe result in {}: run mpi-probe first to let ChainerMN '
            'run where MPI is CUDA-aware'.format(json_path))
    if probe['cuda_aware']:
        return 'chainermn_blocking', probe.get('cuda_aware_why', '')
    return 'host_staged_blocking', (
        'ChainerMN hands MPI device pointers and this MPI is not CUDA-aware '
        '({}): the baseline is our own host-staged blocking reduction'
        .format(probe.get('cuda_aware_why', '')))
