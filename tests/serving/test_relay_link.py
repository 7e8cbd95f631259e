"""The relay's shaped link: one-way latency and a bandwidth cap, pipelined like a wire. A plain TCP
echo server on 127.0.0.1, started and stopped here."""

import socket
import threading
import time

import pytest

from serving.relay import Link, Relay


@pytest.fixture
def echo():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    server.close()


def _echo(conn):
    with conn:
        while True:
            data = conn.recv(1 << 16)
            if not data:
                return
            conn.sendall(data)


def _round_trip(port: int, payload: bytes) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.monotonic()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += s.recv(1 << 16)
        took = time.monotonic() - t0
    assert got == payload
    return took


def test_latency_is_added_each_way(echo):
    """0.2 s each way: a round trip takes 0.4 s; none, one or four latencies would take about 0, 0.2 or
    0.8 s (the upper bound leaves a loaded machine 0.4 s)."""
    with Relay("127.0.0.1", echo, link=Link(latency_s=0.2)) as relay:
        took = _round_trip(relay.port, b"x" * 100)
    assert 0.4 <= took < 0.8, took


def test_bandwidth_caps_the_transfer(echo):
    """16 Mbit each way at 40 Mb/s: 0.4 s to serialize each way; the link is full duplex and the echo
    answers as bytes arrive, so the two directions overlap (about 0.4 s, not 0.8 s). A cap read as
    bytes, not bits, a second would take 3.2 s; the upper bound leaves a loaded machine 1.2 s."""
    payload = b"y" * 2_000_000
    with Relay("127.0.0.1", echo, link=Link(bandwidth_bps=40e6)) as relay:
        took = _round_trip(relay.port, payload)
        counted = relay.snapshot()
    assert 0.4 <= took < 1.6, took
    assert counted.upstream == counted.downstream == len(payload)


def test_chunks_pipeline_instead_of_paying_latency_each(echo):
    """Twenty writes in a row through a 250 ms link arrive after about one latency each way (0.5 s;
    a latency paid per write would take 10 s)."""
    with Relay("127.0.0.1", echo, link=Link(latency_s=0.25)) as relay:
        with socket.create_connection(("127.0.0.1", relay.port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.monotonic()
            for _ in range(20):
                s.sendall(b"z" * 10)
                time.sleep(0.002)
            got = b""
            while len(got) < 200:
                got += s.recv(1 << 16)
            took = time.monotonic() - t0
    assert 0.5 <= took < 2.5, took


def test_bad_links_are_refused():
    with pytest.raises(ValueError, match="latency"):
        Link(latency_s=-1)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(bandwidth_bps=0)
    assert Link().describe() == "loopback" and Link(1e-4, 25e9).describe() == "100 us, 25 Gb/s"
