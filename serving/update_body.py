"""An update call's body as the pieces it arrived in, and its lines found piece by piece.

A 100 MB body joined into one `bytes`, copied, or split into lines in one call holds the interpreter
lock for that whole step (on the 2-core machine about 0.1 s each: `b"".join` of the streamed chunks,
`bytes(body)`, `body.split(b"\\n")`), and every retrieval of the server waits behind it. Here no step
works on more than one piece (`PIECE_BYTES`, the size of a streamed chunk) at a time, so between
pieces the interpreter can go to a retrieval:

* `ChunkedBody`: the chunks of the streamed `["update"]` exchange, kept as they came (`len` is the
  body's size; `bytes(...)` joins them, for a server that wants the whole text);
* `body_lines(body)`: the body's lines, as `body.split(b"\\n")` gives them (a blank last line when
  the body ends with a newline, one empty line for an empty body), from a `ChunkedBody` or from
  `bytes` (an `update` action's body, read in pieces of `PIECE_BYTES`).
"""

from __future__ import annotations

from typing import Iterable, Iterator

PIECE_BYTES = 1 << 20  # the most one step works on (the streamed exchange's chunks are this size)


class ChunkedBody:
    """The body of one update call as a list of `bytes` chunks, in order (none copied or joined)."""

    __slots__ = ("chunks", "size")

    def __init__(self, chunks: Iterable[bytes] = ()):
        self.chunks: list[bytes] = []
        self.size = 0
        for chunk in chunks:
            self.append(chunk)

    def append(self, chunk: bytes) -> None:
        if chunk:
            self.chunks.append(chunk)
            self.size += len(chunk)

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks)


def _pieces(body) -> Iterator[bytes]:
    if isinstance(body, ChunkedBody):
        yield from body.chunks
        return
    view = memoryview(body)
    for lo in range(0, len(view), PIECE_BYTES):
        yield view[lo : lo + PIECE_BYTES].tobytes()


def body_lines(body: "ChunkedBody | bytes") -> Iterator[bytes]:
    """The lines of `body`, equal to `bytes(body).split(b"\\n")`, found one piece at a time (a line
    that spans pieces is joined from its parts once its end is found)."""
    pending: list[bytes] = []  # the parts of the line not yet ended (one unless a line spans pieces)
    for piece in _pieces(body):
        parts = piece.split(b"\n")
        if len(parts) == 1:
            pending.append(piece)
            continue
        pending.append(parts[0])
        yield b"".join(pending)  # one part: that part itself, no copy
        yield from parts[1:-1]
        pending = [parts[-1]]
    yield b"".join(pending)


__all__ = ["PIECE_BYTES", "ChunkedBody", "body_lines"]
