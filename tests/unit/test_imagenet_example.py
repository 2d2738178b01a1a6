"""Unit tests of the ImageNet example's data and timing helpers (no MPI)."""
import numpy as np
import pytest

from examples.imagenet import train_imagenet
from examples.imagenet.models import ARCHS


def test_synthetic_data_is_fixed_by_seed_and_index():
    a = train_imagenet.SyntheticImageNet(10, 32, seed=3)
    b = train_imagenet.SyntheticImageNet(10, 32, seed=3)
    c = train_imagenet.SyntheticImageNet(10, 32, seed=4)
    x, t = a[7]
    assert x.shape == (3, 32, 32) and x.dtype == np.float32
    assert t.dtype == np.int32 and 0 <= t < 1000
    np.testing.assert_array_equal(x, b[7][0])
    assert not np.array_equal(x, a[6][0])
    assert not np.array_equal(x, c[7][0])
    assert len(a) == 10


def test_center_crop_subtracts_the_mean_image_at_the_same_place():
    image = np.arange(3 * 6 * 8, dtype=np.float32).reshape(3, 6, 8)
    mean = np.full((3, 6, 8), 1.0, np.float32)
    mean[:, 1:5, 2:6] = 2.0     # exactly the central 4x4 window
    dataset = train_imagenet.PreprocessedDataset(
        [(image, np.int32(5))], mean, 4, random=False)
    x, t = dataset[0]
    assert t == 5 and x.dtype == np.float32 and x.shape == (3, 4, 4)
    np.testing.assert_allclose(x, (image[:, 1:5, 2:6] - 2.0) / 255.0)


def test_random_crop_is_a_window_possibly_flipped():
    image = np.random.RandomState(0).rand(3, 9, 7).astype(np.float32)
    mean = np.array([10., 20., 30.], np.float32)
    dataset = train_imagenet.PreprocessedDataset(
        [(image, np.int32(0))], mean, 5, random=True, seed=1)
    windows = [image[:, i:i + 5, j:j + 5] for i in range(5)
               for j in range(3)]
    windows += [w[:, :, ::-1] for w in windows]
    seen_flip = seen_plain = False
    for _ in range(40):
        x = dataset[0][0] * 255.0 + mean.reshape(3, 1, 1)
        match = [k for k, w in enumerate(windows)
                 if np.allclose(x, w, atol=1e-4)]
        assert match, 'output is not a crop of the input'
        seen_flip |= match[0] >= 15
        seen_plain |= match[0] < 15
    assert seen_flip and seen_plain


def test_too_small_image_error_names_the_fix():
    dataset = train_imagenet.PreprocessedDataset(
        [(np.zeros((3, 20, 40), np.float32), np.int32(0))], (0., 0., 0.), 32)
    with pytest.raises(ValueError, match='Resize the images'):
        dataset[0]


def test_mean_of_another_size_is_rejected():
    dataset = train_imagenet.PreprocessedDataset(
        [(np.zeros((3, 40, 40), np.float32), np.int32(0))],
        np.zeros((3, 36, 36), np.float32), 32, random=False)
    with pytest.raises(ValueError, match='mean image is 36x36'):
        dataset[0]


def test_load_mean(tmp_path):
    np.testing.assert_allclose(train_imagenet.load_mean(None),
                               train_imagenet.IMAGENET_MEAN_RGB)
    bad = str(tmp_path / 'bad.npy')
    np.save(bad, np.zeros((256, 256, 3)))     # HWC, a common mistake
    with pytest.raises(ValueError, match=r'expected \(3, H, W\)'):
        train_imagenet.load_mean(bad)


def test_summary_takes_the_slowest_rank_and_skips_warmup():
    times = [[9.0, 1.0, 2.0, 1.0], [8.0, 1.5, 1.0, 3.0]]
    s = train_imagenet.summarize_times(times, images_per_iteration=8,
                                       warmup=1)
    assert s['times'] == [9.0, 1.5, 2.0, 3.0]
    assert s['measured'] == 3
    assert s['median_time'] == 2.0
    assert s['throughput'] == 4.0
    # A run no longer than its warm-up still reports its last iteration.
    s = train_imagenet.summarize_times([[5.0, 4.0]], 1, warmup=2)
    assert s['measured'] == 1 and s['median_time'] == 4.0


@pytest.mark.parametrize('arch,insize', [('resnet_small', 32),
                                         ('resnet_small', 64),
                                         ('resnet50', 32)])
def test_models_give_1000_logits(arch, insize):
    model = ARCHS[arch](n_classes=1000)
    x = np.zeros((2, 3, insize, insize), np.float32)
    assert model(x).shape == (2, 1000)


@pytest.mark.parametrize('argv,message', [
    (['--batchsize', '0'], '--batchsize must be at least 1'),
    (['--insize', '16'], '--insize must be at least 32'),
    (['--val', 'v.txt'], '--val needs --train'),
    (['--iterations', '3', '--epochs', '1'], 'not allowed with'),
    (['--bucket-size', '0'], '--bucket-size must be positive'),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_imagenet.parse_args(argv)
    assert message in capsys.readouterr().err
