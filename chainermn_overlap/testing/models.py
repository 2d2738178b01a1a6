"""Small models shared by the test suites.

One definition per shape of model, so that a change of initialisation or
naming reaches every test that uses it.  The models are tiny on purpose:
the tests compare whole training runs at several process counts on two
cores.  Link names (``l1``, ``l2``, ...) and the order in which links are
created are part of the contract: parameter names decide bucket layouts,
and creation order decides which values numpy's global random state gives
each link.

Models that a test builds for one purpose (a parameter used outside its
link, a branch that depends on the rank, ...) stay in that test.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

__all__ = ['MLP', 'Deep', 'GradientScaling', 'InjectInBackward', 'SSDLike',
           'add_ssd_hooks', 'sum_of_squares', 'sum_of_tanh']

Activation = Callable[[chainer.Variable], chainer.Variable]


def sum_of_squares(y: chainer.Variable) -> chainer.Variable:
    """``sum(y * y)``: a scalar loss with a gradient in every element."""
    return F.sum(y * y)


def sum_of_tanh(y: chainer.Variable) -> chainer.Variable:
    """``sum(tanh(y))``: a bounded scalar loss."""
    return F.sum(F.tanh(y))


class MLP(chainer.Chain):
    """Fully connected links ``l1`` ... ``l<n_layers>``.

    ``l1`` maps ``n_in`` to ``n_hidden``, the middle links ``n_hidden`` to
    ``n_hidden`` and the last one ``n_hidden`` to ``n_out`` (a single link
    maps ``n_in`` to ``n_out``); ``activation`` follows every link but the
    last.  The defaults are the 5-8-8-3 ReLU network of the equivalence
    tests.

    Args:
        n_in: input width.
        n_hidden: width of the hidden layers.
        n_out: output width.
        n_layers: number of links (at least 1).
        activation: applied after every link but the last.
        loss: ``None``: ``forward`` returns the output (wrap the model in
            ``L.Classifier``).  A function: ``forward`` returns
            ``loss(output)``, so that ``optimizer.update(model, x)`` works
            without targets.  Use a module-level function (such as
            :func:`sum_of_squares`) if the model is pickled.
    """

    def __init__(self, n_in: int = 5, n_hidden: int = 8, n_out: int = 3,
                 n_layers: int = 3, activation: Activation = F.relu,
                 loss: Optional[Activation] = None) -> None:
        if n_layers < 1:
            raise ValueError('n_layers must be at least 1, got {}'
                             .format(n_layers))
        super().__init__()
        self.n_layers = n_layers
        self.activation = activation
        self.loss = loss
        sizes = [n_in] + [n_hidden] * (n_layers - 1) + [n_out]
        with self.init_scope():
            for i in range(n_layers):
                setattr(self, 'l{}'.format(i + 1),
                        L.Linear(sizes[i], sizes[i + 1]))

    def forward(self, x):
        h = x
        for i in range(1, self.n_layers + 1):
            h = getattr(self, 'l{}'.format(i))(h)
            if i < self.n_layers:
                h = self.activation(h)
        return h if self.loss is None else self.loss(h)


class Deep(chainer.ChainList):
    """``n_layers`` square ``Linear(width, width)`` links, each followed by
    ReLU, then ``loss`` of the result (a scalar).

    Many equal layers give many buckets of a known size, which is what the
    timeline and overlap tests need.

    Args:
        n_layers: number of links.
        width: input and output width of every link.
        loss: reduces the last activation to a scalar.
    """

    def __init__(self, n_layers: int = 4, width: int = 64,
                 loss: Activation = F.sum) -> None:
        super().__init__(*[L.Linear(width, width) for _ in range(n_layers)])
        self.loss = loss

    def forward(self, x):
        for link in self:
            x = F.relu(link(x))
        return self.loss(x)


class InjectInBackward(chainer.FunctionNode):
    """Identity whose backward calls ``action()`` (a fault mid-backward).

    For fault tests: ``h = InjectInBackward(action).apply((h,))[0]``.
    """

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action

    def forward(self, inputs):
        return inputs

    def backward(self, indexes, grad_outputs):
        self.action()
        return grad_outputs


class GradientScaling(object):
    """ChainerCV's update-rule hook of that name (``chainercv.links.model.
    ssd.GradientScaling``): multiplies the gradient by ``rate``.

    Element-wise in fact, but not known to be: what a user's own hook is.
    """

    name = 'GradientScaling'
    call_for_each_param = True

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def __call__(self, rule, param):
        if param.grad is not None:
            param.grad *= self.rate


class _Normalize(chainer.Link):
    """SSD's L2 normalisation over channels with a learned scale."""

    def __init__(self, n_channel: int, initial: float = 20) -> None:
        super().__init__()
        with self.init_scope():
            self.scale = chainer.Parameter(
                chainer.initializers.Constant(initial), (n_channel,))

    def forward(self, x):
        x = F.normalize(x, eps=1e-5, axis=1)
        scale = self.scale[:, numpy.newaxis, numpy.newaxis]
        return x * F.broadcast_to(scale, x.shape)


