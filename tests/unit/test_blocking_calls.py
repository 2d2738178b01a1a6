"""Every blocking MPI call of the library is in communication/blocking.py.

Reads the library's source (``ast``) and fails on a blocking ``mpi4py``
call anywhere else: a collective, a wait, a communicator's construction
that another rank never joins would wait forever; the blocking module
bounds each by the watchdog's limit.  The exceptions are listed below, each
with its reason.  ``python tests/unit/test_blocking_calls.py DIR`` lists
the calls found in another tree (e.g. an older commit's sources).
"""
import ast
import os
import sys

import pytest

import chainermn_overlap

PACKAGE = os.path.dirname(os.path.abspath(chainermn_overlap.__file__))

# mpi4py's blocking calls, upper-case (buffer) forms: no other library the
# package uses spells a method so, whatever the object.  ``Free`` is left
# out: MPICH and Open MPI free a communicator locally.
UPPER = {
    'Allgather', 'Allgatherv', 'Allreduce', 'Alltoall', 'Alltoallv',
    'Alltoallw', 'Barrier', 'Bcast', 'Create', 'Create_cart',
    'Create_dist_graph', 'Create_graph', 'Create_group',
    'Create_intercomm', 'Dup', 'Exscan', 'Gather', 'Gatherv', 'Merge',
    'Mprobe', 'Probe', 'Recv', 'Reduce', 'Reduce_scatter',
    'Reduce_scatter_block', 'Scan', 'Scatter', 'Scatterv', 'Send',
    'Sendrecv', 'Sendrecv_replace', 'Split', 'Split_type', 'Ssend', 'Wait',
    'Waitall', 'Waitany', 'Waitsome',
}
# Lower-case (object) forms of mpi4py and ChainerMN's communicators' calls:
# flagged when the object is named like a communicator or a request (a
# string's ``split`` or an event's ``wait`` is not MPI).
LOWER = {
    'allgather', 'allreduce', 'alltoall', 'barrier', 'bcast', 'exscan',
    'gather', 'probe', 'recv', 'reduce', 'scan', 'scatter', 'send',
    'sendrecv', 'ssend', 'waitall', 'waitany', 'allreduce_obj', 'bcast_obj',
    'bcast_data', 'gather_obj', 'scatter_obj', 'send_obj', 'recv_obj',
    'allreduce_grad', 'multi_node_mean_grad',
}
OWNER = 'communication/blocking.py'

# (file, enclosing function, method): why the call may block there.
EXCEPTIONS = {
    # The communication thread's own collectives: every wait for them goes
    # through the watchdog (Watchdog.wait), which raises on every waiting
    # rank, and a stuck thread makes the process abort at exit.
    ('communication/engine.py', 'Engine._reduce', 'Allreduce'):
        "the communication thread's allreduce",
    ('communication/progress.py', 'allreduce', 'Allreduce'):
        "the communication thread's allreduce (ring, compression)",
    ('communication/progress.py', 'sendrecv', 'Sendrecv'):
        "the communication thread's ring steps",
    ('communication/streams.py', 'CpuCollective.allreduce.run',
     'Allreduce'):
        "a CPU stream's worker, waited for through its events (watchdog)",
    ('communication/emulated.py', '_ModelledComm.Allreduce', 'Allreduce'):
        "the emulated engine's link model, called by the communication "
        'thread',
    ('communication/watchdog.py', 'check_same_collective', 'Allreduce'):
        'debug check run by the communication thread before a collective',
    ('communication/watchdog.py', 'check_same_collective', 'Allgather'):
        'debug check run by the communication thread before a collective',
    ('optimizers/sharding/collectives.py', 'reduce_scatter_mean',
     'Reduce_scatter'):
        "step B's reduce-scatter, run by the communication thread",
    ('optimizers/sharding/collectives.py', 'allgather', 'Allgatherv'):
        "stage 2's allgather after the update, run by the communication "
        'thread',
    # Waits that complete locally: a cancelled receive.
    ('communication/watchdog.py', 'StallInspector._serve', 'Wait'):
        'a cancelled receive completes locally',
    ('communication/watchdog.py', 'StallInspector.ask_all', 'Wait'):
        'a cancelled receive completes locally',
    ('optimizers/sharding/server.py', 'ShardServer._stop_listening',
     'Waitall'):
        'cancelled receives complete locally',
}


def _receiver_named_mpi(node):
    # A name or attribute chain (not a call's result) naming a
    # communicator or a request.
    text = ast.unparse(node).lower()
    plain = isinstance(node, (ast.Name, ast.Attribute))
    return plain and any(k in text for k in ('comm', 'mpi', 'request'))


class _Finder(ast.NodeVisitor):
    def __init__(self):
        self.stack, self.found = [], []

    def _scope(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scope

    def visit_Lambda(self, node):
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and (
                func.attr in UPPER or (func.attr in LOWER and
                                       _receiver_named_mpi(func.value))):
            self.found.append(('.'.join(self.stack), func.attr,
                               node.lineno, ast.unparse(func)))
        self.generic_visit(node)


def blocking_calls(root):
    """``(file, function, method, line, text)`` of every blocking-looking
    MPI call under ``root`` (a package directory)."""
    out = []
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith('.py'):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, '/')
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            finder = _Finder()
            finder.visit(tree)
            out.extend((rel, fn, attr, line, text)
                       for fn, attr, line, text in finder.found)
    return out


def unexpected(root):
    return ['{}:{} {} (in {})'.format(rel, line, text, fn or 'module')
            for rel, fn, attr, line, text in blocking_calls(root)
            if rel != OWNER and (rel, fn, attr) not in EXCEPTIONS]


def test_blocking_mpi_calls_only_in_the_blocking_module():
    found = unexpected(PACKAGE)
    assert not found, (
        'blocking MPI calls outside {} (unbounded waits): {}. Call the '
        'blocking module instead (bounded by the watchdog), or add the call '
        'to EXCEPTIONS with the reason it cannot hang.'.format(
            OWNER, found))


def test_every_exception_is_still_there():
    # A stale entry would hide a new call under an old name.
    seen = {(rel, fn, attr) for rel, fn, attr, _, _ in
            blocking_calls(PACKAGE)}
    assert not set(EXCEPTIONS) - seen, sorted(set(EXCEPTIONS) - seen)


@pytest.mark.parametrize('source, expected', [
    ('def f(mpi_comm):\n    mpi_comm.Bcast(buf, root=0)\n', 1),
    ('def f(self):\n    self.comm.allgather(1)\n', 1),
    ('def f(req):\n    req.Wait()\n', 1),
    ('def f(comm):\n    comm.Ibcast(buf).Test()\n', 0),
    ("def f(text):\n    text.split(',')\n", 0),
    ('def f(event):\n    event.wait()\n', 0),
    ('def f(comm):\n    return lambda: comm.Split(0, 0)\n', 1),
])
def test_the_finder_sees_blocking_calls(tmp_path, source, expected):
    (tmp_path / 'mod.py').write_text(source)
    assert len(blocking_calls(str(tmp_path))) == expected


if __name__ == '__main__':
    for line in unexpected(sys.argv[1] if len(sys.argv) > 1 else PACKAGE):
        print(line)
