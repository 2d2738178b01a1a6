"""Accuracy with a low-precision wire and PowerSGD, on real data.

Run (2 ranks by default; installs nothing: needs scikit-learn and
matplotlib, which ``make bench`` installs)::

    python -m benchmarks.accuracy [--np 2] [--epochs 40]

Data: scikit-learn's bundled copy of the UCI handwritten digits (1797 8x8
images, 10 classes; nothing is downloaded), split 80/20 with a fixed seed.
Each rank trains on its half of every global batch.  A small CNN (two 3x3
convolutions and two fully connected layers, so both convolution kernels
and matrices are compressed) is trained to convergence with the overlapped
optimizer in each mode -- float32 on the wire, float16 on the wire, PowerSGD
of rank 1, 2 and 4 -- from the same initial parameters on the same batches;
test accuracy is evaluated after every epoch.  Also records the ResNet
example's loss on its synthetic data with and without compression.

Writes ``benchmarks/results/accuracy.json`` and ``accuracy.png``.
"""
import argparse
import json
import os
import subprocess
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402

RESULT_TAG = 'ACCURACY_RESULT '
MODES = ['float32', 'float16', 'powersgd1', 'powersgd2', 'powersgd4']


def _optimizer(mode, comm, lr, warmup):
    import chainer
    import numpy
    import chainermn_overlap
    options = {}
    if mode == 'float16':
        options['allreduce_grad_dtype'] = numpy.float16
    elif mode.startswith('powersgd'):
        options['compression'] = chainermn_overlap.PowerSGD(
            rank=int(mode[len('powersgd'):]), warmup_iterations=warmup)
    return chainermn_overlap.create_overlapped_optimizer(
        chainer.optimizers.MomentumSGD(lr, 0.9), comm, **options)


def _digits_model():
    import chainer
    import chainer.functions as F
    import chainer.links as L

    class CNN(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.c1 = L.Convolution2D(1, 32, 3, pad=1)
                self.c2 = L.Convolution2D(32, 64, 3, pad=1)
                self.l1 = L.Linear(64 * 4 * 4, 128)
                self.l2 = L.Linear(128, 10)

        def forward(self, x):
            h = F.relu(self.c1(x))
            h = F.max_pooling_2d(F.relu(self.c2(h)), 2)
            return self.l2(F.relu(self.l1(h)))
    return CNN()


def digits_worker(cfg):
    import chainer
    import chainer.functions as F
    import chainermn
    import numpy
    from sklearn.datasets import load_digits
    comm = chainermn.create_communicator('naive')
    digits = load_digits()
    x = (digits.images / 16.0).astype(numpy.float32)[:, None]
    t = digits.target.astype(numpy.int32)
    order = numpy.random.RandomState(0).permutation(len(x))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    batch = cfg['batch']          # global batch
    per_rank = batch // comm.size
    steps = len(train) // batch
    curves = {}
    for mode in cfg['modes']:
        numpy.random.seed(1)      # the same initial parameters everywhere
        model = _digits_model()
        opt = _optimizer(mode, comm, cfg['lr'], cfg['warmup'])
        opt.setup(model)
        rng = numpy.random.RandomState(2)   # the same batches in each mode
        acc, losses = [], []
        t0 = time.perf_counter()
        for epoch in range(cfg['epochs']):
            perm = train[rng.permutation(len(train))]
            for s in range(steps):
                idx = perm[s * batch:(s + 1) * batch]
                idx = idx[comm.rank * per_rank:(comm.rank + 1) * per_rank]

                def lossfun():
                    return F.softmax_cross_entropy(model(x[idx]), t[idx])
                opt.update(lossfun)
            opt.synchronize()
            with chainer.using_config('train', False), \
                    chainer.no_backprop_mode():
                y = model(x[test])
                acc.append(float((y.array.argmax(1) == t[test]).mean()))
                losses.append(float(F.softmax_cross_entropy(
                    y, t[test]).array))
        stats = opt.communication_stats()
        opt.close()
        curves[mode] = {'test_accuracy': acc, 'test_loss': losses,
                        'seconds': time.perf_counter() - t0,
                        'bytes_per_iteration': stats['bytes'] / max(
                            1, cfg['epochs'] * steps)}
    if comm.rank == 0:
        launch.emit_result(RESULT_TAG, {
            'curves': curves, 'train_samples': int(len(train)),
            'test_samples': int(n_test), 'steps_per_epoch': steps})


def resnet_worker(cfg):
    """The ImageNet example's model on its synthetic data: loss per step."""
    import chainer.functions as F
    import chainermn
    import numpy
    from benchmarks.harness import workloads
    comm = chainermn.create_communicator('naive')
    out = {}
    for mode in cfg['modes']:
        numpy.random.seed(3)
        model = workloads.build_model(cfg['arch'])
        opt = _optimizer(mode, comm, 0.05, cfg['warmup'])
        opt.setup(model)
        rng = numpy.random.RandomState(4 + comm.rank)
        x, t = workloads.synthetic_batch(rng, cfg['batch'], cfg['insize'])
        losses = []
        for _ in range(cfg['iterations']):
            loss = {}

            def lossfun():
                loss['v'] = F.softmax_cross_entropy(model(x), t)
                return loss['v']
            opt.update(lossfun)
            losses.append(float(comm.mpi_comm.allreduce(
                float(loss['v'].array)) / comm.size))
        opt.close()
        out[mode] = losses
    if comm.rank == 0:
        launch.emit_result(RESULT_TAG, {'losses': out})


WORKERS = {'digits': digits_worker, 'resnet': resnet_worker}


def _run(np_, cfg):
    cmd = ([os.path.join(os.path.dirname(sys.executable), 'mpiexec'),
            '-n', str(np_)] + launch.worker_command('benchmarks.accuracy',
                                                    cfg))
    env = dict(os.environ, **launch.worker_env())
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          cwd=launch.ROOT)
    if proc.returncode != 0:
        raise RuntimeError('accuracy worker failed (exit {}):\n{}'.format(
            proc.returncode, proc.stdout[-4000:]))
    return launch.read_result(proc.stdout, RESULT_TAG, 'accuracy worker')


