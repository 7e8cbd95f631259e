"""`bench cpu` (benchmarks/cpu.py) on a small corpus: every answer of its timed match calls (the
batch, the requests one by one) is checked against the oracle, every answer of its timed end-to-end
calls (one request per exchange, the batches, the relayed run) against the float64 reference over
the oracle's sets; a planted wrong answer in either fails its entries and `checks_ok`. The remote
design's services run as processes on 127.0.0.1."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.servers import saved_corpus

pytestmark = pytest.mark.e2e  # starts the remote design's services

K = 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return saved_corpus(tmp_path_factory.mktemp("bench-cpu") / "corpus", 31, n_ads=300, n_requests=5)


def _quiet(_message):
    pass


def test_the_timed_match_answers_are_checked_against_the_oracle_and_a_dropped_ad_fails(corpus, monkeypatch):
    from benchmarks.cpu import bench_match, oracle_sets
    from cpu_baseline.index import CpuTargetingIndex

    _, dataset = corpus
    sets = oracle_sets(dataset, dataset.requests)
    assert sum(len(s) for s in sets) > 0
    result = bench_match(dataset, 2, _quiet, sets)
    checks = result["checks"]
    assert set(checks) == {"match/batch", "match/one_request"}
    assert checks["match/batch"]["requests_checked"] == checks["match/batch"]["requests_timed"] == 2 * 5
    assert all(c["ok"] for c in checks.values()), checks
    shipped = CpuTargetingIndex.match

    def one_short(self, requests):  # the last eligible ad of every answer left out
        return [ids[:-1] for ids in shipped(self, requests)]

    monkeypatch.setattr(CpuTargetingIndex, "match", one_short)
    wrong = bench_match(dataset, 2, _quiet, sets)["checks"]
    assert not wrong["match/batch"]["ok"] and not wrong["match/one_request"]["ok"]
    assert "eligible ads, the oracle" in wrong["match/batch"]["first_failure"]


def test_the_timed_end_to_end_answers_are_checked_against_the_reference_and_a_wrong_score_fails(corpus, monkeypatch):
    from benchmarks.cpu import bench_end_to_end, collect_checks
    from serving.services import ServedRetriever

    root, dataset = corpus
    result = bench_end_to_end(dataset, str(root), K, 2, _quiet)
    checks = result["checks"]
    assert set(checks) == {"end_to_end/one_request", "end_to_end/batch", "end_to_end/relayed"}
    assert checks["end_to_end/one_request"]["requests_checked"] == 5 and checks["end_to_end/batch"]["requests_checked"] == 10
    assert all(c["ok"] for c in checks.values()), checks
    shipped = ServedRetriever.retrieve

    def off(self, requests, k):  # every answer's first score off by 1e-3
        return [(ids, np.concatenate([scores[:1] + np.float32(1e-3), scores[1:]])) if len(ids) else (ids, scores)
                for ids, scores in shipped(self, requests, k)]

    monkeypatch.setattr(ServedRetriever, "retrieve", off)
    wrong = bench_end_to_end(dataset, str(root), K, 2, _quiet)
    assert not any(c["ok"] for c in wrong["checks"].values()), wrong["checks"]
    assert "score" in wrong["checks"]["end_to_end/batch"]["first_failure"]
    # the result's checks gather every part's, and fail with any of them
    whole = collect_checks({"scorer": [{"version": 3, "precision": "fp32", "check": {"ok": True}}],
                            "match": {"checks": {"match/batch": {"ok": True}}}, "end_to_end": wrong})
    assert whole["checks_ok"] is False and "scorer/v3/fp32" in whole["checks"]
