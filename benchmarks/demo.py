"""`andromeda demo`: the migration from remote scoring to co-location, in five measured steps.

On a built-in default corpus (generated, seeded), on this machine:

1. Find the bottleneck: where a request's time and bytes go in the remote-scoring design.
2. The byte budget: bytes per candidate through device memory (fused vs unfused), bytes per request
   on the network (remote vs co-located), counted from the data layout.
3. One tower versus experts: retrieval quality (recall@100 on data with known truth) and the
   scoring speed of the plain dot product against the gated mixture of experts on the same bytes.
4. Co-location and its traffic: both architectures as real Flight services on 127.0.0.1, proven to
   give the same answers, with the bytes on the wire counted by relays.
5. The fused kernel and int8: one pass over the stored bytes against separate array operations that
   materialize every intermediate, at each precision.

Then a side-by-side table of both architectures. Every fast path is checked against the float64
reference before it is timed. Uses the GPU where one is usable, else the CPU (the same per-ad
formula compiled by numba).
"""

from __future__ import annotations

import math
import tempfile
import time

import numpy as np

from andromeda_nb.measure import spread_of, timed_runs
from andromeda_nb.numbers import rate, spread_summary
from andromeda_nb.progress import Say

DEFAULT_ADS = 50_000
DEFAULT_REQUESTS = 12
DEFAULT_K = 100
CPU_KERNEL_ROWS = 1 << 20  # ads per timed CPU scoring pass (a 256 MB fp32 table: well past the caches)
GPU_KERNEL_ADS = 1 << 24
ELIGIBLE_SHARE = 0.08  # a request's match leaves 2% to 14% of a pool eligible (median 4.3% on the generated corpus)
CHECK_ROWS = 2000
REPEAT = 5

Echo = Say  # one line of the demo's output (andromeda_nb.progress)


class DemoError(RuntimeError):
    """A fast path disagreed with the reference: the demo stops rather than time a wrong answer."""


def _timed(rows: int, fn, repeat: int = REPEAT) -> dict:
    """`rows` / seconds of `repeat` calls after one untimed call: {"ads_per_s": the median, "runs": its
    spread}, so the report can say how much the figure moved between runs."""
    per_s = [rows / t for t in timed_runs(fn, repeat, warmup=1)]
    return {"ads_per_s": float(np.median(per_s)), "runs": spread_of(per_s)}


# --- kernel measurements ----------------------------------------------------------------------------------


