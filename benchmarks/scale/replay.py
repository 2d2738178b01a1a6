"""Replays a recorded training iteration on N simulated hosts (SimGrid).

Run with the system Python that has the Debian package ``python3-simgrid``
(3.32), not the project's virtual environment; the trace comes from
:mod:`benchmarks.scale.trace`::

    /usr/bin/python3 benchmarks/scale/replay.py --trace T.json --nodes 64 \\
        --rate 10gbit --latency 25us --mode ours [--compute-scale 0.5]

It prints one JSON line: the simulated iteration times and the
scalability (one rank's compute-only iteration / the simulated iteration).

What is simulated.  Every rank is a host of a star (each host's own
full-duplex link to a switch of unlimited capacity, ``topology='star'``)
or of a two-level fat-tree with full bisection (``'fat_tree'``); a link
carries ``rate * efficiency`` (MPICH over TCP reached 0.96 of the
tbf rate on the bed) and each of the two links of a host-to-host path adds
half the one-way latency.  Each rank runs two actors:

* the main actor replays the trace's compute spans: per layer its
  deferred update and forward (with ``wait='forward'`` it first waits for
  the layer's bucket of the previous iteration), then backward in reverse
  layer order, posting each bucket once its last layer is done and every
  lower-index bucket is posted (the reducer's rule), then ``update()``;
* the communication actor replays the engine (``mpi_priority``): items of
  a round are the control message (item 0, highest priority) and the
  buckets; before a chunk, while some unfinished item is not known to be
  posted everywhere, an *agreement* (a MIN-allreduce of one int32 per item,
  recursive doubling: log2 N exchanges of small messages) learns which
  items every rank has posted; the highest-priority item among those runs
  its next chunk of ``chunk_bytes`` as MPICH's long-message allreduce
  (recursive halving then doubling, 2 log2 N steps; ``--algorithm ring``:
  2 (N - 1) steps of chunk / N bytes to the right neighbour, as NCCL's
  ring, whose chunk grows with N as the engine's: ``max(chunk, 256 KiB
  * N)``, unless ``--chunk-bytes`` fixes it); each engine step also costs
  the measured software time of the trace (``engine.step_overhead_s``).

``--mode blocking`` replays ChainerMN's blocking optimizer: compute, then
one allreduce per gradient array (recursive doubling below 2 KiB, as
MPICH, the long-message algorithm above), then the update.  ``--mode
bound`` times the reduction of the whole gradient as one allreduce, and
reports the overlap bound ``compute / (compute + max(0, comm -
backward))``: communication hiding perfectly behind backward.

The compute spans of ours were recorded with the communication thread
running: on the bed's one-core ranks they are longer than the compute-only
iteration (the thread's CPU time); ``--no-interference`` scales them to
it, as on a machine where communication takes no CPU time from compute.
Ranks are identical (rank 0's trace for everyone): stragglers, the jitter
of a shared machine and CPU time taken by the communication thread beyond
what the recorded spans contain are not modelled.  Above ``--exact-hosts``
ranks (default 8) the replay runs that many hosts and gives each
collective the step count and message sizes of N ranks: a ring step's
message carries the bytes of all 2 (N - 1) steps plus their latency;
halving and doubling run their first log2(hosts) steps as messages and
the rest (the smallest) as latency plus transfer time.  On a full-bisection
network with identical ranks each host link carries one flow per
direction at any N, so this changes only the number of actors.
"""
import argparse
import importlib.util
import json
import math
import os
import re
import sys


