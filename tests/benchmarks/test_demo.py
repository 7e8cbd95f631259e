"""The migration demo runs end to end on a small corpus and reports figures that hang together."""

import numpy as np
import pytest

from benchmarks.demo import run_demo

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands


@pytest.fixture(scope="module")
def demo_run():
    lines = []
    figures = run_demo(n_ads=1200, n_requests=3, seed=4, k=10, device="cpu", echo=lines.append,
                       kernel_rows=1 << 14)
    return figures, "\n".join(lines)


def test_demo_walks_the_five_steps(demo_run):
    figures, text = demo_run
    for header in ("1. Find the bottleneck", "2. The byte budget", "3. One tower versus experts",
                   "4. Co-location and its traffic", "5. The fused kernel and int8", "Side by side"):
        assert header in text
    report = figures["compare"]
    assert report["eligible_equal"] and report["scores_equal"] and report["topk_equal"]
    assert report["bytes_per_request"]["remote"] > report["bytes_per_request"]["colocated"] > 0


def test_demo_figures_are_measured(demo_run):
    figures, _ = demo_run
    kernels = figures["kernels"]
    assert kernels["device"] == "cpu" and kernels["rows"] == 1 << 14
    for precision in ("fp32", "fp16", "int8"):
        assert kernels["fused"][precision]["ads_per_s"] > 0
        assert kernels["unfused"][precision]["ads_per_s"] > 0
    assert set(figures["quality"]["recall"]) == {"two_tower", "moe_k1", "moe_k2", "moe_k4", "dense"}
    assert figures["budget"]["network"]["source"] == "corpus"


def test_on_a_cpu_the_demo_explains_itself(demo_run):
    figures, text = demo_run
    assert figures["device"] == "cpu"
    explanation = text[text.index("What the CPU figures show"):]
    assert "Co-location pays on a GPU server" in explanation
    runs = figures["compare"]["requests_per_second_runs"]
    co, remote = runs["colocated"], runs["remote"]
    said = ("faster even here" if co["min"] > remote["max"] else "slower here" if co["max"] < remote["min"]
            else "within this machine's noise")
    assert said in explanation, "the comparison it draws is the one its runs allow"
    assert "median of its runs with the range" in explanation


def test_a_difference_in_speed_is_claimed_only_when_the_ranges_do_not_overlap():
    """The demo's own advice: trust a difference between medians only when the ranges do not overlap.
    Its conclusion keeps to it (it once said "faster even here" from 99.2 to 248 against 153 to 183)."""
    from benchmarks.demo import time_verdict

    def report(co, remote, n=3):
        return {"requests_per_second_runs": {
            "colocated": {"median": sum(co) / 2, "min": co[0], "max": co[1], "runs": n},
            "remote": {"median": sum(remote) / 2, "min": remote[0], "max": remote[1], "runs": n}}}

    assert "within this machine's noise" in time_verdict(report((153, 183), (99.2, 248)))
    assert "within this machine's noise" in time_verdict(report((100, 120), (119, 130)))
    assert time_verdict(report((200, 210), (150, 199))).startswith("one process with no candidate hop is faster")
    assert time_verdict(report((100, 140), (150, 160))).startswith("slower here")
    assert "cannot tell a difference" in time_verdict(report((200, 200), (100, 100), n=1))
    for verdict in (time_verdict(report((153, 183), (99.2, 248))), time_verdict(report((100, 140), (150, 160)))):
        assert "faster even here" not in verdict


def test_repeated_timings_report_median_and_spread(demo_run):
    figures, text = demo_run
    for precision in ("fp32", "fp16", "int8"):
        runs = figures["kernels"]["fused"][precision]["runs"]
        assert runs["runs"] == 5 and runs["min"] <= runs["median"] <= runs["max"]
        assert runs["median"] == figures["kernels"]["fused"][precision]["ads_per_s"]
    for arch in ("remote", "colocated"):
        runs = figures["compare"]["requests_per_second_runs"][arch]
        assert runs["runs"] == 3 and runs["min"] <= runs["median"] <= runs["max"] > 0
    side = text[text.index("Side by side"):]
    table = side.split("What the CPU figures show")[0]
    assert table.count("over 3 runs") == 2 and "over 5 runs" in text
    if "What the CPU figures show" in side:  # the conclusion quotes the ranges it is drawn from
        assert side.split("* time:")[1].count("over 3 runs") == 2
    assert "e+" not in text, "rates are written with SI prefixes, never in exponent form"


def test_the_kernel_step_puts_the_moe_against_the_dot_product(demo_run):
    from benchmarks.demo import moe_against_dot

    _, text = demo_run
    assert "the MoE-against-dot comparison needs the GPU kernels" in text  # the CPU run says what it lacks
    gpu = {"fused": {"fp16": {"ads_per_s": 17.1e9}}, "dot": {"fp16": {"ads_per_s": 22.6e9}}}
    (line,) = moe_against_dot(gpu)
    assert "1.32x the time" in line and "17.1 G" in line and "22.6 G" in line
    gpu.update(fused_share={"fp16": {"ads_per_s": 32.6e9}}, eligible_share=0.08)
    line, walk = moe_against_dot(gpu)
    assert "8% of the pool eligible" in walk and "1.9x" in walk and "32.6 G" in walk


