"""Automatic synchronisation and the errors/warnings of wait='forward'."""
import copy
import pickle

import chainer
import chainer.functions as F
import chainermn
import numpy as np
import pytest

import chainermn_overlap
from chainermn_overlap.testing import models


def _mlp():
    # 4-6-3, tanh, loss sum(y ** 2) inside forward: update(model, x) needs no
    # targets.  A module-level loss keeps the model picklable.
    return models.MLP(4, 6, 3, n_layers=2, activation=F.tanh,
                      loss=models.sum_of_squares)


def _data(comm, step):
    rng = np.random.RandomState(100 * step + comm.rank)
    return rng.randn(5, 4).astype(np.float32)


def _params(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def _train(comm, wait, steps=4, lr_schedule=None):
    """Trains and returns (model, optimizer) without synchronising."""
    np.random.seed(7)
    model = _mlp()
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.MomentumSGD(0.1), comm, wait=wait).setup(model)
    for i in range(steps):
        opt.update(model, _data(comm, i))
        if lr_schedule is not None:
            opt.lr = lr_schedule(i)
    return model, opt


def _reference(comm, steps=4, lr_schedule=None):
    np.random.seed(7)
    model = _mlp()
    opt = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.1), comm)
    opt.setup(model)
    for i in range(steps):
        opt.update(model, _data(comm, i))
        if lr_schedule is not None:
            opt.lr = lr_schedule(i)
    return _params(model)


def _assert_close(a, b):
    for n in a:
        np.testing.assert_allclose(a[n], b[n], rtol=1e-5, atol=1e-6,
                                   err_msg=n)


def _assert_differs(a, b):
    assert any(not np.allclose(a[n], b[n], rtol=1e-5, atol=1e-6)
               for n in a)


def test_pending_updates_are_real(comm):
    # Negative control for the tests below: right after update() with
    # wait='forward', parameters are one update behind the reference.
    ref = _reference(comm)
    model, opt = _train(comm, 'forward')
    _assert_differs(_params(model), ref)
    opt.synchronize()
    _assert_close(_params(model), ref)
    opt.close()


@pytest.mark.parametrize('read', ['copy', 'deepcopy', 'pickle', 'to_cpu',
                                  'copyparams'])
def test_reads_synchronize(comm, read):
    ref = _reference(comm)
    model, opt = _train(comm, 'forward')
    if read == 'copy':
        got = _params(model.copy(mode='copy'))
    elif read == 'deepcopy':
        got = _params(copy.deepcopy(model))
    elif read == 'pickle':
        got = _params(pickle.loads(pickle.dumps(model)))
    elif read == 'to_cpu':
        model.to_cpu()
        got = _params(model)
    else:
        other = _mlp()
        other.copyparams(model)
        got = _params(other)
    _assert_close(got, ref)
    # The copy is not tied to the optimizer: training it changes nothing.
    opt.close()


def test_save_npz_right_after_training(comm, tmp_path):
    ref = _reference(comm)
    model, opt = _train(comm, 'forward')
    path = str(tmp_path / 'model{}.npz'.format(comm.rank))
    chainer.serializers.save_npz(path, model)
    loaded = _mlp()
    chainer.serializers.load_npz(path, loaded)
    _assert_close(_params(loaded), ref)
    opt.close()


def test_learning_rate_changed_after_update(comm):
    # A schedule changes lr right after each update(); the deferred update
    # of that iteration must still use the old value.
    sched = lambda i: 0.1 / (i + 2)  # NOQA
    ref = _reference(comm, steps=5, lr_schedule=sched)
    model, opt = _train(comm, 'forward', steps=5, lr_schedule=sched)
    opt.synchronize()
    _assert_close(_params(model), ref)
    opt.close()


def test_extra_forward_backward_needs_no_sync(comm):
    model, opt = _train(comm, 'forward', steps=2)
    x = _data(comm, 9)
    model.cleargrads()
    model(x).backward()
    model(x)  # a forward alone (e.g. for logging) is fine
    with pytest.raises(RuntimeError, match='no_sync'):
        model(x).backward()
    # every rank raised; restore a usable state for the next tests
    assert all(comm.mpi_comm.allgather(True))
    opt.close()


def test_no_sync_accumulation_equals_reference(comm):
    # Two micro-batches accumulated == one update on the summed gradient.
    np.random.seed(7)
    ref_model = _mlp()
    ref_opt = chainermn.create_multi_node_optimizer(
        chainer.optimizers.SGD(0.1), comm)
    ref_opt.setup(ref_model)
    np.random.seed(7)
    model = _mlp()
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(0.1), comm).setup(model)
    for step in range(4):
        xa, xb = _data(comm, 2 * step), _data(comm, 2 * step + 1)
        ref_model.cleargrads()
        ref_model(xa).backward()
        ref_model(xb).backward()
        ref_opt.update()
        model.cleargrads()
        with opt.no_sync():
            model(xa).backward()
        model(xb).backward()
        opt.update()
    opt.synchronize()
    _assert_close(_params(model), _params(ref_model))
    opt.close()


def test_gradient_clipping_falls_back_with_one_warning(comm):
    np.random.seed(7)
    ref_model = _mlp()
    ref_opt = chainermn.create_multi_node_optimizer(
        chainer.optimizers.SGD(0.1), comm)
    ref_opt.setup(ref_model)
    ref_opt.add_hook(chainer.optimizer_hooks.GradientClipping(0.01))
    np.random.seed(7)
    model = _mlp()
    opt = chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.SGD(0.1), comm).setup(model)
    opt.add_hook(chainer.optimizer_hooks.GradientClipping(0.01))
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(4):
            ref_opt.update(ref_model, _data(comm, i))
            opt.update(model, _data(comm, i))
    fallback = [x for x in w
                if issubclass(x.category, chainermn_overlap.FallbackWarning)]
    assert len(fallback) == 1 and 'GradientClipping' in str(
        fallback[0].message)
    opt.synchronize()
    _assert_close(_params(model), _params(ref_model))
    opt.close()