class SSDLike(chainer.Chain):
    """What SSD300 has that a chain of layers lacks, in miniature.

    Feature maps of four scales, each read by a location head, a class
    head and (but the last) the next layer: a variable with three consumers,
    whose gradient Chainer sums in the order it runs them.  The first map
    is L2-normalised with a learned scale.  ``forward(x, t_loc, t_conf)``
    returns SSD's loss: Huber on the boxes plus softmax cross entropy on
    the classes (``t_conf`` holds labels per anchor, 0 the background),
    normalised by the number of positives.  Inputs are ``(n, 3, 8, 8)``;
    :attr:`n_anchors` anchors per sample.

    Args:
        c: channels of every feature map.
        n_class: classes including the background.
    """

    n_anchors = 2 * (64 + 16 + 4 + 1)

    def __init__(self, c: int = 8, n_class: int = 4) -> None:
        super().__init__()
        self.n_class = n_class
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, c, 3, pad=1)
            self.norm = _Normalize(c)
            self.conv2 = L.Convolution2D(c, c, 3, stride=2, pad=1)
            self.extra1 = L.Convolution2D(c, c, 3, stride=2, pad=1)
            self.extra2 = L.Convolution2D(c, c, 3, stride=2, pad=1)
            self.loc = chainer.ChainList(
                *[L.Convolution2D(c, 2 * 4, 3, pad=1) for _ in range(4)])
            self.conf = chainer.ChainList(
                *[L.Convolution2D(c, 2 * n_class, 3, pad=1)
                  for _ in range(4)])

    def _heads(self, ys):
        locs, confs = [], []
        for i, y in enumerate(ys):
            loc = F.transpose(self.loc[i](y), (0, 2, 3, 1))
            locs.append(F.reshape(loc, (loc.shape[0], -1, 4)))
            conf = F.transpose(self.conf[i](y), (0, 2, 3, 1))
            confs.append(F.reshape(conf, (conf.shape[0], -1, self.n_class)))
        return F.concat(locs, axis=1), F.concat(confs, axis=1)

    def forward(self, x, t_loc, t_conf):
        h = F.relu(self.conv1(x))
        ys = [self.norm(h)]
        for link in (self.conv2, self.extra1, self.extra2):
            h = F.relu(link(h))
            ys.append(h)
        locs, confs = self._heads(ys)
        positive = t_conf > 0
        n_positive = max(int(positive.sum()), 1)
        loc_loss = F.sum(F.huber_loss(locs, t_loc, 1, reduce='no'), axis=-1)
        loc_loss = F.sum(loc_loss * positive.astype(numpy.float32))
        conf_loss = F.softmax_cross_entropy(
            F.reshape(confs, (-1, self.n_class)), t_conf.reshape(-1))
        return (loc_loss + conf_loss * t_conf.size) / n_positive


def add_ssd_hooks(model: chainer.Link, scale: float = 2,
                  decay: float = 5e-4) -> None:
    """SSD's training recipe: :class:`GradientScaling` on every bias,
    ``WeightDecay`` on the other parameters (after ``setup``)."""
    for param in model.params():
        if param.name == 'b':
            param.update_rule.add_hook(GradientScaling(scale))
        else:
            param.update_rule.add_hook(
                chainer.optimizer_hooks.WeightDecay(decay))
