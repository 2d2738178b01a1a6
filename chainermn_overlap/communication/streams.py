"""The stream interface of the NCCL engine, a CUDA one and a CPU stand-in.

The NCCL engine (:mod:`chainermn_overlap.communication.nccl`) never touches
CUDA itself: it orders work through five calls of a *stream set*,

* ``current_stream()``: the stream the caller's kernels run on (the
  compute stream);
* ``new_stream()``: a stream of the engine's own (the reduction stream);
* ``record(stream)``: an event that fires once everything launched on
  ``stream`` so far has run;
* ``wait_event(stream, event)``: work launched on ``stream`` later runs
  after ``event`` fired, without blocking the host;
* ``launch(stream, fn, *args)``: runs ``fn(*args)`` in ``stream``'s order
  (a kernel launch on CUDA);
* ``allreduce(stream, buf, op)`` of the collective made by
  ``collective(mpi_comm)``: an in-place allreduce in ``stream``'s order;

plus host-side ``query(event)``, ``synchronize(event, timeout)`` and
``elapsed(start, end)`` for the engine's own bookkeeping (throttling,
timeline spans, the watchdog).

:class:`CudaStreams` is the real set (cupy streams and events,
``cupy.cuda.nccl``), imported lazily so that nothing here needs a GPU.
:class:`CpuStreams` stands in for it on any machine: numpy arrays, a stream
is a worker thread that runs queued callables in order, an event is a
:class:`threading.Event`, the allreduce is mpi4py's on a duplicated
communicator.  The engine's ordering, event and watchdog logic runs
unchanged on either, so the MPI tests exercise it without a GPU.

Errors on a stream are *sticky*, as on CUDA: once a callable on a stand-in
stream raised, later work on that stream is skipped and every event
recorded after it carries the error (``event.error``).
"""
import queue
import threading
import time
from typing import Any, Callable, Optional

import numpy

from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import blocking

__all__ = ['CpuStreams', 'CudaStreams', 'StreamError', 'default_streams',
           'nccl_available']


class StreamError(RuntimeError):
    """An operation on a stream failed (carried by the events after it)."""


# ----------------------------------------------------------------------------
# The CPU stand-in


class CpuEvent(object):
    """A stand-in event: fires when the stream reaches it.

    Attributes:
        time (float): ``time.perf_counter()`` when it fired (None before).
        error (BaseException): the sticky error of its stream, if any.
    """

    __slots__ = ('_flag', 'time', 'error')

    def __init__(self):
        self._flag = threading.Event()
        self.time: Optional[float] = None
        self.error: Optional[BaseException] = None

    def _fire(self, error=None):
        self.error = error
        self.time = time.perf_counter()
        self._flag.set()

    @property
    def done(self) -> bool:
        return self._flag.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._flag.wait(timeout)


class HostStream(object):
    """The host itself as a stream: work runs at once, in the caller."""

    name = 'host'

    def submit(self, fn: Callable[[], None]) -> None:
        fn()

    def close(self) -> None:
        pass


class CpuStream(object):
    """A stand-in stream: a worker thread running callables in order."""

    def __init__(self, name: str = 'stream') -> None:
        self.name = name
        self.error: Optional[BaseException] = None
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name='chainermn_overlap-' + name)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def _main(self):
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except Exception as e:  # sticky, as a CUDA error is
                if self.error is None:
                    self.error = e

    def close(self) -> None:
        """Lets queued work finish, then stops the worker."""
        self._queue.put(None)


_local = threading.local()


