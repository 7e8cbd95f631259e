"""Corpus directories and JSON Lines: Parquet round trips at every precision, the schema-version
check, clear errors for broken directories, and import of files mixing valid and malformed ads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from andromeda_nb import corpus, derive, store
from andromeda_nb.constants import SCHEMA_VERSION
from andromeda_nb.model import quantize
from andromeda_nb.targeting import ad_to_json, request_to_json

SEED = 5
ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"


def _load_make_sample():
    spec = importlib.util.spec_from_file_location("make_sample", ROOT / "data" / "make_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=["fp32", "fp16", "int8"])
def generated(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"gen-{request.param}")
    corpus.generate_corpus(out, 400, 6, SEED, precision=request.param)
    return out, request.param


def _same_dataset(a, b) -> None:
    assert [ad_to_json(x) | {"embedding": None} for x in a.ads] == [ad_to_json(x) | {"embedding": None} for x in b.ads]
    assert a.embeddings.precision == b.embeddings.precision
    assert a.embeddings.values.dtype == b.embeddings.values.dtype
    assert np.array_equal(a.embeddings.values, b.embeddings.values)
    assert np.array_equal(a.embeddings.scale, b.embeddings.scale)
    assert [request_to_json(r) for r in a.requests] == [request_to_json(r) for r in b.requests]
    for name in ("W", "b", "K", "A", "B"):
        assert np.array_equal(getattr(a.model, name), getattr(b.model, name))
    assert a.seed == b.seed


def test_generated_corpus_loads_with_the_stored_precision(generated):
    out, precision = generated
    ds = store.load_dataset(out)
    assert len(ds.ads) == 400 and len(ds.requests) == 6
    assert ds.precision == precision == ds.embeddings.precision
    # the stored rows are the quantized derived embeddings of each ad id
    expect = quantize(derive.ad_embeddings(ds.ad_ids, SEED, 64), precision)
    assert np.array_equal(ds.embeddings.values, expect.values)
    assert np.array_equal(ds.embeddings.scale, expect.scale)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["sizes"] == {"D": 64, "E": 6, "k": 2, "F": 8, "S": 16}
    assert meta["counts"] == {"ads": 400, "requests": 6}


def test_load_requests_reads_the_requests_alone(generated, tmp_path):
    """`load_requests` gives what `load_dataset` gives as requests, without touching ads.parquet."""
    out, _ = generated
    want = [request_to_json(r) for r in store.load_dataset(out).requests]
    copy = tmp_path / "requests-only"
    copy.mkdir()
    for path in out.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "ads.parquet").write_bytes(b"ads that cannot be read")
    with pytest.raises(store.StoreError):
        store.load_dataset(copy)
    got = store.load_requests(copy)  # never opens ads.parquet
    assert [request_to_json(r) for r in got] == want and len(want) == 6
    (copy / "requests.parquet").write_bytes(b"not parquet")
    with pytest.raises(store.StoreError, match="requests.parquet"):
        store.load_requests(copy)


def test_parquet_round_trip(generated, tmp_path):
    out, _ = generated
    first = store.load_dataset(out)
    store.save_dataset(first, tmp_path / "copy")
    second = store.load_dataset(tmp_path / "copy")
    _same_dataset(first, second)


def test_jsonl_round_trip(tmp_path):
    corpus.generate_corpus(tmp_path / "gen", 300, 5, SEED)
    first = store.load_dataset(tmp_path / "gen")
    store.export_jsonl(first, tmp_path / "jsonl")
    summary = store.import_jsonl(tmp_path / "jsonl" / "ads.jsonl", tmp_path / "jsonl" / "requests.jsonl",
                                 tmp_path / "back", model_path=tmp_path / "gen" / "model.npz", seed=SEED)
    assert (summary.ads, summary.requests, summary.rejected_ads) == (300, 5, 0)
    assert (tmp_path / "back" / "rejected.jsonl").read_text() == ""
    _same_dataset(first, store.load_dataset(tmp_path / "back"))


def test_schema_version_is_checked(tmp_path):
    corpus.generate_corpus(tmp_path, 50, 2, SEED)
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(store.StoreError, match="schema_version"):
        store.load_dataset(tmp_path)
    del meta["schema_version"]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(store.StoreError, match="schema_version"):
        store.load_dataset(tmp_path)


@pytest.mark.parametrize("broken", ["meta.json", "ads.parquet", "requests.parquet", "model.npz"])
def test_missing_file_is_named(tmp_path, broken):
    corpus.generate_corpus(tmp_path, 20, 2, SEED)
    (tmp_path / broken).unlink()
    with pytest.raises(store.StoreError, match=broken.replace(".", r"\.")):
        store.load_dataset(tmp_path)


def test_wrong_counts_and_column_types_are_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus.generate_corpus(tmp_path, 20, 2, SEED)
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["counts"]["ads"] = 21
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(store.StoreError, match="21 ads"):
        store.load_dataset(tmp_path)
    meta["counts"]["ads"] = 20
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    table = pq.read_table(tmp_path / "ads.parquet")
    table = table.set_column(4, "format", pa.array(table.column("format").to_numpy().astype(np.int64)))
    pq.write_table(table, tmp_path / "ads.parquet")
    with pytest.raises(store.StoreError, match="'format' has type int64"):
        store.load_dataset(tmp_path)
    (tmp_path / "ads.parquet").write_text("not parquet")
    with pytest.raises(store.StoreError, match="not a readable Parquet"):
        store.load_dataset(tmp_path)


def test_import_of_the_sample_rejects_exactly_the_marked_lines(tmp_path):
    malformed = _load_make_sample().MALFORMED
    summary = store.import_jsonl(SAMPLE / "ads.jsonl", SAMPLE / "requests.jsonl", tmp_path, seed=7)
    assert (summary.ads, summary.rejected_ads, summary.requests, summary.rejected_requests) == (190, 10, 20, 0)
    rejected = [json.loads(line) for line in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == len(malformed)
    for (line, what, path), record in zip(malformed, rejected):
        assert set(record) == {"ad_id", "error"}
        assert record["error"].startswith(f"line {line}: "), (what, record)
        if path is None:
            assert record["ad_id"] is None and "not valid JSON" in record["error"]
        else:
            assert isinstance(record["ad_id"], int)
            assert f" {path}: " in record["error"], (what, record)
    ds = store.load_dataset(tmp_path)
    lines = (SAMPLE / "ads.jsonl").read_text().splitlines()
    bad = {line for line, _, _ in malformed}
    expect_ids = [json.loads(text)["ad_id"] for n, text in enumerate(lines, 1) if n not in bad]
    assert ds.ad_ids.tolist() == expect_ids
    # ads without an embedding got the derived one; the first three carried their own
    first = json.loads(lines[0])
    assert np.array_equal(ds.embeddings.values[0], np.asarray(first["embedding"], np.float32))
    assert "embedding" not in json.loads(lines[5])
    assert np.array_equal(ds.embeddings.values[5], derive.ad_embedding(ds.ads[5].ad_id, 7, 64))


def test_import_reports_each_malformed_ad_with_its_path(tmp_path):
    good = {"ad_id": 1, "targeting": {"geo_locations": {"countries": ["US"]}}}
    cases = [
        ({"ad_id": 2, "targeting": {"geo_locations": {"countries": ["US"]}, "genders": []}}, "targeting.genders"),
        ({"ad_id": 3, "targeting": {"geo_locations": {"regions": ["x"]}}}, "targeting.geo_locations.regions[0]"),
        ({"ad_id": 4, "targeting": {"geo_locations": {"countries": ["US"]},
                                    "flexible_spec": [{"interests": [1]}] * 26}}, "targeting.flexible_spec"),
        ({"ad_id": 5, "format": 99, "targeting": {"geo_locations": {"countries": ["US"]}}}, "format"),
        ({"ad_id": 6, "embedding": [0.5] * 3, "targeting": {"geo_locations": {"countries": ["US"]}}}, "embedding"),
        ({"targeting": {}}, "ad_id"),
    ]
    ads = tmp_path / "ads.jsonl"
    ads.write_bytes(b"\n".join([json.dumps(good).encode()] + [json.dumps(c).encode() for c, _ in cases]
                               + [b"{oops", b"\xff\xfe", json.dumps(dict(good, ad_id=7)).encode()]) + b"\n\n")
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"request_id": 1, "user": {"age": 30}, "context": {
        "publisher_platform": "facebook", "device_platform": "mobile", "user_os": "iOS", "time": 0}}) + "\n"
        + json.dumps({"request_id": 2, "user": {"age": "x"}}) + "\n")
    summary = store.import_jsonl(ads, requests, tmp_path / "out", seed=1)
    assert (summary.ads, summary.rejected_ads, summary.requests, summary.rejected_requests) == (2, 8, 1, 1)
    errors = [json.loads(x)["error"] for x in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    for (case, path), error in zip(cases, errors):
        assert f" {path}: " in error, (case, error)
    assert errors[-2].startswith("line 8: not valid JSON")
    assert errors[-1].startswith("line 9: not valid UTF-8")
    rejected_requests = (tmp_path / "out" / "rejected_requests.jsonl").read_text().splitlines()
    assert json.loads(rejected_requests[0])["request_id"] == 2
    assert store.load_dataset(tmp_path / "out").ad_ids.tolist() == [1, 7]


def test_import_with_a_model_uses_its_sizes(tmp_path):
    from andromeda_nb.model import MoeModel

    MoeModel.init(3, D=8, E=3, F=2).save(tmp_path / "m.npz")
    ads = tmp_path / "ads.jsonl"
    france = {"geo_locations": {"countries": ["FR"]}}
    ads.write_text(json.dumps({"ad_id": 1, "format": 1, "targeting": france}) + "\n"
                   + json.dumps({"ad_id": 2, "format": 2, "targeting": france}) + "\n")
    requests = tmp_path / "requests.jsonl"
    requests.write_text("")
    summary = store.import_jsonl(ads, requests, tmp_path / "out", model_path=tmp_path / "m.npz", precision="int8")
    assert (summary.ads, summary.rejected_ads) == (1, 1)  # format 2 is outside F=2
    ds = store.load_dataset(tmp_path / "out")
    assert ds.embeddings.values.shape == (1, 8) and ds.embeddings.values.dtype == np.int8
    assert ds.model.E == 3 and ds.requests == []
    with pytest.raises(store.StoreError, match="no such model file"):
        store.import_jsonl(ads, requests, tmp_path / "x", model_path=tmp_path / "missing.npz")


def test_npz_arrays_mapped_equal_np_load(tmp_path):
    """`read_npz_arrays` gives what `np.load` gives (values, dtypes, shapes) for a file of `_write_npz`
    (every member's data aligned, mapped in place) and for one of `np.savez` (unaligned members
    copied); the arrays are writable and a write never reaches the file (random arrays, seed 41)."""
    import zipfile

    from andromeda_nb.store import NPZ_ALIGN, _write_npz, read_npz_arrays

    rng = np.random.default_rng(41)
    arrays = {"format_version": np.int64(1), "ids": rng.integers(-2**62, 2**62, 1001),
              "small": rng.integers(-100, 100, 333).astype(np.int8), "mask": rng.integers(1, 255, 77).astype(np.uint8),
              "n": rng.integers(0, 9, 12345).astype(np.int32), "empty": np.empty(0, np.int64),
              "circles": rng.normal(size=(57, 3)), "fortran": np.asfortranarray(rng.normal(size=(5, 7))),
              "half": rng.normal(size=91).astype(np.float16)}
    written, saved = tmp_path / "a.npz", tmp_path / "b.npz"
    _write_npz(written, arrays)
    np.savez(saved, **arrays)
    for path in (written, saved):
        got = read_npz_arrays(path, arrays)
        with np.load(path) as npz:
            for name in arrays:
                want = npz[name]
                assert got[name].dtype == want.dtype and got[name].shape == want.shape, (path.name, name)
                assert np.array_equal(got[name], want), (path.name, name)
        before = path.read_bytes()
        got["ids"][:] = 7
        assert path.read_bytes() == before and read_npz_arrays(path, ["ids"])["ids"][0] == arrays["ids"][0]
    with zipfile.ZipFile(written) as zf:  # the writer's padding: every array starts aligned
        for info in zf.infolist():
            with open(written, "rb") as fh:
                fh.seek(info.header_offset + 26)
                name_len, extra_len = np.frombuffer(fh.read(4), "<u2")
            assert (info.header_offset + 30 + int(name_len) + int(extra_len)) % NPZ_ALIGN == 0, info.filename
    with pytest.raises(ValueError, match="missing arrays nope"):
        read_npz_arrays(written, ["ids", "nope"])
    (tmp_path / "c.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError):
        read_npz_arrays(tmp_path / "c.npz", ["ids"])