def cpu_kernels(dataset, seed: int, rows: int = CPU_KERNEL_ROWS, log: Echo = lambda m: None) -> dict:
    """Fused (numba, per-ad formula) vs unfused (numpy array ops) vs two-tower dot, on the CPU."""
    from andromeda_nb.budget import stored_ad_bytes
    from andromeda_nb.model import quantize, two_tower_vector, user_side
    from andromeda_nb.reference import reference_scores, two_tower_scores
    from andromeda_nb.scoring import fold_user_side
    from andromeda_nb.unfused import unfused_scores
    from cpu_baseline.scorer import CpuScorer

    from .cpu import measure_copy_bandwidth

    model = dataset.model
    rng = np.random.default_rng(seed)
    emb = (rng.standard_normal((rows, model.D), np.float32) / math.sqrt(model.D)).astype(np.float32)
    formats = rng.integers(0, model.F, rows).astype(np.int16)
    request = dataset.requests[0]
    us = user_side(model, request)
    tab = fold_user_side(us)
    u = two_tower_vector(model, request)
    all_rows = np.arange(rows, dtype=np.int64)
    sample = rng.choice(rows, CHECK_ROWS, replace=False)
    log(f"measuring memory bandwidth and the scoring kernels on {rows:,} random ads")
    copy = measure_copy_bandwidth(repeat=3, nbytes=256 << 20)
    out: dict = {"device": "cpu", "rows": rows, "copy_GBps": copy["ceiling_GBps"], "fused": {}, "unfused": {},
                 "dot": {}, "compare_precision": "fp32"}
    for precision in ("fp32", "fp16", "int8"):
        table = quantize(emb, precision)
        scorer = CpuScorer.from_table(table, formats, model.top_k)
        lo, hi = reference_scores(model, us, table, sample, formats[sample]).bounds()
        got = scorer.score(sample, tab)
        if np.any(got < lo - 1e-4) or np.any(got > hi + 1e-4):
            raise DemoError(f"CPU fused scorer ({precision}) disagrees with the float64 reference")
        fused = _timed(rows, lambda: scorer.score(all_rows, tab))
        nbytes = stored_ad_bytes(precision, model.D)
        out["fused"][precision] = {**fused, "GBps": fused["ads_per_s"] * nbytes / 1e9}
        values, scale = table.values, table.scale

        def unfused():
            s, _ = unfused_scores(np, values, scale, formats, us, model.top_k, "moe", dtype=np.float32)
            return np.argpartition(-s, DEFAULT_K - 1)[:DEFAULT_K]

        out["unfused"][precision] = _timed(rows, unfused, repeat=2)
        if precision == "fp32":
            f32 = table.values
            dot_ref = two_tower_scores(u, table, sample)
            if np.max(np.abs(f32[sample] @ u.astype(np.float32) - dot_ref)) > 1e-4:
                raise DemoError("CPU dot product disagrees with the float64 reference")
            u32 = u.astype(np.float32)
            dot = _timed(rows, lambda: f32 @ u32)
            out["dot"]["fp32"] = {**dot, "GBps": dot["ads_per_s"] * nbytes / 1e9}
        log(f"  {precision}: fused {rate(out['fused'][precision]['ads_per_s'], 'ads/s')}, "
            f"unfused {rate(out['unfused'][precision]['ads_per_s'], 'ads/s')}")
    return out


def gpu_kernels(seed: int, log: Echo = lambda m: None) -> dict:
    """The fused GPU kernels (the shipped version) and the unfused CuPy pipeline, from `benchmarks.score`."""
    from gpu.kernels import score as sk

    from .score import bench_score

    moe_v = sk.version(None, "moe", "fp16", 64).number  # the tensor-core kernel where the device has them
    dot_v = sk.version(None, "dot", "fp16", 64).number
    res = bench_score(n_ads=GPU_KERNEL_ADS, dims=(64,), precisions=("fp16", "int8"), kinds=("moe", "dot"),
                      versions=sorted({moe_v, dot_v}), versions_of_kind={"moe": [moe_v], "dot": [dot_v]},
                      seed=seed, unfused=True, peers=False,
                      eligible=(1.0, ELIGIBLE_SHARE), progress=False)
    if not res.get("checks_ok", False):
        raise DemoError("a GPU kernel disagreed with the float64 reference")
    out: dict = {"device": res["env"].get("device", "gpu"), "rows": res["n_ads"],
                 "copy_GBps": res["copy_bandwidth_Bps"] / 1e9, "fused": {}, "unfused": {}, "dot": {},
                 "fused_share": {}, "eligible_share": ELIGIBLE_SHARE, "compare_precision": "fp16"}
    for row in res["runs"]:
        if (row["kind"], row["version"]) not in (("moe", moe_v), ("dot", dot_v)):
            continue
        entry = {"ads_per_s": row["ads_per_s"], "copy_fraction": row.get("copy_fraction"), "version": row["version"]}
        if row.get("eligible", 1.0) < 1.0:
            if row["kind"] == "moe":
                out["fused_share"][row["precision"]] = entry
            continue
        out["fused" if row["kind"] == "moe" else "dot"][row["precision"]] = entry
    for row in res["unfused"]:
        out["unfused"][row["precision"]] = {"ads_per_s": row["ads_per_s"]}
    return out


def wire_bytes_text(report: dict, arch: str) -> str:
    """'43,616 bytes on the wire': one request's bytes over every hop of `arch`, as step 4 and the
    side-by-side table give them (step 1 splits the same figure by hop)."""
    return f"{report['bytes_per_request'][arch]:,.0f} bytes on the wire"


