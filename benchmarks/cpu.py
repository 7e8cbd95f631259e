"""`andromeda bench cpu`: the remote-scoring baseline measured (DESIGN section 7).

* memory bandwidth ceiling: a large array copy (numpy, and a numba `prange` copy over all threads),
  bytes read + written / time, median of repeats; the higher of the two is the ceiling;
* CPU match: the inverted index over a generated corpus, pool ads per second
  (requests x pool size / time) with every core matching;
* CPU scorer: every version of `cpu_baseline.scorer.VERSIONS`, per precision, over one candidate
  list holding every row of a table several times larger than the last-level cache: ads per second
  and GB/s (wall clock, all threads), where bytes = stored ad bytes + 4 (candidate row in) + 4
  (score out) per ad; and the single-thread CPU time per ad (process CPU time, which other
  processes on a shared machine do not inflate);
* end to end over Flight: both services started as processes on loopback, one request per
  exchange (latency p50 / p99, requests per second), then batches of 64 (requests per second);
  and, through counting relays, the real bytes per request on each hop.

The benchmark checks exactly what it times: the scorer's outputs of the full-size parallel call and
of the serial driver, at CHECK_ROWS rows spread over the table, against the float64 reference
(routing ties accepted either way); every answer of the timed match calls (the whole batch, and the
requests one at a time) against `andromeda_nb.oracle`'s eligible sets; every answer of the timed
end-to-end calls (one request per exchange, the batches, the relayed run) against the float64
reference over the oracle's eligible sets, by DESIGN section 4's tie-aware top-K rule
(`andromeda_nb.compare.compare_topk`). `checks` holds each entry point's counts
(`benchmarks.checks`) and `checks_ok` whether all passed.
"""

from __future__ import annotations

import os
import tempfile
import time

import numba
import numpy as np

from andromeda_nb import jitcache
from andromeda_nb.measure import copy_bandwidth, log as progress_log, median_seconds, package_version, software
from andromeda_nb.constants import SCORE_ATOL
from andromeda_nb.numbers import rate
from andromeda_nb.provenance import cpu_model

jitcache.install()  # cached code is recompiled when any project source changes

COPY_BYTES = 512 << 20  # per array of the bandwidth copy
LLC_BYTES_FLOOR = 32 << 20  # tables are sized well above this (the L3 of common server parts)


@numba.njit(parallel=True, cache=True)
def _parallel_copy(src, dst):
    n = src.shape[0]
    blocks = 64
    step = (n + blocks - 1) // blocks
    for b in numba.prange(blocks):
        lo = b * step
        hi = min(n, lo + step)
        dst[lo:hi] = src[lo:hi]


