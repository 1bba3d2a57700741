"""A delaying TCP proxy: emulates a network link between a target and its drafter.

Where ``tc netem`` is missing (these kernels have none), tests and benchmarks
put this between the two: every chunk read on one side is written to the other
``delay`` seconds later (one way; the round trip is twice that), in order, and
no faster than ``rate`` bytes per second (a token bucket). Each connection gets
two pump threads per direction. ``bytes_up`` and ``bytes_down`` count what
crossed (TCP payload: gRPC and HTTP/2 framing included, TCP/IP headers not).

    with DelayProxy(("10.0.0.2", 50061), delay=0.0025, rate=12.5e6) as proxy:
        RemoteDrafter(f"127.0.0.1:{proxy.port}", ...)
"""

from __future__ import annotations

import queue
import socket
import threading
import time


class DelayProxy:
    """Listens on ``listen`` (host, port; port 0 picks one) and forwards to ``upstream``."""

    def __init__(self, upstream, *, delay: float = 0.0, rate: float | None = None,
                 listen=("127.0.0.1", 0), burst: int = 16384):
        self.upstream, self.delay, self.rate, self.burst = upstream, delay, rate, burst
        self._sock = socket.create_server(listen)
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns: list = []
        self._closed = threading.Event()
        self._count = threading.Lock()  # the pumps of every connection add to the counters
        self.bytes_up = 0  # TCP payload bytes client -> upstream
        self.bytes_down = 0  # and back
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._closed.set()
        self._sock.close()
        with self._count:
            conns = list(self._conns)
        for s in conns:
            _hang_up(s)

    def _accept(self):
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._count:
                if self._closed.is_set():  # closed while this one connected
                    client.close()
                    server.close()
                    return
                self._conns += [client, server]
            pumps = [2]  # directions still open: the sockets close with the last

            def ended(pair=(client, server), pumps=pumps):
                with self._count:
                    pumps[0] -= 1
                    if pumps[0]:
                        return
                    for s in pair:
                        self._conns.remove(s)
                for s in pair:
                    _hang_up(s)

            self._pipe(client, server, "bytes_up", ended)
            self._pipe(server, client, "bytes_down", ended)

    def _pipe(self, src, dst, counter, ended):
        chunks: queue.Queue = queue.Queue()

        def read():
            while True:
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                chunks.put((time.monotonic() + self.delay, data))
                if not data:
                    return

        def write():
            try:
                pump()
            finally:
                ended()

        def pump():
            tokens, last = float(self.burst), time.monotonic()
            while True:
                due, data = chunks.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                if self.rate:
                    now = time.monotonic()
                    tokens = min(self.burst, tokens + (now - last) * self.rate)
                    last = now
                    tokens -= len(data)
                    if tokens < 0:  # wait until the bucket has paid for this chunk
                        time.sleep(-tokens / self.rate)
                        tokens, last = 0.0, time.monotonic()
                try:
                    dst.sendall(data)
                except OSError:
                    return
                with self._count:
                    setattr(self, counter, getattr(self, counter) + len(data))

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


def _hang_up(s):
    """Shuts s down (waking a pump blocked on it), then closes it."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