def precision_line(kernels: dict, dim: int) -> str:
    """The fused kernel's int8 rate against its fp16 rate, said as what it is: a ratio of ads per
    second (above 1: int8 is faster), beside the bytes each reads per ad."""
    from andromeda_nb.budget import stored_ad_bytes

    int8, fp16 = kernels["fused"]["int8"]["ads_per_s"], kernels["fused"]["fp16"]["ads_per_s"]
    return (f"   int8 against fp16, fused: {int8 / fp16:.2f}x the ads per second (above 1: int8 is faster), reading "
            f"{stored_ad_bytes('int8', dim)} B of stored embedding per ad against {stored_ad_bytes('fp16', dim)} B")


def moe_against_dot(kernels: dict) -> list[str]:
    """The headline of the kernel step: the gated MoE's time against the dot product's on the same bytes.
    On a GPU the shipped kernel runs the 2E per-ad dots on the tensor cores, so the model's arithmetic
    hides under the loads; on the CPU there is no dot kernel in this step, and the lines say so."""
    moe, dot = kernels["fused"].get("fp16"), kernels.get("dot", {}).get("fp16")
    if not moe or not dot:
        return ["   (the MoE-against-dot comparison needs the GPU kernels: on a GPU the shipped kernel runs the "
                "per-ad dots on the tensor cores, so the gated MoE reads the same bytes as a dot product and "
                "should take about as long)"]
    ratio = dot["ads_per_s"] / moe["ads_per_s"]
    lines = [f"   fp16 gated MoE against the dot product on the same bytes: {ratio:.2f}x the time "
             f"(MoE {rate(moe['ads_per_s'])} ads/s, dot {rate(dot['ads_per_s'])} ads/s); the shipped kernel's "
             "12 per-ad dots run on the tensor cores, so the bytes, not the arithmetic, set its pace"]
    share = kernels.get("fused_share", {}).get("fp16")
    if share:
        lines.append(f"   with {kernels['eligible_share']:.0%} of the pool eligible, as a request's match leaves it, "
                     f"the shipped kernel reads only those ads' rows: {share['ads_per_s'] / moe['ads_per_s']:.1f}x "
                     f"the pool ads per second of the full walk ({rate(share['ads_per_s'])} pool ads/s)")
    return lines


# --- the walk ----------------------------------------------------------------------------------------------


def _rate_text(x: float) -> str:
    return rate(x)


def _with_range(figure: dict) -> str:
    """'9.24 M' with its range when it was measured more than once: '9.24 M (8.91 M to 9.40 M over 5 runs)'."""
    runs = figure.get("runs")
    return spread_summary(runs, _rate_text) if runs and runs["runs"] > 1 else _rate_text(figure["ads_per_s"])


def _requests_per_second(report: dict, arch: str) -> str:
    runs = report.get("requests_per_second_runs", {}).get(arch)
    return spread_summary(runs, _rate_text) if runs else _rate_text(report["requests_per_second"][arch])


def time_verdict(report: dict) -> str:
    """What the requests/s of the two designs say, by the demo's own rule: a difference counts only
    when the ranges of the timed runs do not overlap; otherwise it is within this machine's noise."""
    runs = report.get("requests_per_second_runs") or {}
    co, remote = runs.get("colocated"), runs.get("remote")
    if not co or not remote or min(co["runs"], remote["runs"]) < 2:
        return ("one timed run each cannot tell a difference from this machine's noise (compare --runs 3 "
                "gives ranges to compare).")
    if co["min"] > remote["max"]:
        return "one process with no candidate hop is faster even here (the ranges of the runs do not overlap)."
    if co["max"] < remote["min"]:
        return ("slower here (the ranges of the runs do not overlap), because the remote design splits each "
                "request over two processes (index host and scoring service), which on a few cores is "
                "parallelism the one co-located process lacks, while loopback makes the hop it pays for nearly "
                "free.")
    return ("the difference is within this machine's noise (the ranges of the runs overlap), so neither design "
            "is faster here.")


