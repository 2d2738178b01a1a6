"""Scatter and assemble (distconv/distribution.py) on simulated ranks.

Each rank's block is cut with the rank's own topology; assembling all
blocks must give back the global tensor (uneven blocks, sample groups,
channel blocks), and summing the channel coordinates' copies must give the
sum. ``gather`` and ``loss_scale`` run on ``MPI.COMM_SELF``.
"""
import numpy as np
import pytest
from mpi4py import MPI

from chainermn_overlap.distconv import distribution as D
from chainermn_overlap.distconv import geometry as G
from chainermn_overlap.distconv import layout as Lay
from chainermn_overlap.distconv.topology import GridTopology

GRIDS = [((2, 2), 1, 1), ((3, 1), 1, 2), ((1, 2, 2), 1, 1), ((2, 1), 2, 1),
         ((1, 1), 3, 2)]


def ranks(shape, channels, groups):
    size = G.grid_size(shape) * channels * groups
    return [GridTopology(shape, size, r, channels) for r in range(size)]


def global_x(shape):
    spatial = (7, 5, 3)[:len(shape)]
    rng = np.random.RandomState(len(shape))
    return rng.randn(*((5, 7) + spatial)).astype(np.float32)


def layout(x, tops, channel_split):
    t = tops[0]
    counts = tuple(G.block_sizes(x.shape[1], t.channels)) if channel_split \
        else (x.shape[1],) * t.channels
    return Lay.Layout(x.shape[2:], G.block_sizes(x.shape[0], t.n_groups),
                      x.shape[1], counts)


@pytest.mark.parametrize('shape, channels, groups', GRIDS)
@pytest.mark.parametrize('channel_split', [False, True])
def test_assemble_inverts_scatter(shape, channels, groups, channel_split):
    x = global_x(shape)
    tops = ranks(shape, channels, groups)
    parts = [D.scatter(t, x, channel_split) for t in tops]
    assert all(p.flags.c_contiguous for p in parts)
    got = D.assemble(tops[0], parts, layout(x, tops, channel_split),
                     channel_split)
    assert got.tobytes() == x.tobytes()
    # Negative control: a block from another rank is noticed.
    parts[0], parts[-1] = parts[-1], parts[0]
    if parts[0].shape == parts[-1].shape and len(parts) > 1:
        bad = D.assemble(tops[0], parts, layout(x, tops, channel_split),
                         channel_split)
        assert bad.tobytes() != x.tobytes()


def test_reduce_copies_sums_the_channel_coordinates():
    x = global_x((2, 1))
    tops = ranks((2, 1), 3, 1)
    parts = [D.scatter(t, x) * (1 + t.channel_rank) for t in tops]
    lay = layout(x, tops, False)
    np.testing.assert_array_equal(
        D.assemble(tops[0], parts, lay, reduce_copies=True), 6 * x)
    # Without reduce_copies, coordinate 0's copy is the tensor.
    np.testing.assert_array_equal(D.assemble(tops[0], parts, lay), x)


def test_scatter_samples_and_bad_shapes():
    t = GridTopology((2, 1), 4, 3)  # group 1 of 2
    labels = np.arange(7)
    np.testing.assert_array_equal(D.scatter_samples(t, labels), [4, 5, 6])
    with pytest.raises(ValueError, match=r'expected \(N, C, H, W\) for grid '
                       r'\(2, 1\), got shape \(7,\)'):
        D.scatter(t, labels)


def test_gather_and_loss_scale_on_one_process():
    t = GridTopology((1, 1), 1, 0)
    x = global_x((1, 1))
    got = D.gather(t, MPI.COMM_SELF, D.scatter(t, x), layout(x, [t], False))
    assert got.tobytes() == x.tobytes()
    assert D.loss_scale(MPI.COMM_SELF, 1, 4) == 0.25
    with pytest.raises(ValueError, match='global batch is empty'):
        D.loss_scale(MPI.COMM_SELF, 1, 0)