def measure_copy_bandwidth(repeat: int = 5, nbytes: int = COPY_BYTES) -> dict:
    src = np.arange(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    numpy_s = median_seconds(lambda: np.copyto(dst, src), repeat, warmup=1)
    numba_s = median_seconds(lambda: _parallel_copy(src, dst), repeat, warmup=1)
    out = {"bytes_per_copy": 2 * src.nbytes, "numpy_GBps": copy_bandwidth(src.nbytes, numpy_s) / 1e9,
           "parallel_GBps": copy_bandwidth(src.nbytes, numba_s) / 1e9}
    out["ceiling_GBps"] = max(out["numpy_GBps"], out["parallel_GBps"])
    return out


CHECK_ROWS = 20_000  # rows of every timed output checked against the float64 reference


def _serial(serial, scorer, rows, tab, model, out):
    serial(scorer._values, scorer._scale, scorer._formats, rows, tab, model.E, model.top_k, out)
    return out


def bench_scorer(n_rows: int, precisions, repeat: int, seed: int, log) -> list[dict]:
    from andromeda_nb.model import MoeModel, quantize, user_side
    from andromeda_nb.reference import reference_scores
    from andromeda_nb.scoring import fold_user_side
    from andromeda_nb.random_specs import random_requests

    from cpu_baseline.lab.scorer import VERSIONS
    from cpu_baseline.scorer import SHIPPED, CpuScorer

    rng = np.random.default_rng(seed)
    model = MoeModel.init(seed)
    formats = rng.integers(0, model.F, n_rows).astype(np.int16)
    request = random_requests(rng, 1)[0]
    us = user_side(model, request)
    tab = fold_user_side(us)
    rows = np.arange(n_rows, dtype=np.int32)
    emb = np.empty((n_rows, model.D), np.float32)
    for lo in range(0, n_rows, 1 << 18):  # never zeros: N(0, 1/D) entries
        emb[lo : lo + (1 << 18)] = rng.standard_normal((min(1 << 18, n_rows - lo), model.D), np.float32) / 8.0
    results = []
    for precision in precisions:
        table = quantize(emb, precision)
        # checked on exactly what is timed: the full-size calls' outputs, at a spread sample of rows
        sample = np.sort(rng.choice(n_rows, min(n_rows, CHECK_ROWS), replace=False))
        ref = reference_scores(model, us, table, sample, formats[sample])
        lo_b, hi_b = ref.bounds()
        for version in VERSIONS:
            scorer = CpuScorer.from_table(table, formats, model.top_k, version=VERSIONS[version])
            serial = scorer.drivers.serial
            out = np.empty(n_rows, np.float32)
            err = 0.0
            for name, got in (("parallel", scorer.score(rows, tab)),  # the timed call, also the warm-up
                              ("serial", _serial(serial, scorer, rows, tab, model, out))):
                err = max(err, float(np.max(np.maximum(lo_b - got[sample], got[sample] - hi_b).clip(0))))
                if err > SCORE_ATOL:
                    raise AssertionError(f"scorer v{version} {precision} ({name} path, {n_rows:,} rows): "
                                         f"error {err} vs the reference")
            seconds = median_seconds(lambda: scorer.score(rows, tab), repeat)
            moved = n_rows * (scorer.bytes_per_row + 4 + 4)
            cpu_s = median_seconds(lambda: _serial(serial, scorer, rows, tab, model, out), max(1, repeat // 2),
                                   clock=time.process_time)
            results.append({
                "check": {"rows_checked": int(len(sample)), "paths": ["parallel", "serial"], "ok": True,
                          "max_abs_err": err},
                "cpu_ns_per_ad_one_thread": cpu_s / n_rows * 1e9,
                "precision": precision, "version": version, "shipped": version == SHIPPED,
                "ads": n_rows, "table_bytes": n_rows * scorer.bytes_per_row, "seconds": seconds,
                "ads_per_s": n_rows / seconds, "GBps": moved / seconds / 1e9, "max_error": err,
            })
            log(f"  scorer v{version} {precision}: {n_rows / seconds / 1e6:.1f} M ads/s, "
                f"{moved / seconds / 1e9:.2f} GB/s")
        del table
    return results


def _corpus(n_ads: int, n_requests: int, seed: int, precision: str, log):
    from andromeda_nb.corpus import generate_corpus
    from andromeda_nb.store import load_dataset

    tmp = tempfile.TemporaryDirectory(prefix="andromeda-bench-")
    t = time.perf_counter()
    generate_corpus(tmp.name, n_ads, n_requests, seed, precision=precision)
    dataset = load_dataset(tmp.name)
    log(f"  corpus: {n_ads} ads, {n_requests} requests, {precision} ({time.perf_counter() - t:.1f} s)")
    return tmp, dataset


def oracle_sets(dataset, requests) -> list[np.ndarray]:
    """The oracle's eligible ad ids of each request (`andromeda_nb.oracle.match_corpus`, one process
    per core over a corpus read from a directory)."""
    from andromeda_nb.oracle import match_corpus

    return match_corpus(dataset, requests, workers=os.cpu_count() or 1)


def _no_scores(answers):
    return [(ids, np.empty(0, np.float32)) for ids in answers]


def bench_match(dataset, repeat: int, log, oracle: list | None = None) -> dict:
    """The CPU index's pool ads/s, every timed call's answers then checked against the oracle's sets
    (`oracle`: given, or computed here)."""
    from cpu_baseline.index import CpuTargetingIndex

    from .checks import TimedAnswers

    t = time.perf_counter()
    compiled = getattr(dataset, "compiled", None)  # a stored corpus holds its targeting compiled
    index = CpuTargetingIndex(compiled) if compiled is not None else CpuTargetingIndex.build(dataset.ads)
    build_s = time.perf_counter() - t
    requests = dataset.requests
    matched = index.match(requests)  # warm-up
    timed, lone = [], []
    seconds = median_seconds(lambda: timed.append(index.match(requests)), repeat)
    n_lone = min(16, len(requests))
    single = median_seconds(lambda: lone.append([index.match([r])[0] for r in requests[:n_lone]]),
                            max(1, repeat // 2)) / n_lone
    eligible = np.array([len(m) for m in matched], np.float64)
    pool = len(index)
    out = {
        "pool_ads": pool, "requests": len(requests), "threads": index.threads, "build_s": build_s,
        "seconds": seconds, "pool_ads_per_s": pool * len(requests) / seconds,
        "single_request_ms": single * 1e3,
        "eligible_mean": float(eligible.mean()) if len(eligible) else 0.0,
        "eligible_fraction": float(eligible.mean() / pool) if pool and len(eligible) else 0.0,
        "index": index.describe(),
    }
    index.close()
    sets = oracle if oracle is not None else oracle_sets(dataset, requests)
    answers = TimedAnswers()
    for got in timed:
        answers.add("match/batch", range(len(requests)), _no_scores(got))
    for got in lone:
        answers.add("match/one_request", range(n_lone), _no_scores(got))

    def check_one(key, ids, _scores):
        want = sets[key]
        if np.array_equal(ids, want):
            return True, 0.0, ""
        return False, 0.0, f"{len(ids)} eligible ads, the oracle {len(want)}"

    out["checks"] = answers.check(check_one)
    log(f"  match: {out['pool_ads_per_s'] / 1e6:.1f} M pool ads/s, {out['eligible_mean']:.0f} eligible per request; "
        f"timed answers vs oracle: {'ok' if answers.ok else 'FAILED'}")
    return out


def bench_end_to_end(dataset, data_dir: str, k: int, repeat: int, log, oracle: list | None = None) -> dict:
    """The remote design over Flight, every timed call's answers then checked against the float64
    reference over the oracle's eligible sets (`oracle`: given, or computed here)."""
    from andromeda_nb.reference import ReferenceRetriever

    from cpu_baseline.remote import RemoteRetriever

    from .checks import TimedAnswers, topk_check

    requests = dataset.requests
    keys = range(len(requests))
    answers = TimedAnswers()
    out: dict = {"k": k, "requests": len(requests), "precision": dataset.precision}
    with RemoteRetriever.build(dataset) as remote:
        remote.retrieve(requests[:4], k)  # warm-up: connections, caches
        latencies = []
        for _ in range(max(1, repeat // 2)):
            for i, r in enumerate(requests):
                t = time.perf_counter()
                got = remote.retrieve([r], k)
                latencies.append(time.perf_counter() - t)
                answers.add("end_to_end/one_request", [i], got)
        lat = np.asarray(latencies)
        out["latency_ms"] = {"p50": float(np.percentile(lat, 50) * 1e3), "p99": float(np.percentile(lat, 99) * 1e3),
                             "mean": float(lat.mean() * 1e3)}
        out["sequential_requests_per_s"] = float(1.0 / lat.mean())
        batched_answers = []
        batched = median_seconds(lambda: batched_answers.append(remote.retrieve(requests, k)), repeat)
        for got in batched_answers:
            answers.add("end_to_end/batch", keys, got)
        out["batched_requests_per_s"] = len(requests) / batched
        out["batched_pool_ads_per_s"] = len(requests) * len(dataset.embeddings) / batched
        out["index_host_stats"] = remote.action("stats")
    log(f"  end to end: p50 {out['latency_ms']['p50']:.2f} ms, p99 {out['latency_ms']['p99']:.2f} ms, "
        f"{out['batched_requests_per_s']:.0f} requests/s batched")
    with RemoteRetriever.build(dataset, traffic=True) as remote:
        remote.retrieve(requests[:2], k)
        got, per_request = remote.retrieve_traffic(requests, k)
        answers.add("end_to_end/relayed", keys, got)
    hops = {}
    for hop in per_request[0]:
        totals = np.array([p[hop]["total"] for p in per_request], np.float64)
        up = np.array([p[hop]["upstream"] for p in per_request], np.float64)
        down = np.array([p[hop]["downstream"] for p in per_request], np.float64)
        hops[hop] = {"mean_total": float(totals.mean()), "mean_upstream": float(up.mean()),
                     "mean_downstream": float(down.mean()), "max_total": float(totals.max())}
    out["traffic_bytes_per_request"] = hops
    log("  traffic per request: " + ", ".join(f"{h} {v['mean_total'] / 1e3:.1f} kB" for h, v in hops.items()))
    # every timed answer against the float64 reference over the oracle's eligible set
    sets = oracle if oracle is not None else oracle_sets(dataset, requests)
    reference = ReferenceRetriever(dataset.model, None, dataset.embeddings, dataset.ad_ids, dataset.formats,
                                   seed=dataset.seed)
    held: dict = {}

    def check_one(key, ids, scores):
        if held.get("key") != key:
            held.update(key=key, ref=reference.score_ids(requests[key], sets[key]))
        return topk_check(*held["ref"], ids, scores, k)

    out["checks"] = answers.check(check_one)
    log(f"  end to end answers vs the float64 reference: {'ok' if answers.ok else 'FAILED'}")
    return out


def check_tiled_answers(base, copies: int, requests, answers) -> dict:
    """The eligible ad ids a match answered for each request of a pool of `copies` copies of `base`
    (`benchmarks.tiling.tile_compiled`) against `andromeda_nb.oracle` over the base ads: copy c of an
    eligible base ad i (id i + c * stride) and nothing else, ascending."""
    from andromeda_nb.oracle import OracleIndex

    from .tiling import stride_of

    stride = stride_of(base.compiled)
    shift = np.arange(copies, dtype=np.int64)[:, None] * stride
    out = {"requests_timed": len(requests), "requests_checked": len(requests), "failed": 0}
    for request, want_base, ids in zip(requests, OracleIndex.build(base.ads).match(requests), answers):
        want = np.sort((want_base[None, :] + shift).ravel())
        if not np.array_equal(np.asarray(ids, np.int64), want):
            out["failed"] += 1
            out.setdefault("first_failure", f"request {request.request_id}: {len(ids)} eligible ads, the oracle "
                                            f"{len(want)}")
    out["ok"] = out["failed"] == 0 and len(answers) == len(requests)
    return out


def bench_tiled_match(base, pool: int, progress: bool = False) -> dict:
    """The CPU inverted index on a pool of `pool` ads tiled from a benchmark base corpus
    (`benchmarks.tiling`), the requests of the base: what `andromeda bench match` prints beside the
    GPU index."""
    from .tiling import tile_compiled

    from cpu_baseline.index import CpuTargetingIndex

    copies = max(1, pool // len(base.ads))
    ct = tile_compiled(base.compiled, copies)
    t0 = time.perf_counter()
    cpu = CpuTargetingIndex(ct)
    build_s = time.perf_counter() - t0
    reqs = list(base.requests[:64])
    cpu.match(reqs[:4])  # compile / warm
    t0 = time.perf_counter()
    got = cpu.match(reqs)
    dt = time.perf_counter() - t0
    threads = getattr(cpu, "threads", None)
    res = {"ads": len(ct), "requests": len(reqs), "seconds": dt, "pool_ads_per_s": len(reqs) * len(ct) / dt,
           "build_s": build_s, "bytes_per_ad": cpu.nbytes / len(ct) if hasattr(cpu, "nbytes") else None,
           "threads": threads, "check": check_tiled_answers(base, copies, reqs, got)}
    progress_log(progress, f"CPU index, {len(ct):,} ads: {res['pool_ads_per_s'] / 1e9:.2f} G pool ads/s "
                           f"({threads} threads; timed answers vs oracle: {'ok' if res['check']['ok'] else 'FAILED'})")
    cpu.close()
    return res


def machine_info() -> dict:
    """The environment stamp of a CPU result: the processor, threads and software versions."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "numba_threads": numba.get_num_threads(), **software(),
            "pyarrow": package_version("pyarrow"), "load_average": os.getloadavg()}


def run_cpu_bench(*, n_ads: int = 200_000, n_requests: int = 64, k: int = 100, seed: int = 1,
                  precisions=("fp32", "fp16", "int8"), e2e_precision: str = "int8", repeat: int = 5,
                  score_rows: int = 2_000_000, log=print) -> dict:
    result: dict = {"machine": machine_info(), "settings": {
        "pool_ads": n_ads, "requests": n_requests, "k": k, "seed": seed, "score_rows": score_rows,
        "repeat": repeat, "arithmetic": "float32 (default mode)"}}
    log("memory bandwidth ...")
    result["bandwidth"] = measure_copy_bandwidth(repeat)
    log(f"  copy: {result['bandwidth']['ceiling_GBps']:.1f} GB/s (read + write)")
    log("scorer ...")
    result["scorer"] = bench_scorer(score_rows, precisions, repeat, seed, log)
    for row in result["scorer"]:
        row["fraction_of_copy"] = row["GBps"] / result["bandwidth"]["ceiling_GBps"]
    log("corpus ...")
    tmp, dataset = _corpus(n_ads, n_requests, seed, e2e_precision, log)
    try:
        log("oracle ...")
        sets = oracle_sets(dataset, dataset.requests)
        log("match ...")
        result["match"] = bench_match(dataset, repeat, log, sets)
        log("end to end ...")
        result["end_to_end"] = bench_end_to_end(dataset, tmp.name, k, repeat, log, sets)
    finally:
        tmp.cleanup()
    result["machine"]["load_average_end"] = os.getloadavg()
    collect_checks(result)
    return result


def collect_checks(result: dict) -> dict:
    """`checks` (each entry point's counts) and `checks_ok` of a bench cpu result, from its parts."""
    checks = {f"scorer/v{r['version']}/{r['precision']}": r["check"] for r in result.get("scorer", [])}
    for part in ("match", "end_to_end"):
        checks.update((result.get(part) or {}).get("checks", {}))
    result["checks"] = checks
    result["checks_ok"] = bool(checks) and all(c.get("ok") for c in checks.values())
    return result


def format_table(result: dict) -> str:
    bw = result["bandwidth"]
    lines = [f"CPU baseline on {result['machine']['cpu']} ({result['machine']['cores']} cores); "
             f"copy bandwidth {bw['ceiling_GBps']:.1f} GB/s (numpy {bw['numpy_GBps']:.1f}, "
             f"parallel {bw['parallel_GBps']:.1f}); float32 arithmetic", "",
             f"{'scorer':<22}{'ads':>12}{'M ads/s':>10}{'GB/s':>8}{'of copy':>9}{'ns/ad 1 core':>14}"]
    for r in result["scorer"]:
        name = f"v{r['version']} {r['precision']}" + (" (shipped)" if r["shipped"] else "")
        lines.append(f"{name:<22}{r['ads']:>12,}{r['ads_per_s'] / 1e6:>10.1f}{r['GBps']:>8.2f}"
                     f"{r['fraction_of_copy'] * 100:>8.0f}%{r['cpu_ns_per_ad_one_thread']:>14.0f}")
    if "checks_ok" in result:
        lines += ["", f"checks (the scorer vs the float64 reference, every timed match answer vs the oracle, every "
                      f"timed end-to-end answer vs the reference): {'all passed' if result['checks_ok'] else 'FAILED: ' + ', '.join(n for n, c in result['checks'].items() if not c.get('ok'))}"]
    m = result.get("match")
    if m:
        lines += ["", f"match: pool {m['pool_ads']:,} ads x {m['requests']} requests, {m['threads']} threads: "
                  f"{rate(m['pool_ads_per_s'], 'pool ads/s')}; {m['single_request_ms']:.2f} ms per request alone; "
                  f"{m['eligible_mean']:.0f} eligible per request ({m['eligible_fraction'] * 100:.1f}%)"]
    e = result.get("end_to_end")
    if e:
        lines += [f"end to end ({e['precision']}, k={e['k']}): p50 {e['latency_ms']['p50']:.2f} ms, "
                  f"p99 {e['latency_ms']['p99']:.2f} ms, {rate(e['sequential_requests_per_s'], 'requests/s')} one at a "
                  f"time, {rate(e['batched_requests_per_s'], 'requests/s')} in batches "
                  f"({rate(e['batched_pool_ads_per_s'], 'pool ads/s')})"]
        for hop, v in e["traffic_bytes_per_request"].items():
            lines.append(f"  wire bytes per request, {hop}: {v['mean_total']:,.0f} "
                         f"(up {v['mean_upstream']:,.0f}, down {v['mean_downstream']:,.0f})")
    return "\n".join(lines)


__all__ = ["bench_end_to_end", "bench_match", "bench_tiled_match", "check_tiled_answers", "collect_checks", "format_table",
           "machine_info", "measure_copy_bandwidth", "oracle_sets", "run_cpu_bench"]
