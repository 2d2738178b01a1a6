"""The NCCL engine: reductions on a stream of their own, ordered by events.

``'nccl'`` (:class:`NcclEngine`) reduces device arrays where they are.  A
post records an event on the caller's (compute) stream right after the
kernels that produced the buffer; the engine's reduction stream waits on
that event and then runs the allreduce, so the host never synchronises on
the critical path.  A wait makes the compute stream wait on the
reduction's completion event (``sync='stream'``, the default) instead of
blocking the host; ``sync='host'`` blocks the host instead (bounded by the
watchdog).

What runs when is the priority engine's policy
(:class:`~chainermn_overlap.communication.scheduler.PriorityMpiBackend`):
buckets are sliced into chunks, and every rank issues the same chunks in
the same order, chosen from knowledge all ranks share (control exchanges
are small MPI allreduces on the host).  That order matters as much for
NCCL as for MPI: NCCL matches collectives by launch order.  Issuing a
chunk only enqueues it, so the engine keeps at most ``max_inflight`` chunks
on the stream and waits (in its own thread) for the oldest before issuing
more; priority then decides which bucket goes next, the stream is never
idle while work is posted, and a collective that never completes holds the
chunks behind it, which the watchdog reports.

The engine's communication thread, failure latch, stuck check, debug
check, status and stall reports are the engine base's
(:mod:`~chainermn_overlap.communication.engine`).  Errors on a stream are
asynchronous: the thread sees them when it retires the chunk, latches them,
and every wait from then on raises.  A chunk still on the stream after the
watchdog's timeout latches a :class:`~chainermn_overlap.CommunicationTimeout`
and aborts the NCCL communicator, which unblocks the stream.

The streams are reached only through the stream interface of
:mod:`~chainermn_overlap.communication.streams`: the real one (cupy and
NCCL, imported when the engine is built) or the CPU stand-in, on which the
MPI tests run this engine without a GPU.

Collectives of the caller's own (:meth:`Engine.run`: the float16 ring,
compression) run in the engine's order too, host-staged through MPI as on
the other engines: the engine's thread waits for the producing kernels,
runs the collective, and the result is copied back on the reduction stream.
"""
import collections
import threading
import time
from typing import Any, Optional, Sequence

import numpy

import chainer

from chainermn_overlap._host import to_host
from chainermn_overlap.communication import engine as engine_module
from chainermn_overlap.communication import streams as streams_module
from chainermn_overlap.communication.chunking import ring_chunk_bytes
from chainermn_overlap.communication.scheduler import PriorityMpiBackend
from chainermn_overlap.errors import CommunicationError
from chainermn_overlap.errors import CommunicationTimeout

__all__ = ['NcclEngine', 'default_backend', 'pack_arrays', 'unpack_arrays']

SYNC_MODES = ('stream', 'host')


#: Whether ``backend=None`` may pick ``'nccl'`` by itself.  Off until a GPU
#: run has shown the engine to work (docs/gpu.md): it was written and tested
#: on the CPU stand-in only, so GPU parameters get the host-staged MPI
#: engine unless the caller opts in with ``backend='nccl'``.
NCCL_BY_DEFAULT = False


def default_backend(array_module: Any, nccl_available: bool,
                    ranks_share_device: bool = False,
                    nccl_by_default: Optional[bool] = None) -> str:
    """The engine for parameters of ``array_module``: a pure function.

    Args:
        array_module: ``numpy`` or ``cupy`` (the module, or its name).
        nccl_available (bool): whether cupy has NCCL and sees a GPU (see
            :func:`chainermn_overlap.communication.streams.nccl_available`).
        ranks_share_device (bool): whether several ranks of the job use the
            same GPU; NCCL refuses that ("Duplicate GPU detected").
        nccl_by_default (bool): whether ``'nccl'`` may be chosen at all;
            default :data:`NCCL_BY_DEFAULT` (off: ``backend='nccl'`` opts
            in until the engine has run on a GPU).

    Returns:
        str: ``'nccl'`` for device parameters when NCCL may be chosen and
        can be used, otherwise ``'mpi_priority'`` (host-staged MPI).
    """
    if nccl_by_default is None:
        nccl_by_default = NCCL_BY_DEFAULT
    name = getattr(array_module, '__name__', array_module)
    if (nccl_by_default and name == 'cupy' and nccl_available
            and not ranks_share_device):
        return 'nccl'
    return 'mpi_priority'


