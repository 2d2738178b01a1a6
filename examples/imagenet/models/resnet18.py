"""ResNet-18 (He et al., 2016): basic blocks, 11.7 M parameters.

It has less computation per parameter than ResNet-50 (1.8 GFLOP at 224
pixels against 4.1, for 11.7 M parameters against 25.6 M), and less still at
a lower resolution: the workload where gradient reduction is hardest to
hide, used beside ResNet-50 by the compression benchmark.
"""
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers

from .resnet_small import BasicBlock


class ResNet18(chainer.Chain):
    """ResNet-18: two basic blocks in each of four stages (64 to 512
    channels), a 7x7 stem and global average pooling (any input of at
    least 32 pixels).

    Args:
        n_classes (int): Number of output classes.
    """

    def __init__(self, n_classes=1000):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 64, 7, 2, 3, nobias=True,
                                         initialW=initializers.HeNormal())
            self.bn1 = L.BatchNormalization(64)
            self.stages = chainer.ChainList(*[
                chainer.ChainList(BasicBlock(cin, cout, stride),
                                  BasicBlock(cout, cout))
                for cin, cout, stride in ((64, 64, 1), (64, 128, 2),
                                          (128, 256, 2), (256, 512, 2))])
            self.fc = L.Linear(512, n_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.max_pooling_2d(h, 3, 2, 1, cover_all=False)
        for stage in self.stages:
            for block in stage:
                h = block(h)
        h = F.average(h, axis=(2, 3))
        return self.fc(h)