class CpuStreams(object):
    """The stream set on the CPU: numpy arrays, threads and threading events.

    Each thread has a current stream, the host (work runs at once) unless
    set with :meth:`use`, as ``with cupy.cuda.Stream():`` does on CUDA.

    Args:
        poll (float): seconds between checks of a stop request while a
            stream waits for an event (so that a closed engine's streams
            never hang on an event that cannot fire).
    """

    name = 'cpu'
    xp = numpy

    def __init__(self, poll: float = 0.05) -> None:
        self.poll = poll
        self._host = HostStream()
        self._streams = []
        self._stopping = threading.Event()

    # -- streams ---------------------------------------------------------

    def current_stream(self):
        return getattr(_local, 'stream', None) or self._host

    def use(self, stream):
        """Context manager: ``stream`` is this thread's current stream."""
        return _Use(stream)

    def new_stream(self, name: str = 'reduction stream') -> CpuStream:
        stream = CpuStream(name)
        self._streams.append(stream)
        return stream

    def bind_thread(self) -> None:
        """Nothing to bind on the CPU (CUDA binds the device here)."""

    def is_host(self, stream) -> bool:
        """Whether waiting on ``stream`` means blocking the host."""
        return isinstance(stream, HostStream)

    # -- ordering --------------------------------------------------------

    def record(self, stream) -> CpuEvent:
        event = CpuEvent()
        stream.submit(lambda: event._fire(getattr(stream, 'error', None)))
        return event

    def wait_event(self, stream, event: CpuEvent) -> None:
        def wait():
            while not event.wait(self.poll):
                if self._stopping.is_set():
                    raise StreamError('stream stopped while waiting for an '
                                      'event that never fired')
            if event.error is not None:
                raise StreamError('an event this stream waited for carries '
                                  'an error: {}'.format(event.error))
        stream.submit(wait)

    def launch(self, stream, fn: Callable[..., Any], *args: Any) -> None:
        def run():
            if getattr(stream, 'error', None) is not None:
                return  # sticky: nothing runs after a failure
            fn(*args)
        stream.submit(run)

    # -- host side -------------------------------------------------------

    def query(self, event: CpuEvent) -> bool:
        return event.done

    def synchronize(self, event: CpuEvent,
                    timeout: Optional[float] = None) -> bool:
        """Waits (host) for ``event``; False if ``timeout`` passed first."""
        return event.wait(timeout)

    def elapsed(self, start: CpuEvent, end: CpuEvent) -> float:
        return max(0.0, end.time - start.time)

    def error(self, event: CpuEvent) -> Optional[BaseException]:
        return event.error

    def collective(self, mpi_comm: Any) -> 'CpuCollective':
        return CpuCollective(blocking.dup(
            mpi_comm, "the CPU streams' communicator"))

    def close(self) -> None:
        for stream in self._streams:
            stream.close()
        self._stopping.set()


class _Use(object):
    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.prev = getattr(_local, 'stream', None)
        _local.stream = self.stream
        return self.stream

    def __exit__(self, *exc):
        _local.stream = self.prev


class CpuCollective(object):
    """In-place allreduce on a stand-in stream, by mpi4py on ``comm``."""

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI
        self.comm = comm
        self._ops = {'sum': MPI.SUM, 'max': MPI.MAX, 'min': MPI.MIN}
        self._in_place = MPI.IN_PLACE

    def allreduce(self, streams: CpuStreams, stream, buf: numpy.ndarray,
                  op: str) -> None:
        def run():
            self.comm.Allreduce(self._in_place, buf, op=self._ops[op])
        streams.launch(stream, run)

    def abort(self) -> None:
        """A blocking MPI call cannot be interrupted (interface only)."""

    def close(self) -> None:
        try:
            self.comm.Free()
        except Exception:  # MPI may already be finalized at exit
            pass


# ----------------------------------------------------------------------------
# CUDA

_NCCL_DTYPES = {'float16': 'NCCL_FLOAT16', 'float32': 'NCCL_FLOAT32',
                'float64': 'NCCL_FLOAT64', 'int32': 'NCCL_INT32',
                'int64': 'NCCL_INT64', 'uint8': 'NCCL_UINT8',
                'int8': 'NCCL_INT8'}
_NCCL_OPS = {'sum': 'NCCL_SUM', 'max': 'NCCL_MAX', 'min': 'NCCL_MIN'}


def nccl_available() -> bool:
    """True when cupy imports, sees a GPU and has NCCL support."""
    try:
        import cupy
        from cupy.cuda import nccl
        return bool(nccl.available) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # any import or driver failure means: not available
        return False


