"""ResNet-50 (He et al., 2016) for ImageNet classification.

The layout is the common "v1.5" variant (torchvision, NVIDIA, MLPerf): the
stride of a down-sampling bottleneck sits on its 3x3 convolution, not on the
first 1x1 one as in the original paper and Chainer's ImageNet example.  It
needs the same computation and generalises slightly better.
"""
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers


class BottleneckBlock(chainer.Chain):
    """1x1 -> 3x3 -> 1x1 residual block with batch normalization.

    Args:
        in_channels (int): Channels of the input.
        mid_channels (int): Channels of the 3x3 convolution.
        out_channels (int): Channels of the output.
        stride (int): Stride of the 3x3 convolution (2 to down-sample).
    """

    def __init__(self, in_channels, mid_channels, out_channels, stride=1):
        super().__init__()
        w = initializers.HeNormal()
        with self.init_scope():
            self.conv1 = L.Convolution2D(in_channels, mid_channels, 1,
                                         initialW=w, nobias=True)
            self.bn1 = L.BatchNormalization(mid_channels)
            self.conv2 = L.Convolution2D(mid_channels, mid_channels, 3,
                                         stride, 1, initialW=w, nobias=True)
            self.bn2 = L.BatchNormalization(mid_channels)
            self.conv3 = L.Convolution2D(mid_channels, out_channels, 1,
                                         initialW=w, nobias=True)
            self.bn3 = L.BatchNormalization(out_channels)
            # The shortcut needs a projection only where the shape changes.
            self.projection = stride != 1 or in_channels != out_channels
            if self.projection:
                self.conv_proj = L.Convolution2D(
                    in_channels, out_channels, 1, stride,
                    initialW=w, nobias=True)
                self.bn_proj = L.BatchNormalization(out_channels)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        shortcut = self.bn_proj(self.conv_proj(x)) if self.projection else x
        return F.relu(h + shortcut)


class Stage(chainer.ChainList):
    """A sequence of bottleneck blocks; the first one may down-sample."""

    def __init__(self, n_blocks, in_channels, mid_channels, out_channels,
                 stride):
        blocks = [BottleneckBlock(in_channels, mid_channels, out_channels,
                                  stride)]
        blocks += [BottleneckBlock(out_channels, mid_channels, out_channels)
                   for _ in range(n_blocks - 1)]
        super().__init__(*blocks)

    def forward(self, x):
        for block in self:
            x = block(x)
        return x


class ResNet50(chainer.Chain):
    """ResNet-50: 3, 4, 6 and 3 bottleneck blocks; 25.6 M parameters.

    Global average pooling makes it accept any input size of at least 32
    pixels, so quick runs can use a smaller ``--insize`` than 224.

    Args:
        n_classes (int): Number of output classes.
    """

    def __init__(self, n_classes=1000):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 64, 7, 2, 3, nobias=True,
                                         initialW=initializers.HeNormal())
            self.bn1 = L.BatchNormalization(64)
            self.res2 = Stage(3, 64, 64, 256, 1)
            self.res3 = Stage(4, 256, 128, 512, 2)
            self.res4 = Stage(6, 512, 256, 1024, 2)
            self.res5 = Stage(3, 1024, 512, 2048, 2)
            self.fc = L.Linear(2048, n_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        # cover_all=False gives the usual 112 -> 56 size, as other frameworks.
        h = F.max_pooling_2d(h, 3, 2, 1, cover_all=False)
        h = self.res5(self.res4(self.res3(self.res2(h))))
        h = F.average(h, axis=(2, 3))
        return self.fc(h)