def test_the_kernel_step_asks_for_the_kernels_the_device_ships(monkeypatch):
    """The GPU kernel step times the shipped MoE kernel and the shipped dot kernel (different versions
    where the MoE runs on the tensor cores), every ad eligible and a share of the pool."""
    import benchmarks.score as bs
    from benchmarks import demo

    seen = {}

    def fake_bench_score(**kw):
        seen.update(kw)
        runs = [{"kind": kind, "version": v, "precision": p, "eligible": e, "ads_per_s": 1e9 * (v + e), "ok": True}
                for kind, v in (("moe", 7), ("dot", 4), ("moe", 4)) for p in ("fp16", "int8") for e in (1.0, 0.08)]
        return {"checks_ok": True, "env": {"device": "test"}, "n_ads": 1 << 24, "copy_bandwidth_Bps": 3e12,
                "runs": runs, "unfused": []}

    monkeypatch.setattr(bs, "bench_score", fake_bench_score)
    monkeypatch.setattr("gpu.kernels.score.version",
                        lambda v, kind, precision, dim: type("V", (), {"number": 7 if kind == "moe" else 4})())
    out = demo.gpu_kernels(0)
    assert seen["versions"] == [4, 7] and 0.08 in seen["eligible"]
    assert out["fused"]["fp16"]["version"] == 7 and out["dot"]["fp16"]["version"] == 4
    assert out["fused_share"]["fp16"]["ads_per_s"] == 1e9 * 7.08


def test_the_colocation_step_separates_what_the_gpu_buys_from_what_colocation_adds(demo_run):
    from benchmarks.demo import colocation_over_gpu_scoring

    _, text = demo_run
    assert "no GPU here" in text  # the CPU run says where the third column comes from
    report = {
        "architectures": ["remote", "remote_gpu", "colocated"], "remote_gpu": {"device": "gpu"},
        "requests_per_second": {"remote": 71.0, "remote_gpu": 141.0, "colocated": 1322.0},
        "latency_ms": {"remote": {"p50": 46.7}, "remote_gpu": {"p50": 44.4}, "colocated": {"p50": 6.0}},
        "bytes_per_request": {"remote": 593e3, "remote_gpu": 593e3, "colocated": 5.8e3},
        "host_cpu_ms_per_request": {"remote_gpu": {"index host": 12.0, "scoring service": 3.0},
                                    "colocated": {"server": 0.5}},
        "gpu_busy_fraction": {"remote_gpu": {"scoring service": 0.02}, "colocated": {"server": 0.31}},
    }
    lines = "\n".join(colocation_over_gpu_scoring(report))
    assert "the GPU scorer buys 1.99x" in lines
    assert "co-location adds 9.4x the requests per second and 102x fewer bytes" in lines
    assert "15.00 ms for the remote design" in lines and "0.50 ms co-located" in lines
    assert "2.0% behind the remote design, 31.0% co-located" in lines
    report["remote_gpu"]["device"] = "sim"  # the simulator's figures say nothing of a GPU
    assert "no GPU here" in colocation_over_gpu_scoring(report)[0]


def test_the_colocation_step_says_where_a_request_spends_its_time(demo_run):
    """Stage by stage, measured on the engine: every stage took time, scoring read the stored bytes of
    exactly the ads the request found eligible (as many as the comparison's CPU index found, checked
    there against the oracle), and the line in the report carries the same figures."""
    from andromeda_nb.budget import stored_ad_bytes

    figures, text = demo_run
    stages = figures["stages"]
    assert stages["device"] == "cpu" and stages["requests"] == 3
    rows = stages["stages"]
    assert list(rows) == ["match", "user_side", "scoring", "topk"]
    assert all(row["us"] > 0 for row in rows.values())
    scoring = rows["scoring"]
    sizes = figures["compare"]["eligibility"]["eligible_per_request"]
    assert scoring["eligible"] == float(np.median(sizes)) > 0  # 3 requests, each 3 times: the middle one
    assert scoring["bytes"] == pytest.approx(scoring["eligible"] * stored_ad_bytes(figures["compare"]["precision"], 64))
    line = next(ln for ln in text.splitlines() if "where one co-located request's time goes" in ln)
    assert f"scoring {rows['scoring']['us']:,.0f} us ({scoring['eligible']:,.0f} eligible ads" in line


