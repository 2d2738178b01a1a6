r"""Data-parallel ImageNet training with ChainerMN, blocking or overlapped.

Run it with (synthetic data; then a quick run; then real data)::

    mpiexec -n 2 python examples/imagenet/train_imagenet.py --optimizer overlap
    mpiexec -n 2 python examples/imagenet/train_imagenet.py \
        --arch resnet_small --insize 32 --batchsize 8 --iterations 20
    mpiexec -n 4 python examples/imagenet/train_imagenet.py \
        --train train.txt --val val.txt --root /data/imagenet --mean mean.npy

Each process is one data-parallel worker; ``--batchsize`` is per process, so
one iteration trains on ``N * batchsize`` images.  Without ``--train`` the
data are synthetic: random ImageNet-shaped images and labels (1000 classes)
drawn from ``--seed``, generated on the fly so that no memory or disk is
needed.  With ``--train`` the list is in Chainer's ``LabeledImageDataset``
format: one ``relative/path.jpg <integer label>`` per line, paths relative to
``--root``.  Images must be at least ``--insize`` pixels on each side (resize
them to 256x256 beforehand, as Chainer's ImageNet example expects).

``--optimizer blocking`` is ChainerMN's ``create_multi_node_optimizer`` (one
blocking allreduce after backward); ``--optimizer overlap`` is
``chainermn_overlap.create_overlapped_optimizer``, which reduces gradients
during backward.  At the end rank 0 prints the median wall time of an
iteration (slowest rank, after ``--warmup`` iterations) and the throughput in
images per second over all processes.  With ``--optimizer overlap`` the log
also shows, per iteration, the bytes reduced, the seconds spent reducing and
waiting, and the fraction hidden (``comm/...``, from
``chainermn_overlap.extensions.CommunicationReport``); where matplotlib is
installed, ``loss.png`` and ``communication.png`` are plotted into ``--out``.

Threads: numpy's BLAS and OpenMP use as many threads as the environment says
(``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``).  With
several processes on one host, set them to about cores / processes, or
processes fight over the cores and timings become noise; ``make demo`` sets 1.
"""
import argparse
import importlib.util
import os
import sys
import time

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions
import chainermn
import numpy as np

from chainermn_overlap import extensions as comm_extensions

# ``models`` is the package beside this file.  Imported as
# ``examples.imagenet.train_imagenet`` it is a subpackage; run as a script,
# Python has put this file's directory on sys.path, where it is top-level.
if __package__:
    from .models import ARCHS
else:
    from models import ARCHS

IMAGENET_CLASSES = 1000
# Per-channel mean of ImageNet in RGB order (PIL's order), on a 0-255 scale;
# used when no mean image is given with --mean.
IMAGENET_MEAN_RGB = (123.68, 116.78, 103.94)


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------

class SyntheticImageNet(chainer.dataset.DatasetMixin):
    """Random ImageNet-shaped images and labels, the same for a given seed.

    Each example is generated from ``(seed, index)`` when it is read, so the
    dataset costs no memory, pickles to a few bytes (``scatter_dataset``
    broadcasts it), and every process sees the same example at an index.
    The images are standard normal, like preprocessed (mean-subtracted,
    scaled) real images.

    Args:
        length (int): Number of examples.
        insize (int): Height and width of the images.
        n_classes (int): Labels are drawn uniformly from ``[0, n_classes)``.
        seed (int): Seed of the whole dataset.
    """

    def __init__(self, length, insize, n_classes=IMAGENET_CLASSES, seed=0):
        self.length = length
        self.insize = insize
        self.n_classes = n_classes
        self.seed = seed

    def __len__(self):
        return self.length

    def get_example(self, i):
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        image = rng.standard_normal((3, self.insize, self.insize),
                                    dtype=np.float32)
        label = np.int32(rng.integers(self.n_classes))
        return image, label


class RGBLabeledImageDataset(chainer.datasets.LabeledImageDataset):
    """``LabeledImageDataset`` that always returns 3-channel RGB images.

    Chainer's reader returns the file's own channels: one for greyscale,
    four for RGBA or CMYK, and palette indices (not colours) for palette
    images, all of which ImageNet contains.  Converting through PIL gives
    every image the 3 RGB channels the network expects.
    """

    def get_example(self, i):
        from PIL import Image
        path, label = self._pairs[i]
        with Image.open(os.path.join(self._root, path)) as f:
            image = np.asarray(f.convert('RGB'), dtype=np.float32)
        return image.transpose(2, 0, 1), np.int32(label)


