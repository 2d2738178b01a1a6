"""A small ResNet for quick runs and smoke tests (CIFAR-style, ~0.1 M params).

Three stages of basic residual blocks (16, 32 and 64 channels) on a 3x3 stem:
it has the structure that matters to gradient reduction (many small
parameter arrays, batch normalization, a large final layer) at a cost of
milliseconds per iteration at ``--insize 32`` to ``64``.
"""
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers


class BasicBlock(chainer.Chain):
    """3x3 -> 3x3 residual block with batch normalization.

    Args:
        in_channels (int): Channels of the input.
        out_channels (int): Channels of the output.
        stride (int): Stride of the first convolution (2 to down-sample).
    """

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        w = initializers.HeNormal()
        with self.init_scope():
            self.conv1 = L.Convolution2D(in_channels, out_channels, 3,
                                         stride, 1, initialW=w, nobias=True)
            self.bn1 = L.BatchNormalization(out_channels)
            self.conv2 = L.Convolution2D(out_channels, out_channels, 3,
                                         1, 1, initialW=w, nobias=True)
            self.bn2 = L.BatchNormalization(out_channels)
            self.projection = stride != 1 or in_channels != out_channels
            if self.projection:
                self.conv_proj = L.Convolution2D(
                    in_channels, out_channels, 1, stride,
                    initialW=w, nobias=True)
                self.bn_proj = L.BatchNormalization(out_channels)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        shortcut = self.bn_proj(self.conv_proj(x)) if self.projection else x
        return F.relu(h + shortcut)


class ResNetSmall(chainer.Chain):
    """A ResNet with ``blocks`` basic blocks in each of three stages.

    Args:
        n_classes (int): Number of output classes.
        blocks (int): Basic blocks per stage (1 gives an 8-layer network).
    """

    def __init__(self, n_classes=1000, blocks=1):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 16, 3, 1, 1, nobias=True,
                                         initialW=initializers.HeNormal())
            self.bn1 = L.BatchNormalization(16)
            stages = []
            c_in = 16
            for c_out, stride in ((16, 1), (32, 2), (64, 2)):
                stages.append(BasicBlock(c_in, c_out, stride))
                stages += [BasicBlock(c_out, c_out) for _ in range(blocks - 1)]
                c_in = c_out
            self.stages = chainer.ChainList(*stages)
            self.fc = L.Linear(64, n_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        for block in self.stages:
            h = block(h)
        h = F.average(h, axis=(2, 3))
        return self.fc(h)
