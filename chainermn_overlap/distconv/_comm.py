"""Byte movement for distconv: point-to-point exchange and small reductions.

Arrays may be numpy or cupy. Messages are contiguous host buffers packed
and staged by the caller (:mod:`._pack`: one device-host copy per packed
buffer; no MPI derived datatypes), because a CUDA-aware MPI cannot be
assumed. The receives of an exchange land in one host buffer laid out as
:func:`._pack.pieces` lays out a packed one, so the whole of it reaches
the device in one copy and is unpacked from there.
"""
import numpy

from chainer import backend
from mpi4py import MPI

from chainermn_overlap._host import is_host as _is_host
from chainermn_overlap._host import to_host
from chainermn_overlap.communication import blocking
from chainermn_overlap.distconv import _pack

# Each message's tag is made of the number of exchanges posted on its
# communicator before (kept on the communicator) and the message's size.
# Several exchanges can be in flight at once (overlapped layers in
# different branches during backward), and every process of a group posts
# them in the same order when it runs the same graph.  When the graphs
# differ between processes (a layer on some only, or in another order),
# the tags differ, the messages do not match, and the processes waiting
# for them raise CommunicationTimeout naming the exchange instead of
# taking another layer's halo (or a message of another size: MPI would
# truncate a longer one and fill a shorter one in part, silently).  Two
# exchanges at the same place of two graphs with messages of the same
# sizes cannot be told apart.
_TAG_BASE = 8192
_TAG_SPAN = 1 << 14   # tags stay below 32767, the least MPI allows
_SEQUENCE = MPI.Comm.Create_keyval()

MISMATCH_HINT = (
    'If every process of the group is alive, they ran different graphs '
    '(a distconv layer called on some processes only, or in another '
    'order): each exchange has its own tag, so such messages never match. '
    'Run the same model on the same inputs\' shapes on every process.')


def next_exchange(mpi_comm):
    """``(number, tag)`` of the next exchange posted on ``mpi_comm``."""
    count = mpi_comm.Get_attr(_SEQUENCE)
    if count is None:
        count = [0]
        mpi_comm.Set_attr(_SEQUENCE, count)
    n = count[0]
    count[0] = n + 1
    return n, message_tag(n, 0)


def message_tag(number, nbytes):
    """The tag of a message of ``nbytes`` in exchange ``number``."""
    # 7919 is odd: the numbers of 2**14 consecutive exchanges give distinct
    # tags for one size.
    return _TAG_BASE + (number * 7919 + nbytes) % _TAG_SPAN


def like(host, template):
    """Moves a host array to the device of ``template``."""
    if _is_host(template):
        return host
    return backend.get_device_from_array(template).send(host)


class PendingExchange(object):
    """Point-to-point messages in flight; :meth:`wait` completes them.

    Args:
        requests (list): The mpi4py requests.
        host_flat: The flat host buffer the receives land in.
        host_recv (list): Its piece per receive (:func:`._pack.pieces`).
        host_send (list): Host send buffers, kept alive until completion.
        template: An array giving the device of the received arrays.
        about (tuple): ``(number, peers)`` of the exchange.
    """

    def __init__(self, requests, host_flat, host_recv, host_send, template,
                 about=None):
        self.requests = requests
        # (number, peers received from), for messages.
        self.about = about
        self.host_flat = host_flat
        self.host_recv = host_recv
        self.host_send = host_send
        self.template = template
        self.has_messages = bool(requests)
        # The receives come first in ``requests`` (see post_exchange).
        self.n_recv = len(host_recv)

    def test(self):
        """Lets MPI move these messages; True once all have completed.

        MPICH (shared memory, UCX, TCP) moves data only inside MPI calls,
        so messages posted before a long computation sit still until the
        next one. Calling this between pieces of that computation lets a
        rendezvous handshake and the copy proceed while the data is
        computed, and costs microseconds when there is nothing to do.

        Returns:
            bool: True if every message of this exchange has completed.
        """
        if self.requests and MPI.Request.Testall(self.requests):
            self.requests = []
            self.host_send = []
        return not self.requests

    @property
    def completed(self):
        """True if a previous :meth:`test` saw every message complete."""
        return not self.requests

    @property
    def label(self):
        """What the exchange is, for messages."""
        number, peers = self.about or (None, [])
        return ('distconv exchange number {} receiving from rank(s) {} of '
                'its group'.format(number, peers))

    def _wait(self, requests):
        # Bounded; the label is made only for a message.
        blocking.wait(requests, lambda: self.label, poll=True,
                      hint=MISMATCH_HINT)

    def arrivals(self):
        """Yields each received array as soon as its message has arrived.

        Lets the caller unpack one piece while the others are still in
        flight instead of waiting for all (``MPI_Waitany`` over the
        receives); the sends are completed after the last receive.

        Yields:
            tuple: ``(index, array)``: the position of the receive in the
            posted ``recvs`` and the received array, on the device of the
            template, in order of arrival.
        """
        if self.requests:
            recv = self.requests[:self.n_recv]
            done = set()
            while len(done) < self.n_recv:
                i = blocking.wait_any(recv, lambda: self.label)
                if i == MPI.UNDEFINED:
                    # Completed in an earlier test(): they are null now.
                    break
                done.add(i)
                yield i, like(self.host_recv[i], self.template)
            rest = [i for i in range(self.n_recv) if i not in done]
            self._wait(self.requests[self.n_recv:])
        else:
            rest = range(self.n_recv)
        self.requests = []
        self.host_send = []
        for i in rest:
            yield i, like(self.host_recv[i], self.template)

    def wait_flat(self):
        """Waits for every message; returns the received buffer.

        Returns:
            The flat buffer of all receives, in the order of the posted
            receives (the packed layout of their boxes), on the device of
            the template (one copy from the host).
        """
        if self.requests:
            self._wait(self.requests)
        self.requests = []
        self.host_send = []
        return like(self.host_flat, self.template)

    def wait(self):
        """Waits for every message; returns the received arrays.

        Returns:
            list: The received arrays, in the order of the posted receives,
            on the device of the template.
        """
        return _pack.pieces(self.wait_flat(),
                            [buf.shape for buf in self.host_recv])


