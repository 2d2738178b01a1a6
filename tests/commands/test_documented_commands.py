"""Every command the documentation tells a user to run, run as typed.

The command tier of ``make test`` (``make test-commands``).  Each command
runs as a subprocess of bash with a clean environment (the venv's ``bin``
first on PATH, as activated; no PYTHONPATH), from the folder the page
names (the checkout's root unless its marker says otherwise), so that it
sees what a user's shell sees, not this test's ``sys.path``.  Sources:

* the ``run`` blocks of README.md and docs/ (markers: ``tests/documented.py``);
* the command lines of the examples' docstrings, each given a treatment in
  :data:`EXAMPLE_COMMANDS`: run as typed, run with the script's own flags
  for a smaller size (``append``), or not run with the reason.

The same command in several places runs once.  A command of a docstring
missing from the table, or an entry of the table no docstring has, fails
the tier, so a renamed script, flag or command cannot pass unnoticed; the
controls at the end show that a wrong command does fail.
"""
import collections
import os
import re
import shutil

import numpy as np
import pytest

from tests import documented
from tests.documented import ROOT, run_as_user

DEFAULT_TIMEOUT = 300
# Printed by every ImageNet run: the figure make demo exists to show.
THROUGHPUT = r'throughput: +[\d.]+ images/s'
# The U-Net example's verdict on its first steps against one process.
UNET_EQUAL = r'check: equal to one process after \d+ steps'


class Run(collections.namedtuple('Run', 'append timeout expect data')):
    """Run an example's docstring command; ``append``: the script's flags
    for a smaller size; ``data``: a fixture making the files it reads
    (then ``append`` names them); ``expect``: a pattern of its output."""

    def __new__(cls, append='', timeout=DEFAULT_TIMEOUT, expect=None,
                data=None):
        return super().__new__(cls, append, timeout, expect, data)


class NotRun(collections.namedtuple('NotRun', 'reason')):
    """A docstring command deliberately not run, with the reason."""


# A small real data set in Chainer's LabeledImageDataset format: the path
# of the ImageNet example on real data, at 40x40 pixels.
IMAGENET_LISTS = '@imagenet-lists'
QUICK_IMAGENET = '--insize 32 --batchsize 2 --iterations 3'

EXAMPLE_COMMANDS = {
    'examples/imagenet/train_imagenet.py': {
        'mpiexec -n 2 python examples/imagenet/train_imagenet.py '
        '--optimizer overlap': Run(append=QUICK_IMAGENET, expect=THROUGHPUT),
        'mpiexec -n 2 python examples/imagenet/train_imagenet.py --arch '
        'resnet_small --insize 32 --batchsize 8 --iterations 20':
            Run(expect=THROUGHPUT),
        'mpiexec -n 4 python examples/imagenet/train_imagenet.py --train '
        'train.txt --val val.txt --root /data/imagenet --mean mean.npy':
            Run(data=IMAGENET_LISTS, expect=THROUGHPUT,
                append='--train {d}/train.txt --val {d}/val.txt --root {d} '
                       '--mean {d}/mean.npy --arch resnet_small '
                       + QUICK_IMAGENET),
    },
    'examples/spatial/train_spatial.py': {
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_spatial.py': Run(append='--iterations 2'),
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_spatial.py --grid 4,1 --insize 256 '
        '--iterations 5': Run(append='--insize 64 --iterations 2'),
    },
    'examples/spatial/train_cosmoflow3d.py': {
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_cosmoflow3d.py --iterations 3 --insize 32':
            Run(),
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_cosmoflow3d.py --insize 128 --grid 1,2,2':
            Run(append='--insize 32 --iterations 2'),
    },
    'examples/spatial/train_unet3d_spatial.py': {
        '.venv/bin/mpiexec -n 1 .venv/bin/python '
        'examples/spatial/train_unet3d_spatial.py --check':
            Run(expect=UNET_EQUAL),
        '.venv/bin/mpiexec -n 2 .venv/bin/python '
        'examples/spatial/train_unet3d_spatial.py --check':
            Run(expect=UNET_EQUAL),
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_unet3d_spatial.py --check --grid 1,2,2':
            Run(expect=UNET_EQUAL),
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_unet3d_spatial.py --insize 160 --width 16 '
        '--grid 1,2,2 --iterations 3':
            Run(append='--insize 24 --width 4 --iterations 1'),
    },
    'examples/spatial/train_resnet50_channels.py': {
        '.venv/bin/mpiexec -n 2 .venv/bin/python '
        'examples/spatial/train_resnet50_channels.py --iterations 3 '
        '--insize 64 --width 8 --grid 2,1': Run(),
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_resnet50_channels.py --insize 224 '
        '--grid 2,2': Run(append='--insize 64 --width 8 --iterations 2'),
    },
    'examples/spatial/train_resnet50_spatial.py': {
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_resnet50_spatial.py --iterations 3 '
        '--insize 128 --width 16': Run(),
        '.venv/bin/mpiexec -n 4 .venv/bin/python '
        'examples/spatial/train_resnet50_spatial.py --insize 512 '
        '--grid 2,2': Run(append='--insize 64 --width 8 --iterations 2'),
    },
}


