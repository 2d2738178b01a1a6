"""A network link cut mid-training ends the job with an error, not a hang.

Two ranks train over a shaped veth link (testbed/netbed.py); a few
seconds in, the test takes rank 1's interface down.  TCP then neither
delivers nor fails, so without the watchdog every rank waits forever (the
negative control shows it); with ``timeout=`` the waiting rank raises
``CommunicationTimeout`` naming the pending communication, and the
abort-on-exception hook ends the whole job.
"""
import os
import subprocess
import sys
import threading
import time

from testbed import netbed
# tests/netbed has no __init__.py: pytest puts it on sys.path (rootdir-based
# "prepend" import mode) and imports test_netbed under this name.
from test_netbed import needs_root

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

JOB = os.path.join(ROOT, 'tests', 'unit', 'fault_job.py')


def _cut_after(bed, delay, done):
    time.sleep(delay)
    ns = bed.namespaces[1]
    subprocess.run(['ip', '-n', ns, 'link', 'set', 'eth0', 'down'],
                   check=True)
    state = subprocess.run(['ip', '-n', ns, 'link', 'show', 'eth0'],
                           stdout=subprocess.PIPE, universal_newlines=True)
    done['cut_at'] = time.time()
    done['link'] = state.stdout


def _train_and_cut(timeout_opt, limit):
    with netbed.NetBed(2, '100mbit') as bed:
        done = {}
        cutter = threading.Thread(target=_cut_after, args=(bed, 4.0, done))
        cutter.start()
        done['start'] = time.time()
        res = bed.run_mpi(
            [sys.executable, JOB, 'none', '--iterations', '100000000',
             '--timeout', str(timeout_opt)], timeout=limit)
        cutter.join()
    return res, done


@needs_root
def test_link_cut_without_watchdog_hangs():
    # Negative control: the fault is real.  With the watchdog off, the job
    # is still waiting 10 s after the link went down.
    res, done = _train_and_cut(0, limit=14)
    assert 'state DOWN' in done['link'] or ',UP' not in done['link'], done
    assert res['returncode'] == 124, res['stderr'][-2000:]


@needs_root
def test_link_cut_ends_the_job_with_a_named_error():
    res, done = _train_and_cut(3, limit=60)
    out = res['stdout'] + res['stderr']
    assert res['returncode'] not in (0, 124), out[-3000:]
    assert 'CommunicationTimeout' in out, out[-3000:]
    # The error names what was pending: a bucket (with its layers) or the
    # iteration's control message.
    assert 'bucket' in out or 'control message' in out, out[-3000:]
    ended = done['start'] + res['seconds']
    # Timeout 3 s, plus the abort's own clean-up.
    assert ended - done['cut_at'] < 3 + 15, ended - done['cut_at']