def pack_arrays(xp: Any, arrays: Sequence[Any], out: Any) -> Any:
    """Packs ``arrays`` (flattened, in order) into the flat ``out``.

    One concatenation kernel for all members on cupy (instead of one copy
    per member); the same call on numpy.  ``out`` must hold exactly the
    members' elements; members are cast to its dtype.
    """
    n = sum(int(a.size) for a in arrays)
    if out.ndim != 1 or out.size != n:
        raise ValueError('pack_arrays: out must be flat with {} elements '
                         '(the members\' total), got shape {}'.format(
                             n, out.shape))
    if not arrays:
        return out
    flat = [a.reshape(-1) if a.dtype == out.dtype
            else a.reshape(-1).astype(out.dtype) for a in arrays]
    xp.concatenate(flat, out=out)
    return out


def unpack_arrays(xp: Any, buffer: Any, outs: Sequence[Any]) -> None:
    """Copies consecutive pieces of the flat ``buffer`` into ``outs``."""
    off = 0
    for a in outs:
        a[...] = buffer[off:off + a.size].reshape(a.shape).astype(
            a.dtype, copy=False)
        off += a.size
    if off != buffer.size:
        raise ValueError('unpack_arrays: the outputs hold {} elements, the '
                         'buffer {}'.format(off, buffer.size))


class _Record(object):
    """What the engine keeps of one posted reduction."""

    __slots__ = ('producer', 'done', 'device_array', 'host', 'stage')

    def __init__(self, producer, device_array, stage):
        self.producer = producer
        self.done = None       # event after its last chunk
        self.device_array = device_array
        self.host = None
        self.stage = stage


