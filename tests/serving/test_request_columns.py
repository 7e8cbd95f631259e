"""The columnar request batch (serving.request_columns): the same requests as the JSON batch, the
same fault named with the same message, checked per batch, and served.

A drawn test puts faults in drawn rows of both kinds of batch and asserts that the two decoders raise
the same message: the first faulty request's first fault, in the JSON checker's order."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import protocol as fl
from andromeda_nb import testing
from andromeda_nb.compiled import MAX_TERM_ID
from andromeda_nb.constants import MAX_K
from serving.limits import LimitExceeded, ServiceLimits
from andromeda_nb.compiled import encode_requests
from andromeda_nb.model import MoeModel, user_sides
from serving.request_columns import COLUMNS, ROW_PATH_MAX, RequestColumns, decode_columns, request_columns
from andromeda_nb.targeting import MAX_ABS_TIME, request_to_json

from andromeda_nb.reference import ReferenceRetriever

from tests.support.servers import assert_equals_reference, colocated_server, location, saved_corpus, stop

E, S = 3, 4
KW = dict(seed=7, experts=E, width=S)
SCALE = testing.draw_scale()
DRAWN = settings(deadline=None, derandomize=SCALE == 1, database=None, max_examples=40 * SCALE,
                 suppress_health_check=[HealthCheck.too_slow])


def _requests(n: int, seed: int = 1):
    return testing.random_requests(np.random.default_rng(seed), n, experts=E, width=S)


def _same(got, want):
    assert got[1] == want[1]  # ks
    assert list(got[0]) == list(want[0])  # requests (signals are compared below)
    for a, b in zip(got[0], want[0]):
        np.testing.assert_array_equal(a.signals, b.signals)
        assert a.signals.dtype == np.float32 and a.signals.shape == (E, S)


def test_a_columnar_batch_decodes_to_the_requests_of_the_json_batch():
    requests = _requests(40)
    ks = [1 + i % 7 for i in range(40)]
    got = decode_columns(request_columns(requests, ks), **KW)
    _same(got, fl.decode_request_batch(fl.request_batch(requests, ks), **KW))
    assert isinstance(got[0], RequestColumns) and list(got[0]) == requests
    # the server's entry point takes either kind
    _same(fl.decode_request_batch(request_columns(requests, ks), **KW), got)
    # every kind of field is in the drawn requests, or the equality above proves little
    users = [r.user for r in requests]
    assert any(u.country for u in users) and any(u.latitude == u.latitude for u in users)
    assert any(u.region >= 0 for u in users) and sum(len(u.ids) for u in users) > 40


@DRAWN
@given(testing.request_lists(0, 8, experts=E, width=S))
def test_drawn_requests_round_trip(requests):
    got = decode_columns(request_columns(requests, 5), **KW)
    assert list(got[0]) == requests and got[1] == [5] * len(requests)


@pytest.mark.parametrize("rows", [3, 12])
def test_null_signals_are_derived_as_a_json_request_without_them(rows):
    requests = _requests(rows)
    batch = request_columns(requests, 4)
    signals = pa.array([None, batch.column("signals")[1].as_py()] + [None] * (rows - 2),
                       batch.schema.field("signals").type)
    batch = batch.set_column(batch.schema.get_field_index("signals"), "signals", signals)
    got, _ = decode_columns(batch, **KW)
    texts = [json.dumps({k: v for k, v in request_to_json(r, with_id=False).items() if k != "signals"})
             for r in requests]
    want, _ = fl.decode_request_batch(fl.request_batch([json.dumps({"request_id": r.request_id, **json.loads(t)})
                                                        for r, t in zip(requests, texts)], 4), **KW)
    np.testing.assert_array_equal(got[0].signals, want[0].signals)
    np.testing.assert_array_equal(got[2].signals, want[2].signals)
    np.testing.assert_array_equal(got[1].signals, requests[1].signals)
    assert not np.array_equal(got[0].signals, requests[0].signals)


def test_optional_columns_may_be_left_out():
    requests = _requests(4)
    batch = request_columns(requests, 3)
    keep = [c.name for c in COLUMNS if c.required]
    slim = pa.RecordBatch.from_arrays([batch.column(n) for n in keep], names=keep)
    got, _ = decode_columns(slim, **KW)
    for g, r in zip(got, requests):
        assert g.user.age == r.user.age and g.context == r.context
        assert g.user.country == "" and g.user.region == -1 and not g.user.ids
        assert np.isnan(g.user.latitude) and np.isnan(g.user.longitude)


# --- requests as arrays, taken whole ---------------------------------------------------------------------


def _columns(requests, k=5):
    got, _ = decode_columns(request_columns(requests, k), **KW)
    assert isinstance(got, RequestColumns)
    return got


def _same_encoded(a, b):
    for name in ("terms", "term_ptr", "age", "gender", "latitude", "longitude", "publisher", "device", "os", "time"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@DRAWN
@given(testing.request_lists(ROW_PATH_MAX + 1, 20, experts=E, width=S))
def test_the_arrays_encode_and_feed_the_model_as_the_request_objects_do(requests):
    cols = _columns(requests)
    _same_encoded(encode_requests(cols), encode_requests(requests))
    model = MoeModel.init(3, D=8, E=E, F=3, S=S)
    for got, want in zip(user_sides(model, cols), user_sides(model, requests)):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)


def test_slices_and_joins_of_the_arrays_are_the_same_requests():
    requests = _requests(30)
    a, b = _columns(requests[:12]), _columns(requests[12:])
    joined = RequestColumns.concat([a[3:12], b, a[:3]])
    want = requests[3:12] + requests[12:] + requests[:3]
    assert isinstance(joined, RequestColumns) and list(joined) == want
    _same_encoded(encode_requests(joined), encode_requests(want))
    assert joined[-1] == requests[2] and joined[5] is joined[5]  # made once
    np.testing.assert_array_equal(fl.request_ids(joined), [r.request_id for r in want])
    with pytest.raises(IndexError):
        joined[len(want)]


@DRAWN
@given(testing.request_lists(7, 16, experts=E, width=S))
def test_the_arrays_write_back_the_batch_they_were_read_from(requests):
    """`RequestColumns.record_batch` (what a front sends its engine worker): decoded again, the same
    requests numbered as asked, at one k; a slice or a join writes its own rows; and the batch
    `request_columns` writes for the same requests and ids decodes to the same."""
    cols = _columns(requests)
    ids = np.arange(len(requests), dtype=np.int64) * 5 + 3
    got, ks = decode_columns(cols.record_batch(9, ids), **KW)
    want = [dataclasses.replace(r, request_id=int(i)) for r, i in zip(requests, ids)]
    assert list(got) == want and ks == [9] * len(requests)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.signals, b.signals)
    _same(decode_columns(request_columns(requests, 9, request_ids=ids), **KW), (got, ks))
    part = RequestColumns.concat([cols[4:], cols[:4]])
    again, _ = decode_columns(part.record_batch(2), **KW)
    assert list(again) == requests[4:] + requests[:4]


def test_the_batcher_hands_the_engine_the_calls_arrays_joined():
    """Calls decoded to arrays reach the engine as one RequestColumns, answered per call; a call of
    Request objects among them makes the batch a list."""
    import threading

    from serving.batcher import RequestBatcher

    requests = _requests(30)
    seen = []

    def run(batch, k):
        seen.append(type(batch))
        return [(np.array([r.request_id]), np.array([1.0], np.float32)) for r in batch], 0

    batcher = RequestBatcher(run, max_wait_s=0.2)
    parts = [_columns(requests[:10]), _columns(requests[10:20]), requests[20:]]
    results = {}

    def call(i, part):
        results[i] = batcher.submit(part, [3] * len(part))[0]

    try:
        for group in ([0, 1], [0, 1, 2]):
            threads = [threading.Thread(target=call, args=(i, parts[i])) for i in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            for i in group:
                assert [int(ids[0]) for ids, _ in results[i]] == [r.request_id for r in parts[i]]
    finally:
        batcher.close()
    assert seen[0] is RequestColumns and list in seen


def test_the_gpu_engine_answers_the_arrays_as_the_float64_reference(tmp_path):
    """The GPU engine (the simulator here: one launch costs seconds) takes the arrays whole; its
    answers equal the float64 reference's, request by request."""
    from gpu.engine import GpuEngine

    device = testing.KERNEL_DEVICE
    _, dataset = saved_corpus(tmp_path / "corpus", 11, n_ads=40, n_requests=ROW_PATH_MAX + 1)
    cols, _ = decode_columns(request_columns(dataset.requests, 7), seed=dataset.seed, experts=dataset.model.E,
                             width=dataset.model.S)
    assert isinstance(cols, RequestColumns)
    engine = GpuEngine(dataset, device)
    try:
        answers = engine.retrieve(cols, 7)
    finally:
        engine.close()
    assert sum(len(ids) for ids, _ in answers) > 0
    assert_equals_reference(ReferenceRetriever.build(dataset), list(dataset.requests), answers, 7, "columns")


