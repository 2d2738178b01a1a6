"""CommunicationReport in a real trainer: what LogReport and PrintReport show.

Collective: every rank trains the same tiny classifier with the overlapped
optimizer (both wait modes) and the double-buffering one; the report runs
on every rank (it communicates nothing), LogReport and PrintReport too.
"""
import io
import json
import os
import tempfile

import numpy as np
import pytest

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

import chainermn_overlap
from chainermn_overlap.extensions import CommunicationReport
from chainermn_overlap.testing import models

ITERATIONS = 6


class Readings(training.Extension):
    """Records communication_stats() after the report ran (a reader)."""
    trigger = 1, 'iteration'
    priority = training.PRIORITY_READER

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.values = []

    def initialize(self, trainer):
        self.values.append(self.optimizer.communication_stats())

    def __call__(self, trainer):
        self.values.append(self.optimizer.communication_stats())


def _dataset(comm, n=48):
    rng = np.random.RandomState(7)
    x = rng.standard_normal((n, 5)).astype(np.float32)
    t = rng.randint(0, 3, n).astype(np.int32)
    data = chainer.datasets.TupleDataset(x, t) if comm.rank == 0 else None
    import chainermn
    return chainermn.scatter_dataset(data, comm, shuffle=False)


def _train(comm, factory, out, **options):
    np.random.seed(0)
    model = L.Classifier(models.MLP())
    optimizer = factory(chainer.optimizers.MomentumSGD(0.05), comm,
                        **options)
    optimizer.setup(model)
    it = chainer.iterators.SerialIterator(_dataset(comm), 4, shuffle=False)
    trainer = training.Trainer(training.StandardUpdater(it, optimizer),
                               (ITERATIONS, 'iteration'), out=out)
    report = CommunicationReport()
    readings = Readings(optimizer)
    printed = io.StringIO()
    trainer.extend(report)
    trainer.extend(readings)
    trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    trainer.extend(extensions.PrintReport(
        ['iteration', 'main/loss'] + report.entries, out=printed))
    trainer.run()
    optimizer.synchronize()
    with open(os.path.join(out, 'log')) as f:
        log = json.load(f)
    optimizer.close()
    return model, log, readings.values, printed.getvalue(), report


CASES = [
    ('forward', chainermn_overlap.create_overlapped_optimizer,
     {'wait': 'forward'}),
    ('update', chainermn_overlap.create_overlapped_optimizer,
     {'wait': 'update'}),
    ('double_buffering', chainermn_overlap.create_double_buffering_optimizer,
     {}),
]


@pytest.mark.parametrize('name,factory,options', CASES,
                         ids=[c[0] for c in CASES])
def test_log_has_each_iterations_counters(comm, name, factory, options):
    with tempfile.TemporaryDirectory(prefix='comm_report_') as out:
        model, log, readings, printed, report = _train(
            comm, factory, out, **options)
    grad_bytes = sum(p.size * p.dtype.itemsize for p in model.params())
    assert len(log) == ITERATIONS and len(readings) == ITERATIONS + 1
    for i, entry in enumerate(log):
        before, now = readings[i], readings[i + 1]
        # Each logged value is exactly what the optimizer counted in that
        # iteration (LogReport's mean over one observation is the value).
        assert entry['comm/bytes'] == now['bytes'] - before['bytes']
        assert entry['comm/buckets'] == now['buckets'] - before['buckets']
        assert entry['comm/comm_seconds'] == pytest.approx(
            now['comm_seconds'] - before['comm_seconds'], abs=1e-12)
        assert entry['comm/wait_seconds'] == pytest.approx(
            now['wait_seconds'] - before['wait_seconds'], abs=1e-12)
        if entry['comm/comm_seconds'] > 0:
            assert entry['comm/hidden_fraction'] == pytest.approx(
                1 - entry['comm/wait_seconds'] / entry['comm/comm_seconds'])
        else:
            assert 'comm/hidden_fraction' not in entry
    total = sum(e['comm/bytes'] for e in log)
    assert total == readings[-1]['bytes'] - readings[0]['bytes'] > 0
    # Every reduced iteration moves the whole gradient: the log's bytes are
    # whole multiples of it, not zeros or stale copies.
    assert total % grad_bytes == 0 and total >= grad_bytes
    for key in report.entries:
        assert key in printed.splitlines()[0], (key, printed[:300])


def test_wait_update_reduces_every_iteration_in_that_iteration(comm):
    # wait='update' finishes each iteration's reductions inside update(): so
    # from the second iteration on (the first broadcasts), every logged
    # iteration holds exactly one gradient's worth of bytes.
    with tempfile.TemporaryDirectory(prefix='comm_report_') as out:
        model, log, _, _, _ = _train(
            comm, chainermn_overlap.create_overlapped_optimizer, out,
            wait='update')
    grad_bytes = sum(p.size * p.dtype.itemsize for p in model.params())
    assert [e['comm/bytes'] for e in log[1:]] == \
        [grad_bytes] * (ITERATIONS - 1)


def test_chainermn_optimizer_is_refused_with_the_fix(comm):
    import chainermn
    model = L.Classifier(models.MLP())
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.SGD(0.1), comm)
    optimizer.setup(model)
    with pytest.raises(ValueError, match='create_overlapped_optimizer'):
        CommunicationReport(optimizer)
    it = chainer.iterators.SerialIterator(_dataset(comm), 4)
    with tempfile.TemporaryDirectory(prefix='comm_report_') as out:
        trainer = training.Trainer(training.StandardUpdater(it, optimizer),
                                   (1, 'iteration'), out=out)
        trainer.extend(CommunicationReport())
        with pytest.raises(ValueError, match="optimizer 'main'"):
            trainer.run()


def test_imagenet_example_logs_the_counters(comm):
    from examples.imagenet import train_imagenet
    with tempfile.TemporaryDirectory(prefix='comm_report_') as out:
        train_imagenet.main([
            '--arch', 'resnet_small', '--insize', '32', '--batchsize', '2',
            '--iterations', '3', '--no-progress', '--optimizer', 'overlap',
            '--out', out])
        log = None
        if comm.rank == 0:     # LogReport runs on rank 0 only
            with open(os.path.join(out, 'log')) as f:
                log = json.load(f)
    if comm.rank == 0:
        assert len(log) == 3
        assert sum(e['comm/bytes'] for e in log) > 0
        assert all('comm/wait_seconds' in e for e in log)
