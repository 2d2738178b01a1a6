"""One-way delays across a test-bed link, both directions, over TCP.

The namespaces share the kernel's CLOCK_MONOTONIC, so a timestamp taken by
the sender and read by the receiver gives the one-way time.  Run (inside the
namespaces, by tests/netbed/test_netbed_delay.py)::

    python oneway.py serve PORT COUNT          # in rank 1's namespace
    python oneway.py send ADDRESS PORT COUNT   # in rank 0's; prints JSON
"""
import json
import socket
import struct
import sys
import time

MSG = struct.Struct('!d')
REPLY = struct.Struct('!dd')


def _recv_exact(conn, n):
    data = b''
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError('peer closed the connection')
        data += part
    return data


def serve(port, count):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(('0.0.0.0', port))
    srv.listen(1)
    print('listening', flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(count):
        sent, = MSG.unpack(_recv_exact(conn, MSG.size))
        now = time.monotonic()
        conn.sendall(REPLY.pack(now - sent, time.monotonic()))
    conn.close()


def send(address, port, count):
    conn = socket.create_connection((address, port), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    forward, back = [], []
    for _ in range(count):
        conn.sendall(MSG.pack(time.monotonic()))
        fwd, sent = REPLY.unpack(_recv_exact(conn, REPLY.size))
        back.append(time.monotonic() - sent)
        forward.append(fwd)
        time.sleep(0.002)
    conn.close()
    print(json.dumps({'forward_s': forward, 'back_s': back}))


if __name__ == '__main__':
    if sys.argv[1] == 'serve':
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