# --- the same fault, the same message ------------------------------------------------------------------

# (column, value): the value written to a column of the columnar batch and to the same field of the
# JSON request (None: the field left out of the JSON object)
FAULTS = [
    ("age", 130), ("age", -1), ("gender", 3), ("country", "tr"), ("country", "TUR"),
    ("region", MAX_TERM_ID + 1), ("city", -5), ("locale", MAX_TERM_ID + 7),
    ("latitude", 91.5), ("longitude", -180.25), ("latitude", None), ("longitude", None),
    ("interests", [3, -1]), ("custom_audiences", [MAX_TERM_ID + 1]), ("behaviors", [1, 2, MAX_TERM_ID + 2]),
    ("publisher_platform", "myspace"), ("device_platform", "watch"), ("user_os", "BeOS"),
    ("time", MAX_ABS_TIME + 1), ("time", -MAX_ABS_TIME - 1), ("k", 0), ("k", MAX_K + 1),
]
CONTEXT = {"publisher_platform", "device_platform", "user_os", "time"}


def _with_faults(requests, faults):
    """The JSON batch and the columnar batch of `requests`, with faults [(row, column, value)]."""
    ks = [5] * len(requests)
    objs = [request_to_json(r, with_id=False) for r in requests]
    batch = request_columns(requests, ks)
    columns = {name: batch.column(name).to_pylist() for name in batch.schema.names}
    for row, name, value in faults:
        if name == "k":
            ks[row] = value
        else:
            part = objs[row]["context" if name in CONTEXT else "user"]
            if value is None:
                part.pop(name, None)
            else:
                part[name] = value
        columns[name][row] = value
    json_batch = fl.request_batch([json.dumps({"request_id": r.request_id, **o}) for r, o in zip(requests, objs)], ks)
    col_batch = pa.RecordBatch.from_arrays(
        [pa.array(columns[n], batch.schema.field(n).type) for n in batch.schema.names], names=batch.schema.names)
    return json_batch, col_batch


