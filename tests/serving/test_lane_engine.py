"""A front's engine (serving/lane_engine.py) without processes: the batch it sends an engine worker is
the requests as a columnar batch numbered 0 to n - 1 (what the worker's own checks read back as the
same requests); a batch past the server's limits goes in parts that keep within them, the answers
joined in request order with the least seq of the parts; the answer batch is split per request,
empty answers included, and one out of request order is refused."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from serving import engine_channel as ch
from serving.lane_engine import LaneEngine, split_answers
from serving.limits import ServiceLimits
from serving.protocol import ANSWER_SCHEMA, answer_batch, decode_request_batch
from serving.request_columns import decode_columns, request_columns
from tests.support.servers import small_dataset


class FakeWorker:
    """Stands in for the engine worker's lane: each request batch decoded with the worker's own checks
    (under `limits`), answered with ad ids 1000 * (the request's age) + 0..2 (none for an odd age), at
    seqs 7, 5, 9, ... in turn."""

    def __init__(self, dataset, limits):
        self.dataset, self.limits, self.sent, self.seqs = dataset, limits, [], [7, 5, 9, 4]

    def request(self, call_id, schema_bytes, body, timeout_s, what):
        schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
        batch = pa.ipc.read_record_batch(pa.py_buffer(body), schema)
        m = self.dataset.model
        requests, ks = decode_request_batch(batch, seed=self.dataset.seed, experts=m.E, width=m.S, limits=self.limits)
        self.sent.append([r.request_id for r in requests])
        answers = [(np.arange(3, dtype=np.int64) + 1000 * r.user.age, np.ones(3, np.float32)) if r.user.age % 2 == 0
                   else (np.empty(0, np.int64), np.empty(0, np.float32)) for r in requests]
        out = answer_batch([r.request_id for r in requests], answers)
        seq = self.seqs[(len(self.sent) - 1) % len(self.seqs)]
        return ch.answer_message(call_id, seq, 0.0, 0.0, out.serialize())


def lane_engine(dataset, limits):
    engine = LaneEngine("/nonexistent/lane.sock", "engine worker 1 of 1", limits)
    engine.lanes = FakeWorker(dataset, limits)
    return engine


def expected(requests):
    return [list(np.arange(3) + 1000 * r.user.age) if r.user.age % 2 == 0 else [] for r in requests]


def test_a_batch_goes_as_one_columnar_call_numbered_from_zero_and_its_answers_come_back_per_request():
    dataset = small_dataset(seed=21, n_requests=12)
    requests = [dataset.requests[i] for i in (3, 3, 0, 7, 1, 11, 3)]  # repeated ids, as many clients send
    engine = lane_engine(dataset, ServiceLimits())
    answers, seq = engine.retrieve_at(requests, 10)
    assert engine.lanes.sent == [list(range(len(requests)))] and seq == 7
    assert [list(a) for a, _ in answers] == expected(requests)
    m = dataset.model
    columns, _ = decode_columns(request_columns(requests, 10, request_ids=range(100, 100 + len(requests))),
                                seed=dataset.seed, experts=m.E, width=m.S)
    answers, _ = engine.retrieve_at(columns, 10)  # a columnar call's requests, from their arrays
    assert [list(a) for a, _ in answers] == expected(requests)
    assert engine.lanes.sent[-1] == list(range(len(requests)))


def test_a_batch_past_the_limits_goes_in_parts_within_them():
    dataset = small_dataset(seed=22, n_requests=12)
    requests = list(dataset.requests) * 2
    one = request_columns(requests[:1], 10).get_total_buffer_size()
    limits = ServiceLimits(max_batch_requests=10, max_request_bytes=4 * one)
    engine = lane_engine(dataset, limits)
    answers, seq = engine.retrieve_at(requests, 10)
    sent = engine.lanes.sent
    assert len(sent) > 2 and sum(map(len, sent)) == len(requests), sent
    assert all(ids == list(range(len(ids))) and len(ids) <= 10 for ids in sent), sent
    assert [list(a) for a, _ in answers] == expected(requests)
    assert seq == min(engine.lanes.seqs[: len(sent)])  # the least any part reflects


def test_split_answers_gives_empty_answers_their_place_and_refuses_rows_out_of_order():
    out = answer_batch([0, 2, 3], [(np.array([5, 6]), np.array([1.0, 0.5], np.float32)),
                                   (np.array([7]), np.array([0.2], np.float32)),
                                   (np.array([8, 9]), np.array([0.9, 0.1], np.float32))])
    got = split_answers(out, 5)
    assert [list(a) for a, _ in got] == [[5, 6], [], [7], [8, 9], []]
    assert got[3][1].tolist() == pytest.approx([0.9, 0.1])
    backwards = pa.RecordBatch.from_arrays([pa.array([1, 0], pa.int64()), pa.array([1, 2], pa.int64()),
                                            pa.array([0.5, 0.4], pa.float32())], schema=ANSWER_SCHEMA)
    with pytest.raises(RuntimeError, match="request order"):
        split_answers(backwards, 2)
    with pytest.raises(RuntimeError, match="request order"):
        split_answers(out, 3)  # a row of request 3 in an answer to three requests
