"""The general region (halo) exchange and its adjoint, as FunctionNodes."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Tuple, Union

import chainer
from chainer import backend
from chainer import function_node
import chainer.functions
import numpy

from chainermn_overlap.distconv import _comm
from chainermn_overlap.distconv import _pack
from chainermn_overlap.distconv import geometry

if TYPE_CHECKING:
    from chainer.types import NdArray
    from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['RegionExchange', 'RegionExchangeAdjoint', 'region_exchange']


_sel = _pack._sel


def _origin(box):
    return tuple(iv[0] for iv in box)


def _post(grid, x, origin, send_boxes, recv_boxes, template=None):
    """Packs the send boxes of ``x`` (cell 0 at ``origin``) into one buffer
    and posts them with receives of the ``recv_boxes``.

    Args:
        send_boxes, recv_boxes (list): ``(peer, box)`` pairs.

    Returns:
        _comm.PendingExchange: The messages in flight.
    """
    xp = backend.get_array_module(x)
    buf, pieces = _pack.pack_regions(xp, x, [b for _, b in send_boxes],
                                     origin)
    lead = x.shape[:2]
    return _comm.post_exchange(
        grid.mpi_spatial,
        list(zip([p for p, _ in send_boxes], _pack.staged(buf, pieces))),
        [(peer, lead + geometry.box_shape(box)) for peer, box in recv_boxes],
        x if template is None else template)


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

    def __init__(self, grid: SpatialGrid, plan: geometry.ExchangePlan,
                 fill: float = 0) -> None:
        self.grid = grid
        self.plan = plan
        self.fill = fill

    def forward(self, inputs):
        x, = inputs
        self._x_shape = x.shape
        plan = self.plan
        xp = backend.get_array_module(x)
        own0, ext0 = _origin(plan.own), _origin(plan.ext)
        t0 = time.perf_counter()
        pending = _post(self.grid, x, own0, plan.sends, plan.recvs)
        posting = time.perf_counter() - t0
        # The local part is copied while the messages travel.
        y = xp.full(x.shape[:2] + geometry.box_shape(plan.ext), self.fill,
                    dtype=x.dtype)
        if plan.local is not None:
            _pack.copy_box(y, ext0, x, own0, plan.local)
        t0 = time.perf_counter()
        got = pending.wait_flat()
        # Blocking: posting and waiting are exposed (compare with the waits
        # of the overlapped path, HaloFinish/HaloStart).
        self.grid.stats['forward_wait_s'] += posting + time.perf_counter() - t0
        _pack.unpack_regions(xp, got, y, [b for _, b in plan.recvs], ext0)
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

    def __init__(self, grid: SpatialGrid, plan: geometry.ExchangePlan,
                 x_shape: Tuple[int, ...]) -> None:
        self.grid = grid
        self.plan = plan
        self.x_shape = x_shape

    def forward(self, inputs):
        g, = inputs
        plan = self.plan
        xp = backend.get_array_module(g)
        own0, ext0 = _origin(plan.own), _origin(plan.ext)
        # The roles are mirrored: what was received is sent back.
        t0 = time.perf_counter()
        pending = _post(self.grid, g, ext0, plan.recvs, plan.sends)
        posting = time.perf_counter() - t0
        gx = xp.zeros(self.x_shape, dtype=g.dtype)
        if plan.local is not None:
            _pack.copy_box(gx, own0, g, ext0, plan.local, accumulate=True)
        t0 = time.perf_counter()
        got = pending.wait_flat()
        self.grid.stats['backward_wait_s'] += (posting + time.perf_counter()
                                               - t0)
        _pack.unpack_regions(xp, got, gx, [b for _, b in plan.sends], own0,
                             accumulate=True)
        return gx,

    def backward(self, indexes, grad_outputs):
        gg, = grad_outputs
        return RegionExchange(self.grid, self.plan, 0).apply((gg,))


def region_exchange(grid: SpatialGrid, x: Union[chainer.Variable, NdArray],
                    plan: geometry.ExchangePlan,
                    fill: float = 0) -> chainer.Variable:
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


def _check_no_double_backprop():
    if chainer.config.enable_backprop:
        raise NotImplementedError(
            'distconv: double backpropagation through an overlapped halo '
            'exchange is not supported. Set grid.overlap = False for that '
            'computation (the blocking exchange supports it).')


class HaloState(object):
    """What the parts of an overlapped exchange share.

    :class:`HaloStart` posts the messages, :class:`HaloProgress` nodes
    between pieces of the interior computation let MPI move them, and
    :class:`HaloFinish` waits for them. In backward :class:`HaloFinish`
    posts the adjoint messages, the same :class:`HaloProgress` nodes drive
    them between the pieces' gradients, and :class:`HaloStart` waits for
    them, so the computation scheduled in between (the interior of the
    output) hides them.

    Args:
        grid (SpatialGrid): The grid.
        plan (geometry.ExchangePlan): This process's plan.
    """

    def __init__(self, grid, plan):
        self.grid = grid
        self.plan = plan
        self.pending = None
        self.adjoint_pending = None
        self.x_shape = None
        self.dtype = None
        # Gradients of the boundary slabs' locally owned input cells, left
        # by HaloFinish.backward for HaloStart.backward, which adds them to
        # the one gradient array of the block (no second full-size buffer).
        self.local_grads = []

    def progress(self, direction):
        """Drives MPI progress of the messages in flight, if any.

        Args:
            direction (str): ``'forward'`` (halo) or ``'backward'``
                (adjoint messages).
        """
        pending = (self.pending if direction == 'forward'
                   else self.adjoint_pending)
        if pending is None or not pending.has_messages:
            return
        self.grid.stats['progress_calls'] += 1
        pending.test()

    def wait(self, direction):
        """Completes the messages of one direction and records the wait.

        Counts ``<direction>_halos`` (exchanges with messages) and
        ``<direction>_halos_ready`` (those whose messages had all completed
        in a progress call before this wait, i.e. fully hidden), and adds
        the seconds blocked to ``<direction>_wait_s``.

        Returns:
            The flat buffer of the received messages (their packed
            layout), on the device.
        """
        if direction == 'forward':
            pending, self.pending = self.pending, None
        else:
            pending, self.adjoint_pending = self.adjoint_pending, None
        stats = self.grid.stats
        if pending.has_messages:
            stats[direction + '_halos'] += 1
            if pending.completed:
                stats[direction + '_halos_ready'] += 1
        t0 = time.perf_counter()
        got = pending.wait_flat()
        stats[direction + '_wait_s'] += time.perf_counter() - t0
        return got


def _views(x, boxes, origin):
    """Views of ``x`` (cell 0 at ``origin``) selecting each box."""
    outs = []
    for box in boxes:
        if geometry.box_is_empty(box):
            # An empty box may lie outside the array; any empty view does.
            outs.append(x[(Ellipsis,) + tuple(slice(0, 0) for _ in box)])
        else:
            outs.append(x[_sel(box, origin)])
    return outs


class HaloStart(function_node.FunctionNode):
    """First part of an overlapped exchange: posts the halo messages.

    Outputs an empty token, which only orders the graph (the second half
    takes it as input, so in backward this node runs after it and after
    everything scheduled in between), followed by one view of the block per
    box of ``in_boxes`` (the input boxes of the interior pieces). Taking
    the views here rather than with ``F.get_item`` lets backward build the
    block's gradient in one array: the pieces' gradients, the boundary
    slabs' local parts and the adjoint messages are all added to it.

    Args:
        state (HaloState): Shared with the matching :class:`HaloFinish`.
        in_boxes (list of tuple): Global boxes inside the owned block.
    """

    def __init__(self, state, in_boxes=()):
        self.state = state
        self.in_boxes = list(in_boxes)

    def forward(self, inputs):
        x, = inputs
        st = self.state
        plan = st.plan
        xp = backend.get_array_module(x)
        own0 = _origin(plan.own)
        st.x_shape, st.dtype = x.shape, x.dtype
        st.pending = _post(st.grid, x, own0, plan.sends, plan.recvs)
        return (xp.zeros((0,), dtype=x.dtype),) + tuple(
            _views(x, self.in_boxes, own0))

    def backward(self, indexes, grad_outputs):
        _check_no_double_backprop()
        st = self.state
        plan = st.plan
        arrays = [g.array for g in grad_outputs if g is not None]
        xp = backend.get_array_module(*arrays) if arrays else numpy
        own0 = _origin(plan.own)
        gx = xp.zeros(st.x_shape, dtype=st.dtype)
        # Local work first: it hides the rest of the adjoint messages.
        for box, g in zip(self.in_boxes, grad_outputs[1:]):
            if g is not None and not geometry.box_is_empty(box):
                gx[_sel(box, own0)] += g.array
        for part, g, o0 in st.local_grads:
            _pack.copy_box(gx, own0, g, o0, part, accumulate=True)
        st.local_grads = []
        if st.adjoint_pending is not None:
            _pack.unpack_regions(xp, st.wait('backward'), gx,
                                 [b for _, b in plan.sends], own0,
                                 accumulate=True)
        return chainer.Variable(gx),


class HaloProgress(function_node.FunctionNode):
    """Identity on a piece of the block that drives MPI progress.

    Inputs are ``(x_piece, after)``: ``after`` (the previous piece's output)
    only orders the graph, so that in forward this node runs between two
    interior pieces and in backward between their gradients. Each time it
    lets MPI move the messages in flight (:meth:`HaloState.progress`).

    Args:
        state (HaloState): The exchange whose messages to progress.
    """

    def __init__(self, state):
        self.state = state

    def forward(self, inputs):
        self.state.progress('forward')
        return inputs[0],

    def backward(self, indexes, grad_outputs):
        self.state.progress('backward')
        return tuple(grad_outputs[0] if i == 0 else None for i in indexes)


class HaloFinish(function_node.FunctionNode):
    """Second half of an overlapped exchange: waits, builds input boxes.

    Inputs are ``(x, token, after)``: this process's block, the token of
    :class:`HaloStart`, and any variable computed in between (the interior
    output), which only places this node after it in the graph. Outputs
    are the requested global boxes, each filled from the local block, the
    received halos and ``fill`` for padding. In backward, the gradients of
    those boxes are split into the local part (left for
    :class:`HaloStart`) and the parts of other processes, which are posted
    back to their owners at once.

    Args:
        state (HaloState): Shared with the matching :class:`HaloStart`.
        boxes (list of tuple): Global boxes to build.
        fill (float): Value of cells outside the global extent.
    """

    def __init__(self, state, boxes, fill):
        self.state = state
        self.boxes = boxes
        self.fill = fill

    def forward(self, inputs):
        x, _, _ = inputs
        st = self.state
        plan = st.plan
        xp = backend.get_array_module(x)
        own0 = _origin(plan.own)
        lead = x.shape[:2]
        got = _pack.pieces(st.wait('forward'),
                           [lead + geometry.box_shape(rbox)
                            for _, rbox in plan.recvs])
        outs = []
        for box in self.boxes:
            out = xp.full(lead + geometry.box_shape(box), self.fill,
                          dtype=x.dtype)
            if not geometry.box_is_empty(box):
                o0 = _origin(box)
                if plan.local is not None:
                    _pack.copy_box(out, o0, x, own0,
                                   geometry.intersect(plan.local, box))
                for (_, rbox), buf in zip(plan.recvs, got):
                    _pack.copy_box(out, o0, buf, _origin(rbox),
                                   geometry.intersect(rbox, box))
            outs.append(out)
        return tuple(outs)

    def backward(self, indexes, grad_outputs):
        _check_no_double_backprop()
        st = self.state
        if 0 not in indexes:
            # The block needs no gradient (e.g. the network input): the
            # same on every process, so no adjoint messages on any.
            return (None,) * len(indexes)
        plan = st.plan
        grads = [None if g is None else g.array for g in grad_outputs]
        arrays = [g for g in grads if g is not None]
        xp = backend.get_array_module(*arrays) if arrays else numpy
        lead = st.x_shape[:2]
        # The messages back are built in one packed buffer (zeros plus the
        # boxes' gradients), so they leave in one transfer.
        flat, back = _pack.alloc(xp, [lead + geometry.box_shape(rbox)
                                      for _, rbox in plan.recvs],
                                 st.dtype, zero=True)
        local = []
        for box, g in zip(self.boxes, grads):
            if g is None or geometry.box_is_empty(box):
                continue
            o0 = _origin(box)
            if plan.local is not None:
                part = geometry.intersect(plan.local, box)
                if not geometry.box_is_empty(part):
                    local.append((part, g, o0))
            for (_, rbox), buf in zip(plan.recvs, back):
                _pack.copy_box(buf, _origin(rbox), g, o0,
                               geometry.intersect(rbox, box),
                               accumulate=True)
        st.local_grads = local
        # The roles are mirrored: what was received goes back to its owner;
        # the owner waits for it in HaloStart.backward.
        st.adjoint_pending = _comm.post_exchange(
            st.grid.mpi_spatial,
            list(zip([p for p, _ in plan.recvs], _pack.staged(flat, back))),
            [(peer, lead + geometry.box_shape(box))
             for peer, box in plan.sends], xp.empty((0,), dtype=st.dtype))
        out = []
        for i in indexes:
            if i == 1:
                # Non-None, so that Chainer goes on to HaloStart.backward,
                # which adds the local parts and the adjoint messages.
                out.append(chainer.Variable(xp.zeros((0,), dtype=st.dtype)))
            else:
                out.append(None)
        return tuple(out)


class Crop(function_node.FunctionNode):
    """``x[slices]`` for basic slices, with a fast backward.

    Chainer's ``get_item`` accumulates its gradient with ``numpy.add.at``
    (element by element); a crop's gradient is the gradient placed in
    zeros of the input's shape (:class:`Uncrop`), one slice assignment.
    The two are each other's adjoints, so double backpropagation works.

    Args:
        slices (tuple): Basic slices (and ``Ellipsis``) of the input.
    """

    def __init__(self, slices):
        self.slices = slices

    def forward(self, inputs):
        x, = inputs
        self._meta = (x.shape, x.dtype)
        return x[self.slices],

    def backward(self, indexes, grad_outputs):
        shape, dtype = self._meta
        return Uncrop(self.slices, shape, dtype).apply(grad_outputs)


class Uncrop(function_node.FunctionNode):
    """``y`` placed at ``slices`` in zeros of ``shape``; see :class:`Crop`.
    """

    def __init__(self, slices, shape, dtype):
        self.slices = slices
        self.shape = shape
        self.dtype = dtype

    def forward(self, inputs):
        y, = inputs
        xp = backend.get_array_module(y)
        out = xp.zeros(self.shape, dtype=self.dtype)
        out[self.slices] = y
        return out,

    def backward(self, indexes, grad_outputs):
        return Crop(self.slices).apply(grad_outputs)


def crop(x, slices):
    """``x[slices]`` (basic slices) as a :class:`Crop` node."""
    return Crop(tuple(slices)).apply((x,))[0]


class Assemble(function_node.FunctionNode):
    """Places pieces that tile a box into one array (and back in backward).

    Args:
        box (tuple): The global box of the output.
        piece_boxes (list of tuple): The global box of each input piece;
            together they tile ``box``.
    """

    def __init__(self, box, piece_boxes):
        self.box = box
        self.piece_boxes = piece_boxes

    def forward(self, inputs):
        xp = backend.get_array_module(*inputs)
        lead = inputs[0].shape[:2]
        o0 = _origin(self.box)
        y = xp.empty(lead + geometry.box_shape(self.box),
                     dtype=inputs[0].dtype)
        for piece, pbox in zip(inputs, self.piece_boxes):
            if piece.size:
                y[_sel(pbox, o0)] = piece
        return y,

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        if gy is None:
            return (None,) * len(indexes)
        o0 = _origin(self.box)
        return tuple(crop(gy, _sel(self.piece_boxes[i], o0))
                     for i in indexes)
