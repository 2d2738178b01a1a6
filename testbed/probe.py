"""Allreduce bandwidth across a test bed, measured by its own ranks.

:func:`probe` runs this module as an MPI program on a bed (one rank per
namespace); rank 0 prints one JSON line with the times, the bus bandwidth
and the addresses the ranks saw::

    python -m testbed.netbed --ranks 2 --rate 400mbit --probe
"""
import json
import re
import sys
import time

from testbed._system import NetBedError, child_env, module_command, run


def probe_worker(nbytes, repeats):
    """Measures allreduce time of ``nbytes``; rank 0 prints one JSON line."""
    import numpy
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    buf = numpy.ones(nbytes // 4, dtype=numpy.float32)
    comm.Allreduce(MPI.IN_PLACE, buf[:1024])  # connect
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        times.append(time.perf_counter() - t0)
    n = comm.Get_size()
    # The first 1024 elements took part in the connecting allreduce too.
    ok = bool(numpy.all(buf[1024:] == float(n) ** repeats))
    addrs = comm.gather(_eth0_address(), root=0)
    if comm.Get_rank() == 0:
        best = min(times)
        print(json.dumps({
            'probe': 'allreduce', 'bytes': nbytes, 'ranks': n,
            'seconds': times, 'correct': ok, 'addresses': addrs,
            # Bytes a rank sends per direction in a ring allreduce.
            'wire_bytes_per_rank': 2.0 * (n - 1) / n * nbytes,
            'algbw_bit_per_s': nbytes * 8 / best,
            'busbw_bit_per_s': 2.0 * (n - 1) / n * nbytes * 8 / best}))
        sys.stdout.flush()


def _eth0_address():
    try:
        out = run(['ip', '-4', '-o', 'addr', 'show', 'dev', 'eth0'],
                  check=False).stdout
        m = re.search(r'inet (\S+)/', out)
        return m.group(1) if m else None
    except OSError:
        return None


def probe(bed, nbytes=8 * 2 ** 20, repeats=3, timeout=120):
    """Runs the allreduce probe on ``bed``; returns its JSON record."""
    res = bed.run_mpi(module_command('testbed.probe', nbytes, repeats),
                      timeout=timeout, env=child_env())
    if res['returncode'] != 0:
        raise NetBedError('the allreduce probe failed (exit {}):\n{}\n{}'
                          .format(res['returncode'], res['stdout'][-3000:],
                                  res['stderr'][-3000:]))
    lines = [ln for ln in res['stdout'].splitlines()
             if ln.startswith('{"probe"')]
    if not lines:
        raise NetBedError('the probe printed no result:\n' + res['stdout'])
    return json.loads(lines[-1])


if __name__ == '__main__':
    probe_worker(int(sys.argv[1]), int(sys.argv[2]))
