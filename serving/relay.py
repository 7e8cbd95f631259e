"""A counting TCP relay: real bytes on the wire, each way, per connection (DESIGN section 5).

Placed in front of a server (`Relay(target_host, target_port)` listens on 127.0.0.1 and forwards
every accepted connection to the target), it copies bytes in both directions and counts them as
they pass: `upstream` is client -> server, `downstream` server -> client. The counts include all
framing (HTTP/2, gRPC, Arrow IPC), which is the point: the harness reports what went over the
socket, not what the arrays would take.

    relay = Relay("127.0.0.1", server_port).start()
    ... clients connect to relay.port ...
    before = relay.snapshot(); ...one request...; relay.wait_idle(); delta = relay.snapshot() - before
    relay.close()

Each connection is served by two threads (one per direction) doing blocking `recv` / `sendall`.

A network worth the name (`Link`): with `latency_s` and/or `bandwidth_bps` the relay delays what it
forwards as a real link would, per direction: a chunk that arrives at time t leaves the sender's
side once the link has serialized everything before it (size x 8 / bandwidth each) and reaches the
other side `latency_s` later. Chunks are pipelined, as on a wire: ten chunks cost one latency plus
ten serialization times, not ten latencies. Loopback then shows what shipping candidate lists costs
at production rates (for example 100 us and 25 Gb/s).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass

CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class Traffic:
    """Byte counts: upstream (client -> server), downstream (server -> client), connections."""

    upstream: int = 0
    downstream: int = 0
    connections: int = 0

    @property
    def total(self) -> int:
        return self.upstream + self.downstream

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.upstream - other.upstream, self.downstream - other.downstream,
                       self.connections - other.connections)

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.upstream + other.upstream, self.downstream + other.downstream,
                       self.connections + other.connections)

    def to_json(self) -> dict:
        return {"upstream": self.upstream, "downstream": self.downstream, "total": self.total,
                "connections": self.connections}


@dataclass(frozen=True)
class Link:
    """One-way latency (seconds) and bandwidth (bits per second, None: unlimited) of a shaped link."""

    latency_s: float = 0.0
    bandwidth_bps: float | None = None

    def __post_init__(self):
        if self.latency_s < 0 or (self.bandwidth_bps is not None and self.bandwidth_bps <= 0):
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {self}")

    @property
    def shaped(self) -> bool:
        return self.latency_s > 0 or self.bandwidth_bps is not None

    def describe(self) -> str:
        if not self.shaped:
            return "loopback"
        bw = "unlimited" if self.bandwidth_bps is None else f"{self.bandwidth_bps / 1e9:g} Gb/s"
        return f"{self.latency_s * 1e6:g} us, {bw}"


class Relay:
    """Forward 127.0.0.1:`port` to `target_host`:`target_port`, counting bytes each way; with a
    shaped `link`, delaying them as that link would."""

    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1", port: int = 0,
                 link: Link = Link()):
        self.target = (target_host, int(target_port))
        self.link = link
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, port))
        self._listener.listen(64)
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._up = 0
        self._down = 0
        self._connections = 0
        self._per_connection: dict[int, list[int]] = {}
        self._last_activity = time.monotonic()
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name=f"relay-{self.port}", daemon=True)

    @property
    def location(self) -> str:
        return f"grpc://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "Relay":
        self._thread.start()
        return self

    # --- counting ------------------------------------------------------------------------------------
    def snapshot(self) -> Traffic:
        with self._lock:
            return Traffic(self._up, self._down, self._connections)

    def per_connection(self) -> dict[int, tuple[int, int]]:
        """Connection number -> (upstream, downstream) bytes."""
        with self._lock:
            return {c: (u, d) for c, (u, d) in self._per_connection.items()}

    def wait_idle(self, quiet_s: float = 0.02, timeout_s: float = 1.0) -> None:
        """Wait until no byte has passed for `quiet_s` (trailing frames of a finished call are counted)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                idle = time.monotonic() - self._last_activity
            if idle >= quiet_s:
                return
            time.sleep(quiet_s / 2)

    # --- plumbing ------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()  # target down: the client sees the connection drop, as without a relay
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                number = self._connections
                self._connections += 1
                self._per_connection[number] = [0, 0]
                self._sockets.update((client, server))
            for src, dst, direction in ((client, server, 0), (server, client, 1)):
                threading.Thread(target=self._pump, args=(src, dst, direction, number),
                                 name=f"relay-{self.port}-{number}-{direction}", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: int, number: int) -> None:
        shaped = self.link.shaped
        out: queue.Queue | None = None
        if shaped:  # a second thread delivers each chunk at its time, so chunks pipeline
            out = queue.Queue()
            threading.Thread(target=self._deliver, args=(out, dst), name=f"relay-{self.port}-{number}-{direction}-tx",
                             daemon=True).start()
        free_at = 0.0  # when the link has serialized everything received so far
        try:
            while True:
                data = src.recv(CHUNK_BYTES)
                if not data:
                    break
                with self._lock:
                    if direction == 0:
                        self._up += len(data)
                    else:
                        self._down += len(data)
                    self._per_connection[number][direction] += len(data)
                    self._last_activity = time.monotonic()
                if out is None:
                    dst.sendall(data)
                    continue
                now = time.monotonic()
                bw = self.link.bandwidth_bps
                free_at = max(now, free_at) + (len(data) * 8 / bw if bw else 0.0)
                out.put((free_at + self.link.latency_s, data))
        except OSError:
            pass
        finally:
            if out is not None:
                out.put(None)  # the deliverer shuts the sockets down once everything queued is sent
            else:
                self._shutdown(src, dst)

    def _deliver(self, out: "queue.Queue", dst: socket.socket) -> None:
        try:
            while True:
                item = out.get()
                if item is None:
                    break
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
                with self._lock:
                    self._last_activity = time.monotonic()
        except OSError:
            pass
        finally:
            self._shutdown(dst)

    @staticmethod
    def _shutdown(*sockets: socket.socket) -> None:
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        for s in sockets:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "Relay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def traffic_summary(per_request: list[dict]) -> str:
    """A few lines: mean bytes on the wire per request for each hop (from `retrieve_traffic`)."""
    if not per_request:
        return "no requests: no traffic"
    lines = [f"bytes on the wire per request (mean of {len(per_request)}):"]
    total = 0.0
    for hop in per_request[0]:
        up = sum(p[hop]["upstream"] for p in per_request) / len(per_request)
        down = sum(p[hop]["downstream"] for p in per_request) / len(per_request)
        total += up + down
        lines.append(f"  {hop:<24}{up + down:>12,.0f}   (up {up:,.0f}, down {down:,.0f})")
    lines.append(f"  {'all hops':<24}{total:>12,.0f}")
    return "\n".join(lines)


__all__ = ["Link", "Relay", "Traffic", "traffic_summary"]
