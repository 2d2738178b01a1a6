"""GPU set-up, compatibility probe and a short ResNet-50 benchmark.

Run by ``bash benchmarks/gpu_check.sh`` (all steps but ``install``, in the
environment made from the carried wheels: benchmarks/gpu_offline.py) and
``make test-gpu`` (``install``, which needs a registry); each subcommand
can also run on its own::

    python -m benchmarks.gpu_bench install  --json out.json  # cupy wheel
    python -m benchmarks.gpu_bench libpath  --json out.json  # LD_LIBRARY_PATH
    python -m benchmarks.gpu_bench probe    --json out.json  # one process
    mpiexec -n 2 python -m benchmarks.gpu_bench mpi-probe --json out.json
    mpiexec -n 2 python -m benchmarks.gpu_bench nccl-probe --json out.json
    mpiexec -n 2 python -m benchmarks.gpu_bench bench --json out.json

Every subcommand records what it did and what failed into the JSON file
(merged under its own key), and exits non-zero on failure, so that the
driver script can log, go on and report everything in one run.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
import traceback

from benchmarks.harness.gpu_baselines import (HostStagedBlocking,
                                              choose_baseline,
                                              mpi_cuda_aware)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tried in order until one passes the probe.  chainer 7.8.1 was built for
# cupy 7; the oldest cupy with wheels for this Python and the driver's
# CUDA comes first, the newest that still takes numpy < 2 last.
CANDIDATES = {
    # CuPy 14 (the first with more CUDA 13 wheels) needs numpy >= 2.
    13: [['cupy-cuda13x>=13.6,<14', 'nvidia-nccl-cu13']],
    12: [['cupy-cuda12x>=12,<13', 'nvidia-cudnn-cu12>=8.9,<9',
          'nvidia-nccl-cu12'],
         ['cupy-cuda12x>=13,<14', 'nvidia-cudnn-cu12>=8.9,<9',
          'nvidia-nccl-cu12']],
    11: [['cupy-cuda11x>=12,<13', 'nvidia-cudnn-cu11>=8.6,<9',
          'nvidia-nccl-cu11'],
         ['cupy-cuda11x>=13,<14', 'nvidia-cudnn-cu11>=8.6,<9',
          'nvidia-nccl-cu11']],
}


def merge_json(path, key, value):
    """Writes ``value`` under ``key`` of the JSON file at ``path``."""
    if not path:
        return
    data = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError:
            data = {'_unreadable_previous_content': True}
    data[key] = value
    tmp = path + '.tmp{}'.format(os.getpid())
    with open(tmp, 'w') as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, path)


def _error(e):
    return '{}: {}'.format(type(e).__name__, e)


# ----------------------------------------------------------------------------
# install

def driver_cuda_major():
    """The CUDA major version the driver supports (nvidia-smi), or None."""
    try:
        out = subprocess.run(['nvidia-smi'], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    m = re.search(r'CUDA Version:\s*(\d+)\.(\d+)', out)
    if not m:
        return None, out[-2000:]
    return int(m.group(1)), out[-2000:]


# The libraries whose folders libpath reports (soname patterns).
CUDA_LIBS = {'cudart': 'libcudart.so.*', 'cublas': 'libcublas.so.*',
             'nvrtc': 'libnvrtc.so.*', 'nccl': 'libnccl.so.*',
             'cudnn': 'libcudnn.so.*'}


def nvidia_lib_dirs():
    """Folders of the CUDA, NCCL and cuDNN libraries, found at run time.

    The nvidia-* pip packages under every ``*-packages`` folder on
    ``sys.path`` (CUDA 12 wheels keep ``nvidia/<name>/lib``, CUDA 13 ones
    ``nvidia/cu13/lib``), then ``CUDA_PATH``/``CUDA_HOME`` and the toolkit
    of the ``nvcc`` on ``PATH``; only folders holding one of
    :data:`CUDA_LIBS`.  A venv that sees the image's
    site-packages through a ``.pth`` file has them on ``sys.path`` only,
    not in ``site.getsitepackages()``.
    """
    import shutil
    import site
    bases = [p for p in sys.path if p.endswith('-packages')]
    bases += site.getsitepackages() + [site.getusersitepackages()]
    dirs = []
    for base in bases:
        for sub in ('lib', 'lib64'):
            dirs += glob.glob(os.path.join(base, 'nvidia', '*', sub))
    roots = [os.environ.get('CUDA_PATH'), os.environ.get('CUDA_HOME')]
    nvcc = shutil.which('nvcc')
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in roots:
        if root:
            dirs += [os.path.join(root, sub) for sub in ('lib64', 'lib')]
    out = []
    for d in dirs:
        d = os.path.realpath(d)
        if d not in out and any(glob.glob(os.path.join(d, pattern))
                                for pattern in CUDA_LIBS.values()):
            out.append(d)
    return out


def find_libs(dirs):
    """The first file of each library of :data:`CUDA_LIBS` in ``dirs``."""
    found = {}
    for name, pattern in CUDA_LIBS.items():
        for d in dirs:
            hits = sorted(glob.glob(os.path.join(d, pattern)))
            if hits:
                found[name] = hits[0]
                break
        else:
            found[name] = None
    return found


def probe_subprocess(timeout=300):
    """Runs ``probe`` in a fresh interpreter (the new cupy, the new libs)."""
    env = dict(os.environ)
    env['LD_LIBRARY_PATH'] = ':'.join(
        nvidia_lib_dirs() + [env.get('LD_LIBRARY_PATH', '')]).strip(':')
    proc = subprocess.run([sys.executable, '-m', 'benchmarks.gpu_bench',
                           'probe', '--quick'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def cmd_install(args):
    report = {'attempts': []}
    major, smi = driver_cuda_major()
    report['nvidia_smi_tail'] = smi
    report['driver_cuda_major'] = major
    if major is None:
        report['error'] = 'nvidia-smi found no driver/CUDA version'
        merge_json(args.json, 'install', report)
        return 1
    ok, out = probe_subprocess()
    if ok:
        report['result'] = 'a working cupy was already installed'
        report['probe'] = out
        merge_json(args.json, 'install', report)
        return 0
    if os.environ.get('PIP_NO_INDEX', '').lower() in ('1', 'true', 'yes'):
        report['error'] = (
            'offline (PIP_NO_INDEX): no cupy is fetched here; install it '
            'from the carried wheels (bash benchmarks/gpu_check.sh, '
            'docs/gpu.md "Offline")')
        merge_json(args.json, 'install', report)
        return 1
    candidates = CANDIDATES.get(major, CANDIDATES[13] if major > 13
                                else [])
    for packages in candidates:
        t0 = time.time()
        attempt = {'packages': packages}
        cmd = [sys.executable, '-m', 'pip', 'install', '-q'] + packages
        env = dict(os.environ)
        # chainer 7.8.1 needs numpy < 2: never let a cupy wheel upgrade it.
        env.setdefault('PIP_CONSTRAINT', os.path.join(ROOT, 'constraints.txt'))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=600, env=env)
            attempt['pip_rc'] = proc.returncode
            attempt['pip_tail'] = (proc.stdout + proc.stderr)[-2000:]
            if proc.returncode == 0:
                ok, out = probe_subprocess()
                attempt['probe_ok'] = ok
                attempt['probe'] = out
        except (OSError, subprocess.SubprocessError) as e:
            attempt['error'] = _error(e)
            ok = False
        attempt['seconds'] = round(time.time() - t0, 1)
        report['attempts'].append(attempt)
        sys.stdout.write('install: {} -> {}\n'.format(
            ' '.join(packages), 'works' if ok else 'FAILED'))
        sys.stdout.flush()
        if ok:
            report['result'] = packages
            merge_json(args.json, 'install', report)
            return 0
        subprocess.run([sys.executable, '-m', 'pip', 'uninstall', '-q', '-y',
                        packages[0].split('>')[0].split('<')[0]],
                       capture_output=True)
    report['error'] = ('no candidate cupy wheel worked with chainer {} for '
                       'CUDA {}; see attempts'.format('7.8.1', major))
    merge_json(args.json, 'install', report)
    return 1


def cmd_libpath(args):
    dirs = nvidia_lib_dirs()
    merge_json(args.json, 'libpath', {'dirs': dirs, 'libs': find_libs(dirs)})
    sys.stdout.write(':'.join(dirs) + '\n')
    return 0


# ----------------------------------------------------------------------------
# probe (one process)

def cmd_probe(args):
    report = {}
    failed = []

    def step(name, fn):
        t0 = time.time()
        try:
            report[name] = {'ok': True, 'result': fn()}
        except Exception as e:  # recorded: the probe reports every step
            report[name] = {'ok': False, 'error': _error(e),
                            'traceback': traceback.format_exc()[-2000:]}
            failed.append(name)
        report[name]['seconds'] = round(time.time() - t0, 2)
        sys.stdout.write('probe: {}: {}\n'.format(
            name, 'ok' if report[name]['ok'] else report[name]['error']))
        sys.stdout.flush()

    def versions():
        import chainer
        import cupy
        import numpy
        from chainer.backends import cuda
        out = {'chainer': chainer.__version__, 'cupy': cupy.__version__,
               'numpy': numpy.__version__,
               'chainer_accepts_cupy': bool(cuda.available),
               'cudnn_enabled': bool(cuda.cudnn_enabled),
               'cuda_runtime': cupy.cuda.runtime.runtimeGetVersion(),
               'driver': cupy.cuda.runtime.driverGetVersion(),
               'devices': cupy.cuda.runtime.getDeviceCount()}
        try:
            out['device0'] = cupy.cuda.runtime.getDeviceProperties(0)[
                'name'].decode()
        except Exception as e:  # a name is nice to have, not needed
            out['device0'] = _error(e)
        if not cuda.available:
            raise RuntimeError(
                'chainer does not accept cupy {}: {}'.format(
                    cupy.__version__, getattr(cuda, '_resolution_error', '?')))
        return out

    def kernel():
        import cupy
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        return float((a * 2).sum())

    def conv():
        import chainer
        import chainer.functions as F
        import numpy
        from chainer.backends import cuda
        rng = numpy.random.RandomState(0)
        x = rng.randn(4, 8, 16, 16).astype(numpy.float32)
        w = rng.randn(16, 8, 3, 3).astype(numpy.float32)
        gy = rng.randn(4, 16, 16, 16).astype(numpy.float32)
        out = {}
        for use in ('always', 'never'):
            with chainer.using_config('use_cudnn', use):
                xg = chainer.Variable(cuda.to_gpu(x))
                wg = chainer.Variable(cuda.to_gpu(w))
                y = F.convolution_2d(xg, wg, pad=1)
                y.grad = cuda.to_gpu(gy)
                y.backward()
                out[use] = (cuda.to_cpu(y.array), cuda.to_cpu(xg.grad),
                            cuda.to_cpu(wg.grad))
        xc, wc = chainer.Variable(x), chainer.Variable(w)
        yc = F.convolution_2d(xc, wc, pad=1)
        yc.grad = gy
        yc.backward()
        ref = (yc.array, xc.grad, wc.grad)
        errs = {use: [float(numpy.abs(a - b).max()) for a, b in
                      zip(out[use], ref)] for use in out}
        for use, e in errs.items():
            if max(e) > 1e-3:
                raise AssertionError('conv with use_cudnn={} differs from '
                                     'numpy: max errors {}'.format(use, e))
        # Information, not a failure: CuPy 14 has no cupy.cudnn, and CuPy
        # 13 for CUDA 13 finds no cuDNN 8; Chainer then convolves without
        # cuDNN (correct, only slower), as the check above shows.
        return {'max_abs_error_vs_numpy(y, gx, gW)': errs,
                'cudnn_enabled': bool(cuda.cudnn_enabled),
                'cudnn': ('on' if cuda.cudnn_enabled else
                          'off: Chainer sees no usable cuDNN through CuPy {} '
                          '(runs without it: correct, slower)'.format(
                              __import__('cupy').__version__))}

    step('versions', versions)
    step('kernel', kernel)
    if not args.quick:
        step('conv_forward_backward', conv)
        step('nccl_import', lambda: __import__(
            'chainermn_overlap.communication.streams', fromlist=['x'])
            .nccl_available())
    merge_json(args.json, 'probe', dict(report, failed=failed))
    if args.quick:
        sys.stdout.write(json.dumps(report, default=str)[:2000] + '\n')
    return 1 if failed else 0


# ----------------------------------------------------------------------------
# mpi-probe (under mpiexec; no GPU needed)

def cmd_mpi_probe(args):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    got = world.allreduce(world.Get_rank() + 1, op=MPI.SUM)
    want = world.Get_size() * (world.Get_size() + 1) // 2
    try:
        aware, why = mpi_cuda_aware()
    except OSError as e:
        aware, why = False, _error(e)
    report = {'ranks': world.Get_size(), 'allreduce_ok': got == want,
              'library': MPI.Get_library_version().splitlines()[0],
              'thread_level': MPI.Query_thread(),
              'cuda_aware': aware, 'cuda_aware_why': why}
    if world.Get_rank() == 0:
        merge_json(args.json, 'mpi_probe', report)
        sys.stdout.write('mpi-probe: {}\n'.format(report))
    return 0 if got == want else 1


# ----------------------------------------------------------------------------
# nccl-probe (under mpiexec)

def cmd_nccl_probe(args):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    result = {}
    try:
        import cupy
        from cupy.cuda import nccl
        cupy.cuda.Device(0).use()
        uid = nccl.get_unique_id() if rank == 0 else None
        uid = world.bcast(uid, root=0)
        comm = nccl.NcclCommunicator(world.Get_size(), uid, rank)
        a = cupy.full(1000, rank + 1.0, dtype=cupy.float32)
        stream = cupy.cuda.Stream(non_blocking=True)
        comm.allReduce(a.data.ptr, a.data.ptr, a.size, nccl.NCCL_FLOAT32,
                       nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()
        got = float(a[0].get())
        want = world.Get_size() * (world.Get_size() + 1) / 2.0
        result = {'ok': got == want, 'got': got, 'want': want,
                  'nccl_version': nccl.get_version()}
    except Exception as e:  # reported: two ranks on one GPU may be refused
        result = {'ok': False, 'error': _error(e)}
    results = world.gather(result, root=0)
    engine = {}
    try:
        from chainermn_overlap.communication import nccl as nccl_engine
        import cupy
        eng = nccl_engine.NcclEngine(world, timeout=60)
        try:
            a = cupy.full(1 << 20, rank + 1.0, dtype=cupy.float32)
            eng.allreduce(a, label='probe').wait()
            engine = {'ok': float(a[-1].get()) == world.Get_size() * (
                world.Get_size() + 1) / 2.0}
        finally:
            eng.close()
    except Exception as e:  # the same failure on every rank, reported
        engine = {'ok': False, 'error': _error(e)}
    engines = world.gather(engine, root=0)
    ok = all(r.get('ok') for r in results or []) if rank == 0 else True
    if rank == 0:
        merge_json(args.json, 'nccl_probe_np{}'.format(world.Get_size()),
                   {'raw_nccl_allreduce': results, 'nccl_engine': engines})
        sys.stdout.write('nccl-probe at {} ranks: raw {} engine {}\n'.format(
            world.Get_size(), results, engines))
    return 0 if world.bcast(ok, root=0) else 1


# ----------------------------------------------------------------------------
# bench (under mpiexec): ResNet-50, a blocking baseline vs ours

def cmd_bench(args):
    import chainer
    import chainer.links as L
    import chainermn
    import cupy
    import numpy
    from mpi4py import MPI

    import chainermn_overlap
    from chainermn_overlap.testing import device as device_module
    from examples.imagenet.models import ARCHS

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comm = chainermn.create_communicator('naive')
    dev = args.device
    chainer.get_device(dev).use()
    ok_nccl, why_nccl = device_module.nccl_usable(world)
    baseline, why_baseline = choose_baseline(args.baseline, args.json)
    if rank == 0:
        sys.stdout.write('bench: baseline {}: {}\n'.format(baseline,
                                                          why_baseline))
    configs = [(baseline, None, None),
               ('overlap_forward', 'forward', 'mpi_priority'),
               ('overlap_update', 'update', 'mpi_priority')]
    if ok_nccl:
        configs += [('overlap_forward_nccl', 'forward', 'nccl'),
                    ('overlap_update_nccl', 'update', 'nccl')]
    rng = numpy.random.RandomState(rank)
    x = cupy.asarray(rng.randn(args.batchsize, 3, args.insize, args.insize)
                     .astype(numpy.float32))
    t = cupy.asarray(rng.randint(0, 1000, size=args.batchsize)
                     .astype(numpy.int32))
    results = {}
    for name, wait, backend in configs:
        entry, model, opt = {}, None, None
        try:
            numpy.random.seed(0)
            model = L.Classifier(ARCHS[args.arch]())
            model.to_device(dev)
            actual = chainer.optimizers.MomentumSGD(lr=0.01)
            if name == 'host_staged_blocking':
                opt = HostStagedBlocking(actual, world)
            elif wait is None:
                opt = chainermn.create_multi_node_optimizer(actual, comm)
            else:
                opt = chainermn_overlap.create_overlapped_optimizer(
                    actual, comm, wait=wait, backend=backend)
            opt.setup(model)
            times = []
            for it in range(args.warmup + args.iterations):
                world.Barrier()
                cupy.cuda.Device().synchronize()
                t0 = time.perf_counter()
                opt.update(model, x, t)
                cupy.cuda.Device().synchronize()
                dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if it >= args.warmup:
                    times.append(dt)
            if hasattr(opt, 'synchronize') and wait is not None:
                opt.synchronize()
            loss = float(model.loss.array) if model.loss is not None else None
            entry = {'median_s': float(numpy.median(times)),
                     'min_s': float(numpy.min(times)),
                     'images_per_s': size * args.batchsize / float(
                         numpy.median(times)),
                     'iterations': len(times), 'last_loss': loss}
            if wait is not None:
                state = getattr(opt, '_overlap', None)
                entry['comm_stats'] = (state.stats.as_dict()
                                       if state is not None else None)
                if hasattr(opt, 'close'):
                    opt.close()
        except Exception as e:  # recorded; the next configuration runs
            entry = {'error': _error(e),
                     'traceback': traceback.format_exc()[-3000:]}
        results[name] = entry
        if rank == 0:
            sys.stdout.write('bench: {}: {}\n'.format(
                name, {k: v for k, v in entry.items() if k != 'traceback'}))
            sys.stdout.flush()
        model = opt = None
        cupy.get_default_memory_pool().free_all_blocks()
    if rank == 0:
        merge_json(args.json, 'bench', {
            'arch': args.arch, 'batchsize_per_rank': args.batchsize,
            'insize': args.insize, 'ranks': size, 'device': dev,
            'ranks_share_one_gpu': True, 'nccl_engine': (ok_nccl, why_nccl),
            'baseline': baseline, 'baseline_why': why_baseline,
            'timing': 'per iteration, slowest rank, device synchronised '
                      'before and after update()',
            'results': results})
    failed = [k for k, v in results.items() if 'error' in v]
    return 1 if world.bcast(failed, root=0) else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='cmd', required=True)
    for name in ('install', 'libpath', 'probe', 'mpi-probe', 'nccl-probe',
                 'bench'):
        p = sub.add_parser(name)
        p.add_argument('--json', default=None)
        if name == 'probe':
            p.add_argument('--quick', action='store_true')
        if name == 'bench':
            p.add_argument('--arch', default='resnet50')
            p.add_argument('--batchsize', type=int, default=32)
            p.add_argument('--insize', type=int, default=224)
            p.add_argument('--iterations', type=int, default=10)
            p.add_argument('--warmup', type=int, default=3)
            p.add_argument('--device', default='@cupy:0')
            p.add_argument('--baseline', default='auto',
                           choices=['auto', 'chainermn_blocking',
                                    'host_staged_blocking'])
    args = parser.parse_args(argv)
    fn = {'install': cmd_install, 'libpath': cmd_libpath,
          'probe': cmd_probe, 'mpi-probe': cmd_mpi_probe,
          'nccl-probe': cmd_nccl_probe,
          'bench': cmd_bench}[args.cmd]
    try:
        return fn(args)
    except Exception as e:  # recorded, so that the driver's JSON says why
        rank = os.environ.get('PMI_RANK', '0')
        merge_json(args.json if rank == '0' else None,
                   '{}_error'.format(args.cmd),
                   {'error': _error(e),
                    'traceback': traceback.format_exc()[-3000:]})
        raise


if __name__ == '__main__':
    sys.exit(main())
