"""The optimizer equivalence suite with model and data on a GPU.

Ours trains on the device (``model.to_device(...)``, cupy inputs) through
each engine that can run there; the reference is ChainerMN's blocking
optimizer on the CPU with numpy, on the same per-rank data.  Models and
checks are the CPU suite's (``tests/mpi/test_equivalence.py``).

Tolerances are looser than the CPU suite's: cuBLAS/cuDNN and numpy sum in
different orders (about 1e-6 relative per step); a wrong, stale or missing
update moves parameters by ~lr = 1e-1 and is still caught.
"""
import chainer.links as L
import pytest

from chainermn_overlap.testing import device
from chainermn_overlap.testing import equivalence as eq
from chainermn_overlap.testing.models import MLP

import _gpu_device  # NOQA: E402  (tests/gpu)

DEV = _gpu_device.require()

import test_equivalence as cpu  # NOQA: E402  (the CPU suite's models)

GPU_TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 5


def engines():
    out = ['mpi_priority', 'mpi_thread']
    ok, why = device.nccl_usable(eq.get_communicator().mpi_comm)
    out.append('nccl' if ok else pytest.param(
        'nccl', marks=pytest.mark.skip(reason='nccl engine: ' + why)))
    return out


ENGINES = engines()
MODELS = {
    'mlp': (lambda: L.Classifier(MLP()), (5,), 3),
    'cnn': (lambda: L.Classifier(cpu.CNN()), (1, 6, 6), 3),
}


def gpu_step(batches):
    def step(model, opt, it, impl):
        x, t = batches[it]
        opt.update(model, device.to_device(x, DEV), device.to_device(t, DEV))
    return step


def cpu_step(batches):
    def step(model, opt, it, impl):
        opt.update(model, *batches[it])
    return step


@pytest.mark.parametrize('backend', ENGINES)
@pytest.mark.parametrize('wait', cpu.WAITS)
@pytest.mark.parametrize('model', sorted(MODELS))
def test_gpu_training_equals_chainermn_on_cpu(impl, model, wait, backend):
    make, x_shape, n_classes = MODELS[model]
    batches = eq.make_batches(5, STEPS, 2, x_shape, n_classes=n_classes)
    template = cpu.build(make, seed=5)
    wait_mode, opts = cpu.mode(wait)
    opts['backend'] = backend
    ref = eq.train(eq.REFERENCE, template, cpu.momentum_sgd(),
                   cpu_step(batches), STEPS)
    gpu_template = device.to_device(template.copy(mode='copy'), DEV)
    got = eq.train(impl, gpu_template, cpu.momentum_sgd(),
                   gpu_step(batches), STEPS, wait_mode, options=opts)
    device.to_host(got.model)
    eq.assert_equivalent(got.model, ref.model, what='{} on {} ({}) vs '
                         'chainermn on the CPU'.format(impl.name, DEV,
                                                       backend), **GPU_TOL)
    eq.assert_all_ranks(got.opt.t == ref.opt.t,
                        't: {} vs {}'.format(got.opt.t, ref.opt.t))


def test_gpu_negative_control_a_skipped_update_is_caught(impl):
    # The tolerance is not so loose that a missing step passes.
    make, x_shape, n_classes = MODELS['mlp']
    batches = eq.make_batches(6, STEPS, 2, x_shape, n_classes=n_classes)
    template = cpu.build(make, seed=6)
    ref = eq.train(eq.REFERENCE, template, cpu.momentum_sgd(),
                   cpu_step(batches), STEPS)
    got = eq.train(impl, device.to_device(template.copy(mode='copy'), DEV),
                   cpu.momentum_sgd(), gpu_step(batches), STEPS - 1)
    device.to_host(got.model)
    eq.assert_different(got.model, ref.model, what='one step fewer',
                        **GPU_TOL)
