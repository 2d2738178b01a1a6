"""Runs documentation code blocks under MPI; used by test_docs_snippets.py.

    mpiexec -n 2 python tests/unit/snippet_job.py SNIPPETS.json RESULTS.json

``SNIPPETS.json`` is a list of ``{"id", "file", "line", "code", "prelude",
"dir"}``. Every rank runs every snippet in order, each in a namespace of its
own (``__name__ == '__main__'``, so a complete script's main guard runs) and
with the working directory ``dir`` (the same folder on every rank), after
the named prelude (:data:`PRELUDES`, or none). Line numbers in tracebacks
are the documentation file's. After each snippet the ranks exchange their
outcome, optimizers the snippet made are closed and the abort hook is
removed, so one snippet's failure or state does not reach the next. Rank 0
writes ``{id: null or "rank R: traceback"}`` to ``RESULTS.json``.
"""
import json
import os
import sys
import traceback

# What a fragment of a page may take as given.  ``model`` is a small
# classifier with a batch ``x, t`` (5 inputs, 3 classes) per rank;
# ``trainer`` adds an overlapped optimizer and a 4-iteration trainer writing
# into the snippet's folder; ``distconv`` a global image batch ``x``.
PRELUDES = {
    'model': '''
import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy
import chainermn_overlap
from chainermn_overlap.testing import models as _models
comm = chainermn.create_communicator('naive')
numpy.random.seed(0)
model = L.Classifier(_models.MLP(n_in=5, n_hidden=8, n_out=3))
_rng = numpy.random.RandomState(comm.rank)
x = _rng.standard_normal((4, 5)).astype(numpy.float32)
t = _rng.randint(0, 3, 4).astype(numpy.int32)
lossfun = model
''',
    'distconv': '''
import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy
comm = chainermn.create_communicator('naive')
x = numpy.random.RandomState(0).standard_normal((2, 3, 32, 32)).astype('f')
''',
}
PRELUDES['trainer'] = PRELUDES['model'] + '''
from chainer import training
optimizer = chainermn_overlap.create_overlapped_optimizer(
    chainer.optimizers.MomentumSGD(0.05), comm)
optimizer.setup(model)
_data = chainer.datasets.TupleDataset(
    numpy.random.RandomState(1).standard_normal((32, 5)).astype(numpy.float32),
    numpy.random.RandomState(2).randint(0, 3, 32).astype(numpy.int32))
_data = chainermn.scatter_dataset(_data if comm.rank == 0 else None, comm)
train_iter = chainer.iterators.SerialIterator(_data, 4)
updater = training.StandardUpdater(train_iter, optimizer)
trainer = training.Trainer(updater, (4, 'iteration'), out='result')
'''


def _cleanup(ns):
    import chainermn_overlap
    for value in list(ns.values()):
        close = getattr(value, 'close', None)
        if callable(close) and hasattr(value, 'communication_stats'):
            try:
                close()
            except Exception:  # the snippet's own outcome is what counts
                pass
    chainermn_overlap.disable_abort_on_exception()


def run_one(snippet):
    """Runs one snippet on this rank; returns None or a traceback string."""
    ns = {'__name__': '__main__', '__file__': snippet['file']}
    cwd = os.getcwd()
    os.chdir(snippet['dir'])
    try:
        prelude = PRELUDES.get(snippet.get('prelude') or '', '')
        if prelude:
            exec(compile(prelude, '<prelude %s>' % snippet['prelude'],
                         'exec'), ns)
        # Pad so that line numbers are those of the documentation file.
        code = '\n' * (snippet['line'] - 1) + snippet['code']
        exec(compile(code, snippet['file'], 'exec'), ns)
        return None
    except BaseException:  # SystemExit from a script counts as a failure too
        return traceback.format_exc()
    finally:
        _cleanup(ns)
        os.chdir(cwd)


def main(argv):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    with open(argv[0]) as f:
        snippets = json.load(f)
    results = {}
    for snippet in snippets:
        error = run_one(snippet)
        errors = world.allgather(error)
        failed = ['rank %d: %s' % (r, e) for r, e in enumerate(errors) if e]
        results[snippet['id']] = '\n'.join(failed) or None
        sys.stdout.flush()
        world.Barrier()
    if world.rank == 0:
        with open(argv[1], 'w') as f:
            json.dump(results, f)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
