"""The scaling study's pure parts: trace format, timeline reading, platform,
closed forms, dilation arithmetic; and the SimGrid replay of a tiny trace
against a hand-computed α-β time (skipped without python3-simgrid)."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks.scale import project, replay, trace
from testbed import cpuquota

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
RESNET50_TRACE = os.path.join(ROOT, 'benchmarks', 'results',
                              'scale_trace.resnet50.json')


def tiny_trace(layers=4, wait='forward', bucket_bytes=8 << 20):
    names = ['/l{}'.format(i) for i in range(layers)]
    return {
        'format': replay.FORMAT, 'wait': wait, 'update_s': 0.0,
        'layers': [{'name': n, 'forward_s': 0.01, 'backward_s': 0.02,
                    'update_s': 0.0, 'param_bytes': [bucket_bytes]}
                   for n in names],
        # One bucket per layer, posted in backward order.
        'buckets': [{'index': b, 'bytes': bucket_bytes,
                     'final_after': names[layers - 1 - b],
                     'waited_by': [names[layers - 1 - b]]}
                    for b in range(layers)],
        'engine': {'chunk_bytes': 4 << 20, 'step_overhead_s': 0.0}}


def test_validate_names_the_bad_field():
    t = tiny_trace()
    assert replay.validate_trace(t) is t
    with pytest.raises(replay.TraceError, match='format'):
        replay.validate_trace(dict(t, format='x'))
    bad = json.loads(json.dumps(t))
    bad['buckets'][1]['final_after'] = '/nope'
    with pytest.raises(replay.TraceError, match="bucket 1: final_after"):
        replay.validate_trace(bad)
    bad = json.loads(json.dumps(t))
    del bad['layers'][2]['backward_s']
    with pytest.raises(replay.TraceError, match="layer 2 lacks 'backward_s'"):
        replay.validate_trace(bad)
    with pytest.raises(replay.TraceError, match='wait'):
        replay.validate_trace(dict(t, wait='never'))


def test_quantities():
    assert replay.parse_rate('10gbit') == 10e9
    assert replay.parse_rate('737.5mbit') == 737.5e6
    assert replay.parse_seconds('25us') == pytest.approx(25e-6)
    with pytest.raises(ValueError, match='link rate'):
        replay.parse_rate('10 parsecs')


def test_platform_star_and_fat_tree():
    xml = replay.platform_xml(8, 10e9, 50e-6, efficiency=0.5)
    assert 'radical="0-7"' in xml and 'SPLITDUPLEX' in xml
    # 10 Gb/s at half efficiency is 625 MB/s; each of the two links of a
    # path carries half the latency.
    assert 'bw="625000000.0Bps"' in xml and 'lat="2.5e-05s"' in xml
    ft = replay.platform_xml(10, 1e9, 40e-6, topology='fat_tree')
    # 4 hosts per leaf, 3 leaves, 4 spines: 12 host slots, full bisection.
    assert 'topo_parameters="2;4,3;1,4;1,1"' in ft and 'radical="0-11"' in ft
    with pytest.raises(ValueError, match='topology'):
        replay.platform_xml(4, 1e9, 1e-6, topology='ring')


def test_closed_forms():
    # 2 ranks: each sends and receives half the buffer twice.
    assert replay.ring_allreduce_seconds(2, 1e6, 1e-5, 1e8) == \
        pytest.approx(2 * (1e-5 + 0.5e6 / 1e8))
    assert replay.halving_allreduce_seconds(8, 8e6, 1e-5, 1e8) == \
        pytest.approx(2 * (3 * 1e-5 + 8e6 * 7 / 8 / 1e8))
    assert replay.chunk_sizes(10, 4) == [4, 4, 2]
    t = tiny_trace()
    assert replay.compute_seconds(t) == pytest.approx(4 * 0.03)
    assert replay.compute_seconds(dict(t, alone_iteration_s=0.5), 2) == 1.0


def test_min_dilation():
    # 0.8 of a core per undilated rank, 0.4 of 2 cores kept free.
    assert [cpuquota.min_dilation(n, 2) for n in (2, 4, 8)] == [1, 2, 4]
    assert cpuquota.min_dilation(16, 16) == 1
    with pytest.raises(ValueError):
        cpuquota.min_dilation(2, 0.4)


def _timeline():
    """Two iterations of a 2-layer model, in the recorder's format."""
    ev = []

    def x(name, cat, ts, dur, tid=0, args=None):
        e = {'ph': 'X', 'name': name, 'cat': cat, 'pid': 0, 'tid': tid,
             'ts': ts, 'dur': dur}
        if args:
            e['args'] = args
        ev.append(e)

    def i(name, cat, ts, args=None):
        ev.append({'ph': 'i', 's': 't', 'name': name, 'cat': cat, 'pid': 0,
                   'tid': 0, 'ts': ts, 'args': args or {}})
    for it, base in ((1, 0), (2, 1000)):
        # /a's forward span holds its deferred update (30 us), which holds
        # the wait for its bucket (20 us).
        x('forward /a', 'forward', base + 10, 130)
        x('update /a', 'update', base + 12, 30)
        x('wait bucket 1', 'wait', base + 14, 20)
        x('forward /b', 'forward', base + 150, 170)
        i('grad ready /b/W', 'backward', base + 500)
        i('post bucket 0', 'post', base + 501)
        i('grad ready /a/W', 'backward', base + 800)
        i('post bucket 1', 'post', base + 801)
        x('update()', 'update', base + 900, 50)
        label = 'bucket {} of iteration %d' % it
        x('allreduce bucket 0', 'comm', base + 520, 40, tid=1,
          args={'label': label.format(0), 'bytes': 400})
        # Bucket 1 in two chunks, 10 us apart: an engine step.
        for part, start in ((1, 820), (2, 870)):
            x('allreduce bucket 1 chunk {}/2'.format(part), 'comm',
              base + start, 40, tid=1,
              args={'label': label.format(1), 'bytes': 800})
    return {'traceEvents': ev}


