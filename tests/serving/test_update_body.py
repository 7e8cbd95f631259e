"""An update call's body found line by line piece by piece (serving.update_body; issue 37, point 8): the
lines equal `bytes.split(b"\\n")` of the whole body for any body cut into any chunks (lines across
chunk boundaries, blank lines, CRLF, a body ending in a newline, an empty body, a line longer than a
piece), and one update call gives the same acknowledgement, the same log and the same applied updates
whether its body came whole (the `update` action) or in chunks (the streamed exchange)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andromeda_nb import testing
from serving import update_body
from serving.durable import UpdateJournal
from serving.update_body import ChunkedBody, body_lines
from serving.wal import WriteAheadLog

SCALE = testing.draw_scale()
DRAWN = settings(deadline=None, derandomize=SCALE == 1, database=None, max_examples=60 * SCALE,
                 suppress_health_check=[HealthCheck.too_slow])

BODY_BYTES = st.lists(st.sampled_from([b"\n", b"\r\n", b" ", b"{", b"}", b"a", b"\xff", b"xyz\n\n"]),
                      max_size=60).map(b"".join)


def _chunked(body: bytes, cuts: list[int]) -> ChunkedBody:
    points = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
    return ChunkedBody(body[lo:hi] for lo, hi in zip(points, points[1:]))


@DRAWN
@given(BODY_BYTES, st.lists(st.integers(0, 60), max_size=8), st.integers(1, 7))
def test_the_lines_of_a_body_in_any_chunks_are_those_of_the_whole_body(body, cuts, piece):
    chunked = _chunked(body, cuts)
    assert len(chunked) == len(body) and bytes(chunked) == body
    assert list(body_lines(chunked)) == body.split(b"\n"), (body, cuts)
    saved = update_body.PIECE_BYTES
    update_body.PIECE_BYTES = piece  # a whole body read in pieces of `piece` bytes
    try:
        assert list(body_lines(body)) == body.split(b"\n"), (body, piece)
    finally:
        update_body.PIECE_BYTES = saved


def test_an_empty_body_and_one_newline_split_as_bytes_do():
    for body in (b"", b"\n", b"\n\n", b"x"):
        assert list(body_lines(ChunkedBody([body]))) == body.split(b"\n")
        assert list(body_lines(body)) == body.split(b"\n")
    assert list(body_lines(ChunkedBody())) == [b""]


GEO = {"geo_locations": {"countries": ["US"]}}
UPDATES = [
    json.dumps({"op": "upsert", "ad": {"ad_id": 3, "targeting": GEO, "embedding": [0.5] * 8}}),
    json.dumps({"op": "retire", "ad_id": 1}),
    "",  # blank: skipped, still numbered
    json.dumps({"op": "status", "ad_id": 1, "status": "PAUSED"}),  # retired the line before
    '{"op": "retire", "ad_id": 2, "ad_id": 2}',  # a repeated key
    "{not json",
    json.dumps({"op": "upsert", "ad": {"ad_id": 4, "targeting": GEO, "format": 9}}),  # format out of range
    json.dumps({"op": "status", "ad_id": 2, "status": "PAUSED"}),
]


def _submit(body):
    journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2)
    applied: list = []
    ack = journal.submit(body, live=lambda ad_id: ad_id in {1, 2}, apply=lambda items: applied.extend(items))
    ack.pop("seconds")
    return ack, [r.update for r in journal.log.records_after(0)], [(r.seq, u) for r, u in applied]


@DRAWN
@given(st.lists(st.integers(0, 600), max_size=12), st.booleans())
def test_one_call_is_the_same_whether_its_body_came_whole_or_in_chunks(cuts, final_newline):
    body = "\n".join(UPDATES).encode() + (b"\n" if final_newline else b"")
    whole = _submit(body)
    assert whole[0]["applied"] == 3 and [r["line"] for r in whole[0]["rejected"]] == [4, 5, 6, 7], whole[0]
    assert _submit(_chunked(body, cuts)) == whole, cuts
