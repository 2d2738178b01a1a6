"""The commands the documentation tells a user to run, found and run as typed.

Shared by the documentation tests (``tests/unit/test_docs_snippets.py``:
markers, Python blocks, argument checks) and the command tier
(``tests/commands``: every documented command run as a subprocess).

Two sources of commands:

* the fenced blocks of ``README.md`` and ``docs/*.md``, each after a
  marker line (an HTML comment, invisible on GitHub and in the site)::

      <!-- test: mpi [prelude=NAME] [save=FILE] -->
          python: run at 2 ranks in one mpiexec job; ``save=FILE`` also
          writes the block as FILE into the scratch folder of the page's
          ``run`` blocks (the page says "save this as FILE")
      <!-- test: run [cwd=DIR] [append[:SCRIPT]="FLAGS"] [timeout=S] -->
          shell: every command run as typed by bash, from DIR (the
          checkout's root unless given; ``cwd=@scratch`` is a fresh folder
          holding the page's saved files and a link to the venv), with a
          clean environment; ``append`` adds the scripts' own flags to each
          Python command (``append:train.py`` to those running train.py),
          to run a documented size that is too long for a test at a
          smaller one (argparse takes an option's last value)
      <!-- test: wheel -->
          shell: the wheel's install lines, run as typed by ``make
          test-wheel`` (``tests/wheel_check.py``) from a copy of the
          checkout with a home folder of its own; every page's wheel block
          must be the same
      <!-- test: args (why it is not run) -->
          shell: each command's arguments parsed by its script, not run
      <!-- test: illustrative (why) -->
          not run

* the command lines in the module docstrings of ``examples/**/*.py``
  (literal blocks after ``::``), whose treatment is in the command tier's
  table (``tests/commands/test_example_commands.py``).

Blocks in ``text`` (output) or without a language are not code.
"""
import ast
import os
import re
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNNABLE = {'python', 'py', 'sh', 'bash', 'shell', 'console'}
KINDS = {'mpi', 'run', 'wheel', 'args', 'illustrative'}
# Kinds whose marker must give the reason the block is not run.
REASON_KINDS = {'args', 'illustrative'}
MARKER = re.compile(r'^\s*<!--\s*test:\s*(\w+)(.*?)-->\s*$')
FENCE = re.compile(r'^(\s*)(`{3,}|~{3,})\s*([^`\s]*)(.*)$')
# What the environment of a documented command keeps from the test's own:
# the locale, the temporary folder, and OpenBLAS's processor settings
# (set on some machines because older builds crash without them).
KEPT_ENV = ('HOME', 'LANG', 'LC_ALL', 'TMPDIR', 'USER', 'LOGNAME',
            'OPENBLAS_CORETYPE', 'OPENBLAS_L2_SIZE')


class Block(object):
    """A fenced code block and its marker."""

    def __init__(self, path, line, lang, code, marker):
        self.path, self.line, self.lang, self.code = path, line, lang, code
        self.kind, self.options, self.reason = None, {}, ''
        if marker is not None:
            self.kind = marker[0]
            rest = marker[1]
            m = re.search(r'\((.*)\)\s*$', rest)
            if m:
                self.reason, rest = m.group(1).strip(), rest[:m.start()]
            for word in shlex.split(rest):
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


def all_blocks(root=ROOT):
    return [b for path in doc_files(root) for b in blocks(path)]


def commands(code):
    """Splits a shell block into commands (continuations joined).

    Returns:
        list of str: One command a line, comment-only lines left out.
    """
    out = []
    for line in code.replace('\\\n', ' ').splitlines():
        if shlex.split(line, comments=True):
            out.append(' '.join(line.split()))
    return out


def tokens(command):
    return shlex.split(command, comments=True)


def _is_program(token):
    name = os.path.basename(token)
    return bool(re.match(r'^python[\d.]*$', name)) or \
        name == 'chainermn-overlap-launch'