def _load(*parts):
    """A standard-library module of the project, loaded by path: importing
    its package would import Chainer, which the system Python lacks.  Where
    the checkout has no package (beside an installed wheel), the chunk
    rule is the file ``CMO_CHUNKING_FILE`` names, else the installed
    package's (found without importing it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, *parts)
    if not os.path.exists(path) and parts[-1] == 'chunking.py':
        # Given by the caller (benchmarks.scale.project), else found.
        path = os.environ.get('CMO_CHUNKING_FILE') or path
        found = importlib.util.find_spec('chainermn_overlap')
        if not os.path.exists(path) and found is not None and found.origin:
            path = os.path.join(os.path.dirname(found.origin),
                                'communication', 'chunking.py')
    spec = importlib.util.spec_from_file_location(
        '_cmo_' + parts[-1][:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The engine's chunk rule, and the platform.
chunking = _load('..', '..', 'chainermn_overlap', 'communication',
                 'chunking.py')
_platform = _load('platform.py')
platform_xml, TOPOLOGIES = _platform.platform_xml, _platform.TOPOLOGIES

FORMAT = 'chainermn_overlap-replay-trace/1'
MODES = ('ours', 'blocking', 'bound')
# Long-message allreduce: MPICH's recursive halving/doubling
# (Rabenseifner), or a ring (NCCL's, 2 (N-1) latency terms).
ALGORITHMS = ('halving', 'ring')
# MPICH's threshold between its short-message (recursive doubling) and
# long-message allreduce (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE).
SHORT_MSG_BYTES = 2048
# Bytes of the agreement's flags per item (int32) and of the control
# message per rank (two int64) plus its two leading int64.
AGREEMENT_BYTES_PER_ITEM = 4


class TraceError(ValueError):
    """A trace that is not in the replay format."""


# ---------------------------------------------------------------- parsing

def parse_quantity(text, units, what):
    """``'10gbit'`` -> 1e10 with ``units`` a dict suffix -> factor."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r'\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*', str(text))
    if not m or m.group(2).lower() not in units:
        raise ValueError('cannot read {} {!r}: give a number with one of the '
                         'units {}'.format(what, text, sorted(units)))
    return float(m.group(1)) * units[m.group(2).lower()]


def parse_rate(text):
    return parse_quantity(text, {'': 1, 'bit': 1, 'kbit': 1e3, 'mbit': 1e6,
                                 'gbit': 1e9}, 'link rate')


def parse_seconds(text):
    return parse_quantity(text, {'': 1, 's': 1, 'ms': 1e-3, 'us': 1e-6},
                          'latency')


def validate_trace(trace):
    """Checks a replay trace (see docs/performance.md); returns it.

    Raises:
        TraceError: naming the first field that is missing or wrong.
    """
    if not isinstance(trace, dict) or trace.get('format') != FORMAT:
        raise TraceError('not a replay trace: "format" must be {!r} (write '
                         'one with benchmarks/scale/trace.py)'.format(FORMAT))
    for key in ('layers', 'buckets', 'engine', 'wait', 'update_s'):
        if key not in trace:
            raise TraceError('replay trace lacks {!r}'.format(key))
    if trace['wait'] not in ('forward', 'update'):
        raise TraceError('"wait" must be "forward" or "update", got {!r}'
                         .format(trace['wait']))
    names = set()
    for i, layer in enumerate(trace['layers']):
        for key in ('name', 'forward_s', 'backward_s', 'update_s',
                    'param_bytes'):
            if key not in layer:
                raise TraceError('layer {} lacks {!r}'.format(i, key))
        for key in ('forward_s', 'backward_s', 'update_s'):
            if not layer[key] >= 0:
                raise TraceError('layer {} ({}): {} must be >= 0, got {!r}'
                                 .format(i, layer['name'], key, layer[key]))
        names.add(layer['name'])
    for b, bucket in enumerate(trace['buckets']):
        if bucket.get('index') != b:
            raise TraceError('buckets must be listed by index: entry {} has '
                             'index {!r}'.format(b, bucket.get('index')))
        if not bucket.get('bytes', 0) > 0:
            raise TraceError('bucket {} has no bytes'.format(b))
        if bucket.get('final_after') not in names:
            raise TraceError('bucket {}: final_after {!r} is no layer of the '
                             'trace'.format(b, bucket.get('final_after')))
        for name in bucket.get('waited_by', []):
            if name not in names:
                raise TraceError('bucket {}: waited_by names {!r}, no layer'
                                 .format(b, name))
    eng = trace['engine']
    for key in ('chunk_bytes', 'step_overhead_s'):
        if key not in eng:
            raise TraceError('engine lacks {!r}'.format(key))
    return trace


def load_trace(path):
    with open(path) as f:
        return validate_trace(json.load(f))


# ---------------------------------------------------------- closed forms

