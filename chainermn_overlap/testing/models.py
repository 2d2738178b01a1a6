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

import chainer
import chainer.functions as F
import chainer.links as L

__all__ = ['MLP', 'Deep', 'InjectInBackward', 'sum_of_squares',
           'sum_of_tanh']

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
