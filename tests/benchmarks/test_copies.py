"""Pools of distinct copies of a corpus (`benchmarks.copies`, `bench pipeline --data DIR --copies N`):
the copies made over whole arrays equal `compile_ads` of the copies made ad by ad through the parser
(every array), every copy is a valid ad with an id of its own and differs from its ad where the module
says it does, copy 0 is the corpus, the embeddings are the copies' ids' derived ones, a request finds
about the corpus's share of the pool eligible, the checks' CPU index over the copies answers as the
oracle over the parsed copies, and the command line names the pool and refuses what makes no sense.
Seeds are fixed; the corpora are a few hundred ads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from andromeda_nb import derive
from andromeda_nb.compiled import COMPILED_ARRAYS, NULL_END, NULL_START, compile_ads
from andromeda_nb.corpus import generate_corpus
from andromeda_nb.model import quantize
from andromeda_nb.store import load_dataset
from andromeda_nb.targeting import ad_to_json, parse_ad
from benchmarks import copies as bc

SEED = 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A generated corpus of 300 ads (fp16, D = 8) and 48 requests, read back as `bench pipeline --data`
    reads it."""
    path = tmp_path_factory.mktemp("copies") / "corpus"
    generate_corpus(path, 300, 48, SEED, dim=8, precision="fp16")
    return path, load_dataset(path)


def assert_same_compiled(got, want, context):
    for name in COMPILED_ARRAYS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{context}: {name} differs"


@pytest.mark.parametrize("copies", [1, 3])
def test_copies_made_over_arrays_equal_the_copies_made_ad_by_ad_through_the_parser(corpus, copies):
    _, base = corpus
    pool = bc.make_copies(base, copies)
    ads = pool.ads  # copy_ad of every ad, copy after copy
    assert len(ads) == len(pool.compiled) == copies * len(base.compiled)
    assert_same_compiled(pool.compiled, compile_ads(ads), f"seed {SEED}, {copies} copies")
    assert len(np.unique(pool.compiled.ad_id)) == len(pool.compiled)  # every id its own
    assert_same_compiled(bc.CopyPlan.of(base.compiled, 1, base.seed).base, base.compiled, "the plan's base")
    n = len(base.compiled)
    for name in COMPILED_ARRAYS:  # copy 0 is the corpus itself
        if COMPILED_ARRAYS[name][1] == "N":
            assert np.array_equal(getattr(pool.compiled, name)[:n], getattr(base.compiled, name)), name
    for ad in ads[n::97]:  # each copy is a valid ad: its JSON line parses back to the same ad
        again = parse_ad(ad_to_json(ad), seed=base.seed, dim=8, derive_embedding=False)
        assert again == ad


def test_copies_of_edge_case_ads_equal_their_parsed_copies_and_stay_on_the_globe():
    """Random specs of every shape (`andromeda_nb.testing.random_ads`: circles at the poles and near the
    antimeridian, open and closed schedules, every flexible_spec key, exclusions, audiences)."""
    from tests.support.servers import small_dataset

    base = small_dataset(3, n_ads=240)
    pool = bc.make_copies(base, 4)
    want = compile_ads(pool.ads)
    assert_same_compiled(pool.compiled, want, "random ads, seed 3, 4 copies")
    lat, lon = pool.compiled.circles[:, 0], pool.compiled.circles[:, 1]
    assert np.all(np.abs(lat) <= 90.0) and np.all(np.abs(lon) <= 180.0)
    assert np.abs(base.compiled.circles[:, 0]).max() == 90.0  # the draw did put a circle on a pole