# ---------------------------------------------------------------------------
# What is documented, and what the table says of it
# ---------------------------------------------------------------------------

def table_problems(found, table):
    """Docstring commands without an entry, entries without a command.

    Args:
        found (dict): script -> list of its docstring commands.
        table (dict): script -> {command: Run or NotRun}.
    """
    problems = []
    for script, cmds in sorted(found.items()):
        entries = table.get(script, {})
        for c in cmds:
            if c not in entries:
                problems.append(
                    '%s documents %r, which the command tier does not know: '
                    'add it to EXAMPLE_COMMANDS (Run(...) or NotRun(reason))'
                    % (script, c))
        for c in entries:
            if c not in cmds:
                problems.append('EXAMPLE_COMMANDS[%r] has %r, which its '
                                'docstring no longer documents' % (script, c))
    for script in sorted(set(table) - set(found)):
        problems.append('EXAMPLE_COMMANDS names %s, which is not an example '
                        'script' % script)
    for script, entries in sorted(table.items()):
        for c, what in entries.items():
            if isinstance(what, NotRun) and not what.reason.strip():
                problems.append('%s: %r is not run and says no reason'
                                % (script, c))
    return problems


def _documented_examples():
    return {os.path.relpath(p, ROOT): documented.docstring_commands(p)
            for p in documented.example_files()}


Case = collections.namedtuple('Case', 'where cwd command timeout expect data')


def cases():
    """Every command to run, once each (keyed by folder and command)."""
    out = collections.OrderedDict()

    def add(where, cwd, command, timeout, expect=None, data=None):
        key = (cwd, command)
        if key in out:
            out[key] = out[key]._replace(where=out[key].where + ', ' + where)
        else:
            out[key] = Case(where, cwd, command, timeout, expect, data)

    for script, entries in sorted(EXAMPLE_COMMANDS.items()):
        for i, (c, what) in enumerate(entries.items()):
            if isinstance(what, Run):
                command = documented.with_flags(c, what.append) \
                    if what.append else c
                add('%s (docstring, command %d)' % (script, i + 1), '',
                    command, what.timeout, what.expect, what.data)
    for b in documented.all_blocks():
        if b.kind != 'run':
            continue
        # The block runs as one script, so that a ``cd`` in it holds for
        # the commands after it, as in the reader's shell.
        script = '\n'.join(documented.with_flags(c, block_append(b, c))
                           for c in documented.commands(b.code))
        add(b.where, b.options.get('cwd', ''), 'set -eu\n' + script,
            int(b.options.get('timeout', DEFAULT_TIMEOUT)))
    return list(out.values())


def block_append(block, command):
    """The flags a ``run`` block adds to one of its commands:
    ``append="FLAGS"`` to every Python command, ``append:SCRIPT="FLAGS"``
    to those running SCRIPT (by its file name)."""
    try:
        _, target, _ = documented.command_target(documented.tokens(command))
    except ValueError:
        return ''
    flags = [block.options.get('append', '')]
    flags.append(block.options.get('append:' + os.path.basename(target), ''))
    return ' '.join(f for f in flags if f)


CASES = cases()


def test_every_docstring_command_has_a_treatment():
    problems = table_problems(_documented_examples(), EXAMPLE_COMMANDS)
    assert not problems, '\n'.join(problems)


def test_a_changed_docstring_command_is_reported():
    # Negative control of the table check: a renamed flag in a docstring,
    # and a table entry for a script that is gone.
    script = 'examples/imagenet/train_imagenet.py'
    found = _documented_examples()
    found[script] = [c.replace('--iterations', '--iters')
                     for c in found[script]]
    table = dict(EXAMPLE_COMMANDS, **{'examples/gone.py': {'python x': Run()}})
    problems = table_problems(found, table)
    assert any('--iters 20' in p and 'does not know' in p
               for p in problems), problems
    assert any('no longer documents' in p for p in problems), problems
    assert any('examples/gone.py' in p for p in problems), problems


def test_the_tier_has_the_commands_of_every_source():
    wheres = ' '.join(c.where for c in CASES)
    for script in EXAMPLE_COMMANDS:
        assert script in wheres
    assert 'docs/quickstart.md' in wheres and 'docs/distconv.md' in wheres


# ---------------------------------------------------------------------------
# Running them
# ---------------------------------------------------------------------------

def _imagenet_lists(folder):
    """Eight 40x40 PNG images, two lists and a per-channel mean."""
    from PIL import Image
    rng = np.random.RandomState(0)
    os.makedirs(os.path.join(folder, 'img'))
    lines = []
    for i in range(8):
        name = 'img/%d.png' % i
        pixels = rng.randint(0, 256, size=(40, 40, 3)).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, name))
        lines.append('%s %d\n' % (name, i % 4))
    for listname, part in (('train.txt', lines), ('val.txt', lines[:4])):
        with open(os.path.join(folder, listname), 'w') as f:
            f.writelines(part)
    np.save(os.path.join(folder, 'mean.npy'),
            np.array([120.0, 115.0, 100.0], dtype=np.float32))


