"""A link delay for the network test bed on kernels without ``netem``.

:mod:`testbed.netbed` asks ``tc``'s ``netem`` qdisc for a one-way link
delay.  Where the kernel has no ``sch_netem`` (and no other qdisc that
holds packets for a time: no ``fq``/``etf``), the bed instead gives each
end of a link a TAP interface and joins the two through this relay, a
process that reads every frame one TAP hands it, holds it for the delay,
and writes it into the other TAP, in order.  The TCP/IP stacks of both
ends are the kernel's own: the relay only stands in for the wire, as the
host side of a virtual machine's NIC does.

* Frames cross with their virtio-net header (``IFF_VNET_HDR``, checksum and
  TSO offloads on), so a 64 KB TCP super-packet crosses the relay as one
  read and one write, not forty-five: the relay's cost is per super-packet.
  The MTU on the wire stays 1500.
* One queue per direction, ordered by due time (arrival on the relay plus
  the delay, ``CLOCK_MONOTONIC``); the process sleeps in ``select`` until
  a TAP has a frame or the head of a queue is due.  It never spins.
* It asks for real-time scheduling (``SCHED_FIFO``) so that due frames go
  out when due even when the ranks keep every core busy, as ``netem``'s
  timer, which fires in softirq context, would; where that is refused it
  runs at nice -10 instead, and says which in its ready line.
* It dies with its parent (``PR_SET_PDEATHSIG``), so a bed that is killed
  leaves no relay behind.

Run by :class:`testbed.netbed.NetBed`; standard library only::

    python netrelay.py --delay 0.002 --pair NS_A:eth0=NS_B:eth0
    python netrelay.py --ping 10.213.0.2 --count 10   # inside a namespace

On SIGTERM it prints its statistics (frames, bytes, lateness, CPU seconds)
as one JSON line and exits.
"""
import argparse
import collections
import ctypes
import errno
import fcntl
import json
import os
import resource
import select
import signal
import socket
import statistics
import struct
import sys
import time

NETNS_DIR = '/var/run/netns'
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_TIMERSLACK = 29
# linux/if_tun.h
TUNSETIFF = 0x400454ca
TUNSETOFFLOAD = 0x400454d0
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04
TUN_F_TSO_ECN = 0x08
# A TAP hands over at most a GSO super-packet (64 KiB) plus headers.
READ_SIZE = 256 * 1024
# Frames read from one TAP per wake-up before the other side gets a turn.
BATCH = 64
READY = 'netrelay ready '
STATS = 'netrelay stats '


class RelayError(RuntimeError):
    """The relay could not attach to its TAP interfaces."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def enter_netns(name):
    """Moves this process into the named network namespace (``ip netns``)."""
    path = os.path.join(NETNS_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise RelayError('network namespace {} not found ({}): the relay '
                         'attaches to namespaces made with "ip netns add"'
                         .format(name, e)) from e
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise RelayError('setns into {} failed: {} (needs root)'.format(
                name, os.strerror(err)))
    finally:
        os.close(fd)


def open_tap(ns, dev):
    """Attaches to TAP ``dev`` in namespace ``ns``; returns a non-blocking fd.

    The device must exist (``ip -n NS tuntap add dev DEV mode tap``); the
    returned fd stays bound to it whatever namespace this process moves to.
    """
    enter_netns(ns)
    try:
        fd = os.open('/dev/net/tun', os.O_RDWR | os.O_NONBLOCK)
    except OSError as e:
        raise RelayError('cannot open /dev/net/tun ({}): the kernel needs '
                         'CONFIG_TUN and the device node (mknod /dev/net/tun '
                         'c 10 200)'.format(e)) from e
    try:
        ifr = struct.pack('16sH22x', dev.encode(),
                          IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
        fcntl.ioctl(fd, TUNSETOFFLOAD,
                    TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    except OSError as e:
        os.close(fd)
        raise RelayError('cannot attach to TAP {} in {}: {}'.format(
            dev, ns, e)) from e
    return fd


def _realtime():
    """Asks for SCHED_FIFO; else nice -10.  Returns what was applied."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return 'SCHED_FIFO 1'
    except OSError as e:
        why = e.strerror
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return 'nice -10 (SCHED_FIFO refused: {})'.format(why)
    except OSError as e:
        return 'default (SCHED_FIFO refused: {}; nice: {})'.format(
            why, e.strerror)