def test_from_timeline():
    t = trace.from_timeline(_timeline(), {'/a': [400], '/b': [800]},
                            chunk_bytes=1 << 20, meta={'model': 'm'})
    replay.validate_trace(t)
    assert [l['name'] for l in t['layers']] == ['/a', '/b']
    # /a runs to /b's start (1150), less its update (30): 110 us.
    assert [l['forward_s'] for l in t['layers']] == pytest.approx(
        [110e-6, 170e-6])
    assert [l['update_s'] for l in t['layers']] == pytest.approx([10e-6, 0])
    # Backward: /b from the end of forward (1320) to 1500, /a to 1800.
    assert [l['backward_s'] for l in t['layers']] == pytest.approx(
        [300e-6, 180e-6])
    assert [(b['index'], b['bytes'], b['final_after'], b['waited_by'])
            for b in t['buckets']] == [(0, 400, '/b', ['/b']),
                                       (1, 800, '/a', ['/a'])]
    # Only gaps before a chunk of a bucket already posted count: 860 ->
    # 870 in each iteration (560 -> 820 waited for bucket 1's post).
    assert t['engine']['step_overhead_s'] == pytest.approx(10e-6)
    assert t['engine']['step_gaps_measured'] == 2
    assert t['engine']['control_s'] == pytest.approx(19e-6)
    assert [(c['bucket'], c['part'], c['of']) for c in
            t['engine']['chunks']] == [(0, 1, 1), (1, 1, 2), (1, 2, 2)]
    # The rest of the 1000 us iteration (950 -> 1950) less the 20 us wait.
    assert t['waits_s'] == pytest.approx(20e-6)
    assert t['update_s'] == pytest.approx(980e-6 - (110 + 170 + 180 + 300
                                                    + 10) * 1e-6)
    assert t['model'] == 'm'
    with pytest.raises(ValueError, match='2 complete iterations'):
        trace.from_timeline({'traceEvents': _timeline()['traceEvents'][:11]},
                            {})


def _simgrid_missing():
    return project.simgrid_problem()


@pytest.mark.skipif(_simgrid_missing() is not None,
                    reason='python3-simgrid is not installed for '
                           '/usr/bin/python3 (apt-get install -y '
                           'python3-simgrid; make bench-scale does)')
@pytest.mark.parametrize('nodes,algorithm', [(2, 'halving'), (4, 'ring'),
                                             (16, 'halving')])