class PreprocessedDataset(chainer.dataset.DatasetMixin):
    """Crops, flips, subtracts the mean and scales images of a dataset.

    Training takes a random ``crop_size`` square and flips it horizontally
    with probability 1/2; evaluation takes the central square.  Then the
    mean is subtracted and values are scaled from 0..255 to about -0.5..0.5,
    as in Chainer's ImageNet example.

    Args:
        base: Dataset of ``(image, label)``, images ``(3, H, W)`` float32
            in 0..255, H and W at least ``crop_size``.
        mean (numpy.ndarray): Mean image ``(3, H, W)`` of the same size as
            the images (cropped at the same place), or per-channel ``(3,)``.
        crop_size (int): Height and width of the output images.
        random (bool): Random crop and flip (training) or central crop.
        seed (int or None): Seed of the crop and flip choices.
    """

    def __init__(self, base, mean, crop_size, random=True, seed=None):
        self.base = base
        mean = np.asarray(mean, dtype=np.float32)
        self.mean = mean.reshape(3, 1, 1) if mean.ndim == 1 else mean
        self.crop_size = crop_size
        self.random = random
        self.rng = np.random.RandomState(seed)

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        image, label = self.base[i]
        _, h, w = image.shape
        size = self.crop_size
        if h < size or w < size:
            raise ValueError(
                'Image {} of the dataset is {}x{}, smaller than --insize {}. '
                'Resize the images to at least {} pixels on each side (e.g. '
                '256x256) or lower --insize.'.format(i, h, w, size, size))
        if self.random:
            top = self.rng.randint(h - size + 1)
            left = self.rng.randint(w - size + 1)
        else:
            top, left = (h - size) // 2, (w - size) // 2
        window = (slice(None), slice(top, top + size),
                  slice(left, left + size))
        image = image[window]
        if self.random and self.rng.randint(2):
            image = image[:, :, ::-1]
        mean = self.mean
        if mean.shape[1:] != (1, 1):
            if mean.shape[1:] != (h, w):
                raise ValueError(
                    'The mean image is {}x{} but image {} is {}x{}. Give a '
                    'mean image of the same size as the images, or a '
                    'per-channel mean of shape (3,).'.format(
                        mean.shape[1], mean.shape[2], i, h, w))
            mean = mean[window]
        image = (image - mean) * np.float32(1.0 / 255.0)
        return image.astype(np.float32, copy=False), label


def load_mean(path):
    """Returns the mean image in ``path`` (.npy), or ImageNet's channel means.

    Args:
        path (str or None): A ``.npy`` file holding a ``(3, H, W)`` image
            (as Chainer's ``compute_mean.py`` writes) or ``(3,)`` channel
            means, on a 0..255 scale, RGB order.

    Returns:
        numpy.ndarray: The mean, float32.
    """
    if path is None:
        return np.array(IMAGENET_MEAN_RGB, dtype=np.float32)
    mean = np.load(path, allow_pickle=False).astype(np.float32)
    if mean.ndim not in (1, 3) or mean.shape[0] != 3:
        raise ValueError(
            '--mean {} has shape {}; expected (3, H, W) or (3,) in RGB '
            'order.'.format(path, mean.shape))
    return mean


def make_datasets(args, comm):
    """Builds the training and validation datasets and scatters them.

    Only rank 0 reads the lists and the mean; ``scatter_dataset`` sends each
    process its share, so the other ranks need none of these files.

    Returns:
        tuple: This process's training dataset and validation dataset (None
        without ``--val``).
    """
    if args.train is None:
        train = None
        if comm.rank == 0:
            train = SyntheticImageNet(args.dataset_size, args.insize,
                                      seed=args.seed)
        return chainermn.scatter_dataset(train, comm, shuffle=True,
                                         seed=args.seed), None

    train = val = mean = None
    if comm.rank == 0:
        mean = load_mean(args.mean)
        train = RGBLabeledImageDataset(args.train, args.root)
        if args.val is not None:
            val = RGBLabeledImageDataset(args.val, args.root)
    mean = comm.bcast_obj(mean)
    train = chainermn.scatter_dataset(train, comm, shuffle=True,
                                      seed=args.seed)
    # Preprocessing is wrapped after the scatter so that each rank draws its
    # own crops and flips (a generator pickled on rank 0 would repeat them).
    train = PreprocessedDataset(train, mean, args.insize, random=True,
                                seed=[args.seed, comm.rank])
    if args.val is not None:
        # Equal lengths (a few images counted twice) as ChainerMN's
        # multi-node evaluator requires: it averages one result per rank.
        val = chainermn.scatter_dataset(val, comm)
        val = PreprocessedDataset(val, mean, args.insize, random=False)
    return train, val