class CudaStreams(object):
    """The stream set on a GPU: cupy streams and events, NCCL collectives.

    Args:
        device (int): the CUDA device of this rank (default: the current
            one of the constructing thread).
    """

    name = 'cuda'

    def __init__(self, device: Optional[int] = None) -> None:
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as e:
            raise RuntimeError(
                "the 'nccl' communication backend needs cupy with NCCL "
                '({}). Install the cupy wheel of your CUDA version (e.g. '
                "pip install cupy-cuda12x), or use backend='mpi_priority'."
                .format(e)) from e
        if not getattr(nccl, 'available', True):
            raise RuntimeError(
                "the 'nccl' communication backend needs NCCL, but this cupy "
                "has none. Install a cupy wheel with NCCL, or use "
                "backend='mpi_priority'.")
        self.cupy = cupy
        self.nccl = nccl
        self.xp = cupy
        self.device = (cupy.cuda.Device().id if device is None
                       else int(device))

    def current_stream(self):
        return self.cupy.cuda.get_current_stream()

    def use(self, stream):
        return stream

    def new_stream(self, name: str = 'reduction stream'):
        with self.cupy.cuda.Device(self.device):
            return self.cupy.cuda.Stream(non_blocking=True)

    def bind_thread(self) -> None:
        """The calling thread's CUDA device becomes this rank's."""
        self.cupy.cuda.Device(self.device).use()

    def is_host(self, stream) -> bool:
        return False

    def record(self, stream):
        event = self.cupy.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def launch(self, stream, fn: Callable[..., Any], *args: Any) -> None:
        with stream:
            fn(*args)

    def query(self, event) -> bool:
        return event.done

    def synchronize(self, event, timeout: Optional[float] = None) -> bool:
        # Polled rather than cudaEventSynchronize, so that a collective
        # that never completes (a peer that never posted) ends in a
        # timeout the watchdog can report instead of a hang.
        end = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while not event.done:
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True

    def elapsed(self, start, end) -> float:
        return self.cupy.cuda.get_elapsed_time(start, end) / 1e3

    def error(self, event) -> Optional[BaseException]:
        return None  # CUDA errors surface from the calls themselves

    def collective(self, mpi_comm: Any) -> 'NcclCollective':
        return NcclCollective(self, mpi_comm)

    def close(self) -> None:
        pass


class NcclCollective(object):
    """An NCCL communicator over the ranks of ``mpi_comm`` (collective).

    Rank 0 makes the unique id; it reaches the others over MPI.
    """

    def __init__(self, streams: CudaStreams, mpi_comm: Any) -> None:
        nccl = streams.nccl
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        uid = nccl.get_unique_id() if rank == 0 else None
        # JSON, never pickle, from peers.
        uid = tuple(_mpi_json.bcast_json(
            mpi_comm, None if uid is None else list(uid),
            what='the NCCL unique id'))
        error = None
        try:
            with streams.cupy.cuda.Device(streams.device):
                self.comm = nccl.NcclCommunicator(size, uid, rank)
        except Exception as e:  # reported on every rank below
            error = '{}: {}'.format(type(e).__name__, e)
        errors = _mpi_json.allgather_json(
            mpi_comm, error, what='the NCCL set-up errors')
        if any(errors):
            raise RuntimeError(
                'rank {}: could not create the NCCL communicator of the '
                "'nccl' backend ({}). Ranks that share one GPU are refused "
                'by NCCL ("Duplicate GPU detected"): give each rank its own '
                "GPU, or use backend='mpi_priority' (host-staged MPI)."
                .format(rank, '; '.join('rank {}: {}'.format(r, m)
                                        for r, m in enumerate(errors) if m)))
        self.nccl = nccl
        self._dtypes = {k: getattr(nccl, v) for k, v in _NCCL_DTYPES.items()
                        if hasattr(nccl, v)}
        self._ops = {k: getattr(nccl, v) for k, v in _NCCL_OPS.items()}

    def allreduce(self, streams: CudaStreams, stream, buf: Any,
                  op: str) -> None:
        try:
            dtype = self._dtypes[buf.dtype.name]
        except KeyError:
            raise ValueError(
                "the 'nccl' backend cannot reduce {} arrays; NCCL takes {}. "
                'Use allreduce_grad_dtype=numpy.float32.'.format(
                    buf.dtype, ', '.join(sorted(self._dtypes)))) from None
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, dtype,
                            self._ops[op], stream.ptr)

    def abort(self) -> None:
        """Aborts the communicator: unblocks a stream stuck in a collective."""
        abort = getattr(self.comm, 'abort', None)
        if abort is not None:
            abort()

    def close(self) -> None:
        destroy = getattr(self.comm, 'destroy', None)
        if destroy is not None:
            destroy()


def default_streams(array_module: Any = None):
    """The stream set for arrays of ``array_module`` (cupy: CUDA)."""
    if array_module is None or array_module is numpy:
        return CpuStreams()
    return CudaStreams()