def _plot(result, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, c in result['digits']['curves'].items():
        axes[0].plot(range(1, len(c['test_accuracy']) + 1),
                     [100 * a for a in c['test_accuracy']], label=mode)
    axes[0].set_xlabel('epoch')
    axes[0].set_ylabel('test accuracy (%)')
    axes[0].set_title('digits (scikit-learn), {} ranks'.format(
        result['config']['np']))
    axes[0].legend()
    for mode, losses in result['resnet']['losses'].items():
        axes[1].plot(range(1, len(losses) + 1), losses, label=mode)
    axes[1].set_xlabel('iteration')
    axes[1].set_ylabel('training loss (mean over ranks)')
    axes[1].set_title('{} on synthetic data'.format(
        result['config']['resnet']['arch']))
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    if launch.dispatch_worker(argv, lambda cfg: WORKERS[cfg['kind']](cfg)):
        return
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--np', type=int, default=2)
    p.add_argument('--epochs', type=int, default=40)
    p.add_argument('--batch', type=int, default=64)
    p.add_argument('--lr', type=float, default=0.02)
    p.add_argument('--warmup', type=int, default=20)
    p.add_argument('--resnet-arch', default='resnet_small')
    p.add_argument('--resnet-iterations', type=int, default=30)
    p.add_argument('--out', default=os.path.join(launch.RESULTS,
                                                 'accuracy.json'))
    args = p.parse_args(argv)
    digits_cfg = {'kind': 'digits', 'modes': MODES, 'epochs': args.epochs,
                  'batch': args.batch, 'lr': args.lr,
                  'warmup': args.warmup}
    resnet_cfg = {'kind': 'resnet', 'modes': ['float32', 'powersgd4'],
                  'arch': args.resnet_arch, 'batch': 4, 'insize': 64,
                  'iterations': args.resnet_iterations, 'warmup': 5}
    result = {'machine': machine_description(),
              'config': {'np': args.np, 'digits': digits_cfg,
                         'resnet': resnet_cfg},
              'digits': _run(args.np, digits_cfg),
              'resnet': _run(args.np, resnet_cfg)}
    final = {m: c['test_accuracy'][-1]
             for m, c in result['digits']['curves'].items()}
    result['final_accuracy'] = final
    result['max_gap_points'] = max(
        100 * abs(a - final['float32']) for a in final.values())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    try:
        _plot(result, os.path.splitext(args.out)[0] + '.png')
    except ImportError:
        pass
    for m, a in final.items():
        sys.stdout.write('{:10s} final test accuracy {:.2f}%  ({:.0f} B/it)\n'
                         .format(m, 100 * a, result['digits']['curves'][m]
                                 ['bytes_per_iteration']))
    sys.stdout.write('largest gap to float32: {:.2f} points\n'.format(
        result['max_gap_points']))
    for m, losses in result['resnet']['losses'].items():
        sys.stdout.write('{} {:10s} loss {:.3f} -> {:.3f}\n'.format(
            args.resnet_arch, m, losses[0], losses[-1]))


if __name__ == '__main__':
    main()
