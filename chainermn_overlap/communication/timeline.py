"""Chrome-trace / Perfetto timelines of one rank's training iterations.

Open the JSON files in https://ui.perfetto.dev or chrome://tracing: each
rank is a process with a ``main`` thread (forward per link, waits, deferred
updates, ``update()``) and a ``comm`` thread (each bucket's reduction from
its first to its last byte).  Instants mark when a parameter's gradient
became final and when a bucket was posted.
"""
import json
import os
import time
import weakref

from chainermn_overlap import _patches

# Timelines written at interpreter exit too (write_at_exit).
_AT_EXIT = weakref.WeakSet()


def _write_all():
    for timeline in list(_AT_EXIT):
        timeline.write()


class Timeline(object):
    """Collects trace events in memory and writes them as JSON.

    Args:
        path (str): output file; ``{rank}`` in it is replaced by the rank,
            otherwise ``.rank<r>`` is inserted before the extension.
        rank (int): this process's rank (the trace's process id).
        max_events (int): recording stops after this many events, so that
            a long run keeps its first iterations at bounded memory.
    """

    MAIN, COMM = 0, 1

    def __init__(self, path, rank, max_events=200000):
        if '{rank}' in path:
            path = path.format(rank=rank)
        else:
            stem, ext = os.path.splitext(path)
            path = '{}.rank{}{}'.format(stem, rank, ext or '.json')
        self.path = path
        self.rank = rank
        self.max_events = max_events
        self.t0 = time.perf_counter()
        self.events = [
            {'ph': 'M', 'name': 'process_name', 'pid': rank,
             'args': {'name': 'rank {}'.format(rank)}},
            {'ph': 'M', 'name': 'thread_name', 'pid': rank, 'tid': self.MAIN,
             'args': {'name': 'main'}},
            {'ph': 'M', 'name': 'thread_name', 'pid': rank, 'tid': self.COMM,
             'args': {'name': 'comm'}},
        ]

    @property
    def full(self):
        return len(self.events) >= self.max_events

    def _us(self, t):
        return (t - self.t0) * 1e6

    def span(self, name, cat, start, end, tid=MAIN, args=None):
        if self.full or start is None or end is None:
            return
        ev = {'ph': 'X', 'name': name, 'cat': cat, 'pid': self.rank,
              'tid': tid, 'ts': self._us(start), 'dur': (end - start) * 1e6}
        if args:
            ev['args'] = args
        self.events.append(ev)

    def instant(self, name, cat, t=None, tid=MAIN, args=None):
        if self.full:
            return
        t = time.perf_counter() if t is None else t
        ev = {'ph': 'i', 's': 't', 'name': name, 'cat': cat,
              'pid': self.rank, 'tid': tid, 'ts': self._us(t)}
        if args:
            ev['args'] = args
        self.events.append(ev)

    def write(self):
        """Writes the trace; returns its path."""
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        with open(self.path, 'w') as f:
            json.dump({'traceEvents': self.events,
                       'displayTimeUnit': 'ms'}, f)
        return self.path

    def write_at_exit(self):
        """Writes the trace at interpreter exit too (while it is alive),
        before the engines are closed, which may abort the job."""
        _AT_EXIT.add(self)
        _patches.at_exit(_write_all, order=0)


class NullTimeline(object):
    """The timeline when none is asked for: records nothing, costs a call.

    Code that records events calls it unconditionally instead of testing
    for ``None`` at every event.
    """

    MAIN, COMM = Timeline.MAIN, Timeline.COMM
    enabled = False
    full = True

    def span(self, name, cat, start, end, tid=MAIN, args=None):
        pass

    def instant(self, name, cat, t=None, tid=MAIN, args=None):
        pass

    def write(self):
        return None

    def write_at_exit(self):
        pass


Timeline.enabled = True
