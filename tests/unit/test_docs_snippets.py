"""Every code block of README.md and docs/ either runs here or says why not.

A fenced block in a language a reader runs (``python``, ``sh``, ``bash``,
``shell``, ``console``) must follow a marker line (blank lines between are
allowed)::

    <!-- test: mpi [prelude=NAME] -->   python: run at 2 ranks under mpiexec
    <!-- test: sh -->                   shell: run from the checkout's root
    <!-- test: args -->                 shell: each command's arguments are
                                         parsed by its script (not run)
    <!-- test: illustrative (why) -->   not run; the reason in the marker

The markers are HTML comments: invisible on GitHub and in the built site.
Preludes (``model``, ``trainer``, ``distconv``) are in ``snippet_job.py``.
A renamed option or function thus fails a test, not a reader.  Blocks in
``text`` (output) or without a language are not code.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, 'snippet_job.py')
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
RUNNABLE = {'python', 'py', 'sh', 'bash', 'shell', 'console'}
KINDS = {'mpi', 'sh', 'args', 'illustrative'}
MARKER = re.compile(r'^\s*<!--\s*test:\s*(\w+)(.*?)-->\s*$')
FENCE = re.compile(r'^(\s*)(`{3,}|~{3,})\s*([^`\s]*)(.*)$')
MPI_TIMEOUT = 600


class Block(object):
    def __init__(self, path, line, lang, code, marker):
        self.path, self.line, self.lang, self.code = path, line, lang, code
        self.kind, self.options = None, {}
        if marker is not None:
            self.kind = marker[0]
            for word in marker[1].split():
                if '=' in word:
                    k, v = word.split('=', 1)
                    self.options[k] = v

    @property
    def where(self):
        return '%s:%d' % (os.path.relpath(self.path, ROOT), self.line)

    def __repr__(self):
        return '<%s block at %s>' % (self.kind, self.where)


def doc_files(root=ROOT):
    """README.md and the pages of docs/ (not _build, _notes or _ext)."""
    files = [os.path.join(root, 'README.md')]
    for folder, dirs, names in os.walk(os.path.join(root, 'docs')):
        dirs[:] = sorted(d for d in dirs if not d.startswith('_'))
        files += [os.path.join(folder, n) for n in sorted(names)
                  if n.endswith('.md')]
    return [f for f in files if os.path.isfile(f)]


def blocks(path, text=None):
    """The fenced code blocks of a markdown file, with their markers.

    Args:
        path (str): The file (read unless ``text`` is given).
        text (str): Its contents.

    Returns:
        list of Block: Blocks whose language is in :data:`RUNNABLE`; the
        line is that of the block's first code line.
    """
    if text is None:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    lines = text.splitlines()
    out, marker, i = [], None, 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        f = FENCE.match(lines[i])
        if m:
            marker = (m.group(1), m.group(2).strip())
        elif f:
            fence, lang = f.group(2), f.group(3).lower()
            start, i = i + 1, i + 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                i += 1
            if lang in RUNNABLE:
                out.append(Block(path, start + 1, lang,
                                 '\n'.join(lines[start:i]) + '\n', marker))
            marker = None
        elif lines[i].strip():
            marker = None
        i += 1
    return out


def all_blocks():
    return [b for path in doc_files() for b in blocks(path)]


def _ids(bs):
    return [b.where for b in bs]


# ---------------------------------------------------------------------------
# The extractor itself
# ---------------------------------------------------------------------------

def test_extractor_pairs_markers_with_blocks():
    text = '\n'.join([
        'Intro', '', '<!-- test: mpi prelude=model -->', '```python',
        'a = 1', '```', '', '```sh', 'make x', '```', '',
        '<!-- test: illustrative (why) -->', 'text between', '```bash',
        'b', '```', '```text', 'output', '```', '```{toctree}', 'x', '```'])
    found = blocks('x.md', text)
    assert [(b.lang, b.kind, b.options, b.line) for b in found] == [
        ('python', 'mpi', {'prelude': 'model'}, 5),
        ('sh', None, {}, 9),
        ('bash', None, {}, 15)]   # a paragraph between cancels the marker


def test_every_runnable_block_is_marked():
    problems = ['%s: a %s block without a test marker; put one of '
                '"<!-- test: mpi|sh|args|illustrative -->" on the '
                'line before it (see tests/unit/test_docs_snippets.py)'
                % (b.where, b.lang) for b in all_blocks() if b.kind is None]
    problems += ['%s: unknown test marker %r' % (b.where, b.kind)
                 for b in all_blocks() if b.kind and b.kind not in KINDS]
    problems += ['%s: %s marker on a %s block' % (b.where, b.kind, b.lang)
                 for b in all_blocks()
                 if b.kind == 'mpi' and b.lang not in
                 ('python', 'py')]
    problems += ['%s: prelude %r does not exist' % (b.where,
                                                     b.options['prelude'])
                 for b in all_blocks() if 'prelude' in b.options
                 and b.options['prelude'] not in _preludes()]
    assert not problems, '\n'.join(problems)


def _preludes():
    sys.path.insert(0, HERE)
    try:
        import snippet_job
    finally:
        sys.path.remove(HERE)
    return snippet_job.PRELUDES


# ---------------------------------------------------------------------------
# Python at 2 ranks: one mpiexec job for all of them
# ---------------------------------------------------------------------------

MPI_BLOCKS = [b for b in all_blocks() if b.kind == 'mpi']
# Run in the same job as the pages' blocks: one must fail (an option that
# does not exist, as a renamed one would), one shows the job's size.
CONTROLS = {
    'control:renamed-option': 'chainermn_overlap.create_overlapped_optimizer('
                              'chainer.optimizers.SGD(), comm, '
                              'bucket_bytes=4096)\n',
    'control:two-ranks': 'assert comm.size == 2, comm.size\n',
}


@pytest.fixture(scope='module')
def mpi_results():
    with tempfile.TemporaryDirectory(prefix='doc_snippets_') as tmp:
        snippets = []
        for i, b in enumerate(MPI_BLOCKS):
            d = os.path.join(tmp, 'snippet%d' % i)
            os.makedirs(d)
            snippets.append({'id': b.where, 'file': b.where, 'line': b.line,
                             'code': b.code, 'dir': d,
                             'prelude': b.options.get('prelude')})
        for name, code in CONTROLS.items():
            snippets.append({'id': name, 'file': name, 'line': 1,
                             'code': code, 'dir': tmp, 'prelude': 'model'})
        src, out = os.path.join(tmp, 'in.json'), os.path.join(tmp, 'out.json')
        with open(src, 'w') as f:
            json.dump(snippets, f)
        env = dict(os.environ, OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1')
        proc = subprocess.run([MPIEXEC, '-n', '2', sys.executable, JOB, src,
                               out], cwd=tmp, env=env, text=True,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=MPI_TIMEOUT,
                              start_new_session=True)
        if not os.path.exists(out):
            pytest.fail('the snippet job ended (exit %d) without results:\n%s'
                        % (proc.returncode, proc.stdout[-6000:]))
        with open(out) as f:
            return json.load(f), proc.stdout


@pytest.mark.parametrize('block', MPI_BLOCKS, ids=_ids(MPI_BLOCKS))
def test_python_block_runs_at_2_ranks(block, mpi_results):
    results, output = mpi_results
    error = results[block.where]
    assert error is None, '%s failed:\n%s\n---- job output ----\n%s' % (
        block.where, error, output[-3000:])


def test_snippets_run_at_two_ranks_and_can_fail(mpi_results):
    results, _ = mpi_results
    assert results['control:two-ranks'] is None
    error = results['control:renamed-option']
    assert error and 'bucket_bytes' in error and 'rank 1:' in error


# ---------------------------------------------------------------------------
# Shell commands
# ---------------------------------------------------------------------------

SH_BLOCKS = [b for b in all_blocks() if b.kind == 'sh']


def _venv_env():
    env = dict(os.environ)
    env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
    return env


@pytest.mark.parametrize('block', SH_BLOCKS, ids=_ids(SH_BLOCKS))
def test_shell_block_runs(block):
    proc = subprocess.run(['bash', '-euo', 'pipefail', '-c', block.code],
                          cwd=ROOT, env=_venv_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=300)
    assert proc.returncode == 0, '%s exited with %d:\n%s' % (
        block.where, proc.returncode, proc.stdout[-3000:])


# ---------------------------------------------------------------------------
# Command lines whose arguments are checked
# ---------------------------------------------------------------------------

# Run in a fresh interpreter: patch argparse so that the script's own
# parse_args() parses the arguments (exit 2 on a bad one, as for a user)
# and then stops the script before it trains.
_CHECK_ARGS = r'''
import argparse, os, runpy, sys
class _Parsed(BaseException):
    pass
_parse = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    _parse(self, args, namespace)
    raise _Parsed()
argparse.ArgumentParser.parse_args = parse_args
kind, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    if kind == 'module':
        sys.argv = [target] + args
        runpy.run_module(target, run_name='__main__', alter_sys=True)
    else:
        sys.argv = [target] + args
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name='__main__')
except _Parsed:
    sys.exit(0)
sys.exit('%s ended without calling ArgumentParser.parse_args: its '
         'arguments could not be checked' % target)
'''


def commands(code):
    """Splits a shell block into commands (continuations joined).

    Returns:
        list of list of str: One token list per command, comments removed.
    """
    out = []
    for line in code.replace('\\\n', ' ').splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens:
            out.append(tokens)
    return out


def _is_program(token):
    name = os.path.basename(token)
    return bool(re.match(r'^python[\d.]*$', name)) or \
        name == 'chainermn-overlap-launch'


def command_target(tokens):
    """What a command runs: ``('module'|'path', name, args)``.

    Understands ``[VAR=value ...] [mpiexec -n N] python (-m MOD | SCRIPT)
    ARGS`` and the console script ``chainermn-overlap-launch ARGS``.

    Raises:
        ValueError: For any other command (it cannot be checked).
    """
    i = 0
    while i < len(tokens) and re.match(r'^\w+=', tokens[i]):
        i += 1
    if i < len(tokens) and os.path.basename(tokens[i]) in ('mpiexec',
                                                           'mpirun'):
        # mpiexec's own options (-n 4, -hosts a,b, -genv X 1, ...) end at
        # the program.
        i += 1
        while i < len(tokens) and not _is_program(tokens[i]):
            i += 1
    if i < len(tokens) and os.path.basename(tokens[i]) == \
            'chainermn-overlap-launch':
        return 'module', 'chainermn_overlap.launch', tokens[i + 1:]
    if i < len(tokens) and re.match(r'^python[\d.]*$',
                                    os.path.basename(tokens[i])):
        rest = tokens[i + 1:]
        if rest[:1] == ['-m']:
            return 'module', rest[1], rest[2:]
        if rest:
            return 'path', rest[0], rest[1:]
    raise ValueError('cannot check %r: write it as "python SCRIPT ARGS" or '
                     'mark the block illustrative' % ' '.join(tokens))


ARG_COMMANDS = [(b, c) for b in all_blocks() if b.kind == 'args'
                for c in commands(b.code)]


def test_command_target_reads_the_forms_used():
    assert command_target(shlex.split(
        '.venv/bin/mpiexec -n 4 .venv/bin/python examples/x.py --a 1')) == (
            'path', 'examples/x.py', ['--a', '1'])
    assert command_target(shlex.split(
        'OMP_NUM_THREADS=1 python -m chainermn_overlap.launch -n 2 -- t.py'))\
        == ('module', 'chainermn_overlap.launch', ['-n', '2', '--', 't.py'])
    assert command_target(shlex.split(
        'mpiexec -hosts a,b -n 2 -genv X 1 python3 t.py -v')) == (
            'path', 't.py', ['-v'])
    with pytest.raises(ValueError, match='cannot check'):
        command_target(['make', 'demo'])


def _check_args(tokens):
    kind, target, args = command_target(tokens)
    return subprocess.run([sys.executable, '-c', _CHECK_ARGS, kind, target]
                          + args, cwd=ROOT, env=_venv_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=120)


@pytest.mark.parametrize('block,tokens', ARG_COMMANDS,
                         ids=['%s:%s' % (b.where, os.path.basename(
                             command_target(c)[1])) for b, c in ARG_COMMANDS])
def test_command_arguments_parse(block, tokens):
    proc = _check_args(tokens)
    assert proc.returncode == 0, '%s: %s\n%s' % (
        block.where, ' '.join(tokens), proc.stdout[-3000:])


def test_a_renamed_option_fails_the_argument_check():
    # Negative control: the check really parses, so a wrong option fails.
    proc = _check_args(shlex.split(
        'python examples/imagenet/train_imagenet.py --no-such-option 3'))
    assert proc.returncode == 2 and 'unrecognized arguments' in proc.stdout
