"""The docs table of the sharding peers study (docs/_ext/bench_peers_sharding.py),
rendered from the made-up result of ``test_peers_sharding.py``.

A test of the checkout's pages, not of the package: the wheel check leaves
it out with the other ``test_docs*`` files.
"""
import json
import os
import sys

from benchmarks import peers_sharding as ps

from test_peers_sharding import ZERO1_OVERLAP_ERROR, _made_up_result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, 'docs', '_ext'))

import bench_peers_sharding  # NOQA: E402
import benchcore  # NOQA: E402


def test_the_docs_table_renders_the_result(tmp_path):
    with open(tmp_path / 'peers_sharding.json', 'w') as f:
        json.dump(_made_up_result(), f)
    t = bench_peers_sharding.peers_sharding_table(str(tmp_path))
    assert len(t.rows) == 1 + len(ps.PAIRS)
    assert all(len(r) == len(t.header) for r in t.rows)
    assert t.sources == ['peers_sharding.json']
    assert 'ResNet-18 at 128 px' in t.title and 'batch 25' in t.title
    assert 'batch 2, 64 px' in t.title
    rows = {r[1]: r for r in t.rows}
    zero1 = rows['ZeroRedundancyOptimizer']
    assert zero1[0].startswith('stage 1')
    assert zero1[2] == '0.800 [0.800, 0.800]'
    assert zero1[4] == '+0.175 [+0.175, +0.175]'
    assert zero1[5] == '12.0 / 14.0' and zero1[6] == '20.0 / 22.0'
    assert zero1[7] == '12.0'
    failed = rows['ZeroRedundancyOptimizer, `overlap_with_ddp`']
    assert failed[3] == 'did not run: ' + ZERO1_OVERLAP_ERROR
    assert failed[4] == failed[6] == '\u2014'
    assert '| did not run: RuntimeError' in t.markdown()
    # FSDP's grad-op modes appear twice: against stage 2 and against our
    # stage 3 without a prefetch bound, which shards as they do.
    grad_op = [r for r in t.rows if r[1] == 'FSDP1 `SHARD_GRAD_OP`']
    assert [r[0] for r in grad_op] == [
        "stage 2 (`shard='gradients'`)",
        "stage 3, `shard_prefetch=None` (as FSDP's grad-op sharding)"]
    assert grad_op[1][2] == '%.3f [%.3f, %.3f]' % ((1 / 1.35,) * 3)
    assert grad_op[1][7] == '8.0'


def test_the_docs_table_is_registered_only_with_its_results(tmp_path):
    try:
        assert not bench_peers_sharding.register(str(tmp_path))
        assert 'peers-sharding' not in benchcore.TABLES
        (tmp_path / 'peers_sharding.json').write_text('{}')
        assert bench_peers_sharding.register(str(tmp_path))
        assert 'peers-sharding' in benchcore.TABLES
    finally:
        bench_peers_sharding.register()