def test_every_copy_differs_from_its_ad_where_the_module_says_it_does(corpus):
    _, base = corpus
    ct, n = base.compiled, len(base.compiled)
    pool = bc.make_copies(base, 3)
    plan, cp = pool.plan, pool.compiled
    assert np.array_equal(cp.ad_id[n:2 * n], ct.ad_id + plan.stride)
    for c in (1, 2):
        rows = slice(c * n, (c + 1) * n)
        for name in ("status", "format", "age_min", "age_max", "gender_mask", "publisher_mask", "n_positive"):
            assert np.array_equal(getattr(cp, name)[rows], getattr(ct, name)), name  # kept
        start = cp.start_time[rows]
        open_start = ct.start_time == NULL_START
        assert np.array_equal(start == NULL_START, open_start) and np.array_equal(cp.end_time[rows] == NULL_END,
                                                                                  ct.end_time == NULL_END)
        moved = start[~open_start] - ct.start_time[~open_start]
        assert np.all(np.abs(moved) <= bc.SHIFT_S) and np.mean(moved != 0) > 0.9
        terms = cp.terms[c * len(ct.terms):(c + 1) * len(ct.terms)]
        assert np.mean(terms != ct.terms) > 0.5  # most places and audiences moved
        assert np.array_equal(terms >> 40, ct.terms >> 40)  # each term stays of its kind
        assert set(np.unique(terms)) <= set(plan.keys.tolist())  # only terms the corpus uses
        circles = cp.circles[c * len(ct.circles):(c + 1) * len(ct.circles)]
        shift = np.abs(circles[:, :2] - ct.circles[:, :2])
        assert len(ct.circles) and np.all(shift[:, 0] <= bc.JITTER_DEG) and np.all(shift > 0)
        assert np.array_equal(circles[:, 2], ct.circles[:, 2])
    # copies 1 and 2 of one ad differ from each other too
    assert np.mean(cp.terms[len(ct.terms):2 * len(ct.terms)] != cp.terms[2 * len(ct.terms):]) > 0.5


def test_a_term_moves_only_within_its_kind_and_band(corpus):
    _, base = corpus
    plan = bc.CopyPlan.of(base.compiled, 4, base.seed)
    keys, counts = np.unique(base.compiled.terms, return_counts=True)
    bands = bc.term_bands(keys, counts)
    for c in range(plan.copies):
        at = np.searchsorted(keys, plan.mapped[c])
        assert np.array_equal(np.sort(plan.mapped[c]), keys)  # a permutation of the corpus's terms
        assert np.array_equal(bands[at], bands)  # within its band, hence its namespace
        assert np.array_equal(plan.mapped[c][bands == -1], keys[bands == -1])  # locales kept
    assert np.array_equal(plan.mapped[0], keys)
    assert 0.0 < plan.fixed_share() < 0.5


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_copy_embeddings_are_the_corpus_rows_then_the_copies_ids_derived_ones(corpus, precision):
    _, base = corpus
    plan = bc.CopyPlan.of(base.compiled, 3, base.seed)
    table = quantize(derive.ad_embeddings(base.compiled.ad_id, 77, 8), precision)  # a corpus's own rows
    got = bc.copy_embeddings(plan, table, base.seed, workers=2)
    n = len(base.compiled)
    assert np.array_equal(got.values[:n], table.values) and np.array_equal(got.scale[:n], table.scale)
    ids = plan.base.ad_id + 2 * plan.stride
    want = quantize(derive.ad_embeddings(ids, base.seed, 8), precision)
    assert np.array_equal(got.values[2 * n:], want.values) and np.array_equal(got.scale[2 * n:], want.scale)
    assert got.values.dtype == table.values.dtype and not np.array_equal(got.values[n:2 * n], got.values[2 * n:])


def test_a_request_finds_about_the_corpus_share_of_the_copies_eligible(corpus):
    from cpu_baseline.index import CpuTargetingIndex

    _, base = corpus
    pool = bc.make_copies(base, 6)
    n = len(base.compiled)
    counts = np.array([np.bincount(pool.copy_of_ids(ids), minlength=6)
                       for ids in CpuTargetingIndex.from_compiled(pool.compiled).match(base.requests)]) / n
    share_base, share_copies = counts[:, 0].mean(), counts[:, 1:].mean()
    assert share_base > 0.01
    assert abs(share_copies - share_base) < 0.2 * share_base, (share_base, share_copies)


def test_the_checks_over_copies_hold_their_eligible_sets_to_the_oracle_over_parsed_copies(corpus):
    """The eligible sets the checks read over the copies (a scan of their compiled targeting) are the
    oracle's over the copies parsed one by one; the oracle sample spreads over every copy."""
    from andromeda_nb.oracle import OracleIndex
    from benchmarks.checks import CorpusOracle

    _, base = corpus
    pool = bc.make_copies(base, 3)
    oracle = CorpusOracle(pool, pool.compiled.ad_id[::-1].copy(), sample=200)
    wanted = OracleIndex.build(pool.ads).match(base.requests[:12])
    for request, want in zip(base.requests[:12], wanted):
        got = oracle.slot_ad_id[oracle.eligible_slots(request)]
        assert np.array_equal(np.sort(got), np.sort(want))
    sample_ids = oracle._sample_ads()[1]
    assert len(sample_ids) == 200 and len(np.unique(pool.copy_of_ids(sample_ids))) == 3
    assert oracle.sample_check()["ok"]
    shares = oracle.eligible_shares()
    assert shares["requests"] == 12 and len(shares["per_copy"]) == 3 and shares["base"] > 0


