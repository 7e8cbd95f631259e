"""What every benchmark checks (benchmarks.checks): the answers of timed calls kept by entry point and
each one checked; the oracle over a tiled pool in either layout, independent of the GPU's match, and
failing on a flipped bit, slot by slot or by sample; targets met only when the checks passed; the
pipeline's answer check against the float64 reference failing on a planted score, an ineligible ad,
a missing ad and a wrong order. No kernel is launched here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from andromeda_nb.compiled import compile_ads, encode_requests
from andromeda_nb.oracle import OracleIndex
from andromeda_nb.reference import reference_topk
from andromeda_nb.testing import random_ads, random_requests
from benchmarks.checks import TiledOracle, TimedAnswers, checks_passed, gate_targets
from benchmarks.tiling import BaseCorpus, stride_of


def test_every_timed_answer_is_counted_checked_once_per_distinct_answer_and_failures_named():
    answers = TimedAnswers()
    right = (np.array([3, 1]), np.array([0.5, 0.25], np.float32))
    wrong = (np.array([3, 2]), np.array([0.5, 0.25], np.float32))
    answers.add("a", [0, 1], [right, right])
    answers.add("a", [0], [right])
    answers.add("b", [0], [wrong])
    seen = []

    def check_one(key, ids, scores):
        seen.append((key, ids.tolist()))
        ok = ids.tolist() == [3, 1]
        return ok, 0.01 if ok else 0.0, "" if ok else "ad 2 is not eligible"

    checks = answers.check(check_one)
    assert sorted(seen) == [(0, [3, 1]), (0, [3, 2]), (1, [3, 1])]  # each distinct answer once
    assert checks["a"] == {"requests_timed": 3, "requests_checked": 3, "distinct": 2, "ok": True, "max_abs_err": 0.01}
    assert checks["b"]["ok"] is False and checks["b"]["first_failure"] == "request 0: ad 2 is not eligible"
    assert not answers.ok and not checks_passed(checks) and checks_passed({"a": checks["a"]})
    # an entry whose answers were never checked, or a call answering fewer requests, does not pass
    unchecked = TimedAnswers()
    unchecked.add("c", [0, 1], [right])
    assert unchecked.summary()["c"]["ok"] is False and not checks_passed({})


def test_targets_are_met_only_when_the_checks_passed():
    targets = {"p99_ms": {"value": 1.0, "target": "<= 1.5", "met": True},
               "startup_s": {"value": 90.0, "target": "<= 60", "met": False}}
    assert gate_targets(targets, True) == targets
    gated = gate_targets(targets, False)
    assert all(t["met"] is False and t["reason"] == "checks failed" for t in gated.values())
    assert gated["p99_ms"]["value"] == 1.0 and targets["p99_ms"]["met"] is True  # the figure kept, the input untouched


@pytest.mark.parametrize("ranked", [False, True], ids=["format", "geo"])
def test_the_tiled_oracle_answers_as_the_oracle_over_the_tiled_corpus_in_either_layout(ranked):
    from benchmarks.match import build_tiled_index

    rng = np.random.default_rng(71)
    ads = random_ads(rng, 60, formats=3)
    requests = random_requests(rng, 6)
    base = BaseCorpus(ads, requests, 71)
    rank = rng.permutation(len(ads)) if ranked else None
    index = build_tiled_index(base.compiled, 3, device="sim", chunk_slots=32, rank=rank)
    oracle = TiledOracle(base, index.slots.slot_ad_id)
    stride = stride_of(base.compiled)
    copies = [dataclasses.replace(ad, ad_id=ad.ad_id + c * stride) for c in range(3) for ad in ads]
    want = OracleIndex.build(copies).match(requests)
    for request, ids in zip(requests, want):
        assert np.array_equal(np.sort(index.slots.slot_ad_id[oracle.eligible_slots(request)]), ids)
    assert sum(len(w) for w in want) > 0
    # the GPU index's own answer passes, every slot and by sample; one flipped bit fails either way
    words = index.match_slots(encode_requests(requests)).copy_to_host()
    assert oracle.check_words(words, requests) == (0, None)
    every = np.arange(index.capacity)
    assert oracle.check_words(words, requests, full=False, sample=every) == (0, None)
    slot = int(oracle.eligible_slots(requests[2])[0]) if len(want[2]) else int(np.flatnonzero(
        index.slots.slot_ad_id >= 0)[0])
    words[2, slot // 32] ^= np.uint32(1 << (slot % 32))
    bad, first = oracle.check_words(words, requests)
    assert bad == 1 and f"slot {slot} " in first and f"request {requests[2].request_id}" in first
    assert oracle.check_words(words, requests, full=False, sample=np.array([slot]))[0] == 1


def test_the_tiled_oracle_refuses_a_slot_holding_no_copy_of_a_base_ad():
    rng = np.random.default_rng(72)
    ads = random_ads(rng, 10)
    base = BaseCorpus(ads, random_requests(rng, 1), 72)
    stranger = min(set(range(stride_of(base.compiled))) - {a.ad_id for a in ads})  # the id of no base ad
    ids = np.array([ads[0].ad_id, -1, stranger], np.int64)
    with pytest.raises(ValueError, match="no copy of a base ad"):
        TiledOracle(base, ids)
    assert len(compile_ads(ads)) == 10


@pytest.fixture(scope="module")
def pipeline_pool():
    """A tiny pool of `bench pipeline` under the simulator (built, no kernel launched)."""
    from benchmarks import score as bs

    return bs.pipeline_pool(pool=480, base_ads=120, n_requests=6, dim=16, k=10, device="sim", progress=False)


def test_the_pipeline_answer_check_passes_the_reference_answer_and_fails_each_planted_fault(pipeline_pool):
    from benchmarks import score as bs

    pp, k = pipeline_pool, 10
    oracle = TiledOracle(pp.base, pp.index.slots.slot_ad_id)
    check = bs.answer_checker(pp, oracle, k)
    base_format = np.asarray([a.format for a in oracle.ads] + [0])
    tried = 0
    for key, request in enumerate(pp.requests):
        slots = oracle.eligible_slots(request)
        if len(slots) <= k:
            continue
        ids, result = bs.reference_candidates(pp, request, slots, oracle.slot_ad_id[slots],
                                              base_format[oracle.row_of_slot[slots]], k)
        got_ids, got_scores = reference_topk(ids, result.scores.astype(np.float32), k)
        ok, err, message = check(key, got_ids, got_scores)
        assert ok and err < 1e-6, message
        off = got_scores.copy()
        off[3] += 1e-3
        assert not check(key, got_ids, off)[0]  # a score off by more than SCORE_ATOL
        stranger = got_ids.copy()
        stranger[-1] = int(np.setdiff1d(oracle.slot_ad_id[oracle.slot_ad_id >= 0], oracle.slot_ad_id[slots])[0])
        assert "not among the reference candidates" in check(key, stranger, got_scores)[2]  # an ineligible ad
        assert not check(key, got_ids[:-1], got_scores[:-1])[0]  # one ad short of k
        assert not check(key, got_ids[::-1], got_scores[::-1])[0]  # out of order
        tried += 1
    assert tried >= 2, "too few requests with more than k eligible ads to try the faults on"


def test_a_corpus_pool_is_checked_over_the_cpu_index_held_to_the_oracle_and_fails_a_planted_fault(tmp_path):
    """`bench pipeline --data`'s checks: the eligible sets of a corpus of distinct ads come from the CPU
    index and equal the oracle's; the CPU index's sets are held to the oracle on a sample of ads parsed
    from the corpus's files (a dropped ad fails that check); the answer check passes the reference's
    top-K and fails a score off by 1e-3."""
    from benchmarks import score as bs
    from tests.support.servers import saved_corpus

    path, dataset = saved_corpus(tmp_path / "corpus", 41, n_ads=300, n_requests=8)
    pp = bs.data_pool(path, k=10, device="sim", progress=False)
    assert pp.header["distinct_ads"] and pp.header["pool_ads"] == 300
    oracle = pp.oracle()
    wanted = OracleIndex.build(dataset.ads).match(pp.requests)
    for request, want in zip(pp.requests, wanted):
        assert np.array_equal(np.sort(oracle.slot_ad_id[oracle.eligible_slots(request)]), np.sort(want))
    sample = oracle.sample_check()
    assert sample["ok"] and sample["requests_checked"] == len(pp.requests), sample
    k, tried = 5, 0
    check = bs.answer_checker(pp, oracle, k)
    formats = bs.slot_formats(pp.index.slots)
    for key, request in enumerate(pp.requests):
        slots = oracle.eligible_slots(request)
        if len(slots) <= k:
            continue
        ids, result = bs.reference_candidates(pp, request, slots, oracle.slot_ad_id[slots], formats[slots], k)
        got_ids, got_scores = reference_topk(ids, result.scores.astype(np.float32), k)
        ok, err, message = check(key, got_ids, got_scores)
        assert ok and err < 1e-6, message
        off = got_scores.copy()
        off[1] += 1e-3
        assert not check(key, got_ids, off)[0]
        tried += 1
    assert tried >= 2, "too few requests with more than k eligible ads"
    faulty = pp.oracle()
    real = faulty.cpu.match
    faulty.cpu.match = lambda requests: [ids[1:] for ids in real(requests)]  # the lowest eligible id dropped
    for request in pp.requests:
        faulty.slot_mask(request)
    assert not faulty.sample_check()["ok"] and "in the oracle" in faulty.sample_check()["first_failure"]


def test_a_sampled_check_counts_every_timed_answer_checks_the_sample_and_still_fails_a_wrong_one():
    from benchmarks.score import check_sample

    assert check_sample(10, None) is None and check_sample(10, 10) is None
    sample = check_sample(200, 32)
    assert len(sample) == 32 and min(sample) == 0 and max(sample) == 199
    right = (np.array([3, 1]), np.array([0.5, 0.25], np.float32))
    wrong = (np.array([3, 2]), np.array([0.5, 0.25], np.float32))

    def check_one(key, ids, scores):
        ok = np.array_equal(ids, right[0])
        return ok, 0.0, "" if ok else "ad 2 is not eligible"

    answers = TimedAnswers()
    answers.add("a", [0, 1, 2], [right, right, right])
    summary = answers.check(check_one, keys=[0, 2])
    assert summary["a"]["ok"] and summary["a"]["sampled"] and summary["a"]["requests_checked"] == 2
    assert summary["a"]["requests_timed"] == 3
    answers = TimedAnswers()
    answers.add("a", [0, 1, 2], [right, right, wrong])
    assert not answers.check(check_one, keys=[0, 2])["a"]["ok"]
    answers = TimedAnswers()
    answers.add("a", [0, 1, 2], [right, right, right])
    assert not answers.check(check_one, keys=[7])["a"]["ok"], "a sample that checked nothing is not a pass"