def ring_allreduce_seconds(nodes, nbytes, latency_s, bytes_per_s):
    """α-β time of a ring allreduce: 2 (N-1) steps of nbytes / N."""
    if nodes < 2:
        return 0.0
    return 2 * (nodes - 1) * (latency_s + nbytes / nodes / bytes_per_s)


def halving_allreduce_seconds(nodes, nbytes, latency_s, bytes_per_s):
    """α-β time of Rabenseifner's allreduce (N a power of two)."""
    if nodes < 2:
        return 0.0
    steps = int(round(math.log2(nodes)))
    return 2 * (steps * latency_s
                + nbytes * (nodes - 1) / nodes / bytes_per_s)


def chunk_sizes(nbytes, chunk_bytes):
    """The engine's chunks of one item (the last one shorter)."""
    out = []
    left = nbytes
    while left > 0:
        out.append(min(chunk_bytes, left))
        left -= out[-1]
    return out


def compute_seconds(trace, scale=1.0):
    """One rank's iteration without communication: the denominator."""
    if trace.get('alone_iteration_s'):
        return trace['alone_iteration_s'] * scale
    return scale * (sum(l['forward_s'] + l['backward_s'] + l['update_s']
                        for l in trace['layers']) + trace['update_s'])


# -------------------------------------------------------------- the replay