def post_exchange(mpi_comm, sends, recvs, template):
    """Posts non-blocking point-to-point sends and receives.

    Every receive is posted before the first send. ``sends`` may be a
    generator that packs each message when it is reached, so that the
    first messages are on their way while the later ones are packed.

    Args:
        mpi_comm: The mpi4py communicator (the grid's private one).
        sends (iterable): ``(peer, array)`` pairs; arrays are contiguous
            host arrays (:func:`._pack.staged`), or device arrays, then
            staged here one by one.
        recvs (list): ``(peer, shape)`` pairs to receive, dtype of template.
        template: An array giving the dtype and device of received buffers.

    Returns:
        PendingExchange: Call its ``wait()`` to complete the messages.
    """
    host_flat, host_recv = _pack.alloc(numpy, [shape for _, shape in recvs],
                                       template.dtype)
    requests = []
    number, _ = next_exchange(mpi_comm)
    # Receives are posted first so that large messages can land directly in
    # their buffers instead of the unexpected-message queue.
    for (peer, _), buf in zip(recvs, host_recv):
        requests.append(mpi_comm.Irecv([buf, MPI.BYTE], source=peer,
                                       tag=message_tag(number, buf.nbytes)))
    host_send = []
    for peer, arr in sends:
        buf = to_host(arr)
        host_send.append(buf)  # keep alive until Waitall
        requests.append(mpi_comm.Isend([buf, MPI.BYTE], dest=peer,
                                       tag=message_tag(number, buf.nbytes)))
    return PendingExchange(requests, host_flat, host_recv, host_send,
                           template, (number, [p for p, _ in recvs]))


def exchange(mpi_comm, sends, recvs, template):
    """Sends and receives packed buffers and waits for them.

    Same arguments as :func:`post_exchange`.

    Returns:
        list: The received arrays, in the order of ``recvs``, on the device
        of ``template``.
    """
    return post_exchange(mpi_comm, sends, recvs, template).wait()


def allreduce_sum(mpi_comm, arr, out_dtype=None):
    """Sum-allreduces an array; returns a new array on ``arr``'s device.

    Float inputs are reduced in float64: these reductions are tiny (per
    channel or per sample) and the extra precision keeps sums over many
    processes close to the single-process result.

    Args:
        mpi_comm: The mpi4py communicator.
        arr: The local contribution (numpy or cupy).
        out_dtype: dtype of the result; defaults to ``arr.dtype``.

    Returns:
        The sum over all processes of ``mpi_comm``.
    """
    host = to_host(arr)
    if host.dtype.kind == 'f':
        send, mpi_type = host.astype(numpy.float64), MPI.DOUBLE
    else:
        send, mpi_type = host.astype(numpy.int64), MPI.INT64_T
    out = numpy.empty_like(send)
    blocking.allreduce(mpi_comm, [send, mpi_type], [out, mpi_type], MPI.SUM,
                       'a distconv sum', poll=True)
    dtype = arr.dtype if out_dtype is None else out_dtype
    return like(out.astype(dtype, copy=False), arr)