class NcclEngine(PriorityMpiBackend):
    """Chunked, priority-ordered reductions on a reduction stream.

    Args:
        mpi_comm: the communicator whose ranks reduce together (collective
            over it: the NCCL communicator is made from it).
        streams: the stream set (default: :class:`~chainermn_overlap.
            communication.streams.CudaStreams`, cupy and NCCL); the CPU
            stand-in :class:`~chainermn_overlap.communication.streams.
            CpuStreams` runs the same engine on numpy arrays.
        chunk_bytes (int): largest piece issued as one collective.
            Default: NCCL's allreduce is a ring, so the chunk grows with
            the ranks, ``max(4 MiB, 256 KiB * N)``, for each of its
            ``2 (N - 1)`` steps to move at least 256 KiB
            (:func:`~chainermn_overlap.communication.chunking.
            ring_chunk_bytes`; 4 MiB up to 16 ranks); a given value is kept.
        max_inflight (int): chunks on the stream at once; the engine waits
            for the oldest before issuing more.
        sync (str): ``'stream'``: a wait makes the caller's current stream
            wait for the reduction (the host goes on); ``'host'``: a wait
            blocks the host until the reduction finished.
        poll (float): seconds between the thread's checks of in-flight
            chunks while it has nothing else to do.
        **options: ``timeout``, ``stall_warning``, ``debug`` and ``comm``,
            as in :class:`~chainermn_overlap.communication.engine.Engine`.
    """

    name = 'nccl'

    def __init__(self, mpi_comm: Any, *, streams: Any = None,
                 chunk_bytes: Optional[int] = None,
                 max_inflight: int = 4, sync: str = 'stream',
                 poll: float = 0.002, **options: Any) -> None:
        if sync not in SYNC_MODES:
            raise ValueError("sync must be 'stream' or 'host', got {!r}"
                             .format(sync))
        if int(max_inflight) < 1:
            raise ValueError('max_inflight must be at least 1, got {!r}'
                             .format(max_inflight))
        # The base's options are validated before any collective, so that
        # a bad value fails alike on every rank with nothing left behind.
        engine_module._resolve(options.get('timeout'),
                               options.get('stall_warning'),
                               options.get('debug'))
        engine_module.check_thread_multiple(self.name)
        self.streams = (streams if streams is not None
                        else streams_module.CudaStreams())
        self.sync = sync
        self.max_inflight = int(max_inflight)
        self.poll = float(poll)
        self.collective = self.streams.collective(mpi_comm)
        self.stream = self.streams.new_stream()
        self._records = {}
        self._inflight = collections.deque()
        self._tls = threading.local()
        super().__init__(mpi_comm, chunk_bytes=ring_chunk_bytes(
            mpi_comm.Get_size(), chunk_bytes), **options)

    # -- posting (caller's thread) ---------------------------------------

    def _post(self, op, array, label, slot, priority, stage, nbytes):
        self._check_can_post(label)
        custom = callable(op)
        xp = chainer.backend.get_array_module(array)
        if not custom and xp is not self.streams.xp:
            raise ValueError(
                "rank {}: the 'nccl' backend reduces arrays of {} on its "
                'streams ({}), got a {} array for {}. Use '
                "backend='mpi_priority' for host arrays, or move the model "
                'to the device (model.to_device(...)).'.format(
                    self.rank, self.streams.xp.__name__, self.streams.name,
                    xp.__name__, label))
        if not custom and not array.flags.c_contiguous:
            raise ValueError('rank {}: the {} backend reduces C-contiguous '
                             'arrays in place; {} is not'.format(
                                 self.rank, self.name, label))
        # After the kernels that produced the buffer: the reduction stream
        # waits on this event, the host does not.
        producer = self.streams.record(self.streams.current_stream())
        record = _Record(producer, array, stage and custom)
        handle = self.new_handle(
            label, self._finisher(record),
            nbytes=array.nbytes if nbytes is None else nbytes)
        self._tls.record = record
        self._enqueue(handle, array, op, slot, priority)
        return handle

    def _enqueue(self, handle, host, op, slot, priority):
        self._records[handle.seq] = self._tls.record
        super()._enqueue(handle, host, op, slot, priority)

    def _finisher(self, record):
        def finish():
            done = record.done
            current = self.streams.current_stream()
            host = self.sync == 'host' or self.streams.is_host(current)
            if done is not None and host:
                timeout = self.watchdog.timeout
                if not self.streams.synchronize(done, timeout):
                    self.mark_stuck()
                    raise CommunicationTimeout(
                        'rank {}: a reduction issued to the {} stream did '
                        'not finish within {} s; a rank may not have posted '
                        'it. Raise the timeout (create_overlapped_optimizer'
                        '(timeout=...)) if the network is slow.'.format(
                            self.rank, self.name, timeout))
                error = self.streams.error(done)
                if error is not None:
                    raise CommunicationError('rank {}: {}'.format(
                        self.rank, error)) from error
            self._raise_latched()
            if done is not None and not host:
                # The compute stream waits; the host goes on.
                self.streams.wait_event(current, done)
        return finish

    def _raise_latched(self):
        error = self._latch.error
        if error is not None:
            if isinstance(error, CommunicationError):
                raise type(error)(str(error)) from error
            raise CommunicationError(
                'rank {}: a reduction on the {} stream failed ({}); nothing '
                'more is reduced by this engine'.format(
                    self.rank, self.name, error)) from error

    # -- the thread ------------------------------------------------------

    def _serve(self):
        self.streams.bind_thread()
        while True:
            with self._cond:
                while not self._order and not self._closed:
                    # Wake now and then while chunks are on the stream, to
                    # stamp their completion (spans, statistics, timeouts).
                    self._cond.wait(self.poll if self._inflight else None)
                    if self._inflight:
                        break
                if not self._order and self._closed:
                    break
                rnd = (self._rounds[self._order[0]] if self._order
                       else None)
            self._retire()
            if rnd is None:
                continue
            self._serve_round(rnd)
            with self._cond:
                del self._rounds[rnd.key]
                self._order.pop(0)
        while self._inflight and self.stuck is None:
            self._retire(limit=0)

    def _run_chunk(self, item):
        h = item.handle
        record = self._records[h.seq]
        a, b = item.offset, min(item.offset + item.step, item.nelems)
        self._retire(limit=self.max_inflight - 1)
        label = ('{} [elements {}:{} of {}]'.format(h.label, a, b,
                                                     item.nelems)
                 if self.debug else None)
        first = a == 0
        if callable(item.op):
            issue = self._staged(record, item.op)
        else:
            issue = self._issuer(record, item.op, first)
        ok = self._reduce(item.host[a:b] if not callable(item.op)
                          else item.host, issue, h, label=label)
        item.offset = b if ok else item.nelems

    def _issuer(self, record, op, first):
        streams, stream = self.streams, self.stream

        def issue(comm, buf):
            if first:
                streams.wait_event(stream, record.producer)
            start = streams.record(stream)
            self.collective.allreduce(streams, stream, buf, op)
            done = streams.record(stream)
            record.done = done
            self._inflight.append((self._current.handle, start, done,
                                   time.perf_counter()))
        # The debug check fingerprints the operation by this name.
        issue.__qualname__ = op
        return issue

    def _staged(self, record, fn):
        streams, stream = self.streams, self.stream

        def run(comm, buf):
            # Host-staged through MPI, like the other engines: wait (here,
            # in the engine's thread) for the kernels that produced buf.
            if not streams.synchronize(record.producer, None):
                raise RuntimeError('the producing kernels never finished')
            error = streams.error(record.producer)
            if error is not None:
                raise error
            if record.stage and streams.xp is not numpy:
                host = to_host(buf)
                fn(comm, host)
                streams.launch(stream, _copy_back, buf, host)
            else:
                fn(comm, buf)
                # Kernels fn launched ran on this thread's stream.
                streams.wait_event(stream, streams.record(
                    streams.current_stream()))
            start = streams.record(stream)
            done = streams.record(stream)
            record.done = done
            self._inflight.append((self._current.handle, start, done,
                                   time.perf_counter()))
        run.__qualname__ = getattr(fn, '__qualname__', 'run')
        return run

    def _complete(self, handle):
        self._records.pop(handle.seq, None)
        super()._complete(handle)

    def _retire(self, limit=None):
        """Stamps finished chunks; waits while more than ``limit`` remain.

        ``limit=None`` only stamps what has finished.  Waiting happens in
        this thread, never the caller's.  A chunk on the stream for longer
        than the watchdog's timeout is latched as timed out and the
        collective aborted (NCCL: unblocks the stream).
        """
        streams = self.streams
        while self._inflight:
            handle, start, done, issued = self._inflight[0]
            if not streams.query(done):
                if self._overdue(handle, issued):
                    return
                if limit is None or len(self._inflight) <= limit:
                    return
                self._current = engine_module._Activity(
                    handle, 'collective #{} on the {} stream'.format(
                        handle.seq, self.name))
                try:
                    while not streams.synchronize(done, self.poll):
                        if self._overdue(handle, issued):
                            return
                finally:
                    self._current = None
            self._inflight.popleft()
            now = time.perf_counter()
            error = streams.error(done)
            if error is not None:
                latched = (self._latch.record(error, handle)
                           if self._latch.error is None
                           else self._latch.not_attempted())
                if handle.error is None:
                    handle.error = latched
                continue
            duration = streams.elapsed(start, done)
            handle.spans.append((max(issued, now - duration), now))
            handle.finished_at = now

    def _overdue(self, handle, issued):
        timeout = self.watchdog.timeout
        if timeout is None or self.stuck is not None:
            return self.stuck is not None
        if time.perf_counter() - issued < timeout:
            return False
        what = 'collective #{} ({}) on the {} stream'.format(
            handle.seq, handle.label, self.name)
        self.stuck = 'rank {}: {} never completed'.format(self.rank, what)
        self._latch.record(CommunicationTimeout(
            'rank {}: {} did not complete within {} s; a rank may not have '
            'posted it (see StallWarning with stall_warning=...). The '
            'communicator was aborted.'.format(self.rank, what, timeout)),
            handle)
        self.collective.abort()
        return True

    def status(self):
        out = super().status()
        out['on_stream'] = len(self._inflight)
        return out

    def close(self) -> None:
        """Finishes posted work, stops the thread, frees the communicators."""
        if self._closed:
            return
        super().close()
        if self._thread.is_alive():
            return
        close = getattr(self.stream, 'close', None)
        if close is not None:
            close()
        self.collective.close()


def _copy_back(device_array, host):
    device_array[...] = chainer.backend.get_array_module(
        device_array).asarray(host)

