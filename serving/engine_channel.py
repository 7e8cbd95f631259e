"""The channels between the front of a co-located server with several engines and each engine
worker (`serve colocated --engines N`: `serving.engine_front` on one side, `serving.engine_worker`
on the other), framed messages (a 4-byte big-endian length, then the message: the framing of
`multiprocessing.connection.Connection.send_bytes`), no pickle: JSON for what is small and rare,
Arrow IPC for batches. Two kinds of channel:

* the control channel, one Unix socket pair per worker, read by the worker in order: its
  configuration, updates, questions and the stop;
* request lanes: Unix stream sockets the front connects to a worker's lane socket (created by the
  front in a directory of its own, mode 0700, and handed to the worker when it starts), one request
  in flight on a lane at a time. An exchange thread of the front takes a free lane, sends one
  `REQUEST` and waits on that same socket for its `ANSWER` or `ERROR`, so a request's answer wakes
  the thread that waits for it and no other (no reader thread between them, no lock handed over:
  each hop a thread of the front's interpreter makes costs the interpreter lock once more). A lane
  whose caller gave up (its deadline) is closed, never reused, so a late answer reaches no one.

Every message starts with one byte saying its kind; a message that expects an answer carries a call
id (uint64, little-endian) right after it, and its answer the same id.

Front to worker, on the control channel (in the order the front sends them, which the worker keeps):

* `CONFIG` + JSON: the first message, what the worker loads and how it serves (`worker_config`);
* `UPDATE` + id + JSON `[[seq, update object], ...]`: logged updates to apply, in log order;
* `CONTROL` + id + JSON `{"op": "state"}`: the worker's state (health and stats);
* `STOP`: finish the batches in hand and exit.

Front to worker, on a lane:

* `REQUEST` + id + schema length (uint32) + the request batch's schema (IPC) + the batch (IPC
  message): one exchange's request batch, as it arrived.

Worker to front, on the control channel:

* `READY` + JSON: built, warmed up, serving (its pid and what its engine holds);
* `FAILED` + JSON `{"message"}`: it could not start;
* `REPLY` + id + JSON: the answer to an `UPDATE` (`{"seq": n}`) or a `CONTROL`;
* `ERROR` + id + JSON `{"type": a pyarrow.flight error class, "message"}`: the call's error as
  the one-engine server would have raised it (`serving.protocol.to_flight_error`).

Worker to front, on the lane the request came on:

* `ANSWER` + id + seq (int64) + taken and answered (float64, `time.perf_counter()`, one clock
  for all processes of a Linux host) + the answer batch (IPC message of `ANSWER_SCHEMA`);
* `ERROR` + id + JSON, as above.
"""

from __future__ import annotations

import json
import socket
import struct

CONFIG, REQUEST, UPDATE, CONTROL, STOP = b"G", b"R", b"U", b"C", b"S"
READY, FAILED, ANSWER, ERROR, REPLY = b"Y", b"F", b"A", b"E", b"P"

_WAITALL = getattr(socket, "MSG_WAITALL", 0)

CALL_ID = struct.Struct("<Q")
SCHEMA_LEN = struct.Struct("<I")
ANSWER_HEAD = struct.Struct("<Qqdd")  # call id, seq, taken, answered

FRAME = struct.Struct("!i")  # a message's length, as `multiprocessing.connection` frames it
MAX_FRAME = 2**31 - 1
_SEND_JOINED = 1 << 16  # a message shorter than this goes out with its length in one write
_FIRST_READ = 1 << 16  # what a lane's first read of a message takes at most

# the Flight errors a worker may report, by name (anything else arrives as FlightInternalError)
FLIGHT_ERRORS = ("FlightServerError", "FlightInternalError", "FlightTimedOutError", "FlightUnavailableError",
                 "FlightCancelledError", "FlightUnauthenticatedError", "FlightUnauthorizedError")


def message(kind: bytes, call_id: int | None = None, body: bytes | dict | list = b"") -> bytes:
    """One message: its kind, its call id when it has one, and its body (a dict or list as JSON)."""
    if not isinstance(body, (bytes, bytearray, memoryview)):
        body = json.dumps(body).encode()
    head = kind if call_id is None else kind + CALL_ID.pack(call_id)
    return head + bytes(body)


def call_id_of(msg: bytes) -> int:
    return CALL_ID.unpack_from(msg, 1)[0]


def json_body(msg: bytes, with_id: bool = True):
    """The JSON body of a message (after its kind, and its call id when it has one)."""
    return json.loads(bytes(msg[1 + (CALL_ID.size if with_id else 0):]))


def request_message(call_id: int, schema_bytes: bytes, batch_bytes) -> bytes:
    return b"".join((REQUEST, CALL_ID.pack(call_id), SCHEMA_LEN.pack(len(schema_bytes)), schema_bytes, batch_bytes))


def split_request(msg: bytes) -> tuple[int, bytes, memoryview]:
    """(call id, schema bytes, batch bytes) of a `REQUEST`."""
    call_id = CALL_ID.unpack_from(msg, 1)[0]
    at = 1 + CALL_ID.size
    (n,) = SCHEMA_LEN.unpack_from(msg, at)
    at += SCHEMA_LEN.size
    view = memoryview(msg)
    return call_id, bytes(view[at : at + n]), view[at + n :]


def answer_message(call_id: int, seq: int, taken: float, answered: float, batch_bytes) -> bytes:
    return b"".join((ANSWER, ANSWER_HEAD.pack(call_id, seq, taken, answered), batch_bytes))