def _error(batch, limits=None):
    try:
        fl.decode_request_batch(batch, **KW, limits=limits or ServiceLimits())
    except (fl.InvalidInput, LimitExceeded) as exc:
        return type(exc).__name__, str(exc)
    return None


def _located(n: int = 12):
    """Requests that all have a location, so that dropping one half of it is a fault (12: checked by
    arrays; 3, at most ROW_PATH_MAX: row by row)."""
    out = []
    for r in _requests(n, seed=5):
        user = dataclasses.replace(r.user, latitude=10.5, longitude=-20.25)
        out.append(dataclasses.replace(r, user=user))
    return out


@pytest.mark.parametrize("column, value", FAULTS)
@pytest.mark.parametrize("rows", [12, 5])
def test_each_fault_has_the_json_message(column, value, rows):
    assert (rows > ROW_PATH_MAX) == (rows == 12)
    json_batch, col_batch = _with_faults(_located(rows), [(4, column, value)])
    want = _error(json_batch)
    assert want is not None and "request 4" in want[1]
    assert _error(col_batch) == want


@DRAWN
@given(st.lists(st.tuples(st.integers(0, 11), st.sampled_from(FAULTS)), min_size=1, max_size=5))
def test_drawn_faults_name_the_first_faulty_request_as_json_does(faults):
    faults = [(row, column, value) for row, (column, value) in faults]
    json_batch, col_batch = _with_faults(_located(), faults)
    want = _error(json_batch)
    assert want is not None
    assert _error(col_batch) == want


def test_k_over_the_servers_limit_and_duplicate_ids_as_in_json():
    requests = _requests(5)
    limits = ServiceLimits(max_k=50)
    json_batch, col_batch = _with_faults(requests, [(2, "k", 60)])
    assert _error(col_batch, limits) == _error(json_batch, limits) == (
        "LimitExceeded", "request 2: k = 60 is over the server's limit of 50 (--max-k)")
    twice = [requests[0], requests[1], dataclasses.replace(requests[2], request_id=requests[0].request_id)]
    assert _error(request_columns(twice, 5)) == _error(fl.request_batch(twice, 5))
    assert "appears more than once" in _error(request_columns(twice, 5))[1]


