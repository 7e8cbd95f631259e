"""`andromeda bench report`: synthetic result JSON of every kind (the shapes the producers write, with
seeded random figures) -> markdown that carries the figures, charts when matplotlib is present, a clear
error for JSON it does not know; the generated part of BENCHMARKS.md never touches hand-written text."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from andromeda_nb import provenance
from benchmarks import report as rp

SEED = 20260101
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
REPO = Path(__file__).resolve().parents[2]
ENV = {"python": "3.12.3", "numpy": "2.5.2", "numba": "0.68.0", "numba_cuda": "0.30.4", "device": "NVIDIA H200",
       "compute_capability": [9, 0], "sms": 132}


# --- synthetic results in the producers' shapes -------------------------------------------------------


def make_match(rng) -> dict:
    pools = []
    for ads in (1_000_448, 10_004_480):
        timings = []
        for v in (1, 2, 3):
            for b in (64, 256):
                t = float(rng.uniform(0.005, 0.05)) * ads / 1e6
                timings.append({"version": v, "batch": b, "median_s": t, "min_s": t * 0.99, "reps": 7,
                                "pool_ads_per_s": b * ads / t, "ms_per_request": 1e3 * t / b,
                                "host_prepare_s": float(rng.uniform(0.002, 0.02)),
                                "scan_bytes_upper": float(rng.uniform(1.5, 4.0)) * b * ads,
                                "scan_bandwidth_upper": 0.0, "prog_bytes_per_ad": 107.7})
        pools.append({"ads": ads, "copies": ads // 32_768, "capacity": ads + 4096, "build_s": 1.2,
                      "device_bytes": 150 * ads, "device_bytes_per_ad": float(rng.uniform(140, 160)),
                      "eligible_share": float(rng.uniform(0.02, 0.1)),
                      "check": {"oracle_checks": 524_288, "versions_equal": [1, 2, 3], "seconds": 1.7},
                      "timings": timings})
    pools[0]["updates"] = {"rounds": 20, "updates": 20_000, "apply_s": 2.0,
                           "updates_per_s": float(rng.uniform(5000, 9000))}
    return {"benchmark": "match", "environment": ENV, "device_kind": "gpu", "versions": [1, 2, 3],
            "shipped_version": 3, "base_ads": 32_768, "seed": 7, "batches": [64, 256], "pools": pools,
            "copy_bandwidth_Bps": float(rng.uniform(3.5e12, 3.9e12)),
            "cpu_index": {"ads": 983_040, "requests": 64, "seconds": 0.7,
                          "pool_ads_per_s": float(rng.uniform(5e7, 1e8)), "threads": 16}}


def make_score(rng) -> dict:
    runs = []
    bw = float(rng.uniform(3.5e12, 3.9e12))
    for D in (64, 128):
        for prec, nbytes in (("fp32", 4), ("fp16", 2), ("int8", 1)):
            for kind in ("moe", "dot"):
                for v in (1, 2):
                    ads = float(rng.uniform(1e9, 3e10))
                    bpa = D * nbytes + (4 if prec == "int8" else 0) + 0.125 + 0.59
                    runs.append({"D": D, "precision": prec, "kind": kind, "version": v, "ok": True,
                                 "score_ms": 1e3 * 2 ** 26 / ads, "topk_ms": 0.05, "ads_per_s": ads,
                                 "bytes_per_ad": bpa, "GBps": ads * bpa / 1e9, "copy_fraction": ads * bpa / bw})
    runs[3]["ok"] = False  # one failed check: the report must say so
    return {"env": ENV, "n_ads": 2 ** 26, "k": 100, "versions": {"1": "v1 naive", "2": "v2 tiled"},
            "arithmetic": "float32 (default mode)", "runs": runs, "checks_ok": False, "copy_bandwidth_Bps": bw,
            "unfused": [{"D": 64, "precision": "fp16", "time_ms": 350.0, "ads_per_s": float(rng.uniform(1e8, 3e8)),
                         "check": {"ok": True}}],
            "targets": {"fused_over_unfused": {"value": 50.0, "target": ">= 10", "met": True}}}


def make_pipeline(rng) -> dict:
    p50 = float(rng.uniform(1, 6))
    return {"env": ENV, "pool_ads": 10_002_432, "slots": 10_100_000, "precision": "fp16", "D": 64, "k": 100,
            "score_version": 2, "match_version": 5, "arithmetic": "float32 (default mode)", "checks_ok": True,
            "latency_ms": {"p50": p50, "p99": p50 * 1.3, "mean": p50 * 1.05, "requests": 200},
            "throughput": [{"batch": b, "batch_ms": 5.0 * b ** 0.6, "requests_per_s": b / (5e-3 * b ** 0.6),
                            "pool_ads_per_s": b * 10_002_432 / (5e-3 * b ** 0.6)} for b in (1, 16, 64)]}


def make_cpu(rng) -> dict:
    scorer = []
    for prec, nbytes in (("fp32", 4), ("fp16", 2), ("int8", 1)):
        for v in (1, 2):
            ads = float(rng.uniform(2e6, 2e7))
            row = 64 * nbytes + (4 if prec == "int8" else 0)
            scorer.append({"precision": prec, "version": v, "shipped": v == 2, "ads": 2_000_000,
                           "table_bytes": 2_000_000 * row, "seconds": 2e6 / ads, "ads_per_s": ads,
                           "GBps": ads * (row + 8) / 1e9, "max_error": 1e-7,
                           "cpu_ns_per_ad_one_thread": float(rng.uniform(40, 120))})
    return {"machine": {"cpu": "Test CPU 9000", "cores": 16, "numba_threads": 16, "python": "3.11.7",
                        "numpy": "2.4.6", "numba": "0.68.1", "pyarrow": "26.0.1"},
            "settings": {"pool_ads": 200_000, "requests": 64, "k": 100, "seed": 1, "score_rows": 2_000_000},
            "bandwidth": {"numpy_GBps": 14.0, "parallel_GBps": 20.0, "ceiling_GBps": float(rng.uniform(15, 25))},
            "scorer": scorer,
            "match": {"pool_ads": 200_000, "requests": 64, "threads": 16, "seconds": 0.5,
                      "pool_ads_per_s": float(rng.uniform(1e7, 1e8)), "single_request_ms": 3.1,
                      "eligible_mean": 9000.0, "eligible_fraction": 0.045},
            "end_to_end": {"k": 100, "requests": 64, "precision": "int8",
                           "latency_ms": {"p50": float(rng.uniform(8, 12)), "p99": float(rng.uniform(15, 30)),
                                          "mean": 11.0},
                           "sequential_requests_per_s": 90.0, "batched_requests_per_s": 150.0,
                           "batched_pool_ads_per_s": 3e7,
                           "traffic_bytes_per_request": {
                               "client->index host": {"mean_total": 6400.0, "mean_upstream": 3800.0,
                                                      "mean_downstream": 2600.0},
                               "index host->scorer": {"mean_total": float(rng.uniform(4e4, 9e4)),
                                                      "mean_upstream": 3e4, "mean_downstream": 2e4}}}}


def make_compare(rng) -> dict:
    remote = float(rng.uniform(1e6, 5e6))
    colocated = float(rng.uniform(5e3, 8e3))
    ok = {"ok": True, "checked": 16, "failures": []}
    return {"ads": 1_000_000, "requests": 16, "k": 100, "precision": "int8",
            "updates": {"applied": 12, "rejected": []},
            "eligibility": {"equal": True, "eligible_mean": 50_000.0, "eligible_fraction_mean": 0.05},
            "remote": {"scores": ok, "topk": ok, "device": "cpu"},
            "colocated": {"scores": ok, "topk": ok, "device": "gpu"},
            "eligible_equal": True, "scores_equal": True, "topk_equal": True,
            "bytes_per_hop": {"remote": {"client->index host": 6000.0, "index host->scorer": remote - 6000.0},
                              "colocated": {"client->server": colocated}},
            "bytes_per_request": {"remote": remote, "colocated": colocated},
            "traffic_reduction": remote / colocated,
            "requests_per_second": {"remote": 12.5, "colocated": 140.0},
            "pool_ads_per_second": {"remote": 1.25e7, "colocated": 1.4e8}}


def make_quality(rng) -> dict:
    names = ("two_tower", "moe_k1", "moe_k2", "moe_k4", "dense")
    recall = dict(zip(names, sorted(rng.uniform(0.2, 0.7, len(names)).tolist())))
    return {"recall": recall, "flops_per_ad": dict(zip(names, (128, 1035, 1174, 1452, 1694))),
            "bytes_per_ad": {"fp32": 256, "fp16": 128, "int8": 68},
            "test_loss": {n: float(rng.uniform(0.3, 0.5)) for n in names},
            "references": {"random": 0.017}, "kernel": {"skipped": "no usable CUDA GPU"},
            "config": {"seed": 0, "test_requests": 400, "precision": "fp32",
                       "truth": {"ads": 20_000, "experts": 6, "dim": 64}}}


MAKERS = {"match": make_match, "score": make_score, "pipeline": make_pipeline, "cpu": make_cpu,
          "compare": make_compare, "quality": make_quality}


@pytest.fixture
def results(tmp_path):
    rng = np.random.default_rng(SEED)
    print(f"seed {SEED}")
    docs = {kind: make(rng) for kind, make in MAKERS.items()}
    paths = {}
    for kind, doc in docs.items():
        paths[kind] = tmp_path / "in" / f"{kind}_result.json"
        paths[kind].parent.mkdir(exist_ok=True)
        paths[kind].write_text(json.dumps(doc, indent=2))
    return docs, paths


def _no_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError


# --- recognising files ----------------------------------------------------------------------------------


def test_every_kind_is_recognised_from_its_content(results):
    docs, paths = results
    for kind, path in paths.items():
        assert rp.load_source(path).kind == kind, kind
    # an explicit "kind" wins over the content
    assert rp.detect_kind({**docs["quality"], "kind": "compare"}) == "compare"
    assert rp.detect_kind({"kind": "bench-score"}) == "score"


def test_the_committed_producer_files_are_recognised():
    found = {p: rp.load_source(p).kind for p in sorted((REPO / "docs" / "results").glob("*.json"))}
    if (REPO / "docs" / "quality.json").exists():
        found[REPO / "docs" / "quality.json"] = rp.load_source(REPO / "docs" / "quality.json").kind
    if not found:
        pytest.skip("no committed benchmark JSON under docs/")
    assert set(found.values()) <= set(rp.KINDS)
    assert any(k == "match" for k in found.values()) or any(k == "quality" for k in found.values())


def test_unknown_json_is_a_clear_error(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text(json.dumps({"counts": {"ads": 3}, "seed": 1}))
    with pytest.raises(rp.ReportError, match=r"meta\.json: unknown benchmark JSON.*counts"):
        rp.load_source(path)
    path.write_text(json.dumps({"kind": "weather", "x": 1}))
    with pytest.raises(rp.ReportError, match=r"'weather' is not one of"):
        rp.load_source(path)
    path.write_text("[1, 2, 3]")
    with pytest.raises(rp.ReportError, match="a JSON list"):
        rp.load_source(path)
    path.write_text("pool ads 10\nnot json at all\n")
    with pytest.raises(rp.ReportError, match=r"meta\.json: not JSON"):
        rp.load_source(path)


def test_a_file_missing_a_needed_field_names_it(results, tmp_path):
    docs, _ = results
    broken = json.loads(json.dumps(docs["match"]))
    del broken["pools"][1]["timings"][2]["pool_ads_per_s"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(rp.ReportError, match=r"broken\.json: looks like match JSON but has no "
                                             r"'pools\[1\]\.timings\[2\]\.pool_ads_per_s'"):
        rp.load_source(path)


def test_logged_output_ending_in_a_json_line_is_read(results, tmp_path):
    docs, _ = results
    path = tmp_path / "compare.log"
    path.write_text("starting services\nremote: 16 requests\n" + json.dumps(docs["compare"]) + "\n")
    assert rp.load_source(path).kind == "compare"


# --- figures in the markdown --------------------------------------------------------------------------


def test_kernel_flops_per_ad_by_hand():
    # D = 64, E = 6, k = 2: gates 768 + 12, select 12, softmax 7, routed 256 + 8
    assert rp.kernel_flops_per_ad("moe", 64, 6, 2) == 768 + 12 + 12 + 7 + 256 + 8
    assert rp.kernel_flops_per_ad("dot", 64) == 129
    # dense routing (k = E) has no selection
    assert rp.kernel_flops_per_ad("moe", 8, 2, 2) == 32 + 4 + 0 + 7 + 32 + 8


def test_markdown_carries_every_kind_of_figure(results, tmp_path, monkeypatch):
    docs, paths = results
    _no_matplotlib(monkeypatch)
    res = rp.build_report(paths.values(), tmp_path / "docs")
    md = Path(res.markdown).read_text()
    assert md.count(rp.BEGIN) == 1 and md.count(rp.END) == 1
    # match: every (pool, version, batch) row, the G pool ads/s, the CPU index beside it
    m = docs["match"]
    for pool in m["pools"]:
        for t in pool["timings"]:
            assert f"| {pool['ads']:,} | v{t['version']}" in md
            assert f"{t['pool_ads_per_s'] / 1e9:,.1f}" in md
    assert f"{m['cpu_index']['pool_ads_per_s'] / 1e9:.3f} G pool ads/s" in md
    assert f"{m['copy_bandwidth_Bps'] / 1e12:.2f} TB/s" in md
    # score: ads/s, GB/s from ads/s x bytes/ad, FLOP/s from the by-hand FLOP count, the failed check
    s = docs["score"]
    for r in s["runs"]:
        assert f"{r['ads_per_s'] / 1e9:,.2f}" in md
        assert f"{r['ads_per_s'] * r['bytes_per_ad'] / 1e9:,.0f}" in md
        flops = rp.kernel_flops_per_ad(r["kind"], r["D"])
        assert f"{r['ads_per_s'] * flops / 1e9:,.0f}" in md
    assert "**FAILED**" in md
    assert f"{s['unfused'][0]['ads_per_s'] / 1e9:,.3f}" in md
    # pipeline: latency percentiles and each batch's throughput
    p = docs["pipeline"]
    assert f"p50 {p['latency_ms']['p50']:.2f} ms, p99 {p['latency_ms']['p99']:.2f} ms" in md
    for t in p["throughput"]:
        assert f"| {t['batch']} | {t['batch_ms']:,.2f} |" in md
    # CPU baseline: copy ceiling, scorer rows, match, end to end and wire bytes
    c = docs["cpu"]
    assert f"Memory copy bandwidth: {c['bandwidth']['ceiling_GBps']:.1f} GB/s" in md
    for r in c["scorer"]:
        assert f"{r['ads_per_s'] / 1e6:,.1f}" in md and f"{r['GBps']:,.2f}" in md
    assert f"{c['match']['pool_ads_per_s'] / 1e6:.1f} M pool ads/s" in md
    assert f"p50 {c['end_to_end']['latency_ms']['p50']:.2f} ms" in md
    hop = c["end_to_end"]["traffic_bytes_per_request"]["index host->scorer"]["mean_total"]
    assert f"index host->scorer: {hop:,.0f}" in md
    # compare: bytes per request and the reduction
    d = docs["compare"]
    assert f"**{d['traffic_reduction']:,.1f}x**" in md
    assert f"{d['bytes_per_request']['remote']:,.0f}" in md
    # quality: recall of every model
    for name, v in docs["quality"]["recall"].items():
        assert f"| {name} | {v:.3f} |" in md
    # every figure with its device and versions
    assert "NVIDIA H200 (cc 9.0, 132 SMs)" in md and "Test CPU 9000 (16 cores)" in md
    assert "numba-cuda 0.30.4" in md
    assert "command not recorded in the JSON" in md  # none of these synthetic files carries one
    # the headline table puts the published anchors beside the measured figures
    assert "### Headline figures" in md and rp.ANCHORS["match"] in md


def test_rows_with_a_share_eligible_are_shown_but_never_the_headline(tmp_path, monkeypatch):
    """A walk over 8% of the pool reads fewer bytes than a full walk: its pool-ads rate is listed with
    its share, and the headline and roofline keep to the runs with every ad eligible."""
    rng = np.random.default_rng(SEED)
    doc = make_score(rng)
    full = max((r for r in doc["runs"] if r["ok"] and r["kind"] == "moe"), key=lambda r: r["ads_per_s"])
    doc["runs"].append({**full, "eligible": 0.08, "ads_per_s": 3 * full["ads_per_s"], "score_ms": full["score_ms"] / 3})
    path = tmp_path / "score.json"
    path.write_text(json.dumps(doc))
    _no_matplotlib(monkeypatch)
    md = Path(rp.build_report([path], tmp_path / "docs").markdown).read_text()
    headline = md.split("### Headline figures")[1].split("###")[0]
    assert f"{full['ads_per_s'] / 1e9:.2f} G ads/s" in headline
    assert f"{3 * full['ads_per_s'] / 1e9:.2f} G ads/s" not in headline
    assert "| eligible |" in md and "| 0.08 |" in md and f"{3 * full['ads_per_s'] / 1e9:,.2f}" in md
    from benchmarks.report.figures import score_points
    from benchmarks.report.sources import load_source

    src = load_source(path)
    assert len(score_points(src)) == len(doc["runs"])
    assert len(score_points(src, every_ad_eligible=True)) == len(doc["runs"]) - 1


def test_without_matplotlib_the_tables_are_written_and_the_charts_skipped(results, tmp_path, monkeypatch):
    _, paths = results
    _no_matplotlib(monkeypatch)
    res = rp.build_report(paths.values(), tmp_path)
    assert res.charts == {} and "matplotlib is not installed" in res.skipped
    md = Path(res.markdown).read_text()
    assert "Charts skipped: matplotlib is not installed" in md and "![" not in md
    assert not (tmp_path / rp.CHART_DIR).exists()


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib (the optional `plots` extra) is not installed")
def test_charts_are_drawn_and_linked(results, tmp_path):
    _, paths = results
    res = rp.build_report(paths.values(), tmp_path)
    assert res.skipped is None
    assert set(res.charts) == {"roofline", "match", "pipeline", "traffic"}
    md = Path(res.markdown).read_text()
    for name, path in res.charts.items():
        data = Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        assert f"]({rp.CHART_DIR}/{name}.png)" in md


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib (the optional `plots` extra) is not installed")
def test_only_the_charts_with_data_are_drawn(results, tmp_path):
    _, paths = results
    res = rp.build_report([paths["quality"], paths["compare"]], tmp_path)
    assert set(res.charts) == {"pipeline", "traffic"}  # compare has wire bytes and requests/s only
    assert not (tmp_path / rp.CHART_DIR / "roofline.png").exists()


# --- BENCHMARKS.md: the generated part only ---------------------------------------------------------------


def test_hand_written_text_is_kept_and_the_block_replaced(results, tmp_path, monkeypatch):
    docs, paths = results
    _no_matplotlib(monkeypatch)
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nHand-written notes on the H200 run.\n")
    rp.build_report([paths["match"]], tmp_path)
    first = md.read_text()
    assert first.startswith("# Benchmarks\n\nHand-written notes on the H200 run.\n\n" + rp.BEGIN)
    # text after the block survives too, and a second run replaces the block in place
    md.write_text(first + "\n## Later notes\n\nkept\n")
    rp.build_report([paths["pipeline"]], tmp_path)
    second = md.read_text()
    assert "Hand-written notes on the H200 run." in second and "## Later notes\n\nkept\n" in second
    assert second.count(rp.BEGIN) == 1
    assert "Co-located pipeline" in second and "Targeting match" not in second
    # the same inputs give the same file
    rp.build_report([paths["pipeline"]], tmp_path)
    assert md.read_text() == second


def test_broken_markers_stop_before_anything_is_written(results, tmp_path):
    _, paths = results
    md = tmp_path / "BENCHMARKS.md"
    text = "# Benchmarks\n\n" + rp.BEGIN + "\nold generated text\n"
    md.write_text(text)
    with pytest.raises(rp.ReportError, match="no end marker"):
        rp.build_report([paths["match"]], tmp_path)
    assert md.read_text() == text
    md.write_text(rp.BEGIN + "\n" + rp.END + "\n" + rp.BEGIN + "\n" + rp.END + "\n")
    with pytest.raises(rp.ReportError, match="more than one generated part"):
        rp.build_report([paths["match"]], tmp_path)


# --- provenance and the command line ----------------------------------------------------------------


def test_command_line_as_typed_or_rebuilt():
    assert provenance.command_line("x", argv=["/usr/bin/andromeda", "bench", "match", "--pools", "10"]) == \
        "andromeda bench match --pools 10"
    assert provenance.command_line("x", argv=["cli.py", "bench", "score", "--dims", "64"]) == \
        "python3 cli.py bench score --dims 64"
    rebuilt = provenance.command_line("main bench cpu", {"n_ads": 5000, "precisions": ("fp16", "int8"),
                                                         "quiet": True, "out": None, "as_json": False},
                                      argv=["pytest"])
    assert rebuilt == "andromeda bench cpu --n-ads 5000 --precisions fp16 --precisions int8 --quiet"


def test_stamped_results_show_their_command(results, tmp_path, monkeypatch):
    docs, _ = results
    _no_matplotlib(monkeypatch)
    doc = provenance.stamp(dict(docs["pipeline"]), "pipeline", argv=["andromeda", "bench", "pipeline",
                                                                       "--pool", "10000000"])
    assert doc["kind"] == "pipeline" and doc["provenance"]["host"]["python"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    res = rp.build_report([path], tmp_path / "docs")
    assert "command `andromeda bench pipeline --pool 10000000`" in Path(res.markdown).read_text()
    with pytest.raises(ValueError, match="unknown result kind"):
        provenance.stamp({}, "weather")


def test_cli_bench_report(results, tmp_path):
    from cli import main

    _, paths = results
    runner = CliRunner()
    res = runner.invoke(main, ["bench", "report", "--help"])
    assert res.exit_code == 0 and "BENCHMARKS.md" in res.output and "roofline" in res.output
    res = runner.invoke(main, ["bench", "report", str(paths["match"].parent), "--out", str(tmp_path / "docs"),
                               "--no-charts", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert sorted(s["kind"] for s in out["sources"]) == sorted(rp.KINDS)
    assert out["charts"] == {} and out["charts_skipped"] == "--no-charts was given"
    assert Path(out["markdown"]).exists()
    res = runner.invoke(main, ["bench", "report", str(paths["cpu"]), "--out", str(tmp_path / "c"), "--no-charts",
                               "--command", "cpu_result.json=andromeda bench cpu --ads 200000"])
    assert res.exit_code == 0, res.output
    assert ("command `andromeda bench cpu --ads 200000` (as documented; the JSON does not record it)"
            in (tmp_path / "c" / "BENCHMARKS.md").read_text())
    for pair, message in (("nothing-here", "expected FILE=COMMAND"),
                          ("other.json=andromeda bench cpu", "other.json, which is not among the input files")):
        res = runner.invoke(main, ["bench", "report", str(paths["cpu"]), "--out", str(tmp_path / "c"),
                                   "--command", pair])
        assert res.exit_code == 1 and message in res.output, res.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    res = runner.invoke(main, ["bench", "report", str(bad), "--out", str(tmp_path / "docs")])
    assert res.exit_code == 1 and "unknown benchmark JSON" in res.output and "Traceback" not in res.output


MINIMAL = {  # only the fields REQUIRED names (a run cut short, an older producer)
    "match": {"benchmark": "match", "pools": [{"ads": 65_536, "timings": [
        {"version": 2, "batch": 64, "median_s": 0.0021, "pool_ads_per_s": 2.0e9}]}]},
    "score": {"copy_bandwidth_Bps": 3.3e12, "runs": [
        {"D": 64, "precision": "fp16", "kind": "moe", "version": 2, "ads_per_s": 7.7e9, "bytes_per_ad": 128.7}]},
    "pipeline": {"pool_ads": 1_000_000, "latency_ms": {"p50": 2.5, "p99": 3.5},
                 "throughput": [{"batch": 1, "pool_ads_per_s": 4.0e8}]},
    "cpu": {"bandwidth": {"ceiling_GBps": 12.5},
            "scorer": [{"precision": "int8", "version": 1, "ads_per_s": 3.0e6, "GBps": 0.23}]},
    "compare": {"bytes_per_request": {"remote": 123_456.0, "colocated": 789.0}, "eligible_equal": True,
                "topk_equal": False},
    "quality": {"recall": {"moe_k2": 0.59}, "flops_per_ad": {"moe_k2": 1174}},
}


@pytest.mark.parametrize("charts", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAVE_MPL, reason="matplotlib (the optional `plots` extra) is not installed"))])
def test_files_with_only_the_required_fields_still_render(tmp_path, charts):
    paths = []
    for kind, doc in MINIMAL.items():
        paths.append(tmp_path / f"{kind}.json")
        paths[-1].write_text(json.dumps(doc))
    res = rp.build_report(paths, tmp_path / "docs", charts=charts)
    assert sorted(s.kind for s in res.sources) == sorted(rp.KINDS)
    md = Path(res.markdown).read_text()
    assert "| 65,536 | v2 | 64 | 2.10 | 2.0 |" in md
    assert "top-K equal: **no**" in md and "**156.5x**" in md
    assert "p50 2.50 ms, p99 3.50 ms" in md and "| moe_k2 | 0.590 | 1174 |" in md
    assert "versions not recorded" in md
    if charts:
        assert {"roofline", "match", "pipeline", "traffic"} <= set(res.charts)


def test_demo_json_is_reported_through_its_compare_part(tmp_path):
    compare = {"bytes_per_request": {"remote": 9000.0, "colocated": 100.0}, "eligible_equal": True,
               "topk_equal": True, "traffic_reduction": 90.0}
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"compare": compare, "kernels": {}, "budget": {}, "ads": 10}))
    src = rp.load_source(path)
    assert src.kind == "compare" and src.doc["traffic_reduction"] == 90.0