class Direction(object):
    """Frames from one TAP to another, held for ``delay`` seconds."""

    __slots__ = ('src', 'dst', 'name', 'queue', 'frames', 'bytes',
                 'dropped', 'write_errors', 'late_max', 'late_sum',
                 'queued_bytes', 'queued_max', 'limit')

    def __init__(self, src, dst, name, limit):
        self.src, self.dst, self.name = src, dst, name
        self.queue = collections.deque()
        self.frames = self.bytes = self.dropped = self.write_errors = 0
        self.late_max = self.late_sum = 0.0
        self.queued_bytes = self.queued_max = 0
        self.limit = limit

    def stats(self):
        return {'direction': self.name, 'frames': self.frames,
                'bytes': self.bytes, 'dropped_queue_full': self.dropped,
                'write_errors': self.write_errors,
                'late_max_s': self.late_max,
                'late_mean_s': self.late_sum / self.frames
                if self.frames else 0.0,
                'queued_max_bytes': self.queued_max}


def relay(pairs, delay, limit_bytes, stop, wake_fd=None):
    """Moves frames both ways between each pair of TAP fds until ``stop``.

    Args:
        pairs: list of ((fd, name), (fd, name)).
        delay (float): seconds each frame is held.
        limit_bytes (int): per direction; frames beyond it are dropped (as a
            full queue on a wire would), counted in the statistics.
        stop (list): set ``stop[0]`` true (e.g. from a signal handler).
        wake_fd (int): read end of :func:`signal.set_wakeup_fd`'s pipe, so
            that a signal ends the wait at once.
    """
    dirs = []
    for (fa, na), (fb, nb) in pairs:
        dirs.append(Direction(fa, fb, '{}->{}'.format(na, nb), limit_bytes))
        dirs.append(Direction(fb, fa, '{}->{}'.format(nb, na), limit_bytes))
    by_src = {d.src: d for d in dirs}
    fds = list(by_src) + ([wake_fd] if wake_fd is not None else [])
    mono = time.monotonic
    sel = select.select
    read, write = os.read, os.write
    parent = os.getppid()
    while not stop[0]:
        heads = [d.queue[0][0] for d in dirs if d.queue]
        if heads:
            timeout = max(0.0, min(heads) - mono())
        else:
            timeout = 1.0  # idle: wake now and then to see the parent
            if os.getppid() != parent:
                break
        try:
            ready = sel(fds, (), (), timeout)[0]
        except InterruptedError:
            continue
        now = mono()
        for fd in ready:
            d = by_src.get(fd)
            if d is None:  # a signal: drain the wake-up pipe
                try:
                    read(fd, 4096)
                except BlockingIOError:
                    pass
                continue
            due = now + delay
            for _ in range(BATCH):
                try:
                    frame = read(fd, READ_SIZE)
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno in (errno.EBADFD, errno.ENODEV):
                        return dirs  # the TAP is gone: the bed is closing
                    raise
                n = len(frame)
                if d.queued_bytes + n > d.limit:
                    d.dropped += 1
                    continue
                d.queue.append((due, frame))
                d.queued_bytes += n
                if d.queued_bytes > d.queued_max:
                    d.queued_max = d.queued_bytes
        for d in dirs:
            q = d.queue
            while q and q[0][0] <= now:
                due, frame = q.popleft()
                d.queued_bytes -= len(frame)
                late = now - due
                d.late_sum += late
                if late > d.late_max:
                    d.late_max = late
                try:
                    write(d.dst, frame)
                    d.frames += 1
                    d.bytes += len(frame)
                except OSError:
                    # The far interface is down (EIO) or gone: the frame is
                    # lost, as on a cut wire.
                    d.write_errors += 1
    return dirs