def test_on_a_gpu_the_colocation_step_times_a_lone_request_from_graphs_and_step_by_step():
    """`lone_request_launches` alternates the two ways of enqueueing a batch on the GPU engine and puts
    the engine's graphs back; `stage_lines` reports both. (A stand-in engine: no GPU here.)"""
    from benchmarks.demo import lone_request_launches, stage_lines

    class Pipe:
        graphs = object()

    class Engine:
        device = "gpu"

        def __init__(self):
            self.pipeline, self.seen = Pipe(), []

        def retrieve(self, requests, k):
            self.seen.append("graph" if self.pipeline.graphs is not None else "direct")
            return []

    engine = Engine()
    kept = engine.pipeline.graphs
    got = lone_request_launches(engine, ["r1", "r2"], 10, repeat=2)
    assert set(got) == {"graph", "direct"} and all(v > 0 for v in got.values())
    assert engine.seen[:6] == ["graph"] * 6  # each request seen three times first: captured
    assert engine.seen[6:] == ["graph", "direct"] * 4  # then alternating, 2 requests x 2 repeats
    assert engine.pipeline.graphs is kept
    engine.device = "sim"
    assert lone_request_launches(engine, ["r1"], 10, repeat=1) is None  # no device timing to compare
    lines = stage_lines({"device": "gpu", "requests": 2, "repeat": 2, "launches": {"graph": 812.0, "direct": 1034.0},
                         "stages": {"match": {"us": 300.0, "bytes": 1.5e9}}})
    assert "812 us with its batch replayed from CUDA graphs, 1,034 us with every kernel launched" in lines[1]


def test_a_requests_bytes_are_one_figure_and_every_other_count_says_what_it_counts(demo_run):
    """One request's bytes on the wire are one figure in steps 1 and 4 and the table (step 1 splits it
    by hop); the budget's payload of step 2 says it is counted from the data layout, without framing;
    the int8 line says it is a ratio of ads per second and which way is faster."""
    figures, text = demo_run
    report = figures["compare"]
    remote = report["bytes_per_request"]["remote"]
    assert sum(report["bytes_per_hop"]["remote"].values()) == pytest.approx(remote)
    step = {n: text[text.index(f"\n{n}. "):] for n in (1, 2, 4, 5)}
    assert f"{remote:,.0f} bytes on the wire per request, counted by relays" in step[1][:step[1].index("\n2. ")]
    assert f"counted by relays: remote {remote:,.0f} (step 1)" in step[4][:step[4].index("\n5. ")]
    table = text[text.index("Side by side"):]
    assert "bytes on the wire / request" in table and f"{remote:,.0f}" in table
    payload = step[2][:step[2].index("\n3. ")]
    assert "counted from the data layout (the fields alone, without Arrow and gRPC framing)" in payload
    kernels = step[5]
    assert "int8 against fp16, fused: " in kernels and "x the ads per second (above 1: int8 is faster)" in kernels
    assert "int8 over fp16" not in text


def test_step_one_times_the_cpu_index_apart_from_the_request_and_says_so(demo_run):
    """The CPU index's time comes from matching every request together, the request's from one at a
    time: the line says so instead of calling one a part of the other, and the remainder it names is
    positive or not named."""
    _, text = demo_run
    step = text[text.index("1. Find the bottleneck"):text.index("2. The byte budget")]
    assert "the CPU index matches one in" in step and "ms of it" not in step
    assert "go to moving candidate lists" in step or "the figures do not add up" in step
    assert "the other -" not in step


def test_the_kernel_step_puts_the_batched_pass_beside_one_request_at_a_time(demo_run):
    """Step 5 times the request list as one batch and one request at a time on the co-located engine,
    and its line carries those figures, inside step 5."""
    figures, text = demo_run
    b = figures["stages"]["batch"]
    assert b["requests"] == 3 and b["pool_ads"] == 1200 and b["repeat"] >= 1
    assert b["batch_ms"] > 0 and b["lone_ms"] > 0
    line = next(ln for ln in text.splitlines() if "the batched pass" in ln)
    assert f"3 requests in one batch {b['batch_ms']:,.2f} ms, one at a time {b['lone_ms']:,.2f} ms" in line
    assert f"({b['lone_ms'] / b['batch_ms']:.1f}x" in line and "request by request" in line  # the CPU engine's
    assert text.index("5. The fused kernel") < text.index(line) < text.index("Side by side")


def test_the_batched_pass_stops_when_a_batch_changes_an_answer():
    """A batch that answers a request otherwise than alone (other ads, or scores past the reference
    tolerance) is an error, not a figure; scores a rounding apart are the same answer."""
    from benchmarks.demo import DemoError, batch_against_lone

    class Drifting:
        def __len__(self):
            return 10

        def retrieve(self, requests, k):
            shift = 1 if len(requests) > 1 else 0  # a batch's scores differ from the lone request's
            return [(np.arange(k, dtype=np.int64), np.full(k, 0.5 + shift, np.float32)) for _ in requests]

    with pytest.raises(DemoError, match="request 0 answered differently in a batch of 2"):
        batch_against_lone(Drifting(), ["a", "b"], 3, 1)

    class Steady(Drifting):  # a batch summed in another order: scores a rounding apart, the same ads
        def retrieve(self, requests, k):
            last_bit = 1e-6 if len(requests) > 1 else 0.0
            return [(np.arange(k, dtype=np.int64), np.full(k, 0.5 + last_bit, np.float32)) for _ in requests]

    out = batch_against_lone(Steady(), ["a", "b"], 3, 2)
    assert out["requests"] == 2 and out["pool_ads"] == 10 and out["batch_ms"] > 0 and out["lone_ms"] > 0
