"""The machine a result was measured on, as recorded in results files."""
import os
import platform


def machine_description():
    """CPU, cores, software versions and the load average at the start."""
    cpu = ''
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    cpu = line.split(':', 1)[1].strip()
                    break
    except OSError:
        pass
    import chainer
    import numpy
    from mpi4py import MPI
    return {'platform': platform.platform(), 'cpu': cpu,
            'cores': os.cpu_count(), 'python': platform.python_version(),
            'chainer': chainer.__version__, 'numpy': numpy.__version__,
            'mpi': MPI.Get_library_version().splitlines()[0].strip(),
            'loadavg_at_start': os.getloadavg()}