def run_relay(args):
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the prctl
        return 1
    libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    stop = [False]

    def on_term(signum, frame):
        stop[0] = True
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    home = os.open('/proc/self/ns/net', os.O_RDONLY)
    pairs = []
    try:
        for spec in args.pair:
            ends = []
            for end in spec.split('='):
                ns, dev = end.split(':')
                ends.append((open_tap(ns, dev), end))
            pairs.append(tuple(ends))
    except (RelayError, ValueError) as e:
        sys.stderr.write('netrelay: {}\n'.format(e))
        return 2
    # Back home; the fds stay bound to their TAPs.  (Their sockets hold
    # their namespaces until the relay exits: the bed stops the relay
    # before it deletes the namespaces.)
    libc.setns(home, CLONE_NEWNET)
    os.close(home)
    sched = _realtime()
    sys.stdout.write(READY + json.dumps({
        'pid': os.getpid(), 'delay_s': args.delay, 'sched': sched,
        'pairs': args.pair}) + '\n')
    sys.stdout.flush()
    t0 = time.monotonic()
    dirs = relay(pairs, args.delay, args.limit_bytes, stop, wake_r)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    sys.stdout.write(STATS + json.dumps({
        'seconds': time.monotonic() - t0, 'cpu_user_s': ru.ru_utime,
        'cpu_system_s': ru.ru_stime, 'sched': sched,
        'directions': [d.stats() for d in dirs]}) + '\n')
    sys.stdout.flush()
    return 0


# ----------------------------------------------------------------------------
# ping: ICMP echo round trips, for a namespace without the ping tool.

def _checksum(data):
    if len(data) % 2:
        data += b'\0'
    s = sum(struct.unpack('!%dH' % (len(data) // 2), data))
    s = (s >> 16) + (s & 0xffff)
    s += s >> 16
    return ~s & 0xffff


def ping(address, count, interval, timeout):
    """Round-trip times (s) of ``count`` ICMP echoes to ``address``.

    A first echo (not counted) resolves the neighbour's MAC address, which
    itself crosses the link.  Raises OSError when a reply does not come
    within ``timeout`` seconds.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW,
                         socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xffff
    rtts = []
    try:
        for seq in range(count + 1):
            payload = struct.pack('!d', time.monotonic()) + b'netbed' * 6
            hdr = struct.pack('!BBHHH', 8, 0, 0, ident, seq)
            pkt = struct.pack('!BBHHH', 8, 0, _checksum(hdr + payload),
                              ident, seq) + payload
            t0 = time.monotonic()
            sock.sendto(pkt, (address, 0))
            while True:
                left = t0 + timeout - time.monotonic()
                if left <= 0 or not select.select([sock], [], [], left)[0]:
                    raise OSError(errno.ETIMEDOUT, 'no echo reply from {} '
                                  'within {} s'.format(address, timeout))
                data = sock.recv(2048)
                t1 = time.monotonic()
                ihl = (data[0] & 0x0f) * 4
                typ, _, _, rid, rseq = struct.unpack('!BBHHH',
                                                     data[ihl:ihl + 8])
                if typ == 0 and rid == ident and rseq == seq:
                    break
            if seq:
                rtts.append(t1 - t0)
            time.sleep(interval)
    finally:
        sock.close()
    return rtts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--delay', type=float, default=0.0,
                   help='seconds each frame is held')
    p.add_argument('--pair', action='append', default=[],
                   help='NS:DEV=NS:DEV, two TAPs to join (repeatable)')
    p.add_argument('--limit-bytes', type=int, default=64 * 2 ** 20,
                   help='bytes held per direction before frames drop')
    p.add_argument('--ping', default=None, metavar='ADDRESS',
                   help='instead: print ICMP round-trip times to ADDRESS')
    p.add_argument('--count', type=int, default=10)
    p.add_argument('--interval', type=float, default=0.01)
    p.add_argument('--timeout', type=float, default=2.0)
    args = p.parse_args(argv)
    if args.ping:
        try:
            rtts = ping(args.ping, args.count, args.interval, args.timeout)
        except OSError as e:
            sys.stderr.write('netrelay: ping {}: {}\n'.format(args.ping, e))
            return 1
        print(json.dumps({'address': args.ping, 'rtt_s': rtts,
                          'median_s': statistics.median(rtts)}))
        return 0
    if not args.pair:
        p.error('give --pair NS:DEV=NS:DEV (or --ping ADDRESS)')
    return run_relay(args)


if __name__ == '__main__':
    sys.exit(main())
