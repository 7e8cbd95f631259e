"""The scoring targets against PyTorch peers (`benchmarks.score.score_targets`, `benchmarks.peers.best_passing`):
a ratio is taken against the fastest peer that passed the project's answer check, over the same stages as
the project's row (its scoring and its final top-K). Plain dictionaries: no GPU, no PyTorch."""

import pytest

from benchmarks.peers import best_passing
from benchmarks.score import score_targets


def _row(kind, score_ms, topk_ms, version=11):
    return {"D": 64, "precision": "fp16", "kind": kind, "version": version, "eligible": 1.0, "ok": True,
            "score_ms": score_ms, "topk_ms": topk_ms, "ads_per_s": 1e9 / score_ms, "copy_fraction": 0.5}


def _peer(name, kind, time_ms, passes):
    return {"peer": name, "kind": kind, "time_ms": time_ms, "passes": passes}


PEERS = [_peer("fast but wrong", "moe", 1.0, False), _peer("slow", "moe", 9.0, True), _peer("right", "moe", 6.0, True),
         {"peer": "not run", "skipped": "TypeError: out_dtype"}, _peer("dot", "dot", 2.0, True)]


def test_the_best_peer_is_the_fastest_that_passes():
    assert best_passing(PEERS, "moe")["peer"] == "right"
    assert best_passing(PEERS, "dot")["peer"] == "dot"
    assert best_passing([_peer("wrong", "moe", 1.0, False)], "moe") is None


@pytest.mark.parametrize("score_ms,topk_ms,met", [(2.0, 1.0, True), (2.5, 1.0, False)])
def test_the_moe_target_counts_the_rows_top_k_and_the_best_passing_peer(score_ms, topk_ms, met):
    result = {"runs": [_row("moe", score_ms, topk_ms), _row("dot", 1.0, 0.5)], "unfused": [], "peers": PEERS}
    targets = score_targets(result)
    moe = targets["moe_over_best_torch_peer"]
    assert moe["peer"] == "right" and moe["value"] == pytest.approx(6.0 / (score_ms + topk_ms))
    assert moe["met"] is met
    assert targets["dot_over_best_torch_peer"]["value"] == pytest.approx(2.0 / 1.5)


def test_no_ratio_without_a_passing_peer():
    result = {"runs": [_row("moe", 2.0, 1.0)], "unfused": [], "peers": [_peer("wrong", "moe", 1.0, False)]}
    assert "moe_over_best_torch_peer" not in score_targets(result)
