"""Every code block of README.md and docs/ either runs or says why not.

A fenced block in a language a reader runs (``python``, ``sh``, ``bash``,
``shell``, ``console``) must follow a marker line; the markers are in
``tests/documented.py``.  Here: the markers themselves, the Python blocks
(``mpi``: one mpiexec job at 2 ranks), and the commands whose arguments are
only parsed (``args``).  The shell blocks that run (``run``) are run by the
command tier, ``tests/commands``.  A renamed option or function thus fails
a test, not a reader.  Preludes (``model``, ``trainer``, ``distconv``) are
in ``snippet_job.py``.
"""
import json
import os
import shlex
import subprocess
import sys
import tempfile

import pytest

from tests.documented import (  # noqa: F401  (blocks: used by tests)
    KINDS, REASON_KINDS, ROOT, all_blocks, blocks, command_target, commands,
    tokens, user_env)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, 'snippet_job.py')
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
MPI_TIMEOUT = 600
RUN_OPTIONS = {'cwd', 'append', 'timeout'}  # and append:SCRIPT


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


def _marker_problems(bs):
    problems = ['%s: a %s block without a test marker; put one of '
                '"<!-- test: mpi|run|args (why)|illustrative (why) -->" on '
                'the line before it (see tests/documented.py)'
                % (b.where, b.lang) for b in bs if b.kind is None]
    problems += ['%s: unknown test marker %r' % (b.where, b.kind)
                 for b in bs if b.kind and b.kind not in KINDS]
    problems += ['%s: %s marker on a %s block' % (b.where, b.kind, b.lang)
                 for b in bs
                 if (b.kind == 'mpi') != (b.lang in ('python', 'py'))
                 and b.kind in KINDS and b.kind != 'illustrative']
    problems += ['%s: a %s block not run must say why: "<!-- test: %s '
                 '(the reason) -->"' % (b.where, b.kind, b.kind)
                 for b in bs if b.kind in REASON_KINDS and not b.reason]
    problems += ['%s: unknown option(s) %s of a run block (known: %s)'
                 % (b.where, _unknown_run_options(b),
                    ', '.join(sorted(RUN_OPTIONS)))
                 for b in bs if b.kind == 'run'
                 and _unknown_run_options(b)]
    problems += ['%s: prelude %r does not exist' % (b.where,
                                                     b.options['prelude'])
                 for b in bs if 'prelude' in b.options
                 and b.options['prelude'] not in _preludes()]
    return problems


def _unknown_run_options(block):
    return sorted(k for k in block.options if k not in RUN_OPTIONS
                  and not k.startswith('append:'))


def test_every_runnable_block_is_marked():
    problems = _marker_problems(all_blocks())
    assert not problems, '\n'.join(problems)


def test_unmarked_or_unexplained_blocks_are_reported():
    # Negative control of the check above.
    text = '\n'.join([
        '```sh', 'make x', '```', '', '<!-- test: args -->', '```sh',
        'python t.py', '```', '', '<!-- test: run colour=red -->', '```sh',
        'ls', '```', '', '<!-- test: run -->', '```python', 'a = 1', '```'])
    problems = _marker_problems(blocks('x.md', text))
    assert len(problems) == 4, problems
    assert 'without a test marker' in problems[0]
    assert any('must say why' in p for p in problems)
    assert any("['colour']" in p for p in problems)
    assert any('run marker on a python block' in p for p in problems)


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


ARG_COMMANDS = [(b, tokens(c)) for b in all_blocks() if b.kind == 'args'
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
                          + args, cwd=ROOT, env=user_env(), text=True,
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
