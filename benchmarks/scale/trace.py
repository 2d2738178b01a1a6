"""The replay trace: what one training iteration did, read from a timeline.

:func:`from_timeline` turns the Chrome-trace timeline that the optimizer
writes with ``timeline=PATH`` (:mod:`chainermn_overlap.communication.
timeline`) into the replay format of :mod:`benchmarks.scale.replay`
(``format: chainermn_overlap-replay-trace/1``, described field by field in
docs/performance.md, "Beyond two ranks").  Everything in it is measured on
the rank whose timeline is read, in one iteration (by default the one of
median length among the complete ones after the first):

* per layer, in forward order: ``forward_s`` (its forward span less its
  deferred update, which the recorder's span includes),
  ``backward_s`` (from the previous layer's gradients being final, or the
  end of forward for the last layer, to this layer's last gradient being
  final: its backward and the loss's for the last layer), ``update_s`` (its
  deferred update span with ``wait='forward'``, less the wait for its
  bucket inside it: the replay waits by itself), ``param_bytes``;
  ``forward_s`` runs to the next layer's start (the functions between
  links count with the layer before them), and the trace's ``update_s`` is
  the rest of the iteration (the ``update()`` call, the loss's forward,
  what runs between iterations), so that the compute adds up to the
  recorded iteration less its waits (``waits_s``);
* per bucket: ``bytes``, ``final_at_s`` (its post, after the iteration's
  start), ``final_after`` (the layer after whose backward it was posted),
  ``waited_by`` (the layers whose forward waits for it), and the chunks
  the engine ran for it, in the order it ran them (``engine.chunks``:
  the priority decisions as observed);
* ``engine.step_overhead_s``: the median gap on the communication thread
  between one chunk's end and the next chunk's start when that chunk's
  bucket was already posted here: the engine's own time per step (the
  agreement's MIN-allreduce, when there is one, and the thread's Python),
  as measured; ``engine.control_s``: the median time from an iteration's
  first post to its first chunk (the control message and the first
  agreement, plus any wait for the slowest rank's post).

Parameter sizes come from the model (the timeline names parameters but
not their sizes): pass ``param_bytes`` as a dict link name -> list of byte
counts (:func:`param_bytes_of`).
"""
import json
import re
import statistics

FORMAT = 'chainermn_overlap-replay-trace/1'
_ITER = re.compile(r'of iteration (\d+)$')
_CHUNK = re.compile(r'allreduce bucket (\d+)(?: chunk (\d+)/(\d+))?$')


def param_bytes_of(model):
    """Link name (as the timeline writes it) -> byte counts of its
    parameters, for a Chainer model."""
    out = {}
    for name, param in model.namedparams():
        link = name.rsplit('/', 1)[0]
        if param.array is not None:
            out.setdefault(link, []).append(int(param.array.nbytes))
    return out


def _events(timeline):
    if isinstance(timeline, str):
        with open(timeline) as f:
            timeline = json.load(f)
    evs = timeline['traceEvents'] if isinstance(timeline, dict) else timeline
    return [e for e in evs if e.get('ph') in ('X', 'i')]


def iteration_windows(events):
    """(start_us, end_us) of each iteration: from one ``update()`` span's end
    to the next one's end (the first from the first event)."""
    ends = sorted(e['ts'] + e['dur'] for e in events
                  if e['ph'] == 'X' and e['name'] == 'update()')
    if len(ends) < 2:
        raise ValueError('the timeline holds {} update() call(s); the trace '
                         'needs at least 2 complete iterations'.format(
                             len(ends)))
    return list(zip(ends[:-1], ends[1:]))


