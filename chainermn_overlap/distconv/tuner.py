"""Times candidate grids or strategies and picks the fastest.

The CPU analogue of cuDNN's algorithm search: for a given model and input
shape, each candidate (a grid shape, or a grid with a per-stage strategy)
is built and run for a few forward/backward steps; the fastest is chosen.

Usage::

    from chainermn_overlap.distconv import tuner

    def build(grid, candidate):
        return MyNet(grid)            # model(x) -> loss (or any Variable)

    result = tuner.tune(comm, build, (8, 3, 512, 512),
                        candidates=tuner.candidate_grids(comm.size, 2))
    result['best']                    # e.g. (2, 1), the same on every rank
    report = tuner.format_table(result)  # the timings of every candidate

Beyond grid shapes, candidates can carry a channel axis (``'channels'``:
filter/channel parallelism, :func:`grids_with_channels`), a per-stage
strategy (:func:`strategy_candidates`: spatial for the first stages,
filter/channel or sample parallel for the rest, the cut searched) and a
tiling depth for :class:`~chainermn_overlap.distconv.Tiled` stacks
(:func:`depth_candidates`); ``build_model`` reads them from the candidate.
On a link with latency the fastest depth is the one whose saved exchange
rounds outweigh the redundant computation it adds.

Every rank takes the same decision: each rank's step times are gathered
(JSON through byte buffers, nothing is unpickled), the time of a step is
the slowest rank's (the step is synchronous), a candidate's time is the
median over its timed steps, and the minimum is taken over the gathered
table, ties broken by candidate order.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import chainer
import chainer.functions as F
import numpy

from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import blocking
from chainermn_overlap.distconv import geometry
from chainermn_overlap.distconv.grid import SpatialGrid

__all__ = ['candidate_grids', 'depth_candidates', 'format_table',
           'grids_with_channels', 'strategy_candidates', 'tune']


def candidate_grids(size: int, ndim: int) -> List[Tuple[int, ...]]:
    """Every grid shape of ``ndim`` dimensions whose size divides ``size``.

    Args:
        size (int): Number of processes.
        ndim (int): Number of spatial dimensions.

    Returns:
        list of tuple: Shapes, in lexicographic order (``(1, ..., 1)``,
        pure sample parallelism, first).
    """
    shapes = [()]
    for _ in range(ndim):
        shapes = [s + (d,) for s in shapes for d in range(1, size + 1)
                  if size % (geometry.grid_size(s + (d,))) == 0]
    return sorted(shapes)


def grids_with_channels(size: int, ndim: int) -> List[dict]:
    """Every ``{'grid': shape, 'channels': C}`` with ``C * prod(shape)``
    dividing ``size`` (the rest of the processes form sample groups).

    Returns:
        list of dict: In order of channels, then shape.
    """
    out = []
    for c in range(1, size + 1):
        if size % c:
            continue
        for shape in candidate_grids(size // c, ndim):
            out.append({'grid': list(shape), 'channels': c})
    return out


def strategy_candidates(size: int, ndim: int, stages: Sequence[str],
                        depths: Optional[Sequence[Optional[int]]] = None
                        ) -> List[dict]:
    """Per-stage strategies for a network of ``stages`` (in order).

    Each candidate is ``{'grid': shape, 'channels': C, 'strategy': {stage:
    kind}}`` (plus ``'depth'`` for each of ``depths`` if given), where the
    first stages are ``'spatial'`` (split over the grid's spatial axes) and
    the rest ``'channel'`` (filter/channel parallel over the channel axis)
    if ``C > 1``, else ``'sample'`` (whole samples after
    :func:`~chainermn_overlap.distconv.to_sample_layout`): the cut between
    the two is searched, which keeps the number of candidates linear in
    the number of stages (high-resolution stages first, channel-heavy ones
    last, as in a CNN). ``build_model`` reads these keys.

    Args:
        size (int): Number of processes.
        ndim (int): Spatial dimensions.
        stages (list of str): Stage names in network order.
        depths (list): Tiling depths to combine with (None entries mean a
            whole stage in one tile); omitted: no ``'depth'`` key.

    Returns:
        list of dict: Candidates for :func:`tune`.
    """
    stages = list(stages)
    out = []
    for g in grids_with_channels(size, ndim):
        spatial = geometry.grid_size(g['grid']) > 1
        late = 'channel' if g['channels'] > 1 else 'sample'
        cuts = range(len(stages) + 1) if spatial else [0]
        for cut in cuts:
            strategy = {st: ('spatial' if i < cut else late)
                        for i, st in enumerate(stages)}
            cand = dict(g, strategy=strategy)
            if depths is None:
                out.append(cand)
            else:
                out.extend(dict(cand, depth=d) for d in depths)
    return out


def depth_candidates(base: Any, depths: Sequence[Optional[int]]
                     ) -> List[dict]:
    """``base`` (a grid shape or candidate dict) with each tiling depth.

    ``build_model`` builds its :class:`~chainermn_overlap.distconv.Tiled`
    stacks with ``candidate['depth']``; :func:`tune` then picks the depth
    whose step is fastest on this machine and link (layer by layer is
    ``depth=1``).
    """
    if not isinstance(base, dict):
        base = {'grid': list(base)}
    return [dict(base, depth=d) for d in depths]


def _grid_shape(candidate):
    if isinstance(candidate, dict):
        return tuple(candidate['grid'])
    return tuple(candidate)


def _channels(candidate):
    if isinstance(candidate, dict):
        return int(candidate.get('channels', 1))
    return 1


def _label(candidate):
    return json.dumps(candidate, sort_keys=True)


def _invalid_reason(shape, size, ndim, channels=1):
    """Why a grid shape cannot run here, or None."""
    if len(shape) != ndim:
        return ('grid has %d dimensions, the input %d spatial ones'
                % (len(shape), ndim))
    if any(int(s) < 1 for s in shape) or channels < 1:
        return 'grid has a non-positive process count'
    if size % (geometry.grid_size(shape) * channels):
        return ('grid size %d%s does not divide %d processes'
                % (geometry.grid_size(shape) * channels,
                   ' (with %d channel blocks)' % channels
                   if channels > 1 else '', size))
    return None


def _default_loss(model, x):
    out = model(x)
    # Models that also return e.g. their final layout (a tuple).
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out if out.size == 1 else F.sum(out)


def tune(comm: Any, build_model: Callable[[SpatialGrid, Any], chainer.Link],
         input_shape: Sequence[int], candidates: Optional[list] = None,
         iterations: int = 3, warmup: int = 1,
         loss_fn: Optional[Callable[..., chainer.Variable]] = None,
         grid_kwargs: Optional[dict] = None, dtype=numpy.float32,
         timer: Callable[[], float] = time.perf_counter) -> dict:
    """Times each candidate for a few steps and returns the fastest.

    Collective: every process of ``comm`` must call it with the same
    candidates (checked) and input shape.

    Args:
        comm: ChainerMN communicator (or an mpi4py communicator).
        build_model (callable): ``build_model(grid, candidate)`` returns
            the model for a :class:`SpatialGrid` of the candidate's shape;
            called on every process. ``model(x)`` takes this process's
            block of the input (spatial layout).
        input_shape (tuple of int): Global input shape
            ``(N, C, *spatial)``.
        candidates (list): Grid shapes (tuples), or dicts with a ``'grid'``
            key and anything else ``build_model`` reads (e.g. a per-stage
            ``'strategy'``); JSON-serialisable. Default: every grid shape
            that fits (:func:`candidate_grids`).
        iterations (int): Timed forward/backward steps per candidate.
        warmup (int): Untimed steps first (plans, validation caches,
            allocations).
        loss_fn (callable): ``loss_fn(model, x)`` returns the variable to
            backpropagate from; default: the model's output (its first
            element if a tuple), summed.
        grid_kwargs (dict): Extra arguments of :class:`SpatialGrid` (e.g.
            ``overlap``, ``progress_pieces``).
        dtype: Input dtype.
        timer (callable): Clock in seconds (replaceable for tests).

    Returns:
        dict: ``best`` (the chosen candidate, as given), ``best_index``,
        ``best_median_s`` and ``table``, one row per candidate in order
        with ``candidate``, ``grid``, ``status`` (``'ok'``, ``'invalid'``
        or ``'error'``), ``reason``, ``median_s`` (median over steps of the
        slowest rank's step time), ``step_s`` (those step times) and
        ``per_rank_median_s``. Identical on every process.

    Raises:
        ValueError: On every process, if the processes' candidate lists or
            input shapes differ, or no candidate ran.
    """
    if iterations < 1:
        raise ValueError('tune: iterations must be >= 1, got %r'
                         % (iterations,))
    mpi_comm = getattr(comm, 'mpi_comm', comm)
    size = mpi_comm.Get_size()
    input_shape = tuple(int(s) for s in input_shape)
    ndim = len(input_shape) - 2
    if ndim < 1:
        raise ValueError('tune: input_shape must be (N, C, *spatial), got %r'
                         % (input_shape,))
    if candidates is None:
        candidates = candidate_grids(size, ndim)
    candidates = list(candidates)
    # A mismatch would make the processes build different grids and
    # deadlock in their collectives: fail on every process instead.
    plans = _mpi_json.allgather_json(
        mpi_comm, [list(input_shape), [_label(c) for c in candidates]])
    if any(p != plans[0] for p in plans):
        raise ValueError('tune: the processes were given different input '
                         'shapes or candidates: %r' % (plans,))
    loss_fn = loss_fn or _default_loss
    table = []
    for index, cand in enumerate(candidates):
        shape = _grid_shape(cand)
        row = {'candidate': cand, 'grid': list(shape), 'status': 'ok',
               'reason': None, 'median_s': None, 'step_s': [],
               'per_rank_median_s': []}
        table.append(row)
        channels = _channels(cand)
        row['channels'] = channels
        reason = _invalid_reason(shape, size, ndim, channels)
        if reason is not None:
            row.update(status='invalid', reason=reason)
            continue
        kwargs = dict(grid_kwargs or {})
        if channels > 1:
            kwargs['channels'] = channels
        times, error = _time_candidate(
            comm, mpi_comm, build_model, cand, shape, input_shape,
            iterations, warmup, loss_fn, kwargs, dtype, timer)
        gathered = _mpi_json.allgather_json(mpi_comm, [times, error])
        errors = ['rank %d: %s' % (r, e)
                  for r, (_, e) in enumerate(gathered) if e]
        if errors:
            row.update(status='error', reason='; '.join(errors))
            continue
        per_rank = [t for t, _ in gathered]
        # A step ends when its slowest process ends.
        steps = [max(ts) for ts in zip(*per_rank)]
        row.update(step_s=steps, median_s=float(numpy.median(steps)),
                   per_rank_median_s=[float(numpy.median(t))
                                      for t in per_rank])
    timed = [(r['median_s'], i) for i, r in enumerate(table)
             if r['status'] == 'ok']
    if not timed:
        raise ValueError('tune: no candidate ran: %s' % '; '.join(
            '%s: %s' % (_label(r['candidate']), r['reason'])
            for r in table))
    best_time, best_index = min(timed)
    return {'best': candidates[best_index], 'best_index': best_index,
            'best_median_s': best_time, 'iterations': iterations,
            'input_shape': list(input_shape), 'processes': size,
            'table': table}


def _time_candidate(comm, mpi_comm, build_model, cand, shape, input_shape,
                    iterations, warmup, loss_fn, grid_kwargs, dtype, timer):
    """This process's step times for one candidate, or its error text."""
    try:
        grid = SpatialGrid(comm, shape, **grid_kwargs)
        model = build_model(grid, cand)
        lo, hi = grid.sample_range(input_shape[0])
        block = [b - a for a, b in grid.block(input_shape[2:])]
        x = numpy.random.RandomState(grid.rank).standard_normal(
            (hi - lo, input_shape[1]) + tuple(block)).astype(dtype)
        times = []
        for i in range(warmup + iterations):
            # Start together, so that a step's time is its own, not the
            # wait for a process still finishing the previous candidate.
            blocking.barrier(mpi_comm, 'the start of a tuner step')
            t0 = timer()
            loss = loss_fn(model, x)
            if hasattr(model, 'cleargrads'):
                model.cleargrads()
            loss.backward()
            t = timer() - t0
            if i >= warmup:
                times.append(t)
            del loss
        return times, None
    # Reported, not raised: the error is gathered so that every process
    # records the candidate as failed and all move on to the next one
    # together. (distconv's own checks raise on every process alike.)
    except (ValueError, TypeError, IndexError, chainer.utils.type_check.
            InvalidType, MemoryError) as e:
        return [], '%s: %s' % (type(e).__name__, str(e)[:300])


def format_table(result: dict) -> str:
    """The tuner's choice and timings as text (for rank 0 to print)."""
    lines = ['%-4s %-44s %-8s %12s  %s' % ('', 'candidate', 'status',
                                          'median s', 'note')]
    for i, row in enumerate(result['table']):
        mark = '*' if i == result['best_index'] else ''
        med = '%12.4f' % row['median_s'] if row['median_s'] is not None \
            else '%12s' % '-'
        lines.append('%-4s %-44s %-8s %s  %s' % (
            mark, _label(row['candidate'])[:44], row['status'], med,
            row['reason'] or ''))
    lines.append('chosen: %s (%.4f s per step, median of %d, slowest '
                 'process)' % (_label(result['best']),
                               result['best_median_s'],
                               result['iterations']))
    return '\n'.join(lines)
