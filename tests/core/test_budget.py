"""The byte budget counts what the layouts really hold."""

import pytest

from andromeda_nb.budget import (budget_table, fused_stages, network_payload, payload_total, stored_ad_bytes, total,
                                 unfused_stages)
from migration.budget import build_budget, format_budget


@pytest.mark.parametrize("precision,expected", [("fp32", 256), ("fp16", 128), ("int8", 68)])
def test_stored_bytes(precision, expected):
    assert stored_ad_bytes(precision, 64) == expected


def test_fused_reads_each_stored_byte_once_and_unfused_more():
    for p in ("fp32", "fp16", "int8"):
        fused = total(fused_stages(p, 64, k=100))
        assert stored_ad_bytes(p, 64) <= fused < stored_ad_bytes(p, 64) + 8
        assert total(unfused_stages(p, 64)) > 5 * fused
    rows = budget_table()
    assert [r["precision"] for r in rows] == ["fp32", "fp16", "int8"]
    # lower precision shrinks the fused budget but barely the unfused one (float32 intermediates)
    assert rows[2]["unfused_over_fused"] > rows[0]["unfused_over_fused"]


def test_network_payload_grows_with_candidates_only_for_remote():
    small = network_payload(2000, 1_000, 100)
    large = network_payload(2000, 100_000, 100)
    assert payload_total(large["colocated"]) == payload_total(small["colocated"])
    assert payload_total(large["remote"]) > 50 * payload_total(large["colocated"])
    assert large["remote"]["index host->scorer"]["downstream"] == 100_000 * 4
    assert large["colocated"]["client->server"]["downstream"] == 100 * (8 + 4 + 8)


def test_budget_report_from_a_corpus(tmp_path):
    from andromeda_nb.corpus import generate_corpus
    from andromeda_nb.store import load_dataset

    generate_corpus(tmp_path / "c", n_ads=3000, n_requests=6, seed=5)
    dataset = load_dataset(tmp_path / "c")
    report = build_budget(dataset, k=50)
    net = report["network"]
    assert net["source"] == "corpus" and net["requests"] == 6
    assert 0 < net["eligible_mean"] < 3000
    # the scorer hop carries 8 bytes per eligible id plus the user side, and 4 bytes back per id
    hop = net["payload"]["remote"]["index host->scorer"]
    assert hop["downstream"] == pytest.approx(4 * net["eligible_mean"])
    assert "fused B/ad" in format_budget(report)