def cpu_explanation(report: dict, kernels: dict, cores: int) -> list[str]:
    """Why the side-by-side on a CPU looks as it does, and why co-location pays on a GPU server."""
    b = report["bytes_per_request"]
    score = kernels["fused"][kernels["compare_precision"]]["ads_per_s"]
    lines = [
        "\nWhat the CPU figures show",
        f"   Both designs ran on the same {cores} CPU core(s), so the table shows what co-location saves in bytes, "
        "not what it saves in time:",
        f"   * bytes: the co-located server sent {b['colocated']:,.0f} B per request where the remote design sent "
        f"{b['remote']:,.0f} B ({report['traffic_reduction']:.1f}x); on loopback those bytes cost little, across "
        "a network they cost transfer time on every request.",
        f"   * time: co-located answered {_requests_per_second(report, 'colocated')} requests/s against remote's "
        f"{_requests_per_second(report, 'remote')}: " + time_verdict(report),
        f"   Either way the per-ad formula runs at the CPU's scoring rate ({rate(score, 'ads/s')}, step 5), "
        "the same in both designs.",
        "   Co-location pays on a GPU server: there matching and scoring the whole pool run at memory bandwidth, "
        "billions of pool ads per second (docs/BENCHMARKS.md has the H100 figures), so what is left of a "
        "request's time is the network hop and the candidate list the remote design must ship, which "
        "co-location removes.",
        "   Timings on a shared machine move between runs (another process on the same cores can slow one run "
        "several times over): each rate above is the median of its runs with the range beside it; trust a "
        "difference between medians only when the ranges do not overlap.",
    ]
    return lines


def colocation_over_gpu_scoring(report: dict) -> list[str]:
    """Step 4's second half: with the remote design's scorer on a GPU beside the co-located server on
    the same machine (compare's third column), what the GPU buys and what co-location adds on top of
    it, in this run's figures. Without a GPU the lines say where the column comes from."""
    gpu = next((n for n in report.get("architectures", []) if n.startswith("remote_")), None)
    if gpu is None or report[gpu]["device"] != "gpu":
        return ["   (no GPU here: where one is usable, this step also runs the remote design with its scorer on "
                "the GPU, to tell what the GPU buys from what co-location adds)"]
    q, lat, b = report["requests_per_second"], report["latency_ms"], report["bytes_per_request"]
    cpu = report.get("host_cpu_ms_per_request") or {}
    busy = report.get("gpu_busy_fraction") or {}

    def p50(n: str) -> str:
        return f"{lat[n]['p50']:.2f} ms" if lat.get(n) else "n/a"

    lines = [
        f"   the 2024 design, scorer on this GPU: {rate(q[gpu])} requests/s, p50 {p50(gpu)}; with the CPU scorer "
        f"{rate(q['remote'])} requests/s, p50 {p50('remote')}: the GPU scorer buys {q[gpu] / q['remote']:.2f}x",
        f"   co-located on the same GPU: {rate(q['colocated'])} requests/s, p50 {p50('colocated')}: co-location adds "
        f"{q['colocated'] / q[gpu]:.1f}x the requests per second and {b[gpu] / max(1.0, b['colocated']):.0f}x fewer "
        f"bytes on top of GPU scoring",
    ]
    if cpu.get(gpu) and cpu.get("colocated"):
        lines.append(f"   host CPU per request: {sum(cpu[gpu].values()):.2f} ms for the remote design (match and "
                     f"top-K on the index host) against {sum(cpu['colocated'].values()):.2f} ms co-located")
    if busy.get(gpu) and busy.get("colocated"):
        lines.append(f"   GPU busy in the timed runs: {100 * sum(busy[gpu].values()):.1f}% behind the remote design, "
                     f"{100 * sum(busy['colocated'].values()):.1f}% co-located: the rest of a request's time is host "
                     f"work and hops")
    return lines


