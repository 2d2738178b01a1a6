"""The test bed's link delay (testbed/netbed.py, testbed/netrelay.py).

A bed asked for a one-way ``delay`` must delay every frame on the link, in
both directions, through the ranks' own TCP/IP stacks: with ``netem`` where
the kernel has it, else with the relay.  Checked with measurements that do
not use the bed's own RTT probe (TCP one-way times on the shared monotonic
clock, an MPI ping-pong), against a bed without delay as the control; and
the relay must leave no process and no namespace behind, whichever way the
bed ends.  Needs root, as the other netbed tests (same skip rule).
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from testbed._system import child_env
from testbed import netbed
# tests/netbed has no __init__.py: pytest puts it on sys.path (rootdir-based
# "prepend" import mode) and imports test_netbed under this name.
from test_netbed import needs_root
from test_netbed import ours

HERE = os.path.dirname(os.path.abspath(__file__))
ONEWAY = os.path.join(HERE, 'oneway.py')
PINGPONG = os.path.join(HERE, 'mpi_pingpong.py')
DELAY = '2ms'
DELAY_S = netbed.parse_delay(DELAY)
# Clock reads and the scheduler may put a sample a little below the true
# floor; no sample may be below the delay by more than this.
TOLERANCE_S = 0.1 * DELAY_S


def _relay_pids(tag=None):
    """Pids of running relays of the beds of process ``tag`` (a pid).

    Default: this process's beds.
    """
    tag = (netbed.PREFIX + str(tag or os.getpid())).encode()
    pids = []
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
                argv = f.read().split(b'\0')
        except OSError:
            continue
        if any(a.endswith(b'netrelay.py') for a in argv) and any(
                a.startswith(tag) for a in argv):
            pids.append(int(pid))
    return pids


def _oneway(bed, count=20, port=5201):
    server = subprocess.Popen(
        ['ip', 'netns', 'exec', bed.namespaces[1], sys.executable, ONEWAY,
         'serve', str(port), str(count)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True)
    try:
        assert server.stdout.readline().strip() == 'listening', \
            server.communicate(timeout=10)
        client = subprocess.run(
            ['ip', 'netns', 'exec', bed.namespaces[0], sys.executable, ONEWAY,
             'send', bed.addresses[1], str(port), str(count)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, timeout=30)
        assert client.returncode == 0, client.stderr
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return json.loads(client.stdout)


@pytest.mark.timing  # measured delays
@needs_root
def test_delay_applies_to_every_frame_both_ways():
    with netbed.NetBed(2, '400mbit') as bed:
        base = bed.describe()
        base_oneway = _oneway(bed)
    with netbed.NetBed(2, '400mbit', delay=DELAY) as bed:
        desc = bed.describe()
        oneway = _oneway(bed)
        relay = bed.relay
    assert base['delay_method'] is None
    assert desc['delay_method'] == (
        'netem' if desc['netem_available'] else 'relay')
    # The bed's own probe: every round trip at least twice the delay, and
    # far above the round trips of the link without delay.
    rtt, rtt0 = desc['rtt'], base['rtt']
    assert rtt['min_s'] >= 2 * DELAY_S - TOLERANCE_S, rtt
    assert rtt['min_s'] - rtt0['median_s'] >= 2 * DELAY_S - TOLERANCE_S, (
        rtt, rtt0)
    # Independent of it: TCP one-way times, each direction on its own (the
    # data one way, the reply, with the ACKs, the other).
    for way in ('forward_s', 'back_s'):
        assert min(oneway[way]) >= DELAY_S - TOLERANCE_S, (way, oneway)
        assert (statistics.median(oneway[way])
                - statistics.median(base_oneway[way])
                >= DELAY_S - TOLERANCE_S), (way, oneway, base_oneway)
    if desc['delay_method'] == 'relay':
        assert desc['relay']['pid'] == relay.pid
        assert relay.returncode is not None
        stats = bed.relay_stats
        assert stats is not None and len(stats['directions']) == 2
        # Frames crossed both ways, none was lost.
        for d in stats['directions']:
            assert d['frames'] > 0, stats
            assert d['dropped_queue_full'] == d['write_errors'] == 0, stats
    assert ours() == []


@pytest.mark.timing  # measured delays
@needs_root
def test_mpi_small_messages_pay_the_round_trip():
    with netbed.NetBed(2, '400mbit', delay=DELAY) as bed:
        res = bed.run_mpi([sys.executable, PINGPONG, '20'], timeout=60,
                          env=child_env())
    assert res['returncode'] == 0, res['stderr'][-3000:]
    line = [ln for ln in res['stdout'].splitlines()
            if ln.startswith('PINGPONG ')]
    assert line, res['stdout'][-3000:]
    rtts = json.loads(line[-1][len('PINGPONG '):])['rtt_s']
    assert min(rtts) >= 2 * DELAY_S - TOLERANCE_S, rtts
    assert ours() == [] and _relay_pids() == []


@pytest.mark.timing  # measured delays
@needs_root
def test_switch_delays_each_cable():
    # With more than 2 ranks each rank's cable to the switch carries the
    # delay (as with netem on both of its ends): rank to rank, twice.
    with netbed.NetBed(3, '100mbit', delay=DELAY) as bed:
        rtt = bed.describe()['rtt']
    assert rtt['min_s'] >= 4 * DELAY_S - 2 * TOLERANCE_S, rtt
    assert ours() == [] and _relay_pids() == []


@needs_root
def test_relay_and_namespaces_removed_on_error():
    with pytest.raises(RuntimeError, match='boom'):
        with netbed.NetBed(2, '50mbit', delay=DELAY,
                           delay_method='relay') as bed:
            assert len(ours()) == 2
            assert _relay_pids() == [bed.relay.pid]
            raise RuntimeError('boom')
    assert ours() == []
    assert _relay_pids() == []


@needs_root
def test_relay_dies_with_a_killed_bed():
    # SIGKILL leaves no chance to clean up: the relay must die with its
    # parent, and the next bed removes the stale namespaces.
    code = ('import sys, time; sys.path.insert(0, {!r}); '
            'from testbed import netbed; '
            'bed = netbed.NetBed(2, "50mbit", delay={!r}, '
            'delay_method="relay").__enter__(); '
            'print(bed.relay.pid, flush=True); time.sleep(60)'
            ).format(os.path.dirname(os.path.dirname(HERE)), DELAY)
    proc = subprocess.Popen([sys.executable, '-c', code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            universal_newlines=True)
    try:
        first = proc.stdout.readline()
        assert first.strip().isdigit(), proc.communicate(timeout=10)
        relay_pid = int(first)
        assert relay_pid in _relay_pids(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 5
    while _relay_pids(proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert _relay_pids(proc.pid) == []
    tag = netbed.PREFIX + str(proc.pid)
    removed = netbed.remove_stale_namespaces()
    assert [n for n in removed if n.startswith(tag)]
    assert not [n for n in netbed.list_namespaces() if n.startswith(tag)]


@needs_root
def test_cli_sigterm_stops_the_relay():
    proc = subprocess.Popen([sys.executable, netbed.__file__, '--rate',
                             '50mbit', '--delay', DELAY, '--delay-method',
                             'relay', '--', 'sleep', '30'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tag = netbed.PREFIX + str(proc.pid)
    # The bed prints its line (with the RTT) once the link is up and the
    # job about to start.
    line = proc.stdout.readline()
    assert b'RTT' in line, (line, proc.communicate(timeout=20))
    assert _relay_pids(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, (out, err)
    assert not [n for n in netbed.list_namespaces() if n.startswith(tag)]
    assert _relay_pids(proc.pid) == []


@needs_root
def test_netem_forced_without_netem_names_the_problem():
    with netbed.NetBed(2, '50mbit') as bed:
        has_netem = netbed.netem_available(bed.namespaces[0])
    if has_netem:
        pytest.skip('this kernel has netem: nothing to refuse')
    with pytest.raises(netbed.NetBedError, match='no netem'):
        with netbed.NetBed(2, '50mbit', delay=DELAY, delay_method='netem'):
            pass
    assert ours() == []
