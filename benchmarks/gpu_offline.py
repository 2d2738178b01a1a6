"""The GPU run without a network: a wheelhouse made here, an environment there.

The lent GPU machines reach no package registry.  Their ``python3`` is
Python 3.12 in a venv holding PyTorch, numpy 2, cupy-cuda13x 14, mpi4py and
the CUDA 13 libraries as nvidia-* wheels; it has no Chainer, no MPI library
and no fastrlock.  Chainer 7.8.1 needs numpy < 2, and CuPy 14 needs numpy
>= 2 (its metadata: ``numpy<2.6,>=2.0``), so the run carries numpy 1.26.4
and the last CuPy for CUDA 13 that takes it (cupy-cuda13x 13.6.0, which
needs fastrlock).  docs/gpu.md lists every wheel and why.

Subcommands::

    # here, with the registries reachable (make gpu-wheelhouse):
    python -m benchmarks.gpu_offline wheelhouse --out .gpu-wheels \\
        --python python3.12
    # there, with none (benchmarks/gpu_check.sh runs these):
    python -m benchmarks.gpu_offline verify --wheels .gpu-wheels
    python3 -m benchmarks.gpu_offline env --wheels .gpu-wheels \\
        --env .gpu-env --json gpu.json
    .gpu-env/bin/python -m benchmarks.gpu_offline imports --json gpu.json

The wheelhouse is cut into folders ``part1``, ``part2``, ... of at most
``--part-mib`` MiB each, so that one call of the device tool carries one
part (it carries at most 64 MiB, the working tree included); every part
holds the same ``MANIFEST.json``.  A wheel larger than a part is cut into
pieces (``NAME.whl.000``, ...) joined back by ``env``.

``env`` installs with ``pip install --no-index --no-deps`` only: it never
asks a registry for anything, and fails in one line when a wheel is
missing.  The environment is a venv of the image's Python (no pip of its
own: ``--without-pip`` needs no ensurepip) whose site-packages come first
and that sees the image's site-packages after them (a ``.pth`` file calling
``site.addsitedir``): the carried numpy and cupy shadow the image's, while
the image's CUDA, NCCL and cuDNN wheels, pip and pytest stay visible.  A
``pip install --target`` folder on ``PYTHONPATH`` would shadow as well, but
Python reads no ``.pth`` file there, and the start-up file that lets
Chainer import on Python 3.12 (``chainermn_overlap-compat.pth``) is one.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = 'MANIFEST.json'
# 56 MiB leaves 8 MiB of a call's 64 for the working tree (about 4 MiB).
PART_MIB = 56
MIB = 1 << 20

# What the device lacks, pinned to the versions tested here.  'always': the
# environment gets it whatever the image has (the image's cannot serve:
# numpy 2, cupy 14 needing numpy 2, no MPI); 'if_missing': only where the
# image has no such distribution (the device image has these; a bare
# Python, as in the dry run here, has not).
ALWAYS = [
    ('numpy==1.26.4', 'Chainer 7.8.1 needs numpy < 2 (np.sctypes at import, '
     'NEP 50 changes chainer.reporter); the image has numpy 2'),
    ('cupy-cuda13x==13.6.0', 'the image\'s cupy-cuda13x 14 requires numpy '
     '>= 2 (its metadata); 13.6.0 is the one CuPy for CUDA 13 that takes '
     'numpy 1.26'),
    ('fastrlock==0.8.4', 'CuPy 13 needs it; the image has none (CuPy 14 '
     'dropped it)'),
    ('mpich==5.0.2', 'an MPI library and mpiexec: the image\'s mpi4py has '
     'no MPI to load'),
    ('mpi4py==4.1.2', 'the version tested here with that MPICH (the '
     'image\'s mpi4py version is not known here)'),
]
IF_MISSING = [
    ('six==1.17.0', 'Chainer 7.8.1 imports it'),
    ('typing_extensions==4.16.0', 'Chainer 7.8.1 imports it'),
    ('filelock==4.3.2', 'Chainer 7.8.1 imports it'),
    ('pytest==9.2.0', 'tests/gpu'),
    ('pluggy==1.7.0', 'pytest needs it'),
    ('iniconfig==2.3.1', 'pytest needs it'),
    ('packaging==26.4', 'pytest needs it'),
    ('pygments==2.21.0', 'pytest needs it'),
]
BUILT = [
    ('chainer==7.8.1', 'no wheel on PyPI: built here from its sdist'),
    ('chainermn_overlap', 'this package, built here for cp312 (with its C '
     'kernels and the Python 3.12 start-up file)'),
]

# The platform tags a manylinux wheel for the device's x86-64 may carry.
PLATFORMS = ['manylinux_2_28_x86_64', 'manylinux_2_27_x86_64',
             'manylinux_2_17_x86_64', 'manylinux2014_x86_64',
             'manylinux_2_5_x86_64', 'manylinux1_x86_64']

# Environment variables through which pip could reach an index.
PIP_INDEX_VARS = ('PIP_INDEX_URL', 'PIP_EXTRA_INDEX_URL', 'PIP_FIND_LINKS',
                  'PIP_CONSTRAINT', 'PIP_BUILD_CONSTRAINT')


def merge_json(path, key, value):
    """Writes ``value`` under ``key`` of the JSON file at ``path``."""
    from benchmarks.gpu_bench import merge_json as merge
    merge(path, key, value)


def sha256(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return h.hexdigest()


def dist_name(wheel_file):
    """The normalised distribution name of a wheel file name."""
    return re.sub(r'[-_.]+', '-', os.path.basename(wheel_file)
                  .split('-')[0]).lower()


# ----------------------------------------------------------------------------
# wheelhouse (here)

def plan_parts(sizes, limit):
    """Assigns files to parts of at most ``limit`` bytes: a pure function.

    Args:
        sizes (dict): file name -> size in bytes.
        limit (int): the most bytes a part may hold.

    Returns:
        list: one list of ``(name, piece, offset, length)`` per part, where
        ``piece`` is ``None`` for a whole file, else the index of a piece
        of a file larger than ``limit``.  Largest first, each into the
        first part with room (first-fit decreasing).
    """
    if limit <= 0:
        raise ValueError('a part must hold at least one byte, got limit={}'
                         .format(limit))
    items = []
    for name, size in sizes.items():
        if size <= limit:
            items.append((size, name, None, 0))
        else:
            for i, off in enumerate(range(0, size, limit)):
                items.append((min(limit, size - off), name, i, off))
    items.sort(key=lambda t: (-t[0], t[1], t[2] or 0))
    parts, room = [], []
    for size, name, piece, off in items:
        for k, free in enumerate(room):
            if size <= free:
                parts[k].append((name, piece, off, size))
                room[k] -= size
                break
        else:
            parts.append([(name, piece, off, size)])
            room.append(limit - size)
    return parts


def write_parts(files, out, limit, why=None, python='3.12'):
    """Lays the wheels ``files`` out in ``out/part1 ...``; returns the manifest.

    ``python`` is the version the wheels are for (checked by ``env``).
    """
    sizes = {os.path.basename(f): os.path.getsize(f) for f in files}
    src = {os.path.basename(f): f for f in files}
    for d in os.listdir(out) if os.path.isdir(out) else []:
        if re.fullmatch(r'part\d+', d):
            shutil.rmtree(os.path.join(out, d))
    manifest = {'part_limit_bytes': limit, 'parts': [], 'wheels': {},
                'python': python}
    for name in sorted(sizes):
        manifest['wheels'][name] = {
            'bytes': sizes[name], 'sha256': sha256(src[name]),
            'distribution': dist_name(name),
            'install': 'if_missing' if dist_name(name) in {
                dist_name(r.split('==')[0]) for r, _ in IF_MISSING}
            else 'always',
            'why': (why or {}).get(dist_name(name), ''), 'pieces': []}
    for k, part in enumerate(plan_parts(sizes, limit), 1):
        folder = 'part{}'.format(k)
        os.makedirs(os.path.join(out, folder))
        held = 0
        for name, piece, off, length in part:
            dest = name if piece is None else '{}.{:03d}'.format(name, piece)
            with open(src[name], 'rb') as f, \
                    open(os.path.join(out, folder, dest), 'wb') as g:
                f.seek(off)
                g.write(f.read(length))
            manifest['wheels'][name]['pieces'].append(
                {'part': folder, 'file': dest, 'offset': off,
                 'bytes': length})
            held += length
        manifest['parts'].append({'part': folder, 'bytes': held})
    for w in manifest['wheels'].values():
        w['pieces'].sort(key=lambda p: p['offset'])
    for p in manifest['parts']:
        with open(os.path.join(out, p['part'], MANIFEST), 'w') as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest


def _run(cmd, **kw):
    sys.stdout.write('+ {}\n'.format(' '.join(cmd)))
    sys.stdout.flush()
    subprocess.run(cmd, check=True, **kw)


def cmd_wheelhouse(args):
    if not 0 < args.part_mib <= 60:
        raise SystemExit('gpu_offline wheelhouse: --part-mib must be 1-60 (a '
                         'device call carries 64 MiB, the working tree '
                         'included), got {}'.format(args.part_mib))
    py = args.python
    out = os.path.abspath(args.out)
    dl = os.path.join(out, 'download')
    shutil.rmtree(dl, ignore_errors=True)
    os.makedirs(dl)
    version = subprocess.run(
        [py, '-c', 'import sys; print("%d%d" % sys.version_info[:2])'],
        capture_output=True, text=True, check=True).stdout.strip()
    if version != '312':
        raise SystemExit('gpu_offline wheelhouse: --python must be a Python '
                         '3.12 (the device\'s), got {} (cp{}): name one, e.g. '
                         '--python /root/.pyenv/versions/3.12.1/bin/python3.12'
                         .format(py, version))
    platform = sum((['--platform', p] for p in PLATFORMS), [])
    _run([py, '-m', 'pip', 'download', '-q', '--no-deps',
          '--only-binary=:all:', '--python-version', '3.12',
          '--implementation', 'cp', '--abi', 'cp312', '--abi', 'abi3',
          '--abi', 'none'] + platform + ['-d', dl]
         + [r for r, _ in ALWAYS + IF_MISSING])
    env = dict(os.environ)
    # chainer 7.8.1's setup.py needs setuptools < 70 (constraints.txt).
    env['PIP_CONSTRAINT'] = env['PIP_BUILD_CONSTRAINT'] = os.path.join(
        ROOT, 'constraints.txt')
    _run([py, '-m', 'pip', 'wheel', '-q', '--no-deps', '--no-binary',
          'chainer', '-w', dl, 'chainer==7.8.1'], env=env)
    _run([py, '-m', 'pip', 'wheel', '-q', '--no-deps', '-w', dl, ROOT],
         env=env)
    files = sorted(os.path.join(dl, f) for f in os.listdir(dl)
                   if f.endswith('.whl'))
    why = {dist_name(r.split('==')[0]): w for r, w in
           ALWAYS + IF_MISSING + BUILT}
    manifest = write_parts(files, out, args.part_mib * MIB, why)
    shutil.rmtree(dl)
    for p in manifest['parts']:
        names = sorted(w for w, v in manifest['wheels'].items()
                       if any(x['part'] == p['part'] for x in v['pieces']))
        sys.stdout.write('{}: {:.1f} MiB: {}\n'.format(
            p['part'], p['bytes'] / MIB, ', '.join(names)))
    sys.stdout.write('wheelhouse: {} wheels, {:.1f} MiB in {} parts of at '
                     'most {} MiB, in {}\n'.format(
                         len(manifest['wheels']),
                         sum(p['bytes'] for p in manifest['parts']) / MIB,
                         len(manifest['parts']), args.part_mib, out))
    return 0


# ----------------------------------------------------------------------------
# verify and env (there)

def read_manifest(wheels):
    """The manifest of the parts present under ``wheels``."""
    found = sorted(d for d in os.listdir(wheels)
                   if re.fullmatch(r'part\d+', d)
                   and os.path.exists(os.path.join(wheels, d, MANIFEST))) \
        if os.path.isdir(wheels) else []
    if not found:
        raise RuntimeError(
            'no wheelhouse in {}: make it where pip reaches PyPI (make '
            'gpu-wheelhouse) and carry its parts (docs/gpu.md, "Offline")'
            .format(wheels))
    with open(os.path.join(wheels, found[0], MANIFEST)) as f:
        return json.load(f)


def assemble(wheels, dest):
    """Joins and checks every wheel of the manifest into ``dest``.

    Raises RuntimeError naming the parts still missing (they were not
    carried, or not in an earlier call on this warm machine).
    """
    manifest = read_manifest(wheels)
    missing = sorted({p['part'] for w in manifest['wheels'].values()
                      for p in w['pieces']
                      if not os.path.exists(os.path.join(
                          wheels, p['part'], p['file']))})
    if missing:
        raise RuntimeError(
            'the wheelhouse in {} lacks {}: carry each part in a call of its '
            'own, one right after the other on the warm machine (docs/gpu.md, '
            '"Offline")'.format(wheels, ', '.join(missing)))
    os.makedirs(dest, exist_ok=True)
    out = {}
    for name, w in sorted(manifest['wheels'].items()):
        path = os.path.join(dest, name)
        with open(path, 'wb') as g:
            for p in w['pieces']:
                with open(os.path.join(wheels, p['part'], p['file']),
                          'rb') as f:
                    shutil.copyfileobj(f, g)
        got = sha256(path)
        if got != w['sha256']:
            raise RuntimeError(
                '{} is damaged (sha256 {} where the manifest says {}): carry '
                'its part again'.format(name, got[:12], w['sha256'][:12]))
        out[name] = dict(w, path=path)
    return out


def offline_env():
    """os.environ for a pip that can reach no index, however configured."""
    env = {k: v for k, v in os.environ.items() if k not in PIP_INDEX_VARS}
    env.update(PIP_NO_INDEX='1', PIP_CONFIG_FILE=os.devnull,
               PIP_DISABLE_PIP_VERSION_CHECK='1', PIP_NO_INPUT='1')
    return env


def image_site_dirs(python):
    """The site-packages folders of the interpreter ``python`` (the image's)."""
    out = subprocess.run(
        [python, '-c', 'import json, site, sys; print(json.dumps('
         '[p for p in site.getsitepackages() + sys.path[1:] '
         'if p.endswith("-packages")]))'],
        capture_output=True, text=True, check=True).stdout
    seen = []
    for p in json.loads(out):
        if os.path.isdir(p) and p not in seen:
            seen.append(p)
    return seen


def installed_in(python, names):
    """Which of the distributions ``names`` ``python`` already sees."""
    code = ('import json, sys\nfrom importlib import metadata\nout = {}\n'
            'for n in sys.argv[1:]:\n    try:\n'
            '        out[n] = metadata.version(n)\n'
            '    except metadata.PackageNotFoundError:\n        pass\n'
            'print(json.dumps(out))')
    return json.loads(subprocess.run(
        [python, '-c', code] + list(names), capture_output=True, text=True,
        check=True).stdout)


def make_env(base_python, env_dir, image_sites):
    """A venv of ``base_python`` without pip that sees ``image_sites`` last."""
    code = ('import venv, sys; venv.EnvBuilder(with_pip=False, symlinks=True,'
            ' clear=True).create(sys.argv[1])')
    subprocess.run([base_python, '-c', code, env_dir], check=True)
    py = os.path.join(env_dir, 'bin', 'python')
    site_dir = subprocess.run(
        [py, '-c', 'import sysconfig; print(sysconfig.get_path("purelib"))'],
        capture_output=True, text=True, check=True).stdout.strip()
    # 'zz': read after the package's own start-up file.  addsitedir appends,
    # so the environment's own site-packages stay first, and it reads the
    # image's .pth files as the image's Python would.
    with open(os.path.join(site_dir, 'zz_gpu_image_site.pth'), 'w') as f:
        # map, not a comprehension: before Python 3.12 a comprehension is a
        # scope of its own, which does not see the line's own import.
        f.write('import site; list(map(site.addsitedir, {!r}))\n'.format(
            list(image_sites)))
    return py, site_dir


def cmd_verify(args):
    tmp = tempfile.mkdtemp(prefix='gpu-wheels-')
    try:
        wheels = assemble(args.wheels, tmp)
    finally:
        shutil.rmtree(tmp)
    sys.stdout.write('verify: {} wheels complete and intact in {}\n'.format(
        len(wheels), args.wheels))
    return 0


def cmd_env(args):
    t0 = time.time()
    report = {'base_python': args.base_python, 'env': args.env}
    try:
        base = shutil.which(args.base_python) or args.base_python
        report['base_python_path'] = base
        version = subprocess.run(
            [base, '-c', 'import sys; print("%d.%d" % sys.version_info[:2])'],
            capture_output=True, text=True, check=True).stdout.strip()
        report['base_python_version'] = version
        want = read_manifest(args.wheels).get('python', '3.12')
        if version != want:
            raise RuntimeError(
                'the wheelhouse is for Python {} and {} is Python {}: name '
                'that Python with GPU_PYTHON=/path/to/python{}'.format(
                    want, base, version, want))
        wheel_dir = os.path.join(args.env + '.wheels')
        shutil.rmtree(wheel_dir, ignore_errors=True)
        wheels = assemble(args.wheels, wheel_dir)
        sites = image_site_dirs(base)
        report['image_site_packages'] = sites
        have = installed_in(base, sorted({w['distribution']
                                          for w in wheels.values()}))
        report['image_has'] = have
        chosen = [w['path'] for w in wheels.values()
                  if w['install'] == 'always' or w['distribution'] not in have]
        report['skipped_image_has_them'] = sorted(
            n for n, w in wheels.items() if w['path'] not in chosen)
        py, site_dir = make_env(base, os.path.abspath(args.env), sites)
        cmd = [py, '-m', 'pip', 'install', '--no-index', '--no-deps',
               '--ignore-installed', '--no-compile', '--no-cache-dir',
               '--disable-pip-version-check', '-q'] + sorted(chosen)
        report['pip'] = ' '.join(cmd)
        proc = subprocess.run(cmd, env=offline_env(), capture_output=True,
                              text=True)
        report['pip_rc'] = proc.returncode
        report['pip_tail'] = (proc.stdout + proc.stderr)[-3000:]
        if proc.returncode != 0:
            raise RuntimeError(
                'pip install --no-index of the carried wheels failed: {}'
                .format(report['pip_tail'][-600:]))
        report['installed'] = sorted(os.path.basename(c) for c in chosen)
        report['python'] = py
        report['ok'] = True
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        report['ok'] = False
        report['error'] = '{}: {}'.format(type(e).__name__, e)
        if isinstance(e, subprocess.CalledProcessError):
            report['error'] += ' ' + (e.stderr or '')[-600:]
    report['seconds'] = round(time.time() - t0, 1)
    merge_json(args.json, 'env', report)
    sys.stdout.write('env: {}\n'.format(
        'installed {} wheels into {} ({} s)'.format(
            len(report['installed']), args.env, report['seconds'])
        if report['ok'] else report['error']))
    return 0 if report['ok'] else 1


def cmd_imports(args):
    """What the environment imports, and from where (no GPU needed)."""
    report = {'python': sys.version.split()[0], 'executable': sys.executable}
    failed = []

    def check(name, fn):
        try:
            report[name] = fn()
        except Exception as e:  # recorded: every check runs
            report[name] = {'error': '{}: {}'.format(type(e).__name__, e)}
            failed.append(name)

    def numpy_():
        import numpy
        if int(numpy.__version__.split('.')[0]) >= 2:
            raise RuntimeError('numpy {} from {} shadows the carried 1.26.4: '
                               'Chainer 7.8.1 needs numpy < 2'.format(
                                   numpy.__version__, numpy.__file__))
        return {'version': numpy.__version__, 'file': numpy.__file__}

    def chainer_():
        import chainer
        import chainermn
        return {'version': chainer.__version__, 'file': chainer.__file__,
                'chainermn': chainermn.__file__,
                'compat_stand_ins': sorted(
                    m for m in ('numpy.distutils.system_info',
                                'pkg_resources')
                    if type(sys.modules.get(m)).__name__ == 'module'
                    and getattr(sys.modules[m], '__file__', None) is None)}

    def ours():
        import chainermn_overlap
        return {'version': chainermn_overlap.__version__,
                'file': chainermn_overlap.__file__}

    def mpi():
        from mpi4py import MPI
        return {'mpi4py': __import__('mpi4py').__version__,
                'library': MPI.Get_library_version().splitlines()[0]}

    def cupy_():
        try:
            import cupy
        except ImportError as e:
            return {'absent': str(e)}
        return {'version': cupy.__version__, 'file': cupy.__file__}

    check('numpy', numpy_)
    check('chainer', chainer_)
    check('chainermn_overlap', ours)
    check('mpi4py', mpi)
    check('cupy', cupy_)
    report['failed'] = failed
    merge_json(args.json, 'imports', report)
    for k in ('numpy', 'chainer', 'chainermn_overlap', 'mpi4py', 'cupy'):
        sys.stdout.write('imports: {}: {}\n'.format(k, report[k]))
    return 1 if failed else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='cmd', required=True)
    p = sub.add_parser('wheelhouse')
    p.add_argument('--out', default=os.path.join(ROOT, '.gpu-wheels'))
    p.add_argument('--python', default='python3.12')
    p.add_argument('--part-mib', type=int, default=PART_MIB)
    p = sub.add_parser('verify')
    p.add_argument('--wheels', default=os.path.join(ROOT, '.gpu-wheels'))
    p = sub.add_parser('env')
    p.add_argument('--wheels', default=os.path.join(ROOT, '.gpu-wheels'))
    p.add_argument('--env', default=os.path.join(ROOT, '.gpu-env'))
    p.add_argument('--base-python', default=sys.executable)
    p.add_argument('--json', default=None)
    p = sub.add_parser('imports')
    p.add_argument('--json', default=None)
    args = parser.parse_args(argv)
    try:
        return {'wheelhouse': cmd_wheelhouse, 'verify': cmd_verify,
                'env': cmd_env, 'imports': cmd_imports}[args.cmd](args)
    except RuntimeError as e:
        sys.stderr.write('gpu_offline {}: {}\n'.format(args.cmd, e))
        return 1


if __name__ == '__main__':
    if not __package__:
        sys.path.insert(0, ROOT)
    sys.exit(main())
