"""`bench pipeline` (benchmarks/score.py) run whole under the CUDA simulator on a tiny pool, in its
default geographic layout, with one fault planted in one of its timed paths: every entry point it
times (each launch mode's lone requests, the staged path, `launch_split` and `launch` at each batch
size) is in `checks` with every timed answer checked against the float64 reference over the oracle's
eligible sets; the entry points the fault reaches fail, the others pass; `checks_ok` is false and no
target is met. (Each kernel launch takes the simulator seconds: one run serves every assertion.)"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.e2e  # runs a whole benchmark (minutes under the simulator)

BATCH = 2
LATENCY_REQUESTS = 1  # one lone request per launch mode: each timed entry point runs every kernel once


@pytest.fixture(scope="module")
def planted_run():
    """The benchmark with the stage-by-stage path's match output wrong: every slot of its first row
    marked eligible after the kernel ran (the staged path alone calls `GpuTargetingIndex.run`; the
    pipeline's plans launch the kernel themselves)."""
    from benchmarks import score as bs
    from gpu.index import GpuTargetingIndex

    mp = pytest.MonkeyPatch()
    mp.setattr(bs, "WARM_CALLS", 1)
    shipped_run = GpuTargetingIndex.run

    def wrong_run(self, batch, out, version=None):
        shipped_run(self, batch, out, version)
        host = out.copy_to_host()
        host[0, :] = np.uint32(0xFFFFFFFF)
        out.copy_to_device(host)

    mp.setattr(GpuTargetingIndex, "run", wrong_run)
    try:
        yield bs.bench_pipeline(pool=240, base_ads=80, n_requests=BATCH, dim=16, k=10, batches=(BATCH,),
                                latency_requests=LATENCY_REQUESTS, reps=1, device="sim", progress=False)
    finally:
        mp.undo()


def test_every_timed_entry_point_is_checked_on_every_answer_it_timed(planted_run):
    result = planted_run
    checks = result["checks"]
    assert result["layout"] == "geo" and result["device_kind"] == "sim"
    want = {"startup/graph", "latency/graph", "latency/direct", "stages/match_kernel", "stages/fused_launch",
            "host_calls/graph", f"stages/b{BATCH}"}
    want |= {f"{loop}/{mode}/b{BATCH}" for loop in ("serial", "pipelined") for mode in ("graph", "direct")}
    assert set(checks) == want, sorted(checks)
    for name, c in checks.items():
        assert c["requests_checked"] == c["requests_timed"] > 0, (name, c)
    assert checks["latency/graph"]["requests_timed"] == LATENCY_REQUESTS
    assert checks[f"pipelined/direct/b{BATCH}"]["requests_timed"] == BATCH
    assert result["launch_modes_equal"] is True


def test_a_planted_wrong_match_fails_the_paths_it_reaches_and_no_target_is_met(planted_run):
    result = planted_run
    checks = result["checks"]
    failed = {name for name, c in checks.items() if not c["ok"]}
    assert failed == {"stages/match_kernel", "stages/fused_launch"}, {n: c.get("first_failure") for n, c in checks.items()}
    assert "in the match, not in the oracle" in checks["stages/match_kernel"]["first_failure"]
    assert all(c["max_abs_err"] < 1e-4 for name, c in checks.items() if name not in failed)
    assert result["checks_ok"] is False
    assert result["targets"] and all(t["met"] is False and t["reason"] == "checks failed"
                                     for t in result["targets"].values())
    from benchmarks.score import pipeline_table

    table = pipeline_table(result)
    assert "check: FAILED" in table and "FAILED: stages/match_kernel" in table and "(checks failed)" in table
