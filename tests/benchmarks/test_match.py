"""`bench match` (benchmarks/match.py, through benchmarks.match_both) at simulator size in the
geographic layout: the output of every timed launch (each version and batch size), the serving
between update rounds and the CPU index's timed answers are checked against the oracle; one bit
planted wrong in the GPU index's output fails every GPU entry and leaves the CPU index's passing;
the result file carries its provenance. Kernels run under the CUDA simulator (or the real GPU with
ANDROMEDA_TEST_GPU=1)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from andromeda_nb.testing import KERNEL_DEVICE

pytestmark = pytest.mark.e2e  # runs a whole benchmark

CHUNK = 32


def _bench(tmp_path, monkeypatch, **options):
    from benchmarks import match as bm
    from benchmarks.match_both import bench_match
    from gpu.kernels import match as shipped

    monkeypatch.setattr(bm, "WARMUP", 0)
    version = shipped.SIMULATOR_FALLBACK if KERNEL_DEVICE == "sim" else shipped.SHIPPED
    out = tmp_path / "match.json"
    result = bench_match(pools=[240], versions=[version], batches=[8, 32], base_ads=80, requests=40, updates=(2, 15),
                         cpu_pool=160, chunk_slots=CHUNK, layout="geo", device=KERNEL_DEVICE, progress=False,
                         out=str(out), **options)
    return result, json.loads(out.read_text()), version


def test_every_timed_launch_is_checked_against_the_oracle_in_the_geo_layout(tmp_path, monkeypatch):
    result, written, version = _bench(tmp_path, monkeypatch)
    pool = result["pools"][0]
    assert pool["layout"] == "geo" and result["layout"] == "geo"
    checks = result["checks"]
    assert set(checks) == {f"240/v{version}/b8", f"240/v{version}/b32", "240/updates/serve", "240/full_size",
                           "cpu_index/160"}, sorted(checks)
    for b in (8, 32):
        c = checks[f"240/v{version}/b{b}"]
        assert c["ok"] and c["requests_checked"] == c["requests_timed"] == b and c["full_pool_requests"] == b, c
    assert checks["240/updates/serve"]["ok"] and checks["240/updates/serve"]["oracle_checks"] > 0
    assert checks["cpu_index/160"]["ok"] and checks["cpu_index/160"]["requests_checked"] == 40
    assert result["checks_ok"] is True and all(row["ok"] for row in pool["timings"])
    # the file written as the run goes carries the checks and where it came from
    assert written["checks_ok"] is True and written["provenance"]["command"]
    assert set(written["provenance"]) >= {"command", "commit", "dirty", "created", "host"}


def test_a_wrong_bit_in_the_gpu_index_output_fails_its_checks(tmp_path, monkeypatch):
    from gpu.index import GpuTargetingIndex

    shipped_run = GpuTargetingIndex.run

    def wrong_run(self, batch, out, version=None):  # the last request's first slot flipped
        shipped_run(self, batch, out, version)
        host = out.copy_to_host()
        host[-1, 0] ^= np.uint32(1)
        out.copy_to_device(host)

    monkeypatch.setattr(GpuTargetingIndex, "run", wrong_run)
    result, _, version = _bench(tmp_path, monkeypatch)
    checks = result["checks"]
    for name in (f"240/v{version}/b8", f"240/v{version}/b32", "240/full_size"):
        assert not checks[name]["ok"] and checks[name]["failed"] == 1, (name, checks[name])
        assert "slot 0 " in checks[name]["first_failure"], checks[name]
    assert checks["cpu_index/160"]["ok"]  # the CPU index's answers are still right
    assert result["checks_ok"] is False
    assert not any(row["ok"] for row in result["pools"][0]["timings"])