@pytest.mark.parametrize("rows", [3, 12])
def test_signals_faults_are_named_by_group_and_position(rows):
    requests = _requests(rows)
    batch = request_columns(requests, 5)
    values = batch.column("signals").to_pylist()
    values[1][E * S - 2] = float("inf")
    bad = batch.set_column(batch.schema.get_field_index("signals"), "signals",
                           pa.array(values, batch.schema.field("signals").type))
    assert _error(bad) == ("InvalidInput", f"request {requests[1].request_id}: signals[{E - 1}][{S - 2}]: "
                                           "must be finite, got inf")
    short = batch.set_column(batch.schema.get_field_index("signals"), "signals",
                             pa.array([v[:5] for v in batch.column("signals").to_pylist()], pa.list_(pa.float32())))
    assert _error(short)[1] == f"request {requests[0].request_id}: signals: has 5 values; expected {E * S} " \
                               f"({E} groups of {S})"
    nulled = pa.array([v if i != 2 else [None] + v[1:] for i, v in enumerate(values)], pa.list_(pa.float64()))
    # the inf of request 1 comes first; alone, request 2's null is named
    alone = pa.array([v if i != 2 else [None] + v[1:] for i, v in enumerate(batch.column("signals").to_pylist())],
                     pa.list_(pa.float64()))
    assert _error(batch.set_column(batch.schema.get_field_index("signals"), "signals", alone))[1] == (
        f"request {requests[2].request_id}: signals[0][0]: must be a number, got null")
    assert _error(batch.set_column(batch.schema.get_field_index("signals"), "signals", nulled))[1] == (
        f"request {requests[1].request_id}: signals[{E - 1}][{S - 2}]: must be finite, got inf")
    values[1][E * S - 2] = 1e39  # beyond float32, in a float64 column
    wide = pa.array(values, pa.list_(pa.float64()))
    assert "is out of range" in _error(batch.set_column(batch.schema.get_field_index("signals"), "signals", wide))[1]


@pytest.mark.parametrize("rows", [2, 12])
def test_columns_of_the_wrong_type_unknown_or_missing_are_named(rows):
    batch = request_columns(_requests(rows), 5)
    at = batch.schema.get_field_index
    as_text = batch.set_column(at("age"), "age", pa.array([str(30 + i) for i in range(rows)]))
    assert _error(as_text) == ("InvalidInput", "column age is string; expected an integer type")
    wide = batch.set_column(at("age"), "age", pa.array(range(30, 30 + rows), pa.uint64()))  # any integer width
    assert fl.decode_request_batch(wide, **KW)[0][1].user.age == 31
    huge = batch.set_column(at("time"), "time", pa.array([2**63] + [1] * (rows - 1), pa.uint64()))
    first = batch.column("request_id")[0].as_py()
    assert _error(huge) == ("InvalidInput", "column time: a value is outside the range of int64" if rows > ROW_PATH_MAX
                            else f"request {first}: context.time: {2**63} is out of range -{MAX_ABS_TIME}..{MAX_ABS_TIME}")
    extra = batch.append_column("favourite_colour", pa.array(["red"] * rows))
    assert "unknown column(s) favourite_colour" in _error(extra)[1]
    lacking = batch.drop_columns(["time", "user_os"])
    assert "lacks column(s) user_os, time" in _error(lacking)[1]
    dictionary = batch.set_column(at("user_os"), "user_os", batch.column("user_os").dictionary_encode())
    assert list(fl.decode_request_batch(dictionary, **KW)[0]) == list(fl.decode_request_batch(batch, **KW)[0])
    neither = pa.record_batch([pa.array([1], pa.int64())], names=["request_id"])
    assert "lacks column(s) request, k" in _error(neither)[1]
    ids = batch.set_column(at("interests"), "interests", pa.array([["a"]] * rows, pa.list_(pa.utf8())))
    assert _error(ids) == ("InvalidInput", "column interests is list<item: string>; expected a list of integers")


def test_many_calls_checked_as_one_and_a_fault_goes_to_its_call_alone():
    requests = _requests(9)
    calls = [request_columns(requests[i : i + 3], 4) for i in (0, 3, 6)]
    calls.append(request_columns(requests[:2], 6))  # the same ids as the first call: allowed across calls
    calls.append(fl.request_batch(requests[2:4], 5))  # a JSON call among them
    together = fl.decode_request_batches(calls, **KW)
    for call, got in zip(calls, together):
        _same(got, fl.decode_request_batch(call, **KW))
    _, faulty = _with_faults(requests[3:6], [(1, "age", 500)])
    together = fl.decode_request_batches([calls[0], faulty, calls[2]], **KW)
    assert isinstance(together[1], fl.InvalidInput) and f"request {requests[4].request_id}: user.age" in str(together[1])
    _same(together[0], fl.decode_request_batch(calls[0], **KW))
    _same(together[2], fl.decode_request_batch(calls[2], **KW))
    over = fl.decode_request_batches([calls[0], calls[1]], **KW, limits=ServiceLimits(max_batch_requests=2))
    assert all(isinstance(x, LimitExceeded) for x in over)