class Replay(object):
    """One simulation of ``nodes`` ranks (one per process: SimGrid's engine
    is created once)."""

    def __init__(self, trace, nodes, rate_bit_per_s, latency_s, mode='ours',
                 topology='star', efficiency=1.0, compute_scale=1.0,
                 iterations=4, exact_hosts=8, step_overhead_s=None,
                 algorithm='halving', interference=True, chunk_bytes=None):
        import simgrid
        if mode not in MODES:
            raise ValueError('mode must be one of {}'.format(MODES))
        self.sg = simgrid
        self.trace = trace
        self.nodes = nodes
        self.hosts = min(nodes, exact_hosts)
        if self.hosts & (self.hosts - 1):
            raise ValueError('the replay needs a power of two of hosts (the '
                             'agreement is recursive doubling), got {}'
                             .format(self.hosts))
        if algorithm not in ALGORITHMS:
            raise ValueError('algorithm must be one of {}'.format(ALGORITHMS))
        self.algorithm = algorithm
        self.interference = interference
        self.mode = mode
        self.iterations = iterations
        self.scale = self.base_scale = compute_scale
        self.latency = latency_s
        self.bps = rate_bit_per_s * efficiency / 8.0
        eng = trace['engine']
        # The recorded chunk (MPI's); a ring's grows with N as the engine's.
        self.chunk_bytes = int(chunk_bytes or eng['chunk_bytes'])
        if algorithm == 'ring' and not chunk_bytes:
            self.chunk_bytes = max(self.chunk_bytes,
                                   chunking.ring_chunk_bytes(nodes))
        self.step_overhead = (eng['step_overhead_s'] if step_overhead_s is None
                              else step_overhead_s)
        self.layers = trace['layers']
        self.buckets = trace['buckets']
        self.wait = trace['wait']
        path = '/tmp/cmo-replay-{}.xml'.format(os.getpid())
        with open(path, 'w') as f:
            f.write(platform_xml(self.hosts, rate_bit_per_s, latency_s,
                                 topology, efficiency))
        self.engine = simgrid.Engine([
            'replay', '--cfg=network/model:CM02',
            '--cfg=network/crosstraffic:0',
            '--cfg=network/TCP-gamma:1e12',
            '--log=root.thres:critical'])
        self.engine.load_platform(path)
        os.unlink(path)
        self.exchanges = [0] * self.hosts
        self.contrib = {}
        self.starts = [[] for _ in range(self.hosts)]
        self.comm_busy = 0.0

    # -- messages ----------------------------------------------------------

    def _mb(self, kind, rank):
        return self.sg.Mailbox.by_name('{}{}'.format(kind, rank))

    def _sendrecv(self, kind, rank, peer_to, peer_from, nbytes, extra_s=0.0):
        del peer_from  # a mailbox per receiver: any sender's message fits
        c = self._mb(kind, peer_to).put_async(rank, max(1, int(nbytes)))
        self._mb(kind, rank).get()
        c.wait()
        if extra_s > 0:
            self.sg.this_actor.sleep_for(extra_s)

    def allreduce(self, rank, nbytes, kind='big'):
        """A large-message allreduce of ``nbytes`` (``self.algorithm``)."""
        if self.algorithm == 'ring':
            self.ring(rank, nbytes, kind)
        else:
            self.halving(rank, nbytes, kind)

    def ring(self, rank, nbytes, kind='ring'):
        """A ring allreduce of ``nbytes`` (see the module on > exact)."""
        n, h = self.nodes, self.hosts
        right, left = (rank + 1) % h, (rank - 1) % h
        if n == 1:
            return
        if n == h:
            for _ in range(2 * (n - 1)):
                self._sendrecv(kind, rank, right, left, nbytes / n)
            return
        steps = 2 * (n - 1)
        self._sendrecv(kind, rank, right, left, nbytes / n * steps,
                       extra_s=(steps - 1) * self.latency)

    def halving(self, rank, nbytes, kind='rab'):
        """Rabenseifner's allreduce (MPICH's for long messages): recursive
        halving reduce-scatter, then recursive doubling allgather; step k
        of each half moves nbytes / 2^k.  Steps beyond the simulated hosts
        (the smallest messages) are added as latency plus transfer."""
        if self.nodes == 1:
            return
        sizes = [nbytes / 2.0 ** k
                 for k in range(1, int(round(math.log2(self.nodes))) + 1)]
        real = int(round(math.log2(self.hosts)))
        extra = sum(self.latency + s / self.bps for s in sizes[real:])
        for k in range(real):
            peer = rank ^ (self.hosts >> (k + 1))
            self._sendrecv('{}h{}-'.format(kind, k), rank, peer, peer,
                           sizes[k])
        self.sleep_raw(2 * extra)
        for k in reversed(range(real)):
            peer = rank ^ (self.hosts >> (k + 1))
            self._sendrecv('{}d{}-'.format(kind, k), rank, peer, peer,
                           sizes[k])

    def doubling(self, rank, nbytes, kind):
        """A recursive-doubling allreduce of ``nbytes`` (small messages)."""
        if self.nodes == 1:
            return
        h = self.hosts
        k = 1
        while k < h:
            # A mailbox per round: a partner already in its next round
            # cannot be mistaken for this round's.
            self._sendrecv('{}{}-'.format(kind, k), rank, rank ^ k, rank ^ k,
                           nbytes)
            k <<= 1
        missing = (math.ceil(math.log2(self.nodes))
                   - int(round(math.log2(h))))
        if missing > 0:
            self.sg.this_actor.sleep_for(
                missing * (self.latency + nbytes / self.bps))

    # -- compute -----------------------------------------------------------

    def sleep(self, seconds):
        if seconds > 0:
            self.sg.this_actor.sleep_for(seconds * self.scale)

    def now(self):
        return self.sg.Engine.clock

    # -- ours --------------------------------------------------------------

    def _ours_main(self, rank, st):
        final_after = {}
        for b in self.buckets:
            final_after.setdefault(b['final_after'], []).append(b['index'])
        waited = {}
        for b in self.buckets:
            for name in b.get('waited_by', []):
                waited.setdefault(name, []).append(b['index'])
        for it in range(self.iterations):
            self.starts[rank].append(self.now())
            for layer in self.layers:
                if it and self.wait == 'forward':
                    for b in waited.get(layer['name'], []):
                        self._wait_done(st, it - 1, b)
                    self.sleep(layer['update_s'])
                self.sleep(layer['forward_s'])
            final = set()
            nxt = 0
            for layer in reversed(self.layers):
                self.sleep(layer['backward_s'])
                final.update(final_after.get(layer['name'], []))
                while nxt < len(self.buckets) and nxt in final:
                    self._post(st, it, nxt)
                    nxt += 1
            while nxt < len(self.buckets):
                self._post(st, it, nxt)
                nxt += 1
            self.sleep(self.trace['update_s'])
            if self.wait == 'update':
                for b in range(len(self.buckets)):
                    self._wait_done(st, it, b)
                self.sleep(sum(l['update_s'] for l in self.layers))
        self.starts[rank].append(self.now())
        for b in range(len(self.buckets)):
            self._wait_done(st, self.iterations - 1, b)

    def _post(self, st, it, b):
        if b == 0:   # the control message goes first (before_first_post)
            st['posted'].add((it, 0))
        st['posted'].add((it, b + 1))
        st['work'].release()

    def _wait_done(self, st, it, b):
        while (it, b + 1) not in st['done']:
            st['fin'].acquire()

    def _ours_comm(self, rank, st):
        n_items = len(self.buckets) + 1
        sizes = [16 + 16 * self.nodes] + [b['bytes'] for b in self.buckets]
        # wait='forward': the last bucket (first layers) first.
        prio = [float('inf')] + [
            (i if self.wait == 'forward' else -i)
            for i in range(len(self.buckets))]
        for it in range(self.iterations):
            left = {i: chunk_sizes(sizes[i], self.chunk_bytes)
                    for i in range(n_items)}
            known, done = set(), set()
            while len(done) < n_items:
                unfinished = [i for i in range(n_items) if i not in done]
                nxt = _choose(unfinished, known, prio)
                if nxt is None or any(i not in known for i in unfinished):
                    known |= self._agree(rank, st, it, n_items)
                    nxt = _choose(unfinished, known, prio)
                    if nxt is None:
                        nxt = unfinished[0]
                        while (it, nxt) not in st['posted']:
                            st['work'].acquire()
                        known.add(nxt)
                nbytes = left[nxt].pop(0)
                t0 = self.now()
                if nxt == 0:
                    self.doubling(rank, nbytes, 'ctl')
                else:
                    self.allreduce(rank, nbytes)
                self.sleep_raw(self.step_overhead)
                if rank == 0:
                    self.comm_busy += self.now() - t0
                if not left[nxt]:
                    done.add(nxt)
                    st['done'].add((it, nxt))
                    st['fin'].release()

    def _agree(self, rank, st, it, n_items):
        k = self.exchanges[rank]
        self.exchanges[rank] += 1
        mine = {i for i in range(n_items) if (it, i) in st['posted']}
        self.contrib.setdefault(k, []).append(mine)
        self.doubling(rank, AGREEMENT_BYTES_PER_ITEM * n_items, 'agree')
        self.sleep_raw(self.step_overhead)
        # Recursive doubling: every rank has entered by the time this
        # rank's last exchange completes.
        return set.intersection(*self.contrib[k])

    def sleep_raw(self, seconds):
        if seconds > 0:
            self.sg.this_actor.sleep_for(seconds)

    # -- blocking and bound ------------------------------------------------

    def _blocking_main(self, rank):
        for _ in range(self.iterations):
            self.starts[rank].append(self.now())
            for layer in self.layers:
                self.sleep(layer['forward_s'])
            for layer in reversed(self.layers):
                self.sleep(layer['backward_s'])
            for layer in reversed(self.layers):
                for nbytes in layer['param_bytes']:
                    if nbytes <= SHORT_MSG_BYTES:
                        self.doubling(rank, nbytes, 'blk')
                    else:
                        self.allreduce(rank, nbytes, 'blk')
            self.sleep(self.trace['update_s']
                       + sum(l['update_s'] for l in self.layers))
        self.starts[rank].append(self.now())

    def _bound_main(self, rank):
        # The whole gradient as one allreduce: the fewest latency terms.
        total = sum(b['bytes'] for b in self.buckets)
        for _ in range(self.iterations):
            self.starts[rank].append(self.now())
            self.allreduce(rank, total)
        self.starts[rank].append(self.now())

    # -- running -----------------------------------------------------------

    def run(self):
        hosts = self.engine.all_hosts
        if (self.mode == 'blocking' or not self.interference) and \
                self.trace.get('alone_iteration_s'):
            # No communication thread shares the core (blocking), or its
            # CPU time is not to be replayed (interference=False): the
            # spans, taken with one running, are scaled to the compute-only
            # iteration.
            spans = compute_seconds(dict(self.trace, alone_iteration_s=None))
            self.scale *= self.trace['alone_iteration_s'] / spans
        for r in range(self.hosts):
            if self.mode == 'ours':
                st = {'posted': set(), 'done': set(),
                      'work': self.sg.Semaphore(0),
                      'fin': self.sg.Semaphore(0)}
                self.sg.Actor.create('main{}'.format(r), hosts[r],
                                     self._ours_main, r, st)
                self.sg.Actor.create('comm{}'.format(r), hosts[r],
                                     self._ours_comm, r, st)
            elif self.mode == 'blocking':
                self.sg.Actor.create('main{}'.format(r), hosts[r],
                                     self._blocking_main, r)
            else:
                self.sg.Actor.create('main{}'.format(r), hosts[r],
                                     self._bound_main, r)
        self.engine.run()
        return self.result()

    def result(self):
        per_rank = [[b - a for a, b in zip(s, s[1:])] for s in self.starts]
        # Steady state: the first iteration has no previous one to wait for.
        steady = [max(r[i] for r in per_rank)
                  for i in range(1 if self.iterations > 1 else 0,
                                 self.iterations)]
        t_iter = sorted(steady)[len(steady) // 2]
        t_c = compute_seconds(self.trace, self.base_scale)
        out = {'mode': self.mode, 'nodes': self.nodes,
               'simulated_hosts': self.hosts,
               'iteration_s': t_iter, 'iterations_s': steady,
               'compute_s': t_c, 'bytes_per_s': self.bps,
               'latency_s': self.latency}
        if self.mode == 'bound':
            t_bwd = self.scale * sum(l['backward_s'] for l in self.layers)
            out['comm_s'] = t_iter
            out['backward_s'] = t_bwd
            out['scalability'] = t_c / (t_c + max(0.0, t_iter - t_bwd))
        else:
            out['scalability'] = t_c / t_iter
        if self.mode == 'ours':
            out['agreements_per_iteration'] = (
                self.exchanges[0] / float(self.iterations))
            out['comm_busy_s_per_iteration'] = (
                self.comm_busy / float(self.iterations))
        return out


def _choose(unfinished, known, prio):
    ready = [i for i in unfinished if i in known]
    if not ready:
        return None
    return max(ready, key=lambda i: (prio[i], -i))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--trace', required=True)
    p.add_argument('--nodes', type=int, required=True)
    p.add_argument('--rate', required=True, help='e.g. 10gbit, 737mbit')
    p.add_argument('--latency', default='25us',
                   help='one-way host-to-host latency (default 25us)')
    p.add_argument('--mode', choices=MODES, default='ours')
    p.add_argument('--topology', choices=TOPOLOGIES, default='star')
    p.add_argument('--efficiency', type=float, default=1.0,
                   help='fraction of the link rate a transfer reaches')
    p.add_argument('--compute-scale', type=float, default=1.0)
    p.add_argument('--step-overhead', default=None,
                   help="the engine's software time per step (default: the "
                        "trace's)")
    p.add_argument('--iterations', type=int, default=4)
    p.add_argument('--exact-hosts', type=int, default=8)
    p.add_argument('--no-interference', action='store_true',
                   help='ours: scale the compute spans to the compute-only '
                        'iteration (the communication thread takes no CPU '
                        'time from compute, as with a GPU or a spare core)')
    p.add_argument('--algorithm', choices=ALGORITHMS, default='halving',
                   help='long-message allreduce (default: MPICH\'s)')
    p.add_argument('--chunk-bytes', type=int, default=None,
                   help="ours: the engine's chunk at any N (default: the "
                        "trace's; with --algorithm ring, grown with N as "
                        "the engine's ring chunk)")
    args = p.parse_args(argv)
    trace = load_trace(args.trace)
    rep = Replay(trace, args.nodes, parse_rate(args.rate),
                 parse_seconds(args.latency), args.mode, args.topology,
                 args.efficiency, args.compute_scale, args.iterations,
                 args.exact_hosts,
                 None if args.step_overhead is None
                 else parse_seconds(args.step_overhead), args.algorithm,
                 not args.no_interference, args.chunk_bytes)
    sys.stdout.write(json.dumps(rep.run()) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
