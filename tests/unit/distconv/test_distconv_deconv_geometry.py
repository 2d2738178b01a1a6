"""Pure geometry of transposed convolution and resizing (no MPI): the
input cells that reach an output block, by brute force over the
definition, and the plans' exchanges."""
import itertools

import numpy as np
import pytest

from chainermn_overlap.distconv import geometry
from chainermn_overlap.distconv import resize


def _reaching(lo, hi, n_in, k, s, p, d):
    """Input cells i with some j < k and i * s - p + j * d in [lo, hi)."""
    return sorted({i for i in range(n_in) for j in range(k)
                   if lo <= i * s - p + j * d < hi})


@pytest.mark.parametrize('n_in,k,s,p,d', list(itertools.product(
    [1, 4, 7], [1, 2, 3, 5], [1, 2, 3], [0, 1, 3], [1, 2])))
def test_deconv_input_interval_holds_every_reaching_cell(n_in, k, s, p, d):
    n_out = geometry.deconv_output_size(n_in, k, s, p, d)
    if n_out <= 0:
        return
    for lo in range(n_out + s):
        for hi in range(lo, n_out + s + 1):
            cells = _reaching(lo, hi, n_in, k, s, p, d)
            got = geometry.deconv_input_interval((lo, hi), n_in, k, s, p, d)
            if d == 1:
                # Without gaps in the window the interval is tight.
                want = (cells[0], cells[-1] + 1) if cells else (0, 0)
                assert got == want, (lo, hi, n_in, k, s, p, d)
            assert all(got[0] <= i < got[1] for i in cells)
            if cells:
                # The unpadded local output holds every output they reach.
                a, b = geometry.deconv_local_output(got, k, s, p, d)
                reach = [i * s - p + j * d for i in cells for j in range(k)]
                assert a <= min(reach) and max(reach) < b


def test_deconv_output_size_matches_chainer():
    from chainer.utils import conv
    for n, k, s, p, ca in itertools.product([1, 3, 6], [1, 2, 3], [1, 2, 3],
                                           [0, 1], [False, True]):
        assert geometry.deconv_output_size(n, k, s, p, 1, ca) == \
            conv.get_deconv_outsize(n, k, s, p, cover_all=ca)


def test_halo_free_plan_exchanges_nothing():
    # ksize == stride, pad 0, the grid divides the input: own block only.
    for r in range(4):
        plan, out_box, in_box, any_halo = geometry.deconv_plan(
            (8, 4), (16, 8), (2, 2), (2, 2), (2, 2), (0, 0), (1, 1), r)
        assert not any_halo and not plan.recvs and not plan.sends
        assert in_box == plan.own
    # One cell more and the blocks no longer line up.
    _, _, _, any_halo = geometry.deconv_plan(
        (7, 4), (14, 8), (2, 2), (2, 2), (2, 2), (0, 0), (1, 1), 0)
    assert any_halo


def test_deconv_plan_sends_mirror_receives():
    args = ((5, 6), (10, 12), (3, 2), (3, 4), (2, 2), (1, 1), (1, 1))
    plans = [geometry.deconv_plan(*args, r)[0] for r in range(6)]
    for r, plan in enumerate(plans):
        for peer, box in plan.recvs:
            assert (r, box) in plans[peer].sends


@pytest.mark.parametrize('mode,ac', [('bilinear', True),
                                     ('bilinear', False),
                                     ('nearest', True)])
def test_source_indices_match_chainer(monkeypatch, mode, ac):
    from chainer.functions.array import resize_images as chainer_resize
    monkeypatch.setattr(np, 'float', float, raising=False)
    for n_in, n_out in [(4, 8), (5, 7), (7, 3), (3, 1), (1, 4)]:
        v, _, vw, _ = chainer_resize.compute_indices_and_weights(
            (n_out, 1), (n_in, 1), mode, ac, np)
        i0, i1, w = resize.source_indices(n_in, n_out, mode, ac)
        assert (i0 == v.astype(np.intp)).all()
        assert (i1 == np.minimum(i0 + 1, n_in - 1) if mode == 'bilinear'
                else i1 == i0).all()
        assert np.array_equal(w, vw)


@pytest.mark.parametrize('n_in,k,s,p', list(itertools.product(
    [5, 9], [1, 2, 3, 4], [1, 2, 3], [0, 1, 2])))
def test_deconv_interior_reads_only_owned_cells(n_in, k, s, p):
    n_out = geometry.deconv_output_size(n_in, k, s, p)
    if n_out <= 0:
        return
    for procs in (2, 3):
        for r in range(procs):
            own = geometry.block_range(n_in, procs, r)
            ob = geometry.block_range(n_out, procs, r)
            (a, b), = geometry.deconv_interior((ob,), (own,), (n_in,), (k,),
                                               (s,), (p,), (1,))
            assert ob[0] <= a <= b <= ob[1] or a == b == ob[0]
            for o in range(a, b):
                cells = _reaching(o, o + 1, n_in, k, s, p, 1)
                assert all(own[0] <= i < own[1] for i in cells), (o, own)
            # Maximal: the outputs just outside it read other blocks.
            for o in (a - 1, b):
                if ob[0] <= o < ob[1] and b > a:
                    cells = _reaching(o, o + 1, n_in, k, s, p, 1)
                    assert any(not own[0] <= i < own[1] for i in cells)