# --------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------

def _blocking_optimizer(actual_optimizer, comm, args):
    return chainermn.create_multi_node_optimizer(actual_optimizer, comm)


def _overlap_optimizer(actual_optimizer, comm, args):
    import chainermn_overlap
    options = {'wait': args.wait}
    if args.bucket_size is not None:
        options['bucket_size'] = int(args.bucket_size * 2 ** 20)
    return chainermn_overlap.create_overlapped_optimizer(
        actual_optimizer, comm, **options)


# Each factory takes (actual optimizer, communicator, parsed arguments) and
# returns a multi-node optimizer; --optimizer lists these names.
OPTIMIZERS = {
    'blocking': _blocking_optimizer,
    'overlap': _overlap_optimizer,
}


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

class IterationTimer(training.Extension):
    """Records the wall time of every iteration.

    An iteration's time is the interval between the ends of two consecutive
    iterations, so it covers everything the trainer does: reading the batch,
    forward, backward, gradient reduction, update, work deferred into the
    next forward (``wait='forward'``) and the other extensions.  The
    intervals tile the run with no gap.  The time is also reported as
    ``time/iteration`` for ``LogReport``.
    """

    trigger = 1, 'iteration'
    # Runs before the other extensions of the same iteration, so that its
    # report reaches LogReport and the extensions' time lands in the next
    # interval, not between two.
    priority = training.PRIORITY_WRITER

    def __init__(self):
        self.times = []
        self._last = None

    def initialize(self, trainer):
        self._last = time.perf_counter()

    def __call__(self, trainer):
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now
        chainer.report({'time/iteration': self.times[-1]})


