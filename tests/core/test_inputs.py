"""Bad input gets a clear error, never a traceback or a crash (issue 15, points 7 and 9): JSON nested a
thousand deep, repeated keys, byte-order marks and bytes that are not UTF-8 in every JSON reader
(`import`, `--updates`, the Flight request column and update body, meta.json); corpus values out of
range in a corpus edited with its hashes recomputed; a request id with two sources."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from click.testing import CliRunner

from serving import protocol as fl
from andromeda_nb import jsontext, store
from andromeda_nb.targeting import request_to_json
from andromeda_nb.updates import read_updates

from tests.support.servers import D, F, colocated_server, edit_corpus, lines_of, location, saved_corpus, stop, update_stream

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

DEEP = "[" * 1000 + "]" * 1000
GEO = {"geo_locations": {"countries": ["US"]}}


# --- one JSON reader for every input ----------------------------------------------------------------


def test_deep_nesting_is_an_error_naming_the_depth_never_a_recursion_error():
    for text in (DEEP, '{"a":' * 5000 + "1" + "}" * 5000, "[" * 100_000):
        with pytest.raises(jsontext.JsonInputError, match="levels deep; at most 64"):
            jsontext.loads(text)
    assert jsontext.loads('{"a": "' + "[{" * 500 + '"}') == {"a": "[{" * 500}  # brackets in strings do not count
    assert jsontext.loads("[" * 64 + "]" * 64, max_depth=64) is not None
    with pytest.raises(jsontext.JsonInputError, match="65 levels deep"):
        jsontext.loads("[" * 65 + "]" * 65, max_depth=64)


def test_repeated_keys_are_named_by_their_path():
    with pytest.raises(jsontext.JsonInputError) as err:
        jsontext.loads('{"ad": {"targeting": {"flexible_spec": [{"interests": [1]}, {"interests": [2], "interests": [3]}]}}}')
    assert err.value.path == "ad.targeting.flexible_spec[1].interests"
    assert "more than once" in str(err.value)
    with pytest.raises(jsontext.JsonInputError, match="^op: key appears more than once"):
        jsontext.loads('{"op": "retire", "op": "upsert"}')


def test_byte_order_mark_skipped_and_bad_utf8_named():
    assert jsontext.loads("\ufeff{\"x\": 1}") == {"x": 1}
    assert jsontext.loads(b"\xef\xbb\xbf{\"x\": 1}") == {"x": 1}
    with pytest.raises(jsontext.JsonInputError, match=r"not valid UTF-8 \(byte 8 is 0xff\)"):
        jsontext.loads(b'{"x": "\xff"}')


def test_bad_json_is_placed_at_its_true_line_and_column():
    """A line cut short is read with its newline: the error is where the text ends, on that line,
    not at column 1 of an empty line after it; a text of several lines names the line too."""
    cut = '{"ad_id": 5, "status": "ACTIVE", "format": \n'
    with pytest.raises(jsontext.JsonInputError, match=r"^not valid JSON \(Expecting value at column 43, where the "
                                                       r"text ends\)$"):
        jsontext.loads(cut)
    with pytest.raises(jsontext.JsonInputError, match=r"Expecting value at column 19\)$"):
        jsontext.loads('{"ad_id": 1, "x": }\n')
    with pytest.raises(jsontext.JsonInputError, match=r"Expecting property name .* at line 2, column 3\)$"):
        jsontext.loads('{"a": \n1,}')
    with pytest.raises(jsontext.JsonInputError, match=r"Extra data at column 10\)$"):
        jsontext.loads(b'{"a": 1} x\r\n')


def test_a_number_too_long_is_said_so_without_pythons_advice():
    for text in ('{"ad_id": 1' + "1" * 5000 + "}", "[" + "9" * 4301 + "]"):
        with pytest.raises(jsontext.JsonInputError, match=r"^a number of [\d,]+ digits is longer than the [\d,]+ "
                                                           r"digits accepted") as err:
            jsontext.loads(text)
        assert "sys.set_int_max_str_digits" not in str(err.value)


def test_import_names_bad_lines_where_they_break(tmp_path):
    ads = tmp_path / "ads.jsonl"
    ads.write_text(json.dumps({"ad_id": 1, "targeting": GEO}) + "\n" + '{"ad_id": 2, "status": \n'
                   + '{"ad_id": 3, "format": 1' + "0" * 5000 + "}\n" + json.dumps({"ad_id": 6, "status": "BOGUS"}) + "\n")
    reqs = tmp_path / "requests.jsonl"
    request = {"request_id": 7, "user": {"age": "x"},
               "context": {"publisher_platform": "facebook", "device_platform": "mobile", "user_os": "iOS", "time": 0}}
    reqs.write_text(json.dumps(request) + "\n" + json.dumps({**request, "request_id": 8, "user": {"age": 30}}) + "\n")
    summary = store.import_jsonl(ads, reqs, tmp_path / "out", seed=1, dim=8)
    errors = [r["error"] for r in summary.rejections]
    assert errors[0] == "line 2: not valid JSON (Expecting value at column 23, where the text ends)", errors
    assert errors[1].startswith("line 3: a number of 5,001 digits is longer than"), errors
    assert errors[2].startswith("line 4: ad 6: status: "), errors
    assert errors[3].startswith("line 1: request 7: user.age: must be an int"), errors


def test_update_file_bad_lines_rejected_by_number_the_rest_applied(tmp_path):
    path = tmp_path / "updates.jsonl"
    good = [{"op": "upsert", "ad": {"ad_id": i, "targeting": GEO}} for i in (1, 2, 3)]
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(good[0]).encode() + b"\n"
                     + DEEP.encode() + b"\n"
                     + b'{"op": "retire", "ad_id": 1, "ad_id": 2}\n'
                     + b'{"op": "upsert", "ad": {"ad_id": 9, "targeting": {"geo_locations": {"countries": ["\xff"]}}}}\n'
                     + json.dumps(good[1]).encode() + b"\n"
                     + json.dumps(good[2]).encode() + b"\n")
    updates, rejections = read_updates(path, seed=0, dim=4)
    assert [n for n, _ in updates] == [1, 5, 6]  # the byte-order mark did not cost line 1
    reasons = {r.line_no: r.reason for r in rejections}
    assert set(reasons) == {2, 3, 4}
    assert "1000 levels deep" in reasons[2]
    assert "ad_id: key appears more than once" in reasons[3]
    assert "not valid UTF-8" in reasons[4]


def test_import_accepts_a_bom_and_rejects_deep_and_repeated_lines(tmp_path):
    ads = tmp_path / "ads.jsonl"
    ads.write_bytes(b"\xef\xbb\xbf" + json.dumps({"ad_id": 1, "targeting": GEO}).encode() + b"\n"
                    + DEEP.encode() + b"\n"
                    + json.dumps({"ad_id": 3, "targeting": GEO})[:-1].encode() + b', "format": 1, "format": 2}\n'
                    + json.dumps({"ad_id": 4, "targeting": GEO}).encode() + b"\n")
    reqs = tmp_path / "requests.jsonl"
    request = {"request_id": 7, "user": {"age": 30, "country": "US"},
               "context": {"publisher_platform": "facebook", "device_platform": "mobile", "user_os": "iOS", "time": 0}}
    reqs.write_bytes(b"\xef\xbb\xbf" + json.dumps(request).encode() + b"\n" + DEEP.encode() + b"\n")
    summary = store.import_jsonl(ads, reqs, tmp_path / "out", seed=1, dim=8)
    assert (summary.ads, summary.rejected_ads, summary.requests, summary.rejected_requests) == (2, 2, 1, 1)
    errors = [json.loads(line)["error"] for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert errors[0].startswith("line 2: nested 1000 levels deep")
    assert errors[1] == "line 3: format: key appears more than once in its object"
    assert store.load_dataset(tmp_path / "out").ad_ids.tolist() == [1, 4]


def test_cli_updates_file_with_bad_bytes_and_depth_is_reported_not_a_traceback(tmp_path):
    from cli import main

    data, dataset = saved_corpus(tmp_path / "corpus", 3, n_ads=40, n_requests=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe garbage\n" + DEEP.encode() + b"\n" + lines_of(update_stream(dataset, 2, 1)).encode())
    result = CliRunner().invoke(main, ["match", "--data", str(data), "--updates", str(bad), "--json", "-q"])
    assert result.exit_code == 0, result.output
    assert "rejected update line 1" in result.stderr and "not valid UTF-8" in result.stderr
    assert "rejected update line 2" in result.stderr and "levels deep" in result.stderr
    assert "Traceback" not in result.output


# --- corpus values out of range -------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    return saved_corpus(tmp_path / "corpus", 5, n_ads=60, n_requests=3)[0]


@pytest.mark.parametrize("array,value,expected", [
    ("format", 30000, "format: row 7 .* holds 30000; expected a format in 0..7"),
    ("status", 9, "status: row 7 .* holds 9; expected a status code in 0..3"),
    ("age_min", 3, "age_min: row 7 .* holds 3; expected an age in 13..65"),
    ("gender_mask", 0, "gender_mask: row 7"),
    ("os_mask", 255, "os_mask: row 7"),
])
def test_corpus_values_out_of_range_are_refused_naming_the_row(corpus, array, value, expected):
    def edit(a):
        a[7] = value
        return a

    edit_corpus(corpus, compiled={array: edit},
                ads_column={"format": lambda col: [value if i == 7 else v for i, v in enumerate(col)]}
                if array == "format" else None)
    with pytest.raises(store.StoreError, match=expected):
        store.load_dataset(corpus)


def test_terms_and_circles_out_of_range_are_refused(corpus, tmp_path):
    edit_corpus(corpus, compiled={"terms": lambda t: np.r_[np.int64(20) << 40, t[1:]]})
    with pytest.raises(store.StoreError, match="terms: row 0 .* namespace 0..13"):
        store.load_dataset(corpus)
    other, dataset = saved_corpus(tmp_path / "other", 6, n_ads=60, n_requests=2)
    assert len(dataset.compiled.circles), "the corpus of seed 6 has custom locations"
    edit_corpus(other, compiled={"circles": lambda c: np.r_[[[95.0, 0.0, 5.0]], c[1:]]})
    with pytest.raises(store.StoreError, match="circles: row .* latitude -90..90"):
        store.load_dataset(other)


def test_a_bad_term_is_refused_naming_its_ad(corpus):
    """The row named for a bad term is its ad's: the ad found from the term through term_ptr and
    clause_ptr (the compiled check) is the one the plain per-term array of ads gives."""
    ct = store.load_dataset(corpus).compiled
    ad_of_clause = np.repeat(np.arange(len(ct)), np.diff(ct.clause_ptr))
    ad_of_term = ad_of_clause[np.repeat(np.arange(len(ct.clause_negative)), np.diff(ct.term_ptr))]
    sizes = np.diff(ct.term_ptr)
    clause = int(np.flatnonzero(sizes >= 2)[len(np.flatnonzero(sizes >= 2)) // 2])  # a clause of 2+ terms, mid-corpus
    t = int(ct.term_ptr[clause]) + 1
    row = int(ad_of_term[t])

    def unordered(terms):
        terms[t] = terms[t - 1]
        return terms

    edit_corpus(corpus, compiled={"terms": unordered})
    with pytest.raises(store.StoreError, match=f"terms: row {row} .* ascending and unique"):
        store.load_dataset(corpus)


def test_meta_json_seed_and_sizes_are_checked(corpus):
    edit_corpus(corpus, meta={"seed": "abc"})
    with pytest.raises(store.StoreError, match="seed: expected an integer, got 'abc'"):
        store.load_dataset(corpus)
    edit_corpus(corpus, meta={"seed": 0, "sizes": {"D": D, "E": 6, "k": 2, "F": F + 1, "S": 16}})
    with pytest.raises(store.StoreError, match="sizes.F is 9, but model.npz has F = 8"):
        store.load_dataset(corpus)
    (corpus / store.META_FILE).write_bytes(b'{"schema_version": 1, "schema_version": 1}')
    with pytest.raises(store.StoreError, match="schema_version: key appears more than once"):
        store.load_dataset(corpus)


def test_retrieve_on_a_corpus_edited_to_format_30000_is_an_error_not_a_crash(corpus):
    from cli import main

    edit_corpus(corpus, compiled={"format": lambda a: np.full_like(a, 30000)},
                ads_column={"format": lambda col: [30000] * len(col)})
    result = CliRunner().invoke(main, ["retrieve", "--data", str(corpus), "--arch", "colocated", "--device", "cpu",
                                       "-q"])
    assert result.exit_code == 1 and "format: row 0" in result.output and "Traceback" not in result.output


# --- over Flight -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _, dataset = saved_corpus(tmp_path_factory.mktemp("inputs") / "corpus", 8, n_ads=80, n_requests=3)
    srv = colocated_server(dataset)
    yield srv, location(srv), dataset
    stop(srv)


def _send(loc, rows):
    batch = pa.record_batch([pa.array([r[0] for r in rows], pa.int64()), pa.array([r[1] for r in rows], pa.utf8()),
                             pa.array([5] * len(rows), pa.int32())], schema=fl.REQUEST_SCHEMA)
    client = flight.connect(loc)
    try:
        return fl.exchange_batches(client, [batch], timeout=20)
    finally:
        client.close()


def test_request_id_has_one_source(server):
    srv, loc, dataset = server
    body = request_to_json(dataset.requests[0], with_id=False)
    assert "request_id" not in json.loads(fl.request_text(dataset.requests[0]))  # the client sends the column only
    with pytest.raises(flight.FlightServerError, match="request 5: request_id: 99 disagrees with the request id 5"):
        _send(loc, [(5, json.dumps({**body, "request_id": 99}))])
    (answer,) = _send(loc, [(5, json.dumps({**body, "request_id": 5})), ])  # the same id twice is one source
    assert set(answer.column("request_id").to_pylist()) <= {5}
    with pytest.raises(flight.FlightServerError, match="request 5: request_id appears more than once in the batch"):
        _send(loc, [(5, json.dumps(body)), (6, json.dumps(body)), (5, json.dumps(body))])


def test_deep_or_repeated_request_json_is_a_clear_error(server):
    srv, loc, dataset = server
    body = json.dumps(request_to_json(dataset.requests[0], with_id=False))
    with pytest.raises(flight.FlightServerError, match="request 3: request: nested 1000 levels deep"):
        _send(loc, [(3, DEEP)])
    with pytest.raises(flight.FlightServerError, match=r"request 4: user\.age: key appears more than once"):
        _send(loc, [(4, body.replace('"age":', '"age":30,"age":'))])
    with pytest.raises(flight.FlightServerError, match="request 6: request is not valid JSON"):
        _send(loc, [(6, "\ufeff")])
    assert _send(loc, [(7, "\ufeff" + body)])  # a byte-order mark is skipped
    assert fl.flight_action(loc, "health")["status"] == "ok"


def test_update_body_bad_lines_rejected_alone(server):
    srv, loc, dataset = server
    updates = update_stream(dataset, 3, 2)
    lines = lines_of(updates).split("\n")
    body = "\n".join([lines[0], DEEP, lines[1], '{"op":"retire","op":"retire","ad_id":1}', lines[2]]).encode()
    ack = fl.flight_action(loc, "update", body + b"\n\xff\xfe\n")
    assert ack["applied"] == 3
    assert [(r["line"], r["error"].split(":")[0]) for r in ack["rejected"]] == [(2, "malformed JSON"),
                                                                                (4, "malformed JSON"),
                                                                                (6, "malformed JSON")]
    assert "levels deep" in ack["rejected"][0]["error"] and "op: key appears" in ack["rejected"][1]["error"]
    assert "UTF-8" in ack["rejected"][2]["error"]


def test_the_base_corpus_cache_is_parquet_and_a_foreign_file_is_refused(tmp_path):
    from benchmarks.tiling import BaseCorpus, BaseCorpusError, generate_base, load_or_generate_base

    path = tmp_path / "base.parquet"
    made = load_or_generate_base(str(path), 120, 4, 7)
    assert path.read_bytes()[:4] == b"PAR1"
    again = BaseCorpus.load(str(path))
    assert again.ads == made.ads == generate_base(120, 4, 7).ads and again.seed == 7
    assert [r.request_id for r in again.requests] == [r.request_id for r in made.requests]
    path.write_bytes(b"\x80\x04\x95 a pickle, say")
    with pytest.raises(BaseCorpusError, match="not a base corpus cache"):
        BaseCorpus.load(str(path))


# --- errors quote at most 200 characters of a value (issue 37, point 7) --------------------------------

BIG = 1 << 20  # a 1 MB value: quoted whole, it made an error larger than gRPC's metadata limit


def _short(message: str, big: str):
    """The message names the value by its first 200 characters and its length, and stays small."""
    from andromeda_nb.quoting import MESSAGE_LIMIT

    assert len(message) <= MESSAGE_LIMIT, len(message)
    assert f"{big[:200]!r}... ({len(big)} characters)" in message, message[:400]
    assert big[:201] not in message


def test_quote_shows_at_most_200_characters_and_the_length():
    from andromeda_nb.quoting import clip, quote

    assert quote("US") == "'US'" and quote(7) == "7" and clip("user.country") == "user.country"
    assert quote("x" * 201) == repr("x" * 200) + "... (201 characters)"
    assert quote("x" * 200) == repr("x" * 200)
    assert quote(10 ** 300).endswith("... (301 characters)") and len(quote(10 ** 300)) < 230
    assert quote(b"\0" * 1000).endswith("... (1000 bytes)")
    assert clip("k" * 300) == "k" * 200 + "... (300 characters)"


def test_a_1mb_bad_value_in_a_request_is_an_error_quoting_200_characters(server):
    """The issue's case: a 1 MB `country` came back as RESOURCE_EXHAUSTED (metadata too large), not as
    the error; in the JSON request column and in a columnar batch."""
    import dataclasses

    from serving.request_columns import request_columns

    srv, loc, dataset = server
    big = "Z" * BIG
    body = request_to_json(dataset.requests[0], with_id=False)
    bad = {**body, "user": {**body["user"], "country": big}}
    with pytest.raises(flight.FlightServerError, match=r"^invalid request: request 3: user\.country: 'ZZZ") as err:
        _send(loc, [(3, json.dumps(bad))])
    _short(str(err.value).split(". Detail:")[0], big)
    unknown = {**body, "user": {**body["user"], big: 1}}
    with pytest.raises(flight.FlightServerError, match="unknown key") as err:
        _send(loc, [(4, json.dumps(unknown))])
    _short(str(err.value).split(". Detail:")[0], big)
    request = dataset.requests[0]
    columns = request_columns([dataclasses.replace(request, user=dataclasses.replace(request.user, country=big))], 5)
    client = flight.connect(loc)
    try:
        with pytest.raises(flight.FlightServerError, match=r"user\.country: 'ZZZ") as err:
            fl.exchange_batches(client, [columns], timeout=20)
    finally:
        client.close()
    _short(str(err.value).split(". Detail:")[0], big)
    with pytest.raises(flight.FlightServerError, match="unknown action") as err:
        fl.flight_action(loc, big)
    _short(str(err.value).split(". Detail:")[0], big)
    assert fl.flight_action(loc, "health")["status"] == "ok"


def test_an_update_acknowledgement_carries_counts_and_ids_never_the_body(server):
    """Each rejected line is named by its number, ad id and a reason quoting at most 200 characters:
    a body of large bad values gets an acknowledgement far smaller than itself (a 124 MB body got a
    126 MB acknowledgement)."""
    srv, loc, dataset = server
    big = "Q" * (BIG // 16)
    good = lines_of(update_stream(dataset, 1, 11))
    ad = json.loads(good)["ad"]
    bad_lines = [json.dumps({"op": "upsert", "ad": {**ad, "ad_id": 9000 + i,
                                                    "targeting": {"geo_locations": {"countries": [big]}}}})
                 for i in range(8)]
    bad_lines += [json.dumps({"op": "status", "ad_id": ad["ad_id"], "status": big}),
                  json.dumps({"op": big, "ad_id": 1}), json.dumps({"op": "retire", "ad_id": 1, big: 2})]
    body = "\n".join([good, *bad_lines])
    raw = fl.flight_action(loc, "update", body)
    assert raw["applied"] == 1 and [r["line"] for r in raw["rejected"]] == list(range(2, 2 + len(bad_lines)))
    assert [r["ad_id"] for r in raw["rejected"][:8]] == [9000 + i for i in range(8)]
    for rejection in raw["rejected"]:
        _short(rejection["error"], big)
    assert len(json.dumps(raw)) < 8 * 1024 < len(body) // 64, len(json.dumps(raw))


def test_the_remote_services_quote_at_most_200_characters_too(tmp_path):
    from cpu_baseline.index_host import IndexHostServer
    from cpu_baseline.scoring_service import ScoringServer
    from serving.guard import sign_records
    from serving.wal import corpus_lineage

    _, dataset = saved_corpus(tmp_path / "corpus", 9, n_ads=60, n_requests=2)
    scorer = ScoringServer(dataset, "grpc://127.0.0.1:0")
    host = IndexHostServer(dataset, f"grpc://127.0.0.1:{scorer.port}", "grpc://127.0.0.1:0", threads=1, monitor_s=0,
                           scorer_secret=scorer.pair_secret)
    big = "W" * BIG
    try:
        body = request_to_json(dataset.requests[0], with_id=False)
        with pytest.raises(flight.FlightServerError, match=r"user\.country") as err:
            _send(location(host), [(3, json.dumps({**body, "user": {**body["user"], "country": big}}))])
        _short(str(err.value).split(". Detail:")[0], big)
        with pytest.raises(flight.FlightServerError, match="expected upsert") as err:  # the scorer's own check
            record = json.dumps({"seq": 1, "lineage": corpus_lineage(dataset), "update": {"op": big}}).encode()
            fl.flight_action(location(scorer), "update", sign_records(scorer.pair_secret, record))
        _short(str(err.value).split(". Detail:")[0], big)
        with pytest.raises(flight.FlightServerError, match="unknown action") as err:
            fl.flight_action(location(scorer), big)
        _short(str(err.value).split(". Detail:")[0], big)
    finally:
        host.shutdown()
        host.close_resources()
        scorer.shutdown()


def test_a_flight_error_is_cut_to_the_message_limit():
    from andromeda_nb.quoting import MESSAGE_LIMIT

    for exc in (RuntimeError("r" * BIG), fl.InvalidInput("i" * BIG), flight.FlightServerError("f" * BIG)):
        out = fl.to_flight_error(exc)
        assert len(str(out).split(". Detail:")[0]) <= MESSAGE_LIMIT + 40, type(exc)