STAGE_REQUESTS = 4  # requests whose stages are timed, each STAGE_REPEAT times after a warm-up
STAGE_REPEAT = 3
STAGE_NAMES = {"user_side": "user side", "match_preparation": "match preparation", "match": "match",
               "scoring_and_topk": "scoring and top-K", "scoring": "scoring", "topk": "top-K", "answers": "answers back"}


def colocated_stages(dataset, device: str, k: int) -> dict:
    """`andromeda_nb.engine.stage_breakdown` of the co-located engine for `device`, in process."""
    from andromeda_nb.engine import stage_breakdown
    from migration.architectures import build_engine

    engine = build_engine(dataset, device)
    try:
        out = {"device": engine.device, "requests": min(STAGE_REQUESTS, len(dataset.requests)),
               "repeat": STAGE_REPEAT,
               "stages": stage_breakdown(engine, dataset.requests[:STAGE_REQUESTS], k, repeat=STAGE_REPEAT)}
        launches = lone_request_launches(engine, dataset.requests[:STAGE_REQUESTS], k, STAGE_REPEAT)
        if launches:
            out["launches"] = launches
        out["batch"] = batch_against_lone(engine, dataset.requests, k, STAGE_REPEAT)
        return out
    finally:
        engine.close()


def lone_request_launches(engine, requests, k: int, repeat: int) -> dict | None:
    """On the GPU engine: a lone request's wall time (median microseconds) with its batch's plan replayed
    from CUDA graphs and enqueued step by step (`gpu.pipeline`), the requests alternating between the
    two after each was seen three times (captured). None elsewhere (no launches to compare)."""
    pipe = getattr(engine, "pipeline", None)
    if engine.device != "gpu" or pipe is None or pipe.graphs is None or not requests:
        return None
    graphs = pipe.graphs
    times: dict[str, list[float]] = {"graph": [], "direct": []}
    try:
        for r in requests:
            for _ in range(3):
                engine.retrieve([r], k)
        for _ in range(repeat):
            for r in requests:
                for mode, samples in times.items():
                    pipe.graphs = graphs if mode == "graph" else None
                    t = time.perf_counter()
                    engine.retrieve([r], k)
                    samples.append((time.perf_counter() - t) * 1e6)
    finally:
        pipe.graphs = graphs
    return {mode: float(np.median(v)) for mode, v in times.items()}