DATA = {IMAGENET_LISTS: _imagenet_lists}


def _scratch(tmp):
    """A folder holding a link to the venv and the pages' saved files."""
    folder = os.path.join(tmp, 'scratch')
    os.makedirs(folder)
    os.symlink(os.path.dirname(documented.venv_bin()),
               os.path.join(folder, '.venv'))
    for b in documented.all_blocks():
        if b.kind == 'mpi' and 'save' in b.options:
            with open(os.path.join(folder, b.options['save']), 'w') as f:
                f.write(b.code)
    return folder


def run_case(case, tmp):
    command = case.command
    if case.data:
        folder = os.path.join(tmp, 'data')
        DATA[case.data](folder)
        command = command.replace('{d}', folder)
    if case.cwd == '@scratch':
        cwd = _scratch(tmp)
    else:
        cwd = os.path.join(ROOT, case.cwd)
    return run_as_user(command, cwd, timeout=case.timeout)


def _case_id(case):
    if case.where.startswith('examples/'):
        return '%s:%s' % (case.where.split()[0], ' '.join(
            case.command.split()[:8]))
    return case.where


@pytest.mark.parametrize('case', CASES, ids=[_case_id(c) for c in CASES])
def test_documented_command_runs(case, tmp_path):
    proc = run_case(case, str(tmp_path))
    report = '%s\n  documented at %s\n  run from %s\n%s' % (
        case.command, case.where, case.cwd or 'the checkout root',
        proc.stdout[-4000:])
    assert proc.returncode == 0, 'exit %d: %s' % (proc.returncode, report)
    assert 'Traceback' not in proc.stdout, report
    if case.expect:
        assert re.search(case.expect, proc.stdout), report


# ---------------------------------------------------------------------------
# Negative controls: the tier catches a wrong command
# ---------------------------------------------------------------------------

QUICK_SMALL = ('--arch resnet_small --insize 32 --batchsize 2 '
               '--iterations 2 --no-progress')


def test_a_renamed_flag_fails():
    proc = run_as_user('mpiexec -n 2 python examples/imagenet/'
                       'train_imagenet.py %s --no-such-flag 1' % QUICK_SMALL,
                       ROOT, timeout=120)
    assert proc.returncode != 0
    assert 'unrecognized arguments: --no-such-flag' in proc.stdout


def test_a_made_up_script_fails():
    proc = run_as_user('python examples/imagenet/train_everything.py', ROOT,
                       timeout=60)
    assert proc.returncode != 0 and 'No such file' in proc.stdout


def test_the_environment_is_a_users(monkeypatch):
    # What this process has on its path does not reach the command.
    monkeypatch.setenv('PYTHONPATH', ROOT)
    proc = run_as_user('python -c "import os, sys; print(os.environ.get('
                       '\'PYTHONPATH\')); print(sys.executable)"', '/',
                       timeout=60)
    lines = proc.stdout.split()
    assert lines[0] == 'None'
    assert os.path.dirname(lines[1]) == documented.venv_bin()


def test_an_import_of_the_checkout_fails_outside_it(tmp_path):
    # The defect this tier was made for: an example importing its models as
    # ``examples.imagenet...`` ran in the tests (the repository root on
    # sys.path) but not for a user.  A copy of the example outside the
    # checkout runs from its own folder; the same copy with that import
    # fails, so the tier would have caught it.
    good = os.path.join(str(tmp_path), 'good')
    bad = os.path.join(str(tmp_path), 'bad')
    for d in (good, bad):
        shutil.copytree(os.path.join(ROOT, 'examples', 'imagenet'), d,
                        ignore=shutil.ignore_patterns('__pycache__'))
    model = os.path.join(bad, 'models', 'resnet18.py')
    with open(model) as f:
        text = f.read()
    assert 'from .resnet_small import' in text
    with open(model, 'w') as f:
        f.write(text.replace('from .resnet_small import',
                             'from examples.imagenet.models.resnet_small '
                             'import'))
    command = 'mpiexec -n 2 python train_imagenet.py ' + QUICK_SMALL
    ok = run_as_user(command, good, timeout=120)
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert re.search(THROUGHPUT, ok.stdout)
    broken = run_as_user(command, bad, timeout=120)
    assert broken.returncode != 0
    assert "No module named 'examples'" in broken.stdout


def test_a_timeout_is_reported_not_waited_for():
    proc = run_as_user('sleep 30', '/', timeout=1)
    assert proc.returncode == 124 and 'killed after 1 s' in proc.stdout


@pytest.fixture(autouse=True)
def _no_stray_output_dirs():
    # The examples write into --out (default 'result') under their folder
    # of run; a run from the checkout's root must not leave one behind
    # that was not there before.
    before = set(os.listdir(ROOT))
    yield
    for name in set(os.listdir(ROOT)) - before:
        if name in ('result', 'results'):
            shutil.rmtree(os.path.join(ROOT, name), ignore_errors=True)

