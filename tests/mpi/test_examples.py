"""Smoke tests of examples/imagenet/train_imagenet.py, run in-process.

Collective: every rank of the MPI job runs these tests at the same time and
calls the example's ``main`` together, as ``mpiexec ... train_imagenet.py``
would.  Each run is a few iterations of the small ResNet at 32x32.
"""
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from examples.imagenet import train_imagenet

# A large learning rate makes a stale or missing update visible in the
# parameters after these few steps.
QUICK = ['--arch', 'resnet_small', '--insize', '32', '--batchsize', '2',
         '--iterations', '4', '--lr', '0.05', '--no-progress']
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture
def out_dir():
    # One directory per rank, made by tempfile rather than pytest's tmp_path:
    # several ranks creating and pruning pytest's numbered base directories
    # at the same moment race with each other.
    with tempfile.TemporaryDirectory(prefix='train_imagenet_') as d:
        yield d


def _flat_params(model):
    return np.concatenate([p.array.ravel() for _, p in
                           sorted(model.namedparams())])


def _run(out_dir, *extra):
    return train_imagenet.main(QUICK + ['--out', out_dir] + list(extra))


def _check_run(result, out_dir):
    world = MPI.COMM_WORLD
    # The one collective call comes first, so that a failed assertion on
    # one rank cannot leave the others waiting in it.
    params = _flat_params(result['model'])
    root_params = world.bcast(params, root=0)
    assert len(result['times']) == 4
    assert result['measured'] == 2          # 4 iterations, 2 warm-up
    assert result['median_time'] > 0
    assert result['throughput'] == pytest.approx(
        2 * world.size / result['median_time'])
    assert np.all(np.isfinite(params))
    # Data parallelism keeps one model: every rank ends with rank 0's.
    np.testing.assert_array_equal(params, root_params)
    if world.rank == 0:
        assert os.path.exists(os.path.join(out_dir, 'log'))


_blocking_cache = {}


def _blocking_params():
    # The reference for the overlapped runs, computed once per session.
    if 'params' not in _blocking_cache:
        with tempfile.TemporaryDirectory() as d:
            _blocking_cache['params'] = _flat_params(_run(d)['model'])
    return _blocking_cache['params']


def test_blocking(out_dir):
    result = _run(out_dir, '--optimizer', 'blocking')
    _check_run(result, out_dir)
    _blocking_cache.setdefault('params', _flat_params(result['model']))


@pytest.mark.parametrize('wait', ['forward', 'update'])
def test_overlap(out_dir, wait):
    result = _run(out_dir, '--optimizer', 'overlap', '--wait', wait,
                  '--bucket-size', '0.05')
    _check_run(result, out_dir)
    # Same seed, same data: the overlapped reduction must give the blocking
    # one's parameters, not stale or partly reduced ones.
    np.testing.assert_allclose(_flat_params(result['model']),
                               _blocking_params(), **TOLERANCE)


def test_comparison_detects_a_missing_update(out_dir):
    # Negative control for test_overlap: one update fewer (as a stale
    # optimizer would lag) is far outside the tolerance.
    params = _flat_params(_run(out_dir, '--iterations', '3')['model'])
    assert not np.allclose(params, _blocking_params(), **TOLERANCE)


def test_real_image_list(out_dir):
    pytest.importorskip('PIL', reason='reading an image list needs Pillow')
    from PIL import Image

    # Rank 0 alone reads the list, so each rank may write its own copy.
    rng = np.random.RandomState(0)
    lines = []
    for i, mode in enumerate(['RGB', 'L', 'RGBA', 'P', 'RGB', 'RGB']):
        pixels = rng.randint(0, 256, (40, 36, 3)).astype(np.uint8)
        name = 'img{}.png'.format(i)
        Image.fromarray(pixels).convert(mode).save(
            os.path.join(out_dir, name))
        lines.append('{} {}\n'.format(name, i % 3))
    with open(os.path.join(out_dir, 'list.txt'), 'w') as f:
        f.writelines(lines)
    result = _run(out_dir, '--train', os.path.join(out_dir, 'list.txt'),
                  '--val', os.path.join(out_dir, 'list.txt'),
                  '--root', out_dir)
    _check_run(result, out_dir)


def test_bad_option_fails_on_every_rank(capsys):
    # Arguments are checked before any collective call, so every rank exits
    # with the same message instead of some of them waiting forever.
    with pytest.raises(SystemExit):
        train_imagenet.main(QUICK + ['--batchsize', '0'])
    assert '--batchsize must be at least 1' in capsys.readouterr().err