def from_timeline(timeline, param_bytes, wait='forward', iteration='median',
                  chunk_bytes=4 << 20, meta=None):
    """The replay trace of one iteration of ``timeline`` (a path or the
    loaded JSON).

    Args:
        param_bytes (dict): link name -> byte counts (:func:`param_bytes_of`).
        wait (str): the optimizer's ``wait`` of the recorded run.
        iteration (int or str): which complete iteration (index into the
            windows between ``update()`` calls), or ``'median'``: the one
            of median length (the upper one of an even count) among all
            but the first, whose forward had no deferred updates.
        chunk_bytes (int): the engine's chunk size in the recorded run.
        meta (dict): copied into the trace (model, link, ranks, ...).
    """
    events = _events(timeline)
    windows = iteration_windows(events)
    if iteration == 'median':
        # Not the first: its forward had no deferred updates to apply.
        steady = list(range(1, len(windows))) or [0]
        iteration = sorted(steady, key=lambda w: (
            windows[w][1] - windows[w][0]))[len(steady) // 2]
    t0, t1 = windows[iteration]
    inside = [e for e in events if e['ph'] == 'X' and e.get('tid') == 0
              and t0 <= e['ts'] < t1] + [
                  e for e in events if e['ph'] == 'i' and t0 <= e['ts'] < t1]
    fwd = sorted((e for e in inside if e.get('cat') == 'forward'),
                 key=lambda e: e['ts'])
    if not fwd:
        raise ValueError('no forward spans in iteration {}: record the run '
                         'with timeline= on the overlapped optimizer'
                         .format(iteration))
    order = [e['name'][len('forward '):] for e in fwd]
    # A forward span starts before the layer's deferred update (which
    # starts with the wait for its bucket): both are taken out of it, and
    # the waits out of the update, so that the replay's own waits replace
    # the recorded ones.
    upd_spans = [e for e in inside if e.get('cat') == 'update'
                 and e['name'].startswith('update /')]
    waits = [e for e in inside if e.get('cat') == 'wait']
    lone_waits = [w for w in waits
                  if not any(_inside(w, u) for u in upd_spans)]
    forward_s = {}
    for j, (e, name) in enumerate(zip(fwd, order)):
        # Until the next layer starts: the functions between links (ReLU,
        # pooling, additions) belong to the layer before them.
        until = fwd[j + 1]['ts'] if j + 1 < len(fwd) else e['ts'] + e['dur']
        stretch = dict(e, dur=until - e['ts'])
        own = (stretch['dur'] - _nested(stretch, upd_spans)
               - _nested(stretch, lone_waits))
        forward_s[name] = forward_s.get(name, 0.0) + own * 1e-6
    order = list(dict.fromkeys(order))
    update_s = {}
    for e in upd_spans:
        name = e['name'][len('update '):]
        update_s[name] = update_s.get(name, 0.0) + (
            e['dur'] - _nested(e, waits)) * 1e-6
    ready, first_ready = {}, {}
    for e in inside:
        if e['ph'] == 'i' and e['name'].startswith('grad ready '):
            layer = e['name'][len('grad ready '):].rsplit('/', 1)[0]
            ready[layer] = max(ready.get(layer, 0.0), e['ts'])
            first_ready[layer] = min(first_ready.get(layer, e['ts']),
                                     e['ts'])
    fwd_end = max(e['ts'] + e['dur'] for e in fwd)
    backward_s, prev = {}, fwd_end
    for name in sorted(ready, key=ready.get):
        backward_s[name] = max(0.0, ready[name] - prev) * 1e-6
        prev = ready[name]
    posts = sorted((e for e in inside if e['ph'] == 'i'
                    and e['name'].startswith('post bucket ')),
                   key=lambda e: e['ts'])
    post_at = {}
    for e in posts:
        post_at.setdefault(int(e['name'].rsplit(' ', 1)[1]), e['ts'])
    it_no = _iteration_number(events, t0, t1)
    chunks = _chunks(events, it_no)
    nbytes = {}
    for c in chunks:
        nbytes[c['bucket']] = c['bytes']
    buckets = []
    by_ready = sorted(ready, key=ready.get)
    for b in sorted(post_at):
        # The layer whose gradients made it final: the last one ready
        # before its post.
        before = [n for n in by_ready if ready[n] <= post_at[b]]
        buckets.append({'index': b, 'bytes': nbytes.get(b, 0),
                        'final_at_s': (post_at[b] - t0) * 1e-6,
                        'final_after': before[-1] if before else by_ready[0],
                        'waited_by': []})
    # A layer's forward waits for every bucket holding one of its
    # gradients: from the first post after its first gradient was final to
    # the first post after its last one.
    for name in order:
        if name not in ready:
            continue
        after = [b for b in buckets if post_at[b['index']] >= ready[name]]
        for b in buckets:
            if after and first_ready[name] <= post_at[b['index']] <= \
                    post_at[after[0]['index']]:
                b['waited_by'].append(name)
    layers = [{'name': n, 'forward_s': forward_s.get(n, 0.0),
               'backward_s': backward_s.get(n, 0.0),
               'update_s': update_s.get(n, 0.0) if wait == 'forward' else
               0.0, 'param_bytes': list(param_bytes.get(n, []))}
              for n in order]
    # The rest of the iteration, waits excepted: the update() call, the
    # loss, the Python between iterations.
    rest = ((t1 - t0) - sum(w['dur'] for w in waits)) * 1e-6 - sum(
        l['forward_s'] + l['backward_s'] + l['update_s'] for l in layers)
    trace = {
        'format': FORMAT, 'wait': wait, 'iteration_index': iteration,
        'layers': layers,
        'buckets': buckets, 'update_s': max(0.0, rest),
        'waits_s': sum(w['dur'] for w in waits) * 1e-6,
        'iteration_s': (t1 - t0) * 1e-6,
        'engine': dict(_engine_costs(events, windows, chunks),
                       backend='mpi_priority', chunk_bytes=chunk_bytes,
                       priority=('bucket index, highest first (the first '
                                 'layers\' bucket)' if wait == 'forward' else
                                 'bucket index, lowest first'),
                       chunks=[{k: c[k] for k in ('bucket', 'part', 'of',
                                                  'start_s', 'dur_s')}
                               for c in chunks]),
    }
    for c in trace['engine']['chunks']:
        c['start_s'] -= t0 * 1e-6
    trace.update(meta or {})
    return trace


def _inside(a, b):
    return b['ts'] <= a['ts'] and a['ts'] + a['dur'] <= b['ts'] + b['dur']


def _nested(span, spans):
    """Microseconds of ``spans`` that lie inside ``span``."""
    a, b = span['ts'], span['ts'] + span['dur']
    return sum(e['dur'] for e in spans if e is not span and a <= e['ts']
               and e['ts'] + e['dur'] <= b)


def _iteration_number(events, t0, t1):
    """The optimizer's iteration number of the chunks posted in
    (t0, t1]: that of the comm spans starting nearest after the first post."""
    posts = [e['ts'] for e in events if e['ph'] == 'i'
             and e['name'].startswith('post bucket ') and t0 <= e['ts'] < t1]
    if not posts:
        raise ValueError('no bucket posted in the chosen iteration')
    cands = [e for e in events if e.get('cat') == 'comm'
             and e['ts'] >= min(posts)]
    m = _ITER.search(min(cands, key=lambda e: e['ts'])['args']['label'])
    return int(m.group(1))


def _chunks(events, it_no):
    out = []
    for e in events:
        if e.get('cat') != 'comm':
            continue
        m = _CHUNK.match(e['name'])
        it = _ITER.search(e.get('args', {}).get('label', ''))
        if not m or not it or int(it.group(1)) != it_no:
            continue
        out.append({'bucket': int(m.group(1)),
                    'part': int(m.group(2) or 1), 'of': int(m.group(3) or 1),
                    'start_s': e['ts'] * 1e-6, 'dur_s': e['dur'] * 1e-6,
                    'end_us': e['ts'] + e['dur'], 'ts': e['ts'],
                    'bytes': int(e['args'].get('bytes', 0))})
    out.sort(key=lambda c: c['ts'])
    return out


def _engine_costs(events, windows, chunks):
    """Median gap between chunks (bucket already posted) and median
    first-post-to-first-chunk time, over every iteration of the timeline."""
    posts = sorted((e['ts'], int(e['name'].rsplit(' ', 1)[1])) for e in events
                   if e['ph'] == 'i' and e['name'].startswith('post bucket '))
    comm = sorted((e for e in events if e.get('cat') == 'comm'
                   and _CHUNK.match(e['name'])), key=lambda e: e['ts'])
    gaps = []
    for a, b in zip(comm, comm[1:]):
        bucket = int(_CHUNK.match(b['name']).group(1))
        end = a['ts'] + a['dur']
        # Posted here before the previous chunk ended (same iteration: the
        # latest post of that bucket before the chunk).
        mine = [t for t, i in posts if i == bucket and t <= b['ts']]
        if mine and mine[-1] <= end:
            gaps.append((b['ts'] - end) * 1e-6)
    firsts = []
    for t0, t1 in windows:
        p = [t for t, _ in posts if t0 <= t < t1]
        c = [e['ts'] for e in comm if p and e['ts'] >= min(p)]
        if p and c:
            firsts.append((min(c) - min(p)) * 1e-6)
    return {'step_overhead_s': statistics.median(gaps) if gaps else 0.0,
            'step_gaps_measured': len(gaps),
            'control_s': statistics.median(firsts) if firsts else None}
