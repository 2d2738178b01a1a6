"""What the optimizer benchmarks train: the ImageNet example's networks.

Models are built from a fixed seed, so that every variant and every rank
starts from the same weights; batches are synthetic, ImageNet-shaped.
"""
import numpy as np

from examples.imagenet.models import resnet50, resnet_small


def build_model(name, seed=0):
    """A fresh ``'resnet50'`` (any other name: the small ResNet)."""
    np.random.seed(seed)
    if name == 'resnet50':
        return resnet50.ResNet50()
    return resnet_small.ResNetSmall()


def synthetic_batch(rng, batch, insize):
    """Uniform images and labels of 1000 classes drawn from ``rng``."""
    x = rng.rand(batch, 3, insize, insize).astype(np.float32)
    t = rng.randint(0, 1000, batch).astype(np.int32)
    return x, t
