"""The side-by-side harness (`andromeda compare`): both architectures on the same requests and the
same update stream, proven equal and measured.

What it checks (DESIGN section 4):
* eligible sets: the CPU inverted index and the GPU index against the oracle on every request (or
  the first `oracle_requests`), with the update stream applied, and against each other; the oracle
  is plain Python, run over the corpus's row groups in one process per core;
* scores and top-K: the remote-scoring and the co-located answers against the float64 reference,
  with the tie and routing rules of `andromeda_nb.compare`; the reference scores the oracle's
  eligible sets (and says so where a limit left requests to the CPU index, an index under test).

What it measures: real bytes on the wire per request and per hop (a counting relay in front of every
server, `serving.relay`), and requests per second through each architecture's Flight service.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from andromeda_nb.budget import network_payload, payload_total
from andromeda_nb.compare import compare_eligible, compare_scores, compare_topk
from andromeda_nb.constants import DEFAULT_K, SCORE_ATOL
from andromeda_nb.dataset import Dataset
from andromeda_nb.devices import resolve
from andromeda_nb.measure import spread_of
from andromeda_nb.numbers import rate
from andromeda_nb.progress import Say
from andromeda_nb.updates import LiveAds, Rejection, apply_updates, nothing_applied, read_updates
from serving.protocol import request_text
from serving.relay import Link

Log = Say  # one progress line (andromeda_nb.progress)
SIMULATOR_MAX_ADS = 20_000  # the GPU index under the CUDA simulator costs ~0.1 ms per thread


@dataclass
class ArchMeasurement:
    answers: list
    seconds: float
    traffic: list[dict]  # per request: hop -> {"upstream", "downstream", "total", ...}
    latencies: list[float] = field(default_factory=list)  # seconds, one request per exchange
    run_seconds: list[float] = field(default_factory=list)  # each timed run of all requests (`seconds`: the median)
    cpu_ms_per_request: dict = field(default_factory=dict)  # service -> host CPU ms per request in the timed runs
    gpu_busy: dict = field(default_factory=dict)  # service -> its device time / wall time of the timed runs

    def latency_ms(self) -> dict[str, float]:
        if not self.latencies:
            return {}
        ms = np.asarray(self.latencies) * 1e3
        return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "n": len(ms)}

    def bytes_per_hop(self) -> dict[str, float]:
        hops = self.traffic[0].keys() if self.traffic else []
        return {hop: float(np.mean([t[hop]["total"] for t in self.traffic])) for hop in hops}

    def bytes_per_request(self) -> float:
        return float(sum(self.bytes_per_hop().values()))


@dataclass
class Agreement:
    ok: bool = True
    checked: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, result, label: str) -> None:
        self.checked += 1
        if not result.ok:
            self.ok = False
            if len(self.failures) < 5:
                self.failures.append(f"{label}: {result.message}")

    def to_json(self) -> dict:
        return {"ok": self.ok, "checked": self.checked, "failures": self.failures}


def _quiet(_msg: str) -> None:
    pass


def load_updates(dataset: Dataset, updates_path) -> tuple[list, list[Rejection]]:
    if updates_path is None:
        return [], []
    return read_updates(updates_path, seed=dataset.seed, dim=dataset.model.D, formats=dataset.model.F)


def apply_stream(updates, targets: Sequence, dataset: Dataset) -> list[Rejection]:
    """Check the parsed stream against the live ids once, and apply it in order to every target."""
    return apply_updates(updates, targets, LiveAds(dataset.ad_ids.tolist()))


def gpu_index_device(device: str, n_ads: int) -> tuple[str | None, str | None]:
    """Where the harness checks the GPU index for `--device device`: ('gpu' or 'sim', None), or
    (None, the reason it is skipped). The index exists only as CUDA kernels: without a usable GPU it
    runs under the simulator only when 'sim' was asked for, and then only on small corpora."""
    try:
        where = resolve(device, kernels=True, what="the GPU index")
    except RuntimeError as exc:  # NoKernelDevice; 'gpu' without one; the simulator chosen too late
        return None, str(exc)
    if where == "sim" and n_ads > SIMULATOR_MAX_ADS:
        return None, (f"{n_ads:,} ads is more than the CUDA simulator is run on ({SIMULATOR_MAX_ADS:,}: about "
                      "0.1 ms per ad and request)")
    return where, None


def compare_eligibility(dataset: Dataset, requests, updates, *, device: str, oracle_requests: int | None,
                        log: Log = _quiet, layout: str | None = None) -> tuple[dict, list[np.ndarray], list[np.ndarray]]:
    """The CPU and GPU indexes against the oracle, with the update stream applied. The oracle checks
    the first `oracle_requests` requests (None: every one) over the whole corpus, in as many processes
    as there are cores (`oracle.match_corpus`). The GPU index is laid out as the GPU engine lays it
    out (`layout`, None for its default; the world's geographic bits). Returns (summary, CPU index
    sets, oracle sets)."""
    from andromeda_nb.constants import DEFAULT_LAYOUT
    from andromeda_nb.geo_layout import world_buckets
    from andromeda_nb.oracle import match_corpus
    from cpu_baseline.index import CpuTargetingIndex
    from gpu.index import GpuTargetingIndex

    n_oracle = len(requests) if oracle_requests is None else min(oracle_requests, len(requests))
    gpu_where, gpu_skipped = gpu_index_device(device, dataset.n_ads)
    if gpu_skipped:
        log(f"GPU index skipped: {gpu_skipped}")
    log(f"building the CPU index{'' if gpu_skipped else ' and the GPU index (' + gpu_where + ')'} "
        f"over {dataset.n_ads:,} ads")
    cpu = CpuTargetingIndex.from_compiled(dataset.compiled)
    gpu = None if gpu_skipped else GpuTargetingIndex.from_compiled(
        dataset.compiled, device=gpu_where, buckets=world_buckets(dataset.seed),
        rank="geo" if (layout or DEFAULT_LAYOUT) == "geo" else None)
    rejected = {r.line_no for r in apply_stream(updates, [x for x in (cpu, gpu) if x is not None], dataset)}
    log(f"matching {len(requests)} requests")
    cpu.match(requests[:1])  # warm-up: compiled code, scratch buffers
    if gpu is not None:
        gpu.match(requests[:1])
    t0 = time.perf_counter()
    cpu_sets = cpu.match(requests)
    cpu_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gpu_sets = gpu.match(requests) if gpu is not None else None
    gpu_s = time.perf_counter() - t0
    workers = os.cpu_count() or 1
    log(f"the oracle on {n_oracle} requests over {dataset.n_ads:,} ads ({workers} processes)")
    t0 = time.perf_counter()
    oracle_sets = match_corpus(dataset, requests[:n_oracle], [u for line, u in updates if line not in rejected],
                               workers=workers) if n_oracle else []
    oracle_s = time.perf_counter() - t0
    result = {"cpu_vs_oracle": Agreement(), "gpu_vs_oracle": Agreement(), "cpu_vs_gpu": Agreement()}
    for i, req in enumerate(requests):
        label = f"request {req.request_id}"
        if i < n_oracle:
            result["cpu_vs_oracle"].add(compare_eligible(oracle_sets[i], cpu_sets[i]), label)
            if gpu_sets is not None:
                result["gpu_vs_oracle"].add(compare_eligible(oracle_sets[i], gpu_sets[i]), label)
        if gpu_sets is not None:
            result["cpu_vs_gpu"].add(compare_eligible(cpu_sets[i], gpu_sets[i]), label)
    sizes = np.asarray([len(s) for s in cpu_sets])
    summary = {name: a.to_json() for name, a in result.items()}
    summary["equal"] = all(a.ok for a in result.values())
    summary["oracle_requests"] = n_oracle
    summary["gpu_index"] = gpu_skipped or gpu_where
    summary["eligible_mean"] = float(sizes.mean()) if len(sizes) else 0.0
    summary["eligible_per_request"] = sizes.tolist()
    summary["eligible_fraction_mean"] = float(sizes.mean() / max(1, len(cpu))) if len(sizes) else 0.0
    summary["match_seconds"] = {"cpu": cpu_s, "gpu": None if gpu is None else gpu_s, "oracle": oracle_s}
    for index in (cpu, gpu):
        close = getattr(index, "close", None)
        if close:
            close()
    return summary, cpu_sets, oracle_sets


class _NoIndex:
    """The reference retriever's index when the harness brings the eligible sets itself: updates are
    already in those sets, so applying them here does nothing."""

    @classmethod
    def from_compiled(cls, _compiled):
        return cls()

    def apply(self, _update) -> None:
        pass

    def match(self, _requests):
        raise RuntimeError("the harness gives the reference its eligible sets")


def reference_answers(dataset: Dataset, requests, updates, k: int, oracle_sets, index_sets,
                      log: Log = _quiet):
    """Per request: (eligible ids, ScoreResult, top-K ids, top-K scores) from the float64 reference,
    scoring the oracle's eligible sets where the oracle checked the request and the CPU index's (an
    index under test) beyond them. Returns (answers, where the eligible sets came from: counts)."""
    from andromeda_nb.reference import ReferenceRetriever, reference_topk

    ref = ReferenceRetriever.build(dataset, matcher=_NoIndex)
    apply_stream(updates, [ref], dataset)
    log(f"reference scores (float64) for {len(requests)} requests")
    out = []
    for i, req in enumerate(requests):
        ids, scores = ref.score_ids(req, oracle_sets[i] if i < len(oracle_sets) else index_sets[i])
        top_ids, top_scores = reference_topk(ids, scores.scores, k)
        out.append((ids, scores, top_ids, top_scores))
    ref.close()
    source = {"oracle": len(oracle_sets), "cpu index (under test)": len(requests) - len(oracle_sets)}
    return out, source


TIMED_RUNS = 3  # timed runs of all requests per architecture: the median is reported, and the range


def measure(retriever, requests, k: int, traffic_requests: int, runs: int = TIMED_RUNS) -> ArchMeasurement:
    """Time all requests in one exchange `runs` times (the median, and each run for the spread), time
    single-request exchanges (latency), then count bytes one request at a time."""
    retriever.retrieve(requests[:1], k)  # warm-up: connections, compiled code
    run_seconds = []
    cpu, device = getattr(retriever, "cpu_seconds", dict), getattr(retriever, "device_seconds", dict)
    cpu_before, device_before = cpu(), device()
    for _ in range(max(1, runs)):
        t0 = time.perf_counter()
        answers = retriever.retrieve(requests, k)
        run_seconds.append(time.perf_counter() - t0)
    cpu_after, device_after = cpu(), device()
    served = max(1, runs) * len(requests)
    cpu_ms = {role: (after - before) * 1e3 / served for role, before, after in _both(cpu_before, cpu_after)}
    busy = {role: (after - before) / sum(run_seconds) for role, before, after in _both(device_before, device_after)}
    latencies = []
    for request in requests[:traffic_requests]:
        t0 = time.perf_counter()
        retriever.retrieve([request], k)
        latencies.append(time.perf_counter() - t0)
    _, traffic = retriever.retrieve_traffic(requests[:traffic_requests], k)
    return ArchMeasurement(answers, float(np.median(run_seconds)), traffic, latencies, run_seconds, cpu_ms, busy)


def _both(before: dict, after: dict):
    """(role, before, after) for each role with a figure on both sides."""
    return [(role, was, after[role]) for role, was in before.items() if was is not None and after.get(role) is not None]


def check_answers(reference, answers, k: int, label: str) -> dict:
    scores_ok, topk_ok = Agreement(), Agreement()
    for (ids, result, top_ids, top_scores), (got_ids, got_scores) in zip(reference, answers):
        scores_ok.add(compare_scores(result.take(np.searchsorted(ids, got_ids)), got_scores, ids=got_ids)
                      if np.isin(got_ids, ids).all() else _missing(got_ids, ids), label)
        topk_ok.add(compare_topk(top_ids, top_scores, got_ids, got_scores, k), label)
    return {"scores": scores_ok.to_json(), "topk": topk_ok.to_json()}


@dataclass
class _Missing:
    ok: bool
    message: str


def _missing(got_ids, ids) -> _Missing:
    bad = np.asarray(got_ids)[~np.isin(got_ids, ids)]
    return _Missing(False, f"returned ads that are not eligible: {bad[:5].tolist()}")


def scorer_columns(scorer_devices) -> list[tuple[str, str]]:
    """(report key, device) of the remote design's columns, one per distinct scorer device after
    'auto' is decided (the GPU when usable, else the CPU; the simulator only when asked): 'remote' is
    the CPU scoring service, 'remote_<device>' a scoring service on that device (migration.scorer_server)."""
    from andromeda_nb.devices import gpu_usable

    out: list[tuple[str, str]] = []
    for word in scorer_devices:
        device = ("gpu" if gpu_usable() else "cpu") if word == "auto" else word
        key = "remote" if device == "cpu" else f"remote_{device}"
        if key not in [k for k, _ in out]:
            out.append((key, device))
    return out


def run_comparison(dataset: Dataset, *, k: int = DEFAULT_K, device: str = "auto", updates_path=None,
                   requests: int | None = None, oracle_requests: int | None = None, traffic_requests: int = 16,
                   runs: int = TIMED_RUNS, scorer_devices=("cpu", "auto"), link=None, log: Log = _quiet,
                   layout: str | None = None) -> dict:
    """Everything `andromeda compare` reports, as one JSON-ready dict. The remote design runs once per
    distinct scorer device (`scorer_columns`: by default the CPU scoring service and, where a GPU is
    usable, one on the GPU: the 2024 picture), then the co-located design. `link` (`relay.Link`): the
    network every hop behaves as (default: loopback as it is). `layout`: the slot order of the GPU
    index and the GPU co-located engine (None: the engine's default); a layout other than the corpus's
    needs a GPU device."""
    from andromeda_nb.constants import DEFAULT_LAYOUT, LAYOUTS
    from andromeda_nb.devices import resolve
    from cpu_baseline.remote import RemoteRetriever

    from .colocated import ColocatedRetriever

    reqs = dataset.requests[:requests] if requests else dataset.requests
    if not reqs:
        raise ValueError("the corpus has no requests to compare on")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown slot layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    on_cpu = resolve(device) == "cpu"
    if layout not in (None, "format") and on_cpu:
        raise ValueError(f"the slot layout {layout!r} is the GPU engine's: compare it with --device gpu or sim")
    updates, rejected = load_updates(dataset, updates_path)
    # one pass over the live ids splits the stream into what applies and what is rejected
    live_rejected = apply_stream(updates, [], dataset)
    rejected_lines = {r.line_no for r in live_rejected}
    updates = [(line, u) for line, u in updates if line not in rejected_lines]
    rejected = sorted(rejected + live_rejected, key=lambda r: r.line_no or 0)
    problem = nothing_applied(updates_path, len(updates), rejected) if updates_path is not None else None
    if problem:
        raise ValueError(problem)
    report: dict = {
        "ads": dataset.n_ads, "requests": len(reqs), "k": k, "precision": dataset.precision,
        "layout": None if on_cpu else layout or DEFAULT_LAYOUT,
        "updates": {"applied": len(updates), "rejected": [str(r) for r in rejected]},
    }
    eligibility, index_sets, oracle_sets = compare_eligibility(dataset, reqs, updates, device=device,
                                                               oracle_requests=oracle_requests, log=log, layout=layout)
    report["eligibility"] = eligibility
    reference, source = reference_answers(dataset, reqs, updates, k, oracle_sets, index_sets, log)
    report["reference_eligibility"] = source

    from .architectures import remote_scorer

    columns = [(key, RemoteRetriever, {} if dev == "cpu" else remote_scorer(dev), dev)
               for key, dev in scorer_columns(scorer_devices)]
    columns.append(("colocated", ColocatedRetriever, {"device": device, "layout": layout}, None))
    from serving.services import start_side_by_side

    measured: dict[str, ArchMeasurement] = {}
    log(f"starting the services of {', '.join(c[0] for c in columns)} on 127.0.0.1, side by side")
    retrievers = start_side_by_side(
        [lambda cls=cls, options=options: cls.build(dataset, traffic=True, served=True, link=link, **options)
         for _, cls, options, _ in columns])
    try:
        for (name, _, _, runs_on), retriever in zip(columns, retrievers):  # timed one design at a time
            apply_stream(updates, [retriever], dataset)
            log(f"{name}: {len(reqs)} requests")
            measured[name] = measure(retriever, reqs, k, min(traffic_requests, len(reqs)), runs)
            report[name] = check_answers(reference, measured[name].answers, k, name)
            report[name]["device"] = runs_on or getattr(retriever, "device", "cpu")  # remote: its scorer's
            retriever.close()  # its services end once measured
    finally:
        for retriever in retrievers:
            retriever.close()
    report["architectures"] = list(measured)
    report["link"] = (link or Link()).describe()
    report["eligible_equal"] = bool(eligibility["equal"])
    report["scores_equal"] = all(report[n]["scores"]["ok"] for n in measured)
    report["topk_equal"] = all(report[n]["topk"]["ok"] for n in measured)
    report["bytes_per_hop"] = {n: m.bytes_per_hop() for n, m in measured.items()}
    report["bytes_per_request"] = {n: m.bytes_per_request() for n, m in measured.items()}
    report["traffic_reduction"] = report["bytes_per_request"]["remote"] / max(1.0, report["bytes_per_request"]["colocated"])
    report["requests_per_second"] = {n: len(reqs) / m.seconds for n, m in measured.items()}
    report["requests_per_second_runs"] = {n: spread_of(len(reqs) / t for t in m.run_seconds)
                                          for n, m in measured.items()}
    report["latency_ms"] = {n: m.latency_ms() for n, m in measured.items()}
    # host CPU (user + system) of each service during the timed runs, per request: where the match and
    # the top-K run on the host (the remote index host) and what a GPU server still spends there
    report["host_cpu_ms_per_request"] = {n: m.cpu_ms_per_request for n, m in measured.items()}
    # the share of the timed runs' wall time each GPU service spent in its launches (CUDA events
    # around them; no entry on the CPU or under the simulator)
    report["gpu_busy_fraction"] = {n: m.gpu_busy for n, m in measured.items()}
    report["pool_ads_per_second"] = {n: len(reqs) * dataset.n_ads / m.seconds for n, m in measured.items()}
    # the payload model of `andromeda budget` for the requests whose bytes were counted
    counted = min(traffic_requests, len(reqs))
    request_bytes = np.mean([len(request_text(r).encode()) for r in reqs[:counted]])
    counted_eligible = np.mean([len(e[0]) for e in reference[:counted]])
    report["payload_estimate"] = network_payload(
        request_bytes=int(round(request_bytes)), n_eligible=int(round(counted_eligible)), k=k, dim=dataset.model.D,
        experts=dataset.model.E, formats=dataset.model.F)
    return report


def format_report(report: dict) -> str:
    """The human-readable side-by-side table of `run_comparison`'s report."""
    e = report["eligibility"]

    def mark(ok: bool) -> str:
        return "equal" if ok else "DIFFERENT"

    lines = [
        f"{report['ads']:,} ads, {report['requests']} requests, K = {report['k']}, {report['precision']} embeddings; "
        f"mean eligible {e['eligible_mean']:,.0f} ({100 * e['eligible_fraction_mean']:.1f}% of the pool)",
        f"updates: {report['updates']['applied']} applied, {len(report['updates']['rejected'])} rejected",
        f"eligible sets: CPU index vs oracle {mark(e['cpu_vs_oracle']['ok'])} ({e['oracle_requests']} requests), "
        + (f"GPU index ({e['gpu_index']}{', slots by geography' if report.get('layout') == 'geo' else ''}) vs oracle "
           f"{mark(e['gpu_vs_oracle']['ok'])}, CPU vs GPU "
           f"{mark(e['cpu_vs_gpu']['ok'])} ({e['cpu_vs_gpu']['checked']} requests)"
           if e["gpu_index"] in ("gpu", "sim") else f"GPU index skipped: {e['gpu_index']}"),
        "reference eligibility: " + ", ".join(f"{where} on {n} requests"
                                             for where, n in report["reference_eligibility"].items() if n),
        "",
    ]
    archs = report.get("architectures") or ["remote", "colocated"]
    W = 22

    def title(name: str) -> str:
        if name == "colocated":
            return "co-located"
        return "remote, CPU scorer" if name == "remote" else f"remote, {report[name]['device'].upper()} scorer"

    def row(label: str, cells) -> str:
        return f"{label:<28}" + "".join(f"{c:>{W}}" for c in cells)

    lines.append(f"network on every hop: {report.get('link', 'loopback')}")
    lines.append(row("", [title(n) for n in archs]))
    lines.append(row("runs on", [f"CPU + {report[n]['device'].upper()}" if n != "colocated" else report[n]["device"]
                                 for n in archs]))
    lines.append(row(f"scores vs reference, ±{SCORE_ATOL:g}", [mark(report[n]["scores"]["ok"]) for n in archs]))
    lines.append(row("top-K vs reference", [mark(report[n]["topk"]["ok"]) for n in archs]))
    b = report["bytes_per_request"]
    lines.append(row("bytes on the wire / request", [f"{b[n]:,.0f}" for n in archs]))
    for col, arch in enumerate(archs):
        for hop, value in report["bytes_per_hop"][arch].items():
            lines.append(row("  " + hop, [""] * col + [f"{value:,.0f}"]))
    lat = report["latency_ms"]
    if all(lat.get(n) for n in archs):
        lines.append(row("latency p50 / p99 (ms)", [f"{lat[n]['p50']:.2f} / {lat[n]['p99']:.2f}" for n in archs]))
    q = report["requests_per_second"]
    lines.append(row("requests / second", [rate(q[n]) for n in archs]))
    runs = report.get("requests_per_second_runs")
    if runs:  # the median above, the range of the timed runs right under it
        lines.append(row("  range over " + str(runs[archs[0]]["runs"]) + " runs",
                         [rate(runs[n]["min"]) + " to " + rate(runs[n]["max"]) for n in archs]))
    p = report["pool_ads_per_second"]
    lines.append(row("pool ads / second", [rate(p[n]) for n in archs]))
    cpu = report.get("host_cpu_ms_per_request") or {}
    if any(cpu.get(n) for n in archs):  # host CPU per request, per service and in all
        lines.append(row("host CPU ms / request", [f"{sum(cpu[n].values()):.2f}" if cpu.get(n) else "-" for n in archs]))
        for col, arch in enumerate(archs):
            for role, ms in (cpu.get(arch) or {}).items():
                lines.append(row("  " + role.split(" (")[0], [""] * col + [f"{ms:.2f}"]))
    busy = report.get("gpu_busy_fraction") or {}
    if any(busy.get(n) for n in archs):  # device time / wall time of the timed runs, per GPU service
        lines.append(row("GPU busy (timed runs)", [", ".join(f"{100 * f:.1f}%" for f in busy[n].values())
                                                   if busy.get(n) else "-" for n in archs]))
    gpu_remote = [n for n in archs if n.startswith("remote_")]
    if gpu_remote:
        n = gpu_remote[0]
        lines.append(f"what co-location adds on top of {report[n]['device'].upper()} scoring: "
                     f"{b[n] / max(1.0, b['colocated']):,.1f}x fewer bytes on the wire, "
                     f"{q['colocated'] / q[n]:,.2f}x the requests per second")
    lines.append(f"traffic reduction (remote / co-located bytes on the wire): {report['traffic_reduction']:,.1f}x")
    model = report.get("payload_estimate")
    if model:
        lines.append(f"payload model (andromeda budget, framing not counted): remote "
                     f"{payload_total(model['remote']):,.0f} B, co-located {payload_total(model['colocated']):,.0f} B "
                     f"per request")
    for name in archs:
        for what in ("scores", "topk"):
            for failure in report[name][what]["failures"]:
                lines.append(f"  {name} {what}: {failure}")
    for name in ("cpu_vs_oracle", "gpu_vs_oracle", "cpu_vs_gpu"):
        for failure in e[name]["failures"]:
            lines.append(f"  {name}: {failure}")
    return "\n".join(lines)
