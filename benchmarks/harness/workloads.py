"""What the optimizer benchmarks train: the ImageNet example's networks.

Models are built from a fixed seed, so that every variant and every rank
starts from the same weights; batches are synthetic, ImageNet-shaped.
"""
import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L

from examples.imagenet.models import resnet18, resnet50, resnet_small


class MLP(chainer.ChainList):
    """A model dominated by its parameters: ImageNet-shaped images in
    (``insize`` 32: 3072 values), ``depth`` hidden layers of ``width``, 1000
    classes; 37.7 M parameters as built by :func:`build_model`."""

    def __init__(self, insize=32, width=2048, depth=8):
        layers = [L.Linear(3 * insize * insize, width)]
        layers += [L.Linear(width, width) for _ in range(depth - 1)]
        layers.append(L.Linear(width, 1000))
        super().__init__(*layers)

    def forward(self, x):
        h = x.reshape(x.shape[0], -1)
        for layer in self[:-1]:
            h = F.relu(layer(h))
        return self[-1](h)


def build_model(name, seed=0):
    """A fresh ``'resnet50'``, ``'resnet18'``, ``'mlp'`` (:class:`MLP`) or,
    for any other name, the small ResNet."""
    np.random.seed(seed)
    if name == 'resnet50':
        return resnet50.ResNet50()
    if name == 'resnet18':
        return resnet18.ResNet18()
    if name == 'mlp':
        return MLP()
    return resnet_small.ResNetSmall()


def synthetic_batch(rng, batch, insize):
    """Uniform images and labels of 1000 classes drawn from ``rng``."""
    x = rng.rand(batch, 3, insize, insize).astype(np.float32)
    t = rng.randint(0, 1000, batch).astype(np.int32)
    return x, t
