"""ResNet-18 and ResNet-50 in PyTorch, the twins of the Chainer models.

The peer benchmark (:mod:`benchmarks.harness.peers_torch`) trains these with
PyTorch DDP beside our optimizer training
``examples/imagenet/models/resnet50.py`` and ``resnet18.py``; a fair
comparison needs the same network on both sides, so these mirror them
layer for layer: the same layers in the same order, the same parameter
arrays (ResNet-18: 62 arrays, 11,689,512 parameters; ResNet-50: 161 arrays,
25,557,032 parameters), the same initialisation (He-normal convolutions,
LeCun-normal linear layer with a zero bias, batch normalization with
gamma 1, beta 0 and Chainer's epsilon 2e-5).

Plain ``torch.nn`` (torchvision does not import beside the CPU torch wheel
the peer venv uses).  Standing alone, it prints both models' sizes::

    PYTHONPATH=. .venv-peers/bin/python -m benchmarks.harness.torch_models
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

# Chainer's BatchNormalization default (torch's is 1e-5).
BN_EPS = 2e-5


def _conv(in_channels, out_channels, ksize, stride=1, pad=0):
    """A convolution without bias, He-normal as Chainer's ``HeNormal``."""
    conv = nn.Conv2d(in_channels, out_channels, ksize, stride, pad,
                     bias=False)
    nn.init.kaiming_normal_(conv.weight, mode='fan_in',
                            nonlinearity='relu')
    return conv


def _bn(channels):
    return nn.BatchNorm2d(channels, eps=BN_EPS)


def _linear(in_size, out_size):
    """A linear layer initialised as Chainer's ``L.Linear`` (LeCun normal
    weight, zero bias)."""
    fc = nn.Linear(in_size, out_size)
    nn.init.normal_(fc.weight, 0.0, 1.0 / math.sqrt(in_size))
    nn.init.zeros_(fc.bias)
    return fc


class BasicBlock(nn.Module):
    """3x3 -> 3x3 residual block with batch normalization.

    Args:
        in_channels (int): Channels of the input.
        out_channels (int): Channels of the output.
        stride (int): Stride of the first convolution (2 to down-sample).
    """

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = _conv(in_channels, out_channels, 3, stride, 1)
        self.bn1 = _bn(out_channels)
        self.conv2 = _conv(out_channels, out_channels, 3, 1, 1)
        self.bn2 = _bn(out_channels)
        self.projection = stride != 1 or in_channels != out_channels
        if self.projection:
            self.conv_proj = _conv(in_channels, out_channels, 1, stride)
            self.bn_proj = _bn(out_channels)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        shortcut = self.bn_proj(self.conv_proj(x)) if self.projection else x
        return F.relu(h + shortcut)


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 -> 1x1 residual block with batch normalization; the
    stride sits on the 3x3 convolution ("v1.5").

    Args:
        in_channels (int): Channels of the input.
        mid_channels (int): Channels of the 3x3 convolution.
        out_channels (int): Channels of the output.
        stride (int): Stride of the 3x3 convolution (2 to down-sample).
    """

    def __init__(self, in_channels, mid_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = _conv(in_channels, mid_channels, 1)
        self.bn1 = _bn(mid_channels)
        self.conv2 = _conv(mid_channels, mid_channels, 3, stride, 1)
        self.bn2 = _bn(mid_channels)
        self.conv3 = _conv(mid_channels, out_channels, 1)
        self.bn3 = _bn(out_channels)
        # The shortcut needs a projection only where the shape changes.
        self.projection = stride != 1 or in_channels != out_channels
        if self.projection:
            self.conv_proj = _conv(in_channels, out_channels, 1, stride)
            self.bn_proj = _bn(out_channels)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        shortcut = self.bn_proj(self.conv_proj(x)) if self.projection else x
        return F.relu(h + shortcut)


class _ResNet(nn.Module):
    """The 7x7/2 stem, max pooling, the stages, global average pooling and
    the classifier shared by both depths."""

    def __init__(self, stages, features, n_classes):
        super().__init__()
        self.conv1 = _conv(3, 64, 7, 2, 3)
        self.bn1 = _bn(64)
        self.stages = nn.Sequential(*stages)
        self.fc = _linear(features, n_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        # Chainer's max_pooling_2d(h, 3, 2, 1, cover_all=False).
        h = F.max_pool2d(h, 3, 2, 1)
        h = self.stages(h)
        # Global average pooling: any input of at least 32 pixels.
        h = h.mean(dim=(2, 3))
        return self.fc(h)


class ResNet18(_ResNet):
    """ResNet-18: two basic blocks in each of four stages (64 to 512
    channels); 11.7 M parameters.

    Args:
        n_classes (int): Number of output classes.
    """

    def __init__(self, n_classes=1000):
        stages = [nn.Sequential(BasicBlock(cin, cout, stride),
                                BasicBlock(cout, cout))
                  for cin, cout, stride in ((64, 64, 1), (64, 128, 2),
                                            (128, 256, 2), (256, 512, 2))]
        super().__init__(stages, 512, n_classes)


class ResNet50(_ResNet):
    """ResNet-50: 3, 4, 6 and 3 bottleneck blocks; 25.6 M parameters.

    Args:
        n_classes (int): Number of output classes.
    """

    def __init__(self, n_classes=1000):
        stages = []
        for n_blocks, cin, cmid, cout, stride in (
                (3, 64, 64, 256, 1), (4, 256, 128, 512, 2),
                (6, 512, 256, 1024, 2), (3, 1024, 512, 2048, 2)):
            blocks = [BottleneckBlock(cin, cmid, cout, stride)]
            blocks += [BottleneckBlock(cout, cmid, cout)
                       for _ in range(n_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
        super().__init__(stages, 2048, n_classes)


MODELS = {'resnet18': ResNet18, 'resnet50': ResNet50}


def build_model(name, seed=0):
    """A fresh model ``'resnet18'`` or ``'resnet50'``, initialised from
    ``seed`` (the same on every rank)."""
    if name not in MODELS:
        raise ValueError('unknown model {!r}: the PyTorch side has {}'
                         .format(name, ', '.join(sorted(MODELS))))
    torch.manual_seed(seed)
    return MODELS[name]()


def size(model):
    """(number of parameter arrays, number of parameters) of ``model``."""
    params = list(model.parameters())
    return len(params), sum(p.numel() for p in params)


def main():
    for name in sorted(MODELS):
        arrays, count = size(build_model(name))
        print('{}: {} arrays, {} parameters'.format(name, arrays, count))


if __name__ == '__main__':
    main()
