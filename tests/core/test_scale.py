"""Large corpora without parsing: the compiled targeting stored beside ads.parquet (targeting.npz),
the lazy `Dataset.ads`, stale-file detection, `reindex`, the parse fast paths, and services that
load a corpus directory themselves instead of receiving a pickled Dataset."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andromeda_nb import corpus, store
from andromeda_nb.compare import compare_topk
from andromeda_nb.compiled import COMPILED_ARRAYS, check_compiled, compile_ads, concat_compiled, take_compiled
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import MoeModel, quantize
from andromeda_nb.reference import ReferenceRetriever
from andromeda_nb.targeting import parse_ad, parse_targeting
from andromeda_nb.testing import random_ads, random_requests
from andromeda_nb.types import TargetingError, Upsert
from cpu_baseline.index import CpuTargetingIndex

SEED = 17
N_ADS = 1500
N_REQUESTS = 6


def _assert_same_compiled(a, b, label: str) -> None:
    for name in COMPILED_ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{label}: {name}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        assert np.array_equal(x, y), f"{label}: {name} differs (seed {SEED}, {N_ADS} ads)"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    corpus.generate_corpus(out, N_ADS, N_REQUESTS, SEED, precision="int8")
    return out


def _eager_ads(root, seed, dim, formats):
    """Every row of ads.parquet parsed here, one by one (the reference for the lazy list)."""
    table = pq.read_table(root / "ads.parquet")
    rows = table.select(["ad_id", "status", "start_time", "end_time", "format", "targeting"]).to_pylist()
    return [parse_ad({**r, "targeting": json.loads(r["targeting"])}, seed=seed, dim=dim, formats=formats,
                     derive_embedding=False) for r in rows]


def test_load_without_parsing_equals_compile_of_the_parsed_ads(corpus_dir):
    ds = store.load_dataset(corpus_dir)
    assert not ds.ads_loaded and ds.source_dir == corpus_dir
    ids, formats = ds.ad_ids, ds.formats
    assert not ds.ads_loaded, "ids and formats must come from the compiled columns"
    assert len(ids) == ds.n_ads == N_ADS and len(np.unique(ids)) == N_ADS
    ads = ds.ads  # parsed now
    assert ds.ads_loaded
    assert ids.tolist() == [a.ad_id for a in ads]
    assert formats.tolist() == [a.format for a in ads]
    assert len(np.unique(formats)) > 2 and len(ds.compiled.circles) > 0, "the corpus must exercise formats and circles"
    _assert_same_compiled(ds.compiled, compile_ads(ads), "stored vs compile_ads(parsed)")


def test_lazy_ads_equal_the_eagerly_parsed_list(corpus_dir, tmp_path):
    ds = store.load_dataset(corpus_dir)
    eager = _eager_ads(corpus_dir, SEED, ds.model.D, ds.model.F)
    assert ds.ads == eager
    assert [a.targeting_json for a in ds.ads] == [a.targeting_json for a in eager]
    # the same through a pickle of the unparsed dataset (how match_corpus hands the loader to its worker
    # processes: objects passed between the project's own processes, never a file read back)
    fresh = store.load_dataset(corpus_dir)
    clone = pickle.loads(pickle.dumps(fresh))
    assert not clone.ads_loaded and clone.ads == eager
    # and through the slow path of a directory written before targeting.npz existed
    old = tmp_path / "old"
    shutil.copytree(corpus_dir, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["targeting"]
    (old / "meta.json").write_text(json.dumps(meta))
    (old / "targeting.npz").unlink()
    legacy = store.load_dataset(old)
    assert legacy.ads_loaded and legacy.ads == eager
    _assert_same_compiled(legacy.compiled, ds.compiled, "legacy load vs stored")


def test_concat_of_compiled_parts_equals_compiling_all_at_once():
    rng = np.random.default_rng(SEED)
    ads = random_ads(rng, 400, dim=8)
    cuts = [0, 1, 1, 90, 250, 400]  # an empty part included
    parts = [compile_ads(ads[a:b]) for a, b in zip(cuts, cuts[1:])]
    whole = compile_ads(ads)
    _assert_same_compiled(concat_compiled(parts), whole, "concat vs whole")
    check_compiled(whole)
    assert len(whole.circles) and whole.clause_negative.any()


def test_take_of_compiled_rows_equals_compiling_those_ads():
    rng = np.random.default_rng(SEED)
    ads = random_ads(rng, 300, dim=8)
    whole = compile_ads(ads)
    for rows in ([], [0], [299, 3, 150], list(range(0, 300, 7)), rng.permutation(300)[:120].tolist()):
        _assert_same_compiled(take_compiled(whole, rows), compile_ads([ads[i] for i in rows]), f"take {rows[:5]}")
    with pytest.raises(IndexError):
        take_compiled(whole, [300])


def test_check_compiled_names_the_broken_array():
    ct = compile_ads(random_ads(np.random.default_rng(3), 50, dim=8))
    bad = dict(ct.__dict__)
    bad["term_ptr"] = ct.term_ptr.copy()
    bad["term_ptr"][3] = bad["term_ptr"][4] + 1
    with pytest.raises(ValueError, match="term_ptr"):
        check_compiled(type(ct)(**bad))
    bad = dict(ct.__dict__, format=ct.format.astype(np.int64))
    with pytest.raises(ValueError, match="format: expected int16"):
        check_compiled(type(ct)(**bad))
    bad = dict(ct.__dict__, n_positive=ct.n_positive + 1)
    with pytest.raises(ValueError, match="n_positive"):
        check_compiled(type(ct)(**bad))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_stale_or_foreign_targeting_file_is_a_clear_error(corpus_dir, tmp_path):
    # ads.parquet edited after targeting.npz was written (a different, still valid targeting)
    edited = _copy(corpus_dir, tmp_path / "edited")
    table = pq.read_table(edited / "ads.parquet")
    texts = table.column("targeting").to_pylist()
    texts[7] = json.dumps({"geo_locations": {"countries": ["NZ"]}, "age_min": 30})
    table = table.set_column(table.column_names.index("targeting"), "targeting", pa.array(texts, pa.string()))
    pq.write_table(table, edited / "ads.parquet")
    with pytest.raises(store.StoreError, match="stale: ads.parquet has changed"):
        store.load_dataset(edited)
    # reindex parses and validates ads.parquet again and makes the directory loadable
    store.reindex(edited)
    ds = store.load_dataset(edited)
    assert ds.ads[7].targeting == parse_targeting({"geo_locations": {"countries": ["NZ"]}, "age_min": 30})
    _assert_same_compiled(ds.compiled, compile_ads(ds.ads), "after reindex")
    # a targeting.npz from another corpus
    foreign = _copy(corpus_dir, tmp_path / "foreign")
    corpus.generate_corpus(tmp_path / "other", 50, 1, SEED + 1)
    shutil.copy(tmp_path / "other" / "targeting.npz", foreign / "targeting.npz")
    with pytest.raises(store.StoreError, match="not the file meta.json recorded"):
        store.load_dataset(foreign)
    # ... even with meta.json's hash made to match, its rows are not ads.parquet's
    meta = json.loads((foreign / "meta.json").read_text())
    meta["targeting"]["sha256"] = store.file_sha256(foreign / "targeting.npz")
    (foreign / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(store.StoreError, match="holds 50 ads, ads.parquet 1500"):
        store.load_dataset(foreign)
    # missing
    (foreign / "targeting.npz").unlink()
    with pytest.raises(store.StoreError, match="targeting.npz: missing .*reindex"):
        store.load_dataset(foreign)


def test_reindex_rejects_an_invalid_row_by_number(corpus_dir, tmp_path):
    broken = _copy(corpus_dir, tmp_path / "broken")
    table = pq.read_table(broken / "ads.parquet")
    texts = table.column("targeting").to_pylist()
    texts[11] = json.dumps({"geo_locations": {"countries": ["nz"]}})
    table = table.set_column(table.column_names.index("targeting"), "targeting", pa.array(texts, pa.string()))
    pq.write_table(table, broken / "ads.parquet")
    with pytest.raises(store.StoreError, match=r"row 11: .*geo_locations\.countries\[0\]"):
        store.reindex(broken)


def test_import_stores_the_compiled_targeting_of_the_accepted_ads(tmp_path):
    from pathlib import Path

    sample = Path(__file__).resolve().parents[2] / "data" / "sample"
    summary = store.import_jsonl(sample / "ads.jsonl", sample / "requests.jsonl", tmp_path, seed=7)
    ds = store.load_dataset(tmp_path)
    assert summary.rejected_ads > 0 and ds.n_ads == summary.ads
    _assert_same_compiled(ds.compiled, compile_ads(ds.ads), "imported")


def test_save_dataset_of_an_in_memory_dataset_round_trips(tmp_path):
    rng = np.random.default_rng(SEED)
    ads = random_ads(rng, 120, dim=8)
    model = MoeModel.init(SEED, D=8)
    table = quantize(np.stack([a.embedding for a in ads]), "fp16")
    ds = Dataset(ads=ads, embeddings=table, requests=random_requests(rng, 3), model=model, seed=0,
                 precision="fp16")
    store.save_dataset(ds, tmp_path)
    back = store.load_dataset(tmp_path)
    _assert_same_compiled(back.compiled, compile_ads(ads), "saved")
    assert back.ads == ads


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streamed_oracle_equals_the_oracle_index_through_updates(seed):
    from andromeda_nb.oracle import OracleIndex, match_stream
    from andromeda_nb.testing import random_updates
    from andromeda_nb.types import Retire, SetStatus
    from andromeda_nb.updates import LiveAds, apply_updates

    rng = np.random.default_rng(seed)
    ads = random_ads(rng, 300, dim=8)
    requests = random_requests(rng, 25)
    stream = random_updates(rng, ads, 200, invalid=0.1, dim=8)
    assert {type(u) for u in stream} >= {Upsert, SetStatus, Retire}
    oracle = OracleIndex.build(ads)
    rejections = apply_updates(list(enumerate(stream)), [oracle], LiveAds(a.ad_id for a in ads))
    rejected = {r.line_no for r in rejections}
    assert rejected, "the stream must hold updates a checked stream rejects"
    accepted = [u for i, u in enumerate(stream) if i not in rejected]
    chunks = [ads[lo : lo + 37] for lo in range(0, len(ads), 37)]
    want = oracle.match(requests)
    got = match_stream(chunks, requests, accepted)
    assert sum(len(w) for w in want) > 0
    for w, g, r in zip(want, got, requests):
        assert np.array_equal(w, g), f"seed {seed}, request {r.request_id}"


# --- the parse fast paths give the slow paths' answers and errors ------------------------------------


@pytest.mark.parametrize("spec, path", [
    ({"geo_locations": {"regions": [3, 4, True]}}, "targeting.geo_locations.regions[2]"),
    ({"geo_locations": {"cities": [1, 2, 2**40]}}, "targeting.geo_locations.cities[2]"),
    ({"geo_locations": {"cities": [5, -1, 7]}}, "targeting.geo_locations.cities[1]"),
    ({"geo_locations": {"countries": ["US", "us"]}}, "targeting.geo_locations.countries[1]"),
    ({"geo_locations": {"countries": ["US", 7]}}, "targeting.geo_locations.countries[1]"),
    ({"geo_locations": {"countries": ["US", ["GB"]]}}, "targeting.geo_locations.countries[1]"),
    ({"geo_locations": {"countries": ["US"]}, "genders": [1, True]}, "targeting.genders[1]"),
    ({"geo_locations": {"countries": ["US"]}, "user_os": ["iOS", "ios"]}, "targeting.user_os[1]"),
    ({"geo_locations": {"countries": ["US"]}, "device_platforms": [{"a": 1}]}, "targeting.device_platforms[0]"),
    ({"geo_locations": {"countries": ["US"]}, "flexible_spec": [{"interests": [1, 2.0]}]},
     "targeting.flexible_spec[0].interests[1]"),
    ({"geo_locations": {"countries": ["US"]}, "flexible_spec": [{"interests": [1], "hobbies": [2]}]},
     "targeting.flexible_spec[0].hobbies"),
    ({"geo_locations": {"countries": ["US"]}, "age_range": [1, 2]}, "targeting.age_range"),
])
def test_fast_paths_reject_like_the_per_item_checks(spec, path):
    with pytest.raises(TargetingError) as info:
        parse_targeting(spec, ad_id=9)
    assert info.value.path == path and info.value.ad_id == 9


def test_fast_paths_accept_what_the_per_item_checks_accept():
    spec = parse_targeting({
        "geo_locations": {"countries": ["US", np.str_("GB"), "US"], "regions": [np.int64(4), 4, 0],
                          "cities": [2**40 - 1]},
        "genders": [2, np.int64(1), 2], "publisher_platforms": ["instagram", "facebook"],
        "flexible_spec": [{"interests": [7, 7, 8], "behaviors": [7]}],
    })
    assert spec.geo_locations.countries == {"US", "GB"} and spec.geo_locations.regions == {0, 4}
    assert spec.geo_locations.cities == {2**40 - 1} and spec.genders == {1, 2}
    assert all(type(g) is int for g in spec.genders) and all(type(r) is int for r in spec.geo_locations.regions)
    assert spec.flexible_spec[0] == {"interests": {7, 8}, "behaviors": {7}}


def test_parse_ad_copies_the_targeting_object_unless_told_not_to():
    obj = {"ad_id": 5, "targeting": {"geo_locations": {"countries": ["US"]}, "flexible_spec": [{"interests": [1]}]}}
    copied = parse_ad(obj, seed=0, dim=4)
    kept = parse_ad(obj, seed=0, dim=4, copy_targeting=False)
    assert copied.targeting_json == obj["targeting"] and copied.targeting_json is not obj["targeting"]
    assert copied.targeting_json["flexible_spec"][0]["interests"] is not obj["targeting"]["flexible_spec"][0]["interests"]
    assert kept.targeting_json is obj["targeting"] and kept == copied


# --- services that load the directory themselves --------------------------------------------------------


def test_services_started_from_a_directory_answer_like_the_reference(corpus_dir, tmp_path):
    from cpu_baseline.remote import RemoteRetriever
    from migration.colocated import ColocatedRetriever

    ds = store.load_dataset(corpus_dir)
    k = 300  # about every eligible ad of this pool: the upserted one must show up
    everywhere = {"geo_locations": {"countries": [c[0] for c in corpus.COUNTRIES]}, "age_min": 13}
    upsert = Upsert(parse_ad({"ad_id": 77, "format": 3, "targeting": everywhere}, seed=ds.seed, dim=ds.model.D))
    ref = ReferenceRetriever.build(ds, matcher=CpuTargetingIndex)
    assert not ds.ads_loaded, "the CPU-index reference must not parse the ads"
    ref.apply(upsert)
    want = ref.retrieve(ds.requests, k)
    assert any(77 in ids for ids, _ in want), "the upserted ad must reach some answer (a test that can fail)"
    with RemoteRetriever.build(ds) as remote, ColocatedRetriever.build(ds, device="cpu", served=True) as colo:
        assert [p.args[:3] for p in remote.processes] == [["scorer", "--data", str(corpus_dir)]] + \
            [["remote", "--data", str(corpus_dir)]]
        assert colo.process.proc.args[3:5] == ["--data", str(corpus_dir)] and colo._tmpdir is None
        for retriever in (remote, colo):
            retriever.apply(upsert)
            got = retriever.retrieve(ds.requests, k)
            for (wi, ws), (gi, gs), req in zip(want, got, ds.requests):
                result = compare_topk(wi, ws, gi, gs, k)
                assert result.ok, f"{type(retriever).__name__}, request {req.request_id}: {result.message}"
    assert not ds.ads_loaded, "starting services from a directory must not parse the ads here"


def test_a_directory_that_no_longer_holds_the_dataset_is_refused(corpus_dir, tmp_path):
    from migration.colocated import ColocatedRetriever

    moved = _copy(corpus_dir, tmp_path / "moved")
    ds = store.load_dataset(moved)
    shutil.rmtree(moved)
    corpus.generate_corpus(moved, 40, 2, SEED + 2)  # the same path now holds another corpus
    with pytest.raises(RuntimeError, match="differ from the dataset's"):
        ColocatedRetriever.build(ds, device="cpu", served=True)


def test_cli_reindex_adds_the_targeting_file_to_an_old_corpus(corpus_dir, tmp_path):
    from click.testing import CliRunner

    from cli import main

    old = _copy(corpus_dir, tmp_path / "old")
    meta = json.loads((old / "meta.json").read_text())
    del meta["targeting"]
    (old / "meta.json").write_text(json.dumps(meta))
    (old / "targeting.npz").unlink()
    result = CliRunner().invoke(main, ["reindex", "--data", str(old), "--json", "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ads"] == N_ADS
    ds = store.load_dataset(old)
    assert not ds.ads_loaded
    _assert_same_compiled(ds.compiled, store.load_dataset(corpus_dir).compiled, "reindexed")
    bad = CliRunner().invoke(main, ["reindex", "--data", str(tmp_path)])
    assert bad.exit_code == 1 and "meta.json: missing" in bad.output and "Traceback" not in bad.output


def test_lazy_ads_refuse_an_ads_file_changed_after_loading(corpus_dir, tmp_path):
    copy = _copy(corpus_dir, tmp_path / "copy")
    ds = store.load_dataset(copy)
    shutil.copy(tmp_path / "copy" / "ads.parquet", tmp_path / "keep.parquet")
    table = pq.read_table(copy / "ads.parquet").slice(0, N_ADS - 1)
    pq.write_table(table, copy / "ads.parquet")
    with pytest.raises(store.StoreError, match="has changed since the corpus was loaded"):
        ds.ads
    shutil.copy(tmp_path / "keep.parquet", copy / "ads.parquet")
    assert len(ds.ads) == N_ADS
