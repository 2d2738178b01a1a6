"""The tuner chooses a tiling depth and a per-stage split, alike everywhere.

A virtual clock replaces wall time (no timing on a shared machine): each
step advances it by a latency per halo exchange plus a cost per computed
cell, read from the grid's counters and the tiles' redundancy. The tuner
must pick the depth that minimises that model, the same on every rank.
"""
import chainer.functions as F

from chainermn_overlap import _mpi_json
from chainermn_overlap import distconv
from chainermn_overlap.distconv import tiling
from chainermn_overlap.distconv import tuner
from distconv_mpi_helpers import Checker, comm

CLOCK = [0.0]


class Stack(object):
    """Four 3x3 convolutions in a Tiled stack; advances the clock."""

    def __init__(self, grid, depth, latency, per_cell):
        self.grid = grid
        self.latency = latency
        self.per_cell = per_cell
        convs = [distconv.Convolution2D(grid, 2, 2, 3, 1, 1)
                 for _ in range(4)]
        self.tiled = distconv.Tiled(grid, convs, depth=depth)
        self.depth = depth

    def cleargrads(self):
        self.tiled.cleargrads()

    def __call__(self, x):
        before = self.grid.stats['exchange_tiled']
        y = self.tiled(x)
        rounds = self.grid.stats['exchange_tiled'] - before
        windows = self.tiled.windows()
        d = self.depth or len(windows)
        red = tiling.redundancy((16, 16), windows[:d], self.grid.shape)
        CLOCK[0] += rounds * self.latency + red * self.per_cell * 256
        return F.sum(distconv.global_average_pooling(self.grid, y))


def _tune(latency, per_cell):
    size = comm().size
    cands = tuner.depth_candidates((size, 1), [1, 2, 4, None])

    def build(g, cand):
        return Stack(g, cand['depth'], latency, per_cell)

    return distconv.tune(comm(), build, (1, 2, 16, 16), cands,
                         iterations=1, warmup=0,
                         loss_fn=lambda m, x: m(x),
                         timer=lambda: CLOCK[0])


def test_tuner_picks_depth_from_the_step_time():
    chk = Checker()
    size = comm().size
    # High latency, cheap cells: the deepest tile wins (fewest rounds).
    deep = _tune(latency=1.0, per_cell=1e-6)
    # No latency, expensive cells: layer by layer wins (no redundancy).
    flat = _tune(latency=0.0, per_cell=1.0)
    for name, res in (('deep', deep), ('flat', flat)):
        got = _mpi_json.allgather_json(comm().mpi_comm, res['best'])
        chk.true('%s: same choice everywhere: %r' % (name, got),
                 all(g == got[0] for g in got))
    if size > 1:
        chk.true('latency-bound picks one exchange: %r' % deep['best'],
                 deep['best']['depth'] in (4, None))
        chk.true('compute-bound picks layer by layer: %r' % flat['best'],
                 flat['best']['depth'] == 1)
    chk.done()


def test_tuner_strategy_with_channel_axis():
    size = comm().size

    def build(g, cand):
        strat = cand['strategy']
        kind = strat['late']
        return _TwoStage(g, kind)

    cands = tuner.strategy_candidates(size, 2, ['late'])
    res = distconv.tune(comm(), build, (2, 4, 8, 8), cands, iterations=1,
                        warmup=0)
    chk = Checker()
    chk.true('every candidate ran: %r' % [r['reason'] for r in res['table']
                                          if r['status'] != 'ok'],
             all(r['status'] == 'ok' for r in res['table']))
    chk.true('channels recorded', all('channels' in r for r in res['table']))
    chk.done()


class _TwoStage(object):
    def __init__(self, g, kind):
        self.g = g
        self.kind = kind
        if kind == 'channel':
            self.c1 = distconv.Convolution2D(g, 4, 6, 3, 1, 1,
                                             split='filter')
            self.c2 = distconv.Convolution2D(g, 6, 3, 3, 1, 1,
                                             split='channel')
        else:
            self.c1 = distconv.Convolution2D(g, 4, 6, 3, 1, 1)
            self.c2 = distconv.Convolution2D(g, 6, 3, 3, 1, 1)

    def cleargrads(self):
        self.c1.cleargrads()
        self.c2.cleargrads()

    def __call__(self, x):
        h = self.c2(F.relu(self.c1(x)))
        return distconv.global_average_pooling(self.g, h)

