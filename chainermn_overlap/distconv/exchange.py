"""The general region (halo) exchange and its adjoint, as FunctionNodes."""
import chainer
from chainer import backend
from chainer import function_node

from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import geometry


def _sel(box, origin):
    return (Ellipsis,) + geometry.box_slices(box, origin)


def _origin(box):
    return tuple(iv[0] for iv in box)


class RegionExchange(function_node.FunctionNode):
    """Builds the needed box ``plan.ext`` from the blocks of all processes.

    The output has shape ``(N, C, *box_shape(plan.ext))``. Cells inside the
    global extent are copied from their owners (this process or any other);
    cells outside it (padding) hold ``fill``. Collective over the grid's
    spatial group.

    Args:
        grid (SpatialGrid): The grid.
        plan (geometry.ExchangePlan): This process's plan.
        fill (float): Value of padding cells (0 for convolution and average
            pooling, -inf for max pooling). Padding carries no gradient.
    """

    def __init__(self, grid, plan, fill=0):
        self.grid = grid
        self.plan = plan
        self.fill = fill

    def forward(self, inputs):
        x, = inputs
        self._x_shape = x.shape
        plan = self.plan
        xp = backend.get_array_module(x)
        own0, ext0 = _origin(plan.own), _origin(plan.ext)
        lead = x.shape[:2]
        y = xp.full(lead + geometry.box_shape(plan.ext), self.fill,
                    dtype=x.dtype)
        if plan.local is not None:
            y[_sel(plan.local, ext0)] = x[_sel(plan.local, own0)]
        sends = [(peer, xp.ascontiguousarray(x[_sel(box, own0)]))
                 for peer, box in plan.sends]
        recvs = [(peer, lead + geometry.box_shape(box))
                 for peer, box in plan.recvs]
        got = _comm.exchange(self.grid.mpi_spatial, sends, recvs, x)
        for (_, box), buf in zip(plan.recvs, got):
            y[_sel(box, ext0)] = buf
        return y,

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        return RegionExchangeAdjoint(
            self.grid, self.plan, self._x_shape).apply((gy,))


class RegionExchangeAdjoint(function_node.FunctionNode):
    """Adjoint of :class:`RegionExchange`: returns halo values to owners.

    Each process sends the values of the cells it received back to their
    owner, which adds them (a cell can be needed by several processes);
    padding cells are dropped.

    Args:
        grid (SpatialGrid): The grid.
        plan (geometry.ExchangePlan): The plan of the forward exchange.
        x_shape (tuple): Shape of the forward input (this process's block).
    """

    def __init__(self, grid, plan, x_shape):
        self.grid = grid
        self.plan = plan
        self.x_shape = x_shape

    def forward(self, inputs):
        g, = inputs
        plan = self.plan
        xp = backend.get_array_module(g)
        own0, ext0 = _origin(plan.own), _origin(plan.ext)
        lead = g.shape[:2]
        gx = xp.zeros(self.x_shape, dtype=g.dtype)
        if plan.local is not None:
            gx[_sel(plan.local, own0)] += g[_sel(plan.local, ext0)]
        # The roles are mirrored: what was received is sent back.
        sends = [(peer, xp.ascontiguousarray(g[_sel(box, ext0)]))
                 for peer, box in plan.recvs]
        recvs = [(peer, lead + geometry.box_shape(box))
                 for peer, box in plan.sends]
        got = _comm.exchange(self.grid.mpi_spatial, sends, recvs, g)
        for (_, box), buf in zip(plan.sends, got):
            gx[_sel(box, own0)] += buf
        return gx,

    def backward(self, indexes, grad_outputs):
        gg, = grad_outputs
        return RegionExchange(self.grid, self.plan, 0).apply((gg,))


def region_exchange(grid, x, plan, fill=0):
    """Differentiable region exchange (see :class:`RegionExchange`).

    Args:
        grid (SpatialGrid): The grid.
        x (chainer.Variable or array): This process's block.
        plan (geometry.ExchangePlan): This process's plan.
        fill (float): Value of cells outside the global extent.

    Returns:
        chainer.Variable: The needed box, padding included.
    """
    return RegionExchange(grid, plan, fill).apply((x,))[0]


class ZeroBlock(function_node.FunctionNode):
    """Produces a zero array of a given shape from some inputs.

    Used where a process's output block is empty (no samples, or no output
    cells in a dimension). Keeping the inputs connected makes the backward
    of the preceding exchange run on this process too, which the other
    processes of the group wait for, and gives parameters zero gradients.

    Args:
        shape (tuple): Shape of the (empty) output.
    """

    def __init__(self, shape):
        self.shape = shape

    def forward(self, inputs):
        self._in = [(x.shape, x.dtype) for x in inputs]
        xp = backend.get_array_module(*inputs)
        self._xp = xp
        return xp.zeros(self.shape, dtype=inputs[0].dtype),

    def backward(self, indexes, grad_outputs):
        return tuple(chainer.Variable(self._xp.zeros(*self._in[i]))
                     for i in indexes)