def split_answer(msg: bytes) -> tuple[int, int, float, float, memoryview]:
    """(call id, seq, taken, answered, answer batch bytes) of an `ANSWER`."""
    call_id, seq, taken, answered = ANSWER_HEAD.unpack_from(msg, 1)
    return call_id, seq, taken, answered, memoryview(msg)[1 + ANSWER_HEAD.size :]


def send_frame(sock, msg) -> None:
    """One framed message on a lane (`socket.socket`), whole (OSError when the other end is gone)."""
    n = len(msg)
    if n > MAX_FRAME:
        raise ValueError(f"a message of {n} bytes is over the channel's {MAX_FRAME}")
    if n < _SEND_JOINED:
        sock.sendall(FRAME.pack(n) + msg)
    else:
        sock.sendall(FRAME.pack(n))
        sock.sendall(msg)


def recv_frame(sock) -> bytes | None:
    """The next framed message on a lane; None when the other end closed it between two messages.
    EOFError when it closed inside one; TimeoutError past the socket's timeout. A lane carries one
    message at a time each way, so its first read takes whatever has come, up to `_FIRST_READ`
    bytes: a message that arrived whole (an answer, a request) costs one read, and one wait for
    the interpreter lock after it, not two; bytes past the message (a second one sent before the
    first was answered) break that rule and are refused with EOFError."""
    data = sock.recv(_FIRST_READ)
    if not data:
        return None
    if len(data) < FRAME.size:
        data += _recv_exactly(sock, FRAME.size - len(data))
    (n,) = FRAME.unpack_from(data)
    have = len(data) - FRAME.size
    if n < 0 or have > n:
        raise EOFError(f"a lane's frame says {n} bytes, and {have} came with it")
    body = data[FRAME.size :]
    if have < n:
        body += _recv_exactly(sock, n - have)
    return body


def _recv_exactly(sock, n: int) -> bytes:
    """The next `n` bytes of a message; EOFError when the lane closes first."""
    data = sock.recv(n, _WAITALL)
    if len(data) == n:
        return data
    if not data:
        raise EOFError("the lane closed inside a message")
    parts, got = [data], len(data)  # a short read (a signal, or a socket with a timeout)
    while got < n:
        more = sock.recv(n - got)
        if not more:
            raise EOFError("the lane closed inside a message")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class Lanes:
    """The request lanes to one engine worker's lane socket (`path`), as a caller sees them: each
    `request` on a lane of its own, taken from the free ones or newly connected, and given back once
    its answer was read whole; a lane whose call ended otherwise (a deadline, a lost worker) may still
    get that answer, so it is closed, never used again. `name`: the worker, as errors call it;
    `lost()`: the error of a call whose lane ended (the caller knows best why the worker went)."""

    def __init__(self, path: str, name: str, lost):
        import threading

        self.path, self.name, self._lost = path, name, lost
        self._lock = threading.Lock()
        self._free: list[socket.socket] = []
        self.busy = 0  # calls on lanes now
        self.closed = False

    def request(self, call_id: int, schema: bytes, body, timeout_s: float | None, what: str) -> bytes:
        """One request batch (its schema's and its own IPC bytes) on a lane, and the `ANSWER` message
        that came back on it; the Flight error the worker reported; `lost()` when the lane ended;
        FlightTimedOutError after `timeout_s` (None: as long as the worker lives)."""
        import pyarrow.flight as flight

        lane = self._take()
        kept = False
        try:
            lane.settimeout(timeout_s)
            send_frame(lane, request_message(call_id, schema, body))
            msg = recv_frame(lane)
            if msg is None:
                raise EOFError
            kind = msg[:1]
            if call_id_of(msg) != call_id or kind not in (ANSWER, ERROR):
                raise flight.FlightInternalError(f"{self.name} answered call {call_id_of(msg)} with "
                                                 f"{bytes(kind)!r} on the lane of call {call_id}")
            kept = True
            if kind == ERROR:
                raise flight_error(json_body(msg))
            return msg
        except TimeoutError:
            raise flight.FlightTimedOutError(f"{self.name} did not answer the {what} within {timeout_s:g} s") \
                from None
        except (EOFError, OSError):
            raise self._lost() from None
        finally:
            self._give(lane, kept)

    def _take(self) -> socket.socket:
        with self._lock:
            self.busy += 1
            if self._free:
                return self._free.pop()
        lane = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lane.connect(self.path)
        except OSError:
            lane.close()
            with self._lock:
                self.busy -= 1
            raise self._lost() from None
        return lane

    def _give(self, lane: socket.socket, kept: bool) -> None:
        with self._lock:
            self.busy -= 1
            if kept and not self.closed:
                self._free.append(lane)
                return
        lane.close()

    def close(self) -> None:
        """Close the free lanes; a lane in use is closed when its call ends."""
        with self._lock:
            self.closed = True
            free, self._free = self._free, []
        for lane in free:
            lane.close()


def error_body(exc: BaseException) -> dict:
    """An error as the worker reports it: the Flight error the one-engine server would raise."""
    from .protocol import to_flight_error

    flight_exc = to_flight_error(exc)
    return {"type": type(flight_exc).__name__, "message": str(flight_exc)}


def flight_error(body: dict) -> Exception:
    """The Flight error a worker reported (`error_body`), to raise in the front."""
    import pyarrow.flight as flight

    name = body.get("type")
    cls = getattr(flight, name) if name in FLIGHT_ERRORS else flight.FlightInternalError
    return cls(str(body.get("message", "")))


__all__ = ["ANSWER", "CONFIG", "CONTROL", "ERROR", "FAILED", "READY", "REPLY", "REQUEST", "STOP", "UPDATE",
           "Lanes", "answer_message", "call_id_of", "error_body", "flight_error", "json_body", "message",
           "recv_frame", "request_message", "send_frame", "split_answer", "split_request"]