def batch_against_lone(engine, requests, k: int, repeat: int) -> dict:
    """The whole request list as one batch against the same requests one at a time, on the co-located
    engine in process: the median wall time of each (ms), alternated `repeat` times after a warm-up of
    each, and both answers held to each other first (a batch must not change a request's answer: the
    same ads in the same order, scores within the reference tolerance SCORE_ATOL, since a batch's user
    side may be summed in another order than a lone request's)."""
    from andromeda_nb.constants import SCORE_ATOL

    requests = list(requests)
    batch = engine.retrieve(requests, k)
    lone = [engine.retrieve([r], k)[0] for r in requests]
    for b, (got, want) in enumerate(zip(batch, lone)):
        if not (np.array_equal(got[0], want[0])
                and np.allclose(got[1], want[1], rtol=0.0, atol=SCORE_ATOL)):
            raise DemoError(f"request {b} answered differently in a batch of {len(requests)} than alone")
    times: dict[str, list[float]] = {"batch": [], "lone": []}
    for _ in range(repeat):
        t = time.perf_counter()
        engine.retrieve(requests, k)
        times["batch"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for r in requests:
            engine.retrieve([r], k)
        times["lone"].append(time.perf_counter() - t)
    out = {"requests": len(requests), "repeat": repeat, "pool_ads": len(engine)}
    out.update({f"{name}_ms": float(np.median(v)) * 1e3 for name, v in times.items()})
    return out


def batch_line(stages: dict) -> str | None:
    """Step 5's line on the batched pass: the request list in one batch against one at a time."""
    b = stages.get("batch")
    if not b:
        return None
    pool_rate = b["requests"] * b["pool_ads"] / (b["batch_ms"] / 1e3)
    return (f"   the batched pass ({stages['device']} engine, in process): {b['requests']} requests in one batch "
            f"{b['batch_ms']:,.2f} ms, one at a time {b['lone_ms']:,.2f} ms ({b['lone_ms'] / b['batch_ms']:.1f}x; "
            f"{rate(pool_rate, 'pool ads/s')} batched); the same answers either way. "
            + ("On the GPU a batch's match reads the pool once for each group of 64 requests, and one scoring "
               "launch walks every request's eligible ads, an ad's row read from device memory once and from "
               "L2 by the requests after" if stages["device"] == "gpu" else
               "The CPU engine matches and scores a batch request by request: "
               "a batch saves per-call work, not reads of the pool"))


def stage_lines(stages: dict) -> list[str]:
    """Where one co-located request's time goes, stage by stage, in microseconds and bytes."""
    rows = stages.get("stages") or {}
    if not rows:
        return []
    parts = []
    for name, row in rows.items():
        text = f"{STAGE_NAMES.get(name, name)} {row['us']:,.0f} us"
        extra = []
        if "eligible" in row:
            extra.append(f"{row['eligible']:,.0f} eligible ads")
        if "bytes" in row:
            extra.append(f"{row['bytes'] / 1e3:,.1f} KB")
        parts.append(text + (f" ({', '.join(extra)})" if extra else ""))
    total = sum(row["us"] for row in rows.values())
    lines = [f"   where one co-located request's time goes ({stages['device']} engine, in process, median of "
             f"{stages['requests']} requests x {stages['repeat']}, each stage waited for): " + "; ".join(parts)
             + f"; {total:,.0f} us in all"]
    if launches := stages.get("launches"):
        lines.append(f"   a lone request end to end: {launches['graph']:,.0f} us with its batch replayed from CUDA "
                     f"graphs, {launches['direct']:,.0f} us with every kernel launched and copy made from Python "
                     f"(a numba launch costs tens of microseconds of host time; a graph is one driver call), the "
                     f"user side computed while the device matches")
    return lines


def run_demo(n_ads: int = DEFAULT_ADS, n_requests: int = DEFAULT_REQUESTS, seed: int = 0, k: int = DEFAULT_K,
             device: str = "auto", echo: Echo = print, log: Echo = lambda m: None,
             kernel_rows: int = CPU_KERNEL_ROWS) -> dict:
    """Run the five steps; `echo` gets the report, `log` progress. Returns every figure (JSON-ready)."""
    from andromeda_nb import corpus
    from andromeda_nb.budget import stored_ad_bytes
    from andromeda_nb.devices import resolve
    from andromeda_nb.quality import QualityConfig, run_quality
    from andromeda_nb.store import load_dataset
    from migration.budget import build_budget
    from migration.harness import run_comparison

    # 'gpu' when one is usable, else compiled CPU code (said once on stderr); the simulator only when
    # asked for
    where = resolve(device)
    kernel_device = "gpu" if where == "gpu" else "cpu"
    with tempfile.TemporaryDirectory(prefix="andromeda-demo-") as tmp:
        t0 = time.perf_counter()
        corpus.generate_corpus(tmp, n_ads, n_requests, seed)
        dataset = load_dataset(tmp)
        log(f"corpus: {n_ads:,} ads and {n_requests} requests generated and loaded in {time.perf_counter() - t0:.1f} s")
        report = run_comparison(dataset, k=k, device=device, oracle_requests=None,
                                traffic_requests=min(8, n_requests), log=log)
        stages = colocated_stages(dataset, device, k)
    kernels = gpu_kernels(seed, log) if kernel_device == "gpu" else cpu_kernels(dataset, seed, kernel_rows, log=log)
    log("training the two-tower and the mixture of experts on synthetic clicks (quality --small)")
    quality = run_quality(QualityConfig.small(seed))
    budget = build_budget(dataset, k=k)
    m = dataset.model
    e = report["eligibility"]
    figures = {"ads": n_ads, "requests": n_requests, "k": k, "seed": seed, "device": where,
               "compare": report, "kernels": kernels, "budget": budget, "stages": stages,
               "quality": {"recall": quality.recall, "flops_per_ad": quality.flops_per_ad}}

    echo(f"andromeda demo: {n_ads:,} ads, {n_requests} requests, K = {k}, seed {seed}; "
         f"D = {m.D}, E = {m.E} experts, top-{m.top_k} routing; running on: {where}")
    echo(f"each request finds {e['eligible_mean']:,.0f} eligible ads on average "
         f"({100 * e['eligible_fraction_mean']:.1f}% of the pool)")

    # 1 -------------------------------------------------------------------------------------------------
    echo("\n1. Find the bottleneck (remote scoring: CPU index host, separate scoring service)")
    per_req = report["latency_ms"]["remote"]["p50"] / 1e3
    match_s = e["match_seconds"]["cpu"] / n_requests
    cp = kernels["compare_precision"]
    ref = kernels["fused"][cp]
    score_rate = ref["ads_per_s"] if kernel_device == "cpu" else None
    hop = report["bytes_per_hop"]["remote"]
    echo(f"   a request takes {per_req * 1e3:.2f} ms end to end (median, one request at a time); the CPU index "
         f"matches one in {match_s * 1e3:.2f} ms (the mean over all {n_requests}, matched apart from the service)")
    if score_rate:
        score_s = e["eligible_mean"] / score_rate
        rest = per_req - match_s - score_s
        echo(f"   scoring its {e['eligible_mean']:,.0f} candidates takes {score_s * 1e3:.2f} ms at "
             f"{rate(score_rate, 'ads/s')}"
             + (f"; the other {rest * 1e3:.1f} ms ({100 * rest / per_req:.0f}%) go to moving candidate lists and "
                "scores between processes and to top-K" if rest > 0 else
                "; matching and scoring alone take as long as the whole request here (they were timed apart from "
                "it, on a busy machine the figures do not add up)"))
    echo(f"   {wire_bytes_text(report, 'remote')} per request, counted by relays: "
         f"{hop.get('index host->scorer', 0):,.0f} between index host and scorer, "
         f"{hop.get('client->index host', 0):,.0f} between client and index host")
    read_GBps = ref["ads_per_s"] * stored_ad_bytes(cp, m.D) / 1e9
    echo(f"   the {kernels['device']} scoring kernel ({cp}) reads {read_GBps:,.1f} GB/s of embeddings against "
         f"{kernels['copy_GBps']:,.1f} GB/s of measured copy bandwidth (read + write); every candidate costs its "
         f"stored bytes, so the budget of step 2 decides how many ads fit in a request")

    # 2 -------------------------------------------------------------------------------------------------
    echo("\n2. The byte budget per candidate")
    for row in budget["device"]:
        echo(f"   {row['precision']}: fused kernel {row['fused_bytes_per_ad']:.0f} B/ad, unfused pipeline "
             f"{row['unfused_bytes_per_ad']:.0f} B/ad ({row['unfused_over_fused']:.1f}x)")
    net = budget["network"]["payload"]
    remote = sum(d["upstream"] + d["downstream"] for d in net["remote"].values())
    colo = sum(d["upstream"] + d["downstream"] for d in net["colocated"].values())
    echo(f"   network payload per request, counted from the data layout (the fields alone, without Arrow and "
         f"gRPC framing): remote {remote:,.0f} B (the candidate list and its scores), co-located {colo:,.0f} B "
         f"(user features in, top-{k} out); with framing, on the wire: step 4")

    # 3 -------------------------------------------------------------------------------------------------
    echo("\n3. One tower versus experts")
    r = quality.recall
    echo(f"   recall@100 on multi-interest users: two-tower {r['two_tower']:.3f}, MoE k=1 {r['moe_k1']:.3f}, "
         f"k=2 {r['moe_k2']:.3f}, k=4 {r['moe_k4']:.3f}, dense {r['dense']:.3f} (quality --small)")
    f = quality.flops_per_ad
    echo(f"   FLOPs per ad: two-tower {f['two_tower']}, MoE k=2 {f['moe_k2']} ({f['moe_k2'] / f['two_tower']:.0f}x), "
         f"same stored bytes per ad")
    dot = kernels["dot"].get(cp)
    if dot:
        echo(f"   scoring speed, {cp}, same bytes per ad: dot product {rate(dot['ads_per_s'], 'ads/s')}, gated MoE "
             f"{rate(ref['ads_per_s'], 'ads/s')} (MoE time {dot['ads_per_s'] / ref['ads_per_s']:.2f}x the dot's)")

    # 4 -------------------------------------------------------------------------------------------------
    echo("\n4. Co-location and its traffic")
    ok = report["eligible_equal"] and report["scores_equal"] and report["topk_equal"]
    echo(f"   same answers: eligible sets {'equal' if report['eligible_equal'] else 'DIFFERENT'}, scores "
         f"{'equal' if report['scores_equal'] else 'DIFFERENT'}, top-{k} {'equal' if report['topk_equal'] else 'DIFFERENT'}"
         f" (oracle and float64 reference, DESIGN section 4)")
    b = report["bytes_per_request"]
    echo(f"   bytes on the wire per request, every hop, counted by relays: remote {b['remote']:,.0f} (step 1), "
         f"co-located {b['colocated']:,.0f}: {report['traffic_reduction']:.1f}x less (grows with the eligible pool: "
         f"the remote design ships every candidate)")
    for line in colocation_over_gpu_scoring(report):
        echo(line)
    for line in stage_lines(stages):
        echo(line)

    # 5 -------------------------------------------------------------------------------------------------
    echo(f"\n5. The fused kernel and int8 ({kernels['device']}, {kernels['rows']:,} ads per pass)")
    for precision in ("fp32", "fp16", "int8"):
        if precision not in kernels["fused"]:
            continue
        fu, un = kernels["fused"][precision], kernels["unfused"].get(precision)
        line = f"   {precision}: fused {_with_range(fu)} ads/s"
        if un:
            line += f", unfused {_with_range(un)} ads/s ({fu['ads_per_s'] / un['ads_per_s']:.1f}x)"
        if fu.get("copy_fraction") is not None:
            line += f", {100 * fu['copy_fraction']:.0f}% of copy bandwidth"
        echo(line)
    echo(precision_line(kernels, m.D))
    for line in moe_against_dot(kernels):
        echo(line)
    if line := batch_line(stages):
        echo(line)

    # side by side ---------------------------------------------------------------------------------------
    echo("\nSide by side")
    archs = report.get("architectures") or ["remote", "colocated"]
    server = f"one {'GPU' if where == 'gpu' else where.upper()} server"
    titles = {"remote": "remote, CPU scorer", "colocated": "co-located"}
    places = {"remote": "CPU index host + CPU scorer", "colocated": server}
    for name in archs:
        if name.startswith("remote_"):
            titles[name] = f"remote, {report[name]['device'].upper()} scorer"
            places[name] = f"CPU index host + {report[name]['device'].upper()} scorer"
    rows = [
        ("where it runs", [places[n] for n in archs]),
        ("answers vs reference", ["equal" if report[n]["topk"]["ok"] else "DIFFERENT" for n in archs]),
        ("bytes on the wire / request", [f"{b[n]:,.0f}" for n in archs]),
        ("requests / second", [_requests_per_second(report, n) for n in archs]),
        ("pool ads / second", [rate(report["pool_ads_per_second"][n]) for n in archs]),
    ]
    W = 34 if len(archs) < 3 else 30
    echo(f"   {'':<30}" + "".join(f"{titles[n]:>{W}}" for n in archs))
    for name, cells in rows:
        echo(f"   {name:<30}" + "".join(f"{c:>{W}}" for c in cells))
    if where != "gpu":
        import os

        for line in cpu_explanation(report, kernels, os.cpu_count() or 1):
            echo(line)
    if not ok:
        raise DemoError("the two architectures disagree: see the comparison above")
    return figures