def test_the_colocated_server_answers_a_columnar_batch_as_the_json_batch(tmp_path):
    _, dataset = saved_corpus(tmp_path / "corpus", 3, n_ads=120, n_requests=12)
    server = colocated_server(dataset)
    try:
        loc = location(server)
        by_json = fl.retrieve_over_flight(loc, dataset.requests, 10)
        by_columns = fl.retrieve_over_flight(loc, dataset.requests, 10, request_format="columns")
        assert sum(len(ids) for ids, _ in by_json) > 0
        for (a, sa), (b, sb) in zip(by_json, by_columns):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(sa, sb)
        client = fl.flight.connect(loc)
        try:
            bad = request_columns(dataset.requests[:2], 10)
            bad = bad.set_column(bad.schema.get_field_index("age"), "age", pa.array([20, 200], pa.int16()))
            with pytest.raises(fl.flight.FlightServerError,
                               match=f"invalid request: request {dataset.requests[1].request_id}: user.age: 200 is "
                                     "out of range"):
                fl.exchange_batches(client, [bad], timeout=20)
        finally:
            client.close()
        assert fl.retrieve_over_flight(loc, dataset.requests[:3], 10, request_format="columns")[0][0].size
    finally:
        stop(server)


@pytest.mark.parametrize("signals_type", ["fixed-size list", "list"])
def test_sliced_batches_decode_their_own_rows_signals(signals_type):
    """A slice of a columnar batch decodes each row's own signals, compared explicitly (`Request`
    equality leaves signals out): slices starting past row 0, short ones (decoded row by row) and
    long ones (decoded as arrays), with the signals column of either list type."""
    requests = _requests(30)
    whole = request_columns(requests, 5)
    if signals_type == "list":
        signals = pa.array(whole.column("signals").to_pylist(), pa.list_(pa.float32()))
        whole = whole.set_column(whole.schema.get_field_index("signals"), "signals", signals)
    assert len({r.signals.tobytes() for r in requests}) == len(requests)  # a wrong row cannot pass
    for lo, hi in ((3, 10), (1, 2), (4, 4 + ROW_PATH_MAX), (7, 30), (12, 29)):  # arrays, rows, rows, arrays
        got, ks = decode_columns(whole.slice(lo, hi - lo), **KW)
        assert ks == [5] * (hi - lo)
        _same((list(got), ks), (requests[lo:hi], ks))
        for i, (g, r) in enumerate(zip(got, requests[lo:hi])):
            np.testing.assert_array_equal(g.signals, r.signals, err_msg=f"slice {lo}:{hi}, row {lo + i}")


def test_sliced_batches_and_null_rows_over_values_read_only_their_own_values():
    """A batch that is a slice of a larger one, and list columns whose null rows cover values (Arrow
    allows it), decode to the rows' own values: a bad id under a null row or outside the slice is
    nobody's."""
    requests = _requests(30)
    whole = request_columns(requests, 5)
    for lo, hi in ((3, 20), (10, 30), (0, 12)):
        got = list(decode_columns(whole.slice(lo, hi - lo), **KW)[0])
        assert got == requests[lo:hi]
    n = len(requests)
    offsets = pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32))
    values = pa.array(np.tile([5, -1], n).astype(np.int64))  # every row's second id is out of range
    mask = pa.array([i % 2 == 1 for i in range(n)])  # ... except that odd rows are null
    bad = pa.ListArray.from_arrays(offsets, values, mask=mask)
    batch = whole.set_column(whole.schema.get_field_index("interests"), "interests", bad)
    assert _error(batch) == ("InvalidInput", f"request {requests[0].request_id}: user.interests[1]: -1 is out of "
                             f"range 0..{MAX_TERM_ID}")
    values = pa.array(np.tile([5, 6], n).astype(np.int64))
    good = pa.ListArray.from_arrays(offsets, values, mask=mask)
    got = list(decode_columns(whole.set_column(whole.schema.get_field_index("interests"), "interests", good), **KW)[0])
    assert [g.user.ids.get("interests") for g in got] == [frozenset({5, 6}) if i % 2 == 0 else None for i in range(n)]
