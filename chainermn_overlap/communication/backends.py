"""The first-in-first-out engine, and the engines' public names.

``'mpi_thread'`` (:class:`MpiThreadBackend`) reduces posted buffers one
after the other, in exactly the order they were posted.  Everything else an
engine does (thread, failure latch, watchdog, stall reports, debug checks)
is in :mod:`chainermn_overlap.communication.engine`; the priority engine is
in :mod:`~chainermn_overlap.communication.scheduler`, the emulated network
in :mod:`~chainermn_overlap.communication.emulated`.

Engines are looked up by name (:func:`get_backend`)::

    engine = backends.get_backend('mpi_thread')(mpi_comm, timeout=60)
    handle = engine.allreduce(array, label='bucket 0')
    handle.wait()
"""
import queue
from typing import Any

from chainermn_overlap.communication.engine import Engine
from chainermn_overlap.communication.engine import Handle
from chainermn_overlap.communication.engine import check_thread_multiple
from chainermn_overlap.communication.engine import get_backend
from chainermn_overlap.communication.engine import register_backend

__all__ = ['Engine', 'Handle', 'MpiThreadBackend', 'check_thread_multiple',
           'get_backend', 'register_backend']


class MpiThreadBackend(Engine):
    """Blocking MPI collectives run by a communication thread, in order.

    Non-blocking MPI collectives do not progress on their own on CPU without
    asynchronous progress (which costs a core and slows blocking collectives
    several-fold).  A thread doing the blocking collective progresses the
    transfer continuously while the main thread computes: mpi4py releases
    the GIL inside MPI calls.  Requires ``MPI_THREAD_MULTIPLE``.

    Arrays on a GPU are staged through host memory, which needs no
    CUDA-aware MPI (an NCCL engine is the faster path there).

    Args:
        mpi_comm: the communicator to duplicate (collective over it).
        **options: ``timeout``, ``stall_warning``, ``debug`` and ``comm``,
            as in :class:`~chainermn_overlap.communication.engine.Engine`.
            This engine has no policy options.
    """

    name = 'mpi_thread'

    def __init__(self, mpi_comm: Any, **options: Any) -> None:
        self._queue = queue.Queue()
        super().__init__(mpi_comm, **options)

    def _enqueue(self, handle, host, op, slot, priority):
        self._queue.put((host, op, handle))

    def _wake(self):
        self._queue.put(None)

    def _serve(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            buf, op, handle = item
            self._reduce(buf, op, handle)
            self._complete(handle)