def test_replay_against_alpha_beta(tmp_path, nodes, algorithm):
    t = tiny_trace()
    path = tmp_path / 't.json'
    path.write_text(json.dumps(t))
    rate, lat = 1e9, 20e-6
    bps = rate / 8
    total = 4 * (8 << 20)
    closed = (replay.halving_allreduce_seconds if algorithm == 'halving'
              else replay.ring_allreduce_seconds)
    bound = project.replay(str(path), nodes, rate, lat, 'bound',
                           algorithm=algorithm, iterations=2)
    assert bound['comm_s'] == pytest.approx(closed(nodes, total, lat, bps),
                                            rel=1e-9)
    # Blocking: compute, then one allreduce per array (4 arrays).
    blk = project.replay(str(path), nodes, rate, lat, 'blocking',
                         algorithm=algorithm, iterations=2)
    assert blk['iteration_s'] == pytest.approx(
        0.12 + 4 * closed(nodes, 8 << 20, lat, bps), rel=1e-9)
    # Ours hides communication behind backward: never slower than
    # blocking, and at least compute + the last bucket's reduction.
    ours = project.replay(str(path), nodes, rate, lat, 'ours',
                          algorithm=algorithm, iterations=3)
    assert ours['iteration_s'] < blk['iteration_s']
    assert ours['iteration_s'] >= 0.12


def test_replay_script_refuses_a_bad_trace(tmp_path):
    if _simgrid_missing() is not None:
        pytest.skip('python3-simgrid is not installed')
    path = tmp_path / 'bad.json'
    path.write_text(json.dumps({'format': 'other'}))
    proc = subprocess.run([project.SYSTEM_PYTHON, project.REPLAY, '--trace',
                           str(path), '--nodes', '2', '--rate', '1gbit'],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=120,
                          env=project._replay_env())
    assert proc.returncode != 0
    assert 'not a replay trace' in proc.stderr


def test_registry_lists_scale():
    from benchmarks.harness import registry
    assert registry.module_of('scale') == 'benchmarks.scale_bench'
    # The replay module imports without SimGrid (this Python has none).
    assert 'simgrid' not in sys.modules or sys.executable == \
        project.SYSTEM_PYTHON


@pytest.mark.skipif(_simgrid_missing() is not None,
                    reason='python3-simgrid is not installed for '
                           '/usr/bin/python3')
@pytest.mark.parametrize('algorithm', ['halving', 'ring'])
def test_fewer_simulated_hosts_give_the_same_iteration(tmp_path, algorithm):
    # 16 ranks simulated as 16 hosts and as 4 hosts carrying 16 ranks'
    # steps: the same time (identical ranks, full bisection).
    t = tiny_trace()
    t['engine']['step_overhead_s'] = 1e-4
    path = tmp_path / 't.json'
    path.write_text(json.dumps(t))
    out = [project.replay(str(path), 16, 1e9, 20e-6, 'ours',
                          algorithm=algorithm, iterations=3, exact_hosts=h)
           for h in (16, 4)]
    assert [o['simulated_hosts'] for o in out] == [16, 4]
    assert out[1]['iteration_s'] == pytest.approx(out[0]['iteration_s'],
                                                  rel=1e-9)


@pytest.mark.skipif(_simgrid_missing() is not None,
                    reason='python3-simgrid is not installed')
@pytest.mark.skipif(not os.path.exists(RESNET50_TRACE),
                    reason='the recorded trace (benchmarks/results) is not '
                           'copied beside an installed wheel')
def test_ring_chunk_grown_with_n_at_1024_nodes():
    # The recorded ResNet-50 at a GPU-class iteration, 1,024 nodes, 10 Gb/s,
    # ring.  With the fixed 4 MiB chunk each of ~30 chunks costs 2 (N - 1)
    # latencies for 4 KiB a step: the projection collapses.  With the
    # engine's rule (chunk max(4 MiB, 256 KiB N)) each bucket is one ring,
    # and what the communication thread spends is the alpha-beta time of
    # one ring per item, within 5 % (agreements and engine steps).
    path = RESNET50_TRACE
    t = replay.load_trace(path)
    scale = project.GPU_CLASS['iteration_s'] / t['alone_iteration_s']
    rate, lat, eff = 10e9, 25e-6, 0.96
    common = dict(compute_scale=scale, efficiency=eff, algorithm='ring',
                  iterations=3, step_overhead=t['engine']['step_overhead_s']
                  * scale)
    fixed = project.replay(path, 1024, rate, lat, 'ours',
                           chunk_bytes=4 << 20, **common)
    grown = project.replay(path, 1024, rate, lat, 'ours', **common)
    assert fixed['scalability'] < 0.2
    assert grown['scalability'] > 2 * fixed['scalability']
    ring = sum(replay.ring_allreduce_seconds(1024, b['bytes'], lat,
                                             rate * eff / 8)
               for b in t['buckets'])
    assert ring <= grown['comm_busy_s_per_iteration'] <= 1.05 * ring
