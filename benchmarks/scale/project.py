"""Running the SimGrid replay from the project's Python: validation against
the bed and projection to 1,024 nodes.

The replay (:mod:`benchmarks.scale.replay`) runs under the system Python
that has ``python3-simgrid``, one process per simulated configuration (a
SimGrid engine is created once per process); this module starts those
processes and gathers their JSON lines.
"""
import json
import os
import subprocess

SYSTEM_PYTHON = os.environ.get('CMO_SIMGRID_PYTHON', '/usr/bin/python3')
REPLAY = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'replay.py')
# The reference setting: ResNet-50, 16 nodes, 10 Gb/s, blocking 66.72 %,
# layer-wise 92.4 %; Horovod: 90 % at 512 GPUs (ResNet-101, 25 Gb/s RoCE).
REFERENCE = {'nodes': 16, 'rate_bit_per_s': 10e9, 'blocking': 0.6672,
             'layerwise': 0.924, 'latency_s': 25e-6}
HOROVOD = {'nodes': 512, 'scalability': 0.90, 'rate_bit_per_s': 25e9,
           'model': 'ResNet-101'}
# A GPU-class compute time: Goyal et al. 2017 ("Accurate, Large Minibatch
# SGD: Training ImageNet in 1 Hour", arXiv:1706.02677): the 8-GPU
# baseline (Tesla P100, 32 images per GPU) trains ResNet-50 for 90 epochs
# of 1.28 M images in 29 hours: 8 * 32 * 29 * 3600 / (1.28e6 * 90) s per
# iteration, about 0.232 s, communication inside one server included.
GPU_CLASS = {'iteration_s': 8 * 32 * 29 * 3600 / (1.28e6 * 90),
             'source': 'Goyal et al. 2017 (arXiv:1706.02677): ResNet-50, 90 '
                       'epochs of 1.28 M images in 29 h on 8 Tesla P100, 32 '
                       'images per GPU'}
NODES = (16, 64, 256, 1024)
RATES = (10e9, 25e9, 100e9)


def simgrid_problem(python=SYSTEM_PYTHON):
    """None if ``python`` imports simgrid, else what to do about it."""
    try:
        proc = subprocess.run([python, '-c', 'import simgrid'],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=60)
    except OSError as e:
        return '{} cannot run ({}): install python3 and python3-simgrid ' \
               '(apt-get install -y python3-simgrid)'.format(python, e)
    if proc.returncode != 0:
        return ('{} cannot import simgrid: install the Debian package '
                '(apt-get install -y python3-simgrid; make bench-scale does '
                'as root) or point CMO_SIMGRID_PYTHON at a Python that has '
                'it'.format(python))
    return None


def _replay_env():
    """The replay's environment: where the engine's chunk rule is, for a
    checkout without the package beside it (an installed wheel); the
    system Python cannot import the package itself."""
    import importlib.util
    env = dict(os.environ)
    found = importlib.util.find_spec('chainermn_overlap')
    if found is not None and found.origin:
        env['CMO_CHUNKING_FILE'] = os.path.join(
            os.path.dirname(found.origin), 'communication', 'chunking.py')
    return env


def replay(trace_path, nodes, rate, latency, mode, python=SYSTEM_PYTHON,
           timeout=1200, **options):
    """One replay; its JSON result. ``options``: compute_scale,
    efficiency, step_overhead (seconds), algorithm, iterations,
    exact_hosts, topology."""
    cmd = [python, REPLAY, '--trace', trace_path, '--nodes', str(nodes),
           '--rate', repr(float(rate)), '--latency', repr(float(latency)),
           '--mode', mode]
    for key, value in sorted(options.items()):
        if value == '':     # a flag
            cmd.append('--' + key.replace('_', '-'))
        elif value is not None:
            cmd += ['--' + key.replace('_', '-'), str(value)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=timeout,
                          env=_replay_env())
    lines = [l for l in proc.stdout.splitlines() if l.startswith('{')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError('replay failed (exit {}): {}\n{}'.format(
            proc.returncode, ' '.join(cmd), proc.stderr[-2000:]))
    out = json.loads(lines[-1])
    out['command'] = cmd
    return out


def calibrate_reference(trace_path, efficiency, **options):
    """Compute scale at which blocking gives the reference's 66.72 % at 16
    nodes on 10 Gb/s.  Blocking's communication does not depend on the
    compute time, so one replay at scale 1 gives it."""
    r = replay(trace_path, REFERENCE['nodes'], REFERENCE['rate_bit_per_s'],
               REFERENCE['latency_s'], 'blocking', efficiency=efficiency,
               compute_scale=1.0, **options)
    t_comm = r['iteration_s'] - r['compute_s']
    s = REFERENCE['blocking']
    return t_comm * s / (1.0 - s) / r['compute_s'], r


def project(trace_path, compute_scale, efficiency, step_overhead_s,
            nodes=NODES, rates=RATES, algorithm='halving', log=None,
            chunk_bytes=None):
    """Ours (with the communication thread's CPU time as recorded, and
    without: ``ours_no_interference``), blocking and the overlap bound at
    every (nodes, rate).  ``chunk_bytes``: the engine's chunk at every N
    (default: the trace's, grown with N for a ring)."""
    rows = []
    for rate in rates:
        for n in nodes:
            row = {'nodes': n, 'rate_bit_per_s': rate}
            for mode in ('ours', 'ours_no_interference', 'blocking',
                         'bound'):
                extra = {}
                if mode == 'ours_no_interference':
                    extra['no_interference'] = ''
                r = replay(trace_path, n, rate, REFERENCE['latency_s'],
                           mode.split('_')[0], compute_scale=compute_scale,
                           efficiency=efficiency,
                           step_overhead=step_overhead_s * compute_scale,
                           algorithm=algorithm, chunk_bytes=chunk_bytes,
                           **extra)
                row[mode] = r['scalability']
                if mode == 'ours':
                    row['agreements_per_iteration'] = r[
                        'agreements_per_iteration']
                    row['ours_iteration_s'] = r['iteration_s']
                if mode == 'bound':
                    row['comm_s'] = r['comm_s']
                    row['backward_s'] = r['backward_s']
            row['compute_s'] = r['compute_s']
            row['gap_to_bound'] = row['bound'] - row['ours']
            row['gap_to_bound_no_interference'] = (
                row['bound'] - row['ours_no_interference'])
            rows.append(row)
            if log:
                log('  {:>5} nodes {:>5.0f} Gb/s: blocking {:.3f} ours {:.3f} '
                    '(no interference {:.3f}) bound {:.3f}'.format(
                        n, rate / 1e9, row['blocking'], row['ours'],
                        row['ours_no_interference'], row['bound']))
    return rows
