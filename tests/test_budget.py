"""The byte budget counts what the layouts really hold."""

import pytest

from andromeda_nb.budget import budget_table, fused_stages, network_payload, stored_ad_bytes, total, unfused_stages


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
    assert sum(large["colocated"].values()) == sum(small["colocated"].values())
    assert sum(large["remote"].values()) > 50 * sum(large["colocated"].values())
    assert large["remote"]["scorer->index host"] == 100_000 * 4
