"""The channel between a co-located front and its engine workers (`serving.engine_channel`): every
message kind reads back as written, a lane's frames read back whole and a cut one is told from a
clean end, a worker's error reaches the front as the Flight error the one-engine server raises; and the front's set of live ids (`serving.engine_front.LiveIds`) follows
updates as an engine does."""

from __future__ import annotations

import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from serving import engine_channel as ch
from serving import protocol as fl
from serving.engine_front import LiveIds
from serving.inputs import InvalidInput
from serving.limits import DEFAULT_LIMITS


def test_a_request_and_its_answer_read_back_as_written():
    batch = fl.request_batch([json.dumps({"request_id": 3, "user": {}, "context": {}})], 7)
    schema = batch.schema.serialize().to_pybytes()
    msg = ch.request_message(2**40 + 5, schema, batch.serialize())
    assert msg[:1] == ch.REQUEST
    call_id, schema_bytes, body = ch.split_request(msg)
    assert call_id == 2**40 + 5 and schema_bytes == schema
    back = pa.ipc.read_record_batch(pa.py_buffer(body), pa.ipc.read_schema(pa.py_buffer(schema_bytes)))
    assert back.equals(batch)
    answer = fl.answer_batch([3], [(np.array([9, 4], np.int64), np.array([0.5, 0.25], np.float32))])
    msg = ch.answer_message(11, 42, 1.5, 2.5, answer.serialize())
    call_id, seq, taken, answered, data = ch.split_answer(msg)
    assert (call_id, seq, taken, answered) == (11, 42, 1.5, 2.5)
    assert pa.ipc.read_record_batch(pa.py_buffer(data), fl.ANSWER_SCHEMA).equals(answer)
    msg = ch.message(ch.UPDATE, 8, [[1, {"op": "retire", "ad_id": 3}]])
    assert ch.call_id_of(msg) == 8 and ch.json_body(msg) == [[1, {"op": "retire", "ad_id": 3}]]
    assert ch.json_body(ch.message(ch.READY, body={"pid": 1}), with_id=False) == {"pid": 1}


def test_a_workers_error_is_the_flight_error_of_one_engine():
    for exc, kind in ((InvalidInput("request 4: user.age: bad"), flight.FlightServerError),
                      (DEFAULT_LIMITS.over("max_k", 9999, "k"), flight.FlightServerError),
                      (RuntimeError("boom"), flight.FlightInternalError)):
        got = ch.flight_error(json.loads(json.dumps(ch.error_body(exc))))
        want = fl.to_flight_error(exc)
        assert type(got) is type(want) is kind and str(got) == str(want)
    assert isinstance(ch.flight_error({"type": "NotAFlightError", "message": "x"}), flight.FlightInternalError)


def test_live_ids_follow_upserts_and_retires():
    live = LiveIds(np.array([30, 10, 20], np.int64))
    assert [a in live for a in (10, 20, 30, 40)] == [True, True, True, False] and len(live) == 3
    live.remove(20)
    live.add(40)
    assert 20 not in live and 40 in live and len(live) == 3
    live.add(20)  # an id may come back
    live.remove(40)
    assert 20 in live and 40 not in live and len(live) == 3


def test_a_lane_carries_whole_frames_and_tells_a_clean_end_from_a_cut_one():
    import socket

    a, b = socket.socketpair()
    try:
        small, large = ch.message(ch.READY, body={"x": 1}), bytes(range(256)) * 1024  # one write, then two
        for msg in (small, large, b""):  # one message at a time, as on a lane
            sender = threading.Thread(target=ch.send_frame, args=(a, msg))
            sender.start()  # the large one is more than the socket holds: read while it is sent
            assert ch.recv_frame(b) == msg
            sender.join(10)
        ch.send_frame(a, small)
        ch.send_frame(a, small)  # two at once break the lane's rule: refused, not misread
        with pytest.raises(EOFError, match="came with it"):
            ch.recv_frame(b)
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    try:
        a.sendall(ch.FRAME.pack(10) + b"12345")  # the sender ends inside a message
        a.close()
        with pytest.raises(EOFError):
            ch.recv_frame(b)
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    a.close()  # between two messages: a clean end
    assert ch.recv_frame(b) is None
    b.close()