def summarize_times(times_by_rank, images_per_iteration, warmup):
    """Median iteration time and throughput from every rank's timings.

    An iteration is done when its slowest rank is done, so each iteration
    counts with its largest time over the ranks.

    Args:
        times_by_rank (list of list of float): Seconds per iteration, one
            list per rank, all of the same length.
        images_per_iteration (int): Images in one iteration, all ranks.
        warmup (int): Leading iterations to leave out (the first includes the
            parameter broadcast and memory allocation).

    Returns:
        dict: ``times`` (slowest rank per iteration), ``measured`` (how many
        iterations the median is over), ``median_time`` (s) and
        ``throughput`` (images/s).
    """
    times = np.max(np.asarray(times_by_rank, dtype=np.float64), axis=0)
    # A run no longer than the warm-up still gets a (pessimistic) number
    # from its last iteration rather than none.
    measured = times[warmup:] if len(times) > warmup else times[-1:]
    median = float(np.median(measured)) if len(measured) else float('nan')
    return {
        'times': times.tolist(),
        'measured': len(measured),
        'median_time': median,
        'throughput': images_per_iteration / median,
    }


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='ImageNet training with ChainerMN, blocking or '
                    'overlapped gradient reduction.')
    parser.add_argument('--arch', '-a', choices=sorted(ARCHS),
                        default='resnet50', help='network architecture')
    parser.add_argument('--batchsize', '-B', type=int, default=32,
                        help='images per process per iteration')
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument('--iterations', '-i', type=int,
                      help='stop after this many iterations')
    stop.add_argument('--epochs', '-E', type=int,
                      help='stop after this many epochs (default 1)')
    parser.add_argument('--lr', type=float,
                        help='learning rate of MomentumSGD (default: '
                             '0.1 * batchsize * processes / 256)')
    parser.add_argument('--momentum', type=float, default=0.9)
    parser.add_argument('--weight-decay', type=float, default=1e-4,
                        help='weight decay (0 for none)')
    parser.add_argument('--optimizer', choices=sorted(OPTIMIZERS),
                        default='blocking',
                        help='multi-node optimizer: ChainerMN\'s blocking '
                             'allreduce, or chainermn_overlap\'s overlapped '
                             'one')
    parser.add_argument('--wait', choices=('forward', 'update'),
                        default='forward',
                        help='overlap only: where a reduction is waited for: '
                             'before the next forward of its link, or in '
                             'update()')
    parser.add_argument('--bucket-size', type=float,
                        help='overlap only: fusion bucket size in MiB '
                             '(default: the library\'s)')
    parser.add_argument('--communicator', default='naive',
                        help='ChainerMN communicator name')
    parser.add_argument('--insize', type=int, default=224,
                        help='height and width of the network input')
    parser.add_argument('--dataset-size', type=int, default=1024,
                        help='images in the synthetic dataset (ImageNet has '
                             '1281167)')
    parser.add_argument('--train',
                        help='training image list (LabeledImageDataset '
                             'format); synthetic data if not given')
    parser.add_argument('--val',
                        help='validation image list, evaluated every epoch '
                             '(needs --train)')
    parser.add_argument('--root', default='.',
                        help='directory the image paths are relative to')
    parser.add_argument('--mean',
                        help='mean image (.npy, (3, H, W) or (3,), RGB, '
                             '0..255); ImageNet\'s channel means if not '
                             'given')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the data, the model and the shuffling')
    parser.add_argument('--warmup', type=int, default=2,
                        help='iterations left out of the timing')
    parser.add_argument('--log-interval', type=int, default=1,
                        help='iterations between log lines')
    parser.add_argument('--progress', action='store_true',
                        default=sys.stdout.isatty(),
                        help='show a progress bar (default: when stdout is '
                             'a terminal)')
    parser.add_argument('--no-progress', dest='progress',
                        action='store_false')
    parser.add_argument('--out', '-o', default='result',
                        help='output directory (the log)')
    args = parser.parse_args(argv)
    for name in ('batchsize', 'iterations', 'epochs', 'insize',
                 'dataset_size', 'log_interval'):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error('--{} must be at least 1, got {}'.format(
                name.replace('_', '-'), value))
    if args.warmup < 0:
        parser.error('--warmup must be 0 or more, got {}'.format(args.warmup))
    if args.insize < 32:
        parser.error('--insize must be at least 32 (the networks down-sample '
                     '5 times), got {}'.format(args.insize))
    if args.val is not None and args.train is None:
        parser.error('--val needs --train: there is no synthetic validation '
                     'set')
    if args.bucket_size is not None and args.bucket_size <= 0:
        parser.error('--bucket-size must be positive (MiB), got {}'.format(
            args.bucket_size))
    return args