def command_target(toks):
    """What a command runs: ``('module'|'path', name, args)``.

    Understands ``[VAR=value ...] [mpiexec -n N] python (-m MOD | SCRIPT)
    ARGS`` and the console script ``chainermn-overlap-launch ARGS``.

    Raises:
        ValueError: For any other command (it cannot be checked).
    """
    i = 0
    while i < len(toks) and re.match(r'^\w+=', toks[i]):
        i += 1
    if i < len(toks) and os.path.basename(toks[i]) in ('mpiexec', 'mpirun'):
        # mpiexec's own options (-n 4, -hosts a,b, -genv X 1, ...) end at
        # the program.
        i += 1
        while i < len(toks) and not _is_program(toks[i]):
            i += 1
    if i < len(toks) and os.path.basename(toks[i]) == \
            'chainermn-overlap-launch':
        return 'module', 'chainermn_overlap.launch', toks[i + 1:]
    if i < len(toks) and re.match(r'^python[\d.]*$',
                                  os.path.basename(toks[i])):
        rest = toks[i + 1:]
        if rest[:1] == ['-m']:
            return 'module', rest[1], rest[2:]
        if rest:
            return 'path', rest[0], rest[1:]
    raise ValueError('cannot check %r: write it as "python SCRIPT ARGS" or '
                     'mark the block illustrative' % ' '.join(toks))


def with_flags(command, flags):
    """``command`` with the script's own ``flags`` added at its end.

    Only for a Python command (:func:`command_target` reads it); the
    command's comment is dropped.
    """
    if not flags:
        return command
    toks = tokens(command)
    command_target(toks)
    return shlex.join(toks + shlex.split(flags))


# ---------------------------------------------------------------------------
# Example docstrings
# ---------------------------------------------------------------------------

def example_files(root=ROOT):
    """The example scripts (``examples/**/*.py`` but packages' modules)."""
    out = []
    for folder, dirs, names in os.walk(os.path.join(root, 'examples')):
        dirs[:] = sorted(d for d in dirs if not d.startswith(('_', '.'))
                         and d != 'models')
        out += [os.path.join(folder, n) for n in sorted(names)
                if n.endswith('.py') and n != '__init__.py']
    return out


def docstring_commands(path):
    """The command lines of a script's module docstring.

    A command is a line of a literal block (indented text after a
    paragraph ending in ``::``) that starts with ``mpiexec``, ``python``
    or a path to either; continuations (``\\``) are joined and comment
    lines left out.

    Returns:
        list of str: The commands, whitespace normalised.
    """
    with open(path, encoding='utf-8') as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ''
    out, literal, base = [], False, None
    lines = doc.replace('\\\n', ' ').splitlines()
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if literal and base is None and indent > 0:
            base = indent
        if literal and base is not None and indent < base:
            literal, base = False, None
        if literal and base is not None:
            text = ' '.join(line.split())
            first = text.split()[0] if text.split() else ''
            if re.match(r'^(\S*/)?(mpiexec|mpirun|python[\d.]*)$', first):
                out.append(text)
            continue
        if line.rstrip().endswith('::'):
            literal, base = True, None
    return out


# ---------------------------------------------------------------------------
# Running a command as a user would
# ---------------------------------------------------------------------------

def venv_bin():
    """The folder of this interpreter's ``python`` and ``mpiexec``."""
    return os.path.dirname(sys.executable)


def user_env(extra=None):
    """A clean environment: the venv's bin first on PATH (as activated), no
    PYTHONPATH or other Python variables, one BLAS thread per process.
    """
    env = {k: os.environ[k] for k in KEPT_ENV if k in os.environ}
    env['PATH'] = os.pathsep.join([venv_bin(), '/usr/local/bin', '/usr/bin',
                                   '/bin', '/usr/sbin', '/sbin'])
    env['VIRTUAL_ENV'] = os.path.dirname(venv_bin())
    env.setdefault('HOME', '/root')
    env.setdefault('LANG', 'C.UTF-8')
    # As make demo does and the examples' docstrings advise for several
    # processes on one host.
    for k in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'):
        env[k] = '1'
    env.update(extra or {})
    return env


def run_as_user(command, cwd, timeout=300, extra_env=None):
    """Runs one shell command line with bash, as a user would type it.

    Returns:
        subprocess.CompletedProcess: stdout and stderr together in
        ``stdout``.  A command past ``timeout`` is killed with its process
        group and reported with exit status 124.
    """
    proc = subprocess.Popen(
        ['bash', '-o', 'pipefail', '-c', command], cwd=cwd,
        env=user_env(extra_env), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        import signal
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += '\n[killed after %d s]' % timeout
        code = 124
    return subprocess.CompletedProcess(command, code, out, None)
