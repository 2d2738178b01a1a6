"""Ours against PyTorch DDP on the same bed, in the same run.

Run (as root, from the repository root; ``make bench-peers`` builds the
PyTorch environment ``.venv-peers`` first)::

    python -m benchmarks.peers_bench [--model resnet18 --batch 8 --insize 128]

Both frameworks train the same network (ResNet-50 by default, or
ResNet-18 with ``--model resnet18``, what ``make bench-peers`` runs;
:mod:`benchmarks.harness.torch_models` mirrors the Chainer models layer for
layer, parameter for parameter) on two ranks of one network test bed, each rank
pinned to a core with one thread:

* ours (:mod:`benchmarks.harness.trainer`): one rank alone, ChainerMN's
  blocking optimizer, and ours with ``wait='forward'``: float32, float16 on the
  wire, PowerSGD of rank 1 and 4;
* PyTorch (:mod:`benchmarks.harness.peers_torch`, gloo): one rank alone, DDP
  with float32, its ``fp16_compress_hook``, its ``powerSGD_hook`` of rank 1 and
  4 (one bucket: with several, gloo crashes, see that module).

**Compute-matched.**  PyTorch computes a ResNet step faster than Chainer
on this CPU, and a faster step hides less communication.  Its batch is
chosen so that its single-rank step takes as long as ours (the smallest
batch whose step is at least 97 % of ours, measured pinned): the same
bytes to move behind the same compute.  Each side's scalability is against
its own single-rank speed, measured in the same rounds.

**One run.**  The link is calibrated with ours (ChainerMN's blocking
optimizer at the anchor's 0.667, as ``overlap_bench``); then both jobs
start at once on that bed and take turns
(:mod:`benchmarks.harness.interleave`): rounds ours/theirs, theirs/ours, ...,
each round every mode once.  Each figure is the median over rounds with its 95
% bootstrap interval; ours minus theirs is paired by round, with its interval.

Writes ``benchmarks/results/peers.json`` (the model and its configuration
recorded in it; ``--out`` writes elsewhere).
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

if not __package__:
    sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..')))

from benchmarks.harness import (  # noqa: E402
    bedrun, interleave, launch, stats, trainer)
from benchmarks.harness.machine import machine_description  # noqa: E402
from testbed import netbed  # noqa: E402

PEERS_PYTHON = os.path.join(launch.ROOT, '.venv-peers', 'bin', 'python')
PEER_MODULE = 'benchmarks.harness.peers_torch'
OURS = ['alone', 'blocking', 'overlap_forward', 'overlap_forward_float16',
        'overlap_forward_powersgd1', 'overlap_forward_powersgd4']
THEIRS = ['alone', 'ddp_fp32', 'ddp_fp16', 'ddp_powersgd1', 'ddp_powersgd4']
# (theirs, ours): the comparison is B - A = ours - theirs.
PAIRS = [('alone', 'alone'), ('ddp_fp32', 'overlap_forward'),
         ('ddp_fp16', 'overlap_forward_float16'),
         ('ddp_powersgd1', 'overlap_forward_powersgd1'),
         ('ddp_powersgd4', 'overlap_forward_powersgd4')]
LABELS = {'ddp_fp32': 'float32', 'ddp_fp16': 'float16',
          'ddp_powersgd1': 'PowerSGD r=1', 'ddp_powersgd4': 'PowerSGD r=4'}
MATCH = 0.97


def peer_command(cfg, module=PEER_MODULE):
    """The command line of a PyTorch worker ``module`` (in the peer
    environment) for ``cfg``."""
    return [PEERS_PYTHON, '-m', module, launch.WORKER_FLAG, json.dumps(cfg)]


def peer_alone_seconds(cfg, batch, module=PEER_MODULE):
    """PyTorch's single-rank step time at ``batch``, pinned to core 0
    (the ``alone`` mode of worker ``module``)."""
    c = dict(cfg, batch=batch, modes=['alone'], warmup=1, settle=0,
             iterations=3, rounds=1)
    stdout = launch.run_pinned(peer_command(c, module),
                               'PyTorch alone, batch {}'
                               .format(batch), timeout=900)
    raw = launch.read_result(stdout, trainer.RESULT_TAG, 'PyTorch alone')
    return statistics.median(
        bedrun.flatten(raw['modes']['alone']['round_seconds']))


def match_batch(cfg, target, log, limit=256, module=PEER_MODULE):
    """The smallest batch whose PyTorch step takes >= MATCH x ``target``
    (timed with worker ``module``'s ``alone``).

    Returns:
        tuple: the batch and every (batch, seconds) measured.
    """
    seen = {}

    def t(b):
        if b not in seen:
            seen[b] = peer_alone_seconds(cfg, b, module)
            log('  PyTorch batch {}: {:.3f} s per step alone'.format(
                b, seen[b]))
        return seen[b]
    b = max(1, cfg['batch'])
    # Step time grows about linearly with the batch: estimate, then walk.
    b = max(1, min(limit, int(round(b * MATCH * target / t(b)))))
    while b < limit and t(b) < MATCH * target:
        b += 1
    while b > 1 and t(b - 1) >= MATCH * target:
        b -= 1
    return b, sorted(seen.items())


def report(result, log):
    log('{:<14} {:>22} {:>22} {:>26}'.format(
        'mode', 'ours', 'PyTorch DDP', 'ours - theirs'))
    for theirs, ours in PAIRS[1:]:
        row = result['comparison']['{}/{}'.format(theirs, ours)]
        log('{:<14} {:>22} {:>22} {:>26}'.format(
            LABELS[theirs],
            stats.fmt(stats.interval(
                result['ours']['modes'][ours]['scalability_rounds'])),
            stats.fmt(stats.interval(
                result['theirs']['modes'][theirs]['scalability_rounds'])),
            stats.fmt(row['scalability']['difference'])
            + (' *' if row['scalability']['claimed'] else '')))
    b = result['ours']['modes'].get('blocking')
    if b:
        log('ChainerMN blocking: {}'.format(
            stats.fmt(stats.interval(b['scalability_rounds']))))
    log('* the interval excludes zero')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='resnet50',
                   choices=('resnet50', 'resnet18'))
    p.add_argument('--batch', type=int, default=4, help='our batch per rank')
    p.add_argument('--insize', type=int, default=224)
    p.add_argument('--peer-batch', type=int, default=None,
                   help='PyTorch\'s batch (default: compute-matched)')
    p.add_argument('--rounds', type=int, default=12)
    p.add_argument('--iterations', type=int, default=3)
    p.add_argument('--warmup', type=int, default=3,
                   help='>= 2: PowerSGD hooks start at iteration 2')
    p.add_argument('--settle', type=int, default=1)
    p.add_argument('--rate', default=None,
                   help='link rate (default: calibrated with ours)')
    p.add_argument('--out', default=None)
    args = p.parse_args(argv)
    out = args.out or os.path.join(launch.RESULTS, 'peers.json')
    t_start = time.time()

    def log(msg):
        sys.stdout.write('[{:6.0f} s] {}\n'.format(time.time() - t_start,
                                                   msg))
        sys.stdout.flush()

    if not os.path.exists(PEERS_PYTHON):
        sys.stderr.write('peers_bench: {} is missing: run make bench-peers '
                         '(it installs PyTorch there)\n'.format(PEERS_PYTHON))
        return 2
    netbed.require_root()
    cfg = {'model': args.model, 'batch': args.batch, 'insize': args.insize,
           'iterations': args.iterations, 'warmup': max(2, args.warmup),
           'settle': args.settle, 'rounds': args.rounds, 'trace': None}
    t_ours = bedrun.measure_alone(dict(cfg, modes=OURS))
    log('ours alone: {:.3f} s per step at batch {}'.format(t_ours,
                                                          args.batch))
    if args.peer_batch:
        peer_batch, matching = args.peer_batch, []
    else:
        peer_batch, matching = match_batch(cfg, t_ours, log)
    log('PyTorch batch {} (compute-matched to ours)'.format(peer_batch))
    nbytes = bedrun.gradient_bytes(args.model)
    if args.rate:
        rate, calibration = netbed.parse_rate(args.rate), []
    else:
        rate, calibration = bedrun.calibrate(dict(cfg, modes=OURS), t_ours,
                                             nbytes, log)
    ours_cfg = dict(cfg, modes=OURS)
    theirs_cfg = dict(cfg, modes=THEIRS, batch=peer_batch,
                      master_addr=None, master_port=random.randint(
                          20000, 40000), ifname='eth0')
    per_turn = 2 * bedrun.expected_seconds(dict(ours_cfg, rounds=1), t_ours)
    log('both at {:.1f} Mbit/s: {} rounds'.format(rate / 1e6, args.rounds))
    with netbed.NetBed(2, rate) as bed:
        theirs_cfg['master_addr'] = bed.addresses[0]
        record = bed.describe()
        jobs = {'ours': {'command': launch.worker_command(trainer.MODULE,
                                                          ours_cfg),
                         'env': launch.worker_env()},
                'theirs': {'command': peer_command(theirs_cfg),
                           'env': launch.worker_env()}}
        runs = interleave.run_interleaved(bed, jobs, args.rounds, per_turn,
                                          log)
    result = {'benchmark': 'ours against PyTorch DDP, interleaved rounds',
              'machine': machine_description(), 'config': cfg,
              'peer_batch': peer_batch, 'peer_batch_matching': matching,
              't_ours_alone_s': t_ours, 'rate_bit_per_s': rate,
              'calibration': calibration, 'bed': record,
              'peer_version': runs['theirs']['warmup'][0].get('version'),
              'ours': {'modes': interleave.job_summary(
                  runs['ours']['rounds'], OURS)},
              'theirs': {'modes': interleave.job_summary(
                  runs['theirs']['rounds'], THEIRS)}}
    result['comparison'] = interleave.compare(
        result['theirs']['modes'], result['ours']['modes'], PAIRS)
    result['checks'] = {
        'ours - theirs >= 0.05 ({})'.format(LABELS[t]):
            result['comparison']['{}/{}'.format(t, o)]['scalability'][
                'difference']['median'] >= 0.05 for t, o in PAIRS[1:]}
    result['seconds'] = time.time() - t_start
    report(result, log)
    for k, v in result['checks'].items():
        log('check {}: {}'.format(k, 'yes' if v else 'NO'))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, 'w') as f:
        json.dump(result, f, indent=1)
    log('saved ' + out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