@pytest.mark.parametrize("which", ["generated", "random"])
def test_the_scan_over_compiled_copies_answers_as_the_cpu_index(corpus, which):
    """`CompiledScan` (the checks' eligible sets over a pool of copies) against the CPU index over the
    same compiled targeting, every request: generated ads, and random specs of every shape (circles,
    exclusions, open schedules, users without a location)."""
    from cpu_baseline.index import CpuTargetingIndex
    from andromeda_nb.testing import random_requests
    from tests.support.servers import small_dataset

    if which == "generated":
        base = corpus[1]
        requests = base.requests
    else:
        base = small_dataset(7, n_ads=240)
        requests = random_requests(np.random.default_rng(7), 40)
    pool = bc.make_copies(base, 3)
    want = CpuTargetingIndex.from_compiled(pool.compiled).match(requests)
    got = pool.matcher().match(requests)
    assert sum(len(w) for w in want) > len(requests)  # not a scan of nothing
    for request, g, w in zip(requests, got, want):
        assert np.array_equal(g, w), f"{which}, request {request.request_id}"


def test_warp_mix_counts_warps_of_one_ad_s_copies():
    stride = 100
    one = np.array([7 + c * stride for c in range(32)])  # 32 copies of ad 7
    mixed = np.arange(32) + 3 * stride
    ids = np.concatenate([one, mixed, np.full(32, -1), one[:16]])
    got = bc.warp_mix(ids, stride)
    assert got == {"full_warps": 2, "one_base_ad": 0.5, "distinct_base_ads_mean": 16.5}


def test_copies_are_refused_below_one_or_past_the_largest_id(corpus):
    _, base = corpus
    with pytest.raises(ValueError, match="at least 1"):
        bc.make_copies(base, 0)
    with pytest.raises(ValueError, match="largest ad id"):
        bc.CopyPlan.of(base.compiled, 1 << 62, base.seed)


def test_bench_pipeline_names_a_pool_of_copies_and_refuses_copies_without_a_corpus(corpus, monkeypatch):
    from benchmarks import score as bs
    from tests.support.cli import runner, run_cli
    from cli import main

    path, _ = corpus
    seen = []

    def fake(*, layout, **options):
        seen.append((options["data"], options["copies"]))
        return {"layout": layout, "env": {"device": "test"}, "pool_ads": 900, "precision": "fp16", "D": 8,
                "k": 100, "checks_ok": True, "latency_ms": {"p50": 1.0, "p99": 2.0}, "throughput": [],
                "targets": {}, "data": str(path), "pool": "distinct copies", "copies": 3, "base_ads": 300,
                "copies_made_s": 0.5, "warps": {"one_base_ad": 0.0, "distinct_base_ads_mean": 31.0},
                "eligible_share": {"requests": 8, "base": 0.05, "copies": 0.049, "pool": 0.0493}}

    monkeypatch.setattr(bs, "bench_pipeline", fake)
    table = run_cli("bench", "pipeline", "--data", path, "--copies", 3).stdout
    assert seen == [(str(path), 3)]
    assert "3 distinct copies of corpus" in table and "corpus (copy 0) 0.0500" in table
    doc = json.loads(run_cli("bench", "pipeline", "--data", path, "--copies", 3, "--json").stdout.splitlines()[-1])
    assert doc["pool"] == "distinct copies" and doc["copies"] == 3
    assert run_cli("bench", "pipeline", "--data", path).stdout and seen[-1] == (str(path), None)
    alone = runner().invoke(main, ["bench", "pipeline", "--copies", "3"])
    assert alone.exit_code == 2 and "--copies" in alone.stderr and "--data" in alone.stderr
    zero = runner().invoke(main, ["bench", "pipeline", "--data", str(path), "--copies", "0"])
    assert zero.exit_code == 2 and "--copies" in zero.stderr