def main(argv=None):
    """Trains, prints the timing on rank 0 and returns it on every rank.

    Args:
        argv (list of str): Command-line arguments (``sys.argv[1:]`` if
            None).

    Returns:
        dict: ``summarize_times``'s result plus ``model`` (the trained
        ``Classifier``) and ``args``.
    """
    args = parse_args(argv)
    comm = chainermn.create_communicator(args.communicator)
    images_per_iteration = args.batchsize * comm.size
    lr = args.lr if args.lr is not None else 0.1 * images_per_iteration / 256
    if comm.rank == 0:
        data = ('{} synthetic images'.format(args.dataset_size)
                if args.train is None else args.train)
        reduction = args.optimizer
        if args.optimizer == 'overlap':
            reduction += ' (wait={})'.format(args.wait)
        print('{} processes, {} on {}, batch {} per process, input {}x{}, '
              'optimizer {}, communicator {}, lr {:g}'.format(
                  comm.size, args.arch, data, args.batchsize, args.insize,
                  args.insize, reduction, args.communicator, lr))
        sys.stdout.flush()

    # Every rank initialises the same model; rank 0's parameters are
    # broadcast on the first update anyway, this only makes runs repeatable.
    np.random.seed(args.seed)
    model = L.Classifier(ARCHS[args.arch](n_classes=IMAGENET_CLASSES))

    actual = chainer.optimizers.MomentumSGD(lr=lr, momentum=args.momentum)
    optimizer = OPTIMIZERS[args.optimizer](actual, comm, args)
    optimizer.setup(model)
    if args.weight_decay > 0:
        optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(
            args.weight_decay))

    train, val = make_datasets(args, comm)
    # Each rank shuffles its share differently but repeatably.
    train_iter = chainer.iterators.SerialIterator(
        train, args.batchsize,
        order_sampler=chainer.iterators.ShuffleOrderSampler(
            np.random.RandomState([args.seed, comm.rank])))
    updater = training.StandardUpdater(train_iter, optimizer)
    if args.iterations is not None:
        stop = (args.iterations, 'iteration')
    else:
        stop = (args.epochs or 1, 'epoch')
    trainer = training.Trainer(updater, stop, out=args.out)

    timer = IterationTimer()
    trainer.extend(timer)
    if val is not None:
        val_iter = chainer.iterators.SerialIterator(
            val, args.batchsize, repeat=False, shuffle=False)
        evaluator = extensions.Evaluator(val_iter, model)
        trainer.extend(chainermn.create_multi_node_evaluator(evaluator, comm),
                       trigger=(1, 'epoch'))
    if comm.rank == 0:
        log_trigger = (args.log_interval, 'iteration')
        trainer.extend(extensions.LogReport(trigger=log_trigger))
        entries = ['epoch', 'iteration', 'main/loss', 'main/accuracy']
        if val is not None:
            entries += ['validation/main/loss', 'validation/main/accuracy']
        entries += ['time/iteration', 'elapsed_time']
        # PlotReport.available() warns when matplotlib is missing; plotting
        # is optional here, so look for it quietly.
        can_plot = importlib.util.find_spec('matplotlib') is not None
        if hasattr(optimizer, 'communication_stats'):
            # Bytes reduced, time reduced and waited, fraction hidden: per
            # iteration in the log, beside the loss.
            report = comm_extensions.CommunicationReport(optimizer)
            trainer.extend(report)
            entries += report.entries
            if can_plot:
                trainer.extend(extensions.PlotReport(
                    ['comm/comm_seconds', 'comm/wait_seconds'], 'iteration',
                    trigger=log_trigger, filename='communication.png'))
        if can_plot:
            trainer.extend(extensions.PlotReport(
                ['main/loss'], 'iteration', trigger=log_trigger,
                filename='loss.png'))
        trainer.extend(extensions.PrintReport(entries), trigger=log_trigger)
        if args.progress:
            trainer.extend(extensions.ProgressBar(
                update_interval=args.log_interval))

    start = time.perf_counter()
    trainer.run()
    sync_start = time.perf_counter()
    # The overlapped optimizer may still have reductions and updates in
    # flight (wait='forward' applies them at the next forward); finish them
    # so the model holds the final parameters.  ChainerMN's optimizer has
    # no synchronize: it finishes everything inside update().
    synchronize = getattr(optimizer, 'synchronize', None)
    if synchronize is not None:
        synchronize()
    end = time.perf_counter()

    result = summarize_times(comm.mpi_comm.allgather(timer.times),
                             images_per_iteration, args.warmup)
    result.update(model=model, args=args, total_time=end - start,
                  sync_time=end - sync_start)
    if comm.rank == 0:
        print_summary(result, comm.size, args)
    return result


def print_summary(result, n_processes, args):
    """Prints ``main``'s timing result (on rank 0)."""
    times = result['times']
    print('\nIteration times (s, slowest rank): ' +
          ' '.join('{:.3f}'.format(t) for t in times))
    print('{} processes x batch {} = {} images per iteration; median over '
          'the last {} of {} iterations ({} warm-up left out):'.format(
              n_processes, args.batchsize, n_processes * args.batchsize,
              result['measured'], len(times),
              len(times) - result['measured']))
    print('  time per iteration: {:.4f} s'.format(result['median_time']))
    print('  throughput:         {:.2f} images/s'.format(
        result['throughput']))
    print('  total training time {:.2f} s (final synchronize {:.3f} s)'.format(
        result['total_time'], result['sync_time']))
    sys.stdout.flush()


if __name__ == '__main__':
    # An exception on one rank would leave the others waiting forever in a
    # collective; this hook aborts the whole MPI job instead (and, unlike
    # chainermn.global_except_hook, also covers exceptions in threads and
    # cannot hang in MPI_Abort itself).
    import chainermn_overlap
    chainermn_overlap.enable_abort_on_exception()
    main()
