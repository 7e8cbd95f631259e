"""Reading benchmark JSON for `andromeda bench report`: each file's kind, read from an explicit "kind" key
(added by `andromeda_nb.provenance`) or recognised from its content, and what every figure is shown
with: the device, the software versions, the sizes and the command that made it.

    match     `andromeda bench match --out`      (benchmarks/match.py: "benchmark": "match", pools)
    score     `andromeda bench score --out`      (benchmarks/score.py: runs, copy_bandwidth_Bps)
    pipeline  `andromeda bench pipeline --out`   (benchmarks/score.py: latency_ms, throughput)
    cpu       `andromeda bench cpu --out`        (benchmarks/cpu.py: machine, bandwidth, scorer)
    compare   `andromeda compare --json`         (migration/harness.py: bytes_per_request, ...)
    quality   `andromeda quality --out` / --json (andromeda_nb/quality/report.py: recall, flops_per_ad)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from andromeda_nb.constants import PRECISION_BYTES
from andromeda_nb.provenance import KINDS

REQUIRED = {
    "match": ["pools", "pools[].ads", "pools[].timings", "pools[].timings[].version", "pools[].timings[].batch",
              "pools[].timings[].median_s", "pools[].timings[].pool_ads_per_s"],
    "score": ["runs", "copy_bandwidth_Bps", "runs[].D", "runs[].precision", "runs[].kind", "runs[].version",
              "runs[].ads_per_s", "runs[].bytes_per_ad"],
    "pipeline": ["pool_ads", "latency_ms", "latency_ms.p50", "latency_ms.p99", "throughput",
                 "throughput[].batch", "throughput[].pool_ads_per_s"],
    "cpu": ["bandwidth", "bandwidth.ceiling_GBps", "scorer", "scorer[].precision", "scorer[].version",
            "scorer[].ads_per_s", "scorer[].GBps"],
    "compare": ["bytes_per_request", "bytes_per_request.remote", "bytes_per_request.colocated",
                "eligible_equal", "topk_equal"],
    "quality": ["recall", "flops_per_ad"],
}


class ReportError(ValueError):
    """A benchmark file that cannot be read or recognised; the message names the file and the reason."""


# --- reading and recognising ------------------------------------------------------------------------


@dataclass
class Source:
    path: str
    kind: str
    doc: dict
    given_command: str | None = None  # supplied to the report for a JSON that does not record its command
    link: str | None = None  # the file relative to BENCHMARKS.md, when it lies beside or below it

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def label(self) -> str:
        return Path(self.path).stem


def detect_kind(doc) -> str | None:
    """The kind of a result object, from its explicit "kind" or its content; None when unknown."""
    if not isinstance(doc, dict):
        return None
    explicit = doc.get("kind")
    if isinstance(explicit, str):
        name = explicit.strip().lower()
        for prefix in ("bench-", "bench ", "bench_"):
            name = name[len(prefix):] if name.startswith(prefix) else name
        if name in KINDS:
            return name
    if doc.get("benchmark") == "match" or ("pools" in doc and "batches" in doc):
        return "match"
    if "runs" in doc and "copy_bandwidth_Bps" in doc:
        return "score"
    if "latency_ms" in doc and "throughput" in doc:
        return "pipeline"
    if "scorer" in doc and "bandwidth" in doc:
        return "cpu"
    if "bytes_per_request" in doc and "eligible_equal" in doc:
        return "compare"
    if "recall" in doc and "flops_per_ad" in doc:
        return "quality"
    return None


def _missing(doc, path: str) -> str | None:
    """The first missing part of a REQUIRED path in doc, as a readable path; None when present."""

    def walk(node, parts, where):
        if not parts:
            return None
        part = parts[0]
        each = part.endswith("[]")
        key = part[:-2] if each else part
        if not isinstance(node, dict) or key not in node or node[key] is None:
            return f"{where}{key}"
        value = node[key]
        if each:
            if not isinstance(value, list):
                return f"{where}{key} (a list)"
            for i, item in enumerate(value):
                bad = walk(item, parts[1:], f"{where}{key}[{i}].")
                if bad:
                    return bad
            return None
        return walk(value, parts[1:], f"{where}{key}.")

    return walk(doc, path.split("."), "")


def parse_json_text(text: str, path: str):
    """One JSON document, or the last non-empty line of a JSON Lines / logged output."""
    from andromeda_nb.jsontext import JsonInputError, last_json_document

    try:
        return last_json_document(text)
    except JsonInputError as exc:
        raise ReportError(f"{path}: not JSON ({exc})") from None


def _is_demo(doc) -> bool:
    return (isinstance(doc, dict) and isinstance(doc.get("compare"), dict) and "kernels" in doc
            and "budget" in doc)


def load_source(path) -> Source:
    """Read one result file and recognise its kind; ReportError names the file and what is wrong."""
    path = str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read ({exc})") from None
    doc = parse_json_text(text, path)
    if _is_demo(doc):  # `andromeda demo --json` carries a whole compare report: report that part
        doc = {**doc["compare"], "provenance": doc.get("provenance") or doc["compare"].get("provenance")}
    kind = detect_kind(doc)
    if kind is None:
        what = (f"a JSON object with keys {sorted(doc)[:12]}" if isinstance(doc, dict)
                else f"a JSON {type(doc).__name__}")
        explicit = f' (its "kind" {doc["kind"]!r} is not one of {", ".join(KINDS)})' \
            if isinstance(doc, dict) and "kind" in doc else ""
        raise ReportError(
            f"{path}: unknown benchmark JSON{explicit}: {what}; expected the output of bench match/score/"
            f"pipeline/cpu --out, compare --json or quality --out (or an explicit \"kind\": one of "
            f"{', '.join(KINDS)})")
    for req in REQUIRED[kind]:
        bad = _missing(doc, req)
        if bad:
            raise ReportError(f"{path}: looks like {kind} JSON but has no {bad!r}")
    return Source(path, kind, doc)


def expand_paths(paths: Iterable) -> list[str]:
    """Files as given; a directory stands for the *.json files directly in it, in name order."""
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(str(f) for f in p.glob("*.json"))
            if not found:
                raise ReportError(f"{p}: a directory with no *.json files")
            out += found
        else:
            out.append(str(p))
    if not out:
        raise ReportError("no benchmark JSON files given")
    return out


def load_sources(paths: Iterable) -> list[Source]:
    return [load_source(p) for p in expand_paths(paths)]


def of_kind(sources: list[Source], kind: str) -> list[Source]:
    return [s for s in sources if s.kind == kind]


# --- what each figure needs: device, versions, sizes, command ----------------------------------------


def _host(doc) -> dict:
    return (doc.get("provenance") or {}).get("host") or {}


def device_of(src: Source) -> str:
    d = src.doc
    if src.kind in ("match", "score", "pipeline"):
        env = d.get("environment") or d.get("env") or {}
        name = env.get("device", "unknown device")
        extra = []
        if env.get("compute_capability"):
            extra.append("cc " + ".".join(str(x) for x in env["compute_capability"]))
        if env.get("sms"):
            extra.append(f"{env['sms']} SMs")
        return name + (f" ({', '.join(extra)})" if extra else "")
    if src.kind == "cpu":
        m = d.get("machine") or {}
        return f"{m.get('cpu', _host(d).get('cpu', 'unknown CPU'))} ({m.get('cores', '?')} cores)"
    cpu = _host(d).get("cpu")
    cpu_text = f"{cpu} ({_host(d).get('cores', '?')} cores)" if cpu else "CPU not recorded"
    if src.kind == "compare":
        colocated = (d.get("colocated") or {}).get("device")
        where = {"gpu": "the GPU", "cpu": "the CPU", "sim": "the CUDA simulator"}.get(colocated, colocated)
        return f"{cpu_text}; co-located path on {where or 'a device not recorded'}"
    kernel = d.get("kernel") or {}
    return f"{cpu_text}" + (f"; kernel on {kernel['device']}" if kernel.get("device") else "")


def versions_of(src: Source) -> str:
    d = src.doc
    merged = {**_host(d), **(d.get("machine") or {}), **(d.get("environment") or d.get("env") or {})}
    names = [("python", "Python"), ("numpy", "numpy"), ("numba", "numba"), ("numba_cuda", "numba-cuda"),
             ("pyarrow", "pyarrow"), ("cupy_cuda12x", "cupy"), ("cupy_cuda13x", "cupy")]
    parts = [f"{label} {merged[key]}" for key, label in names if merged.get(key)]
    host = _host(d)
    if host.get("git_commit"):
        parts.append(f"source {host['git_commit'][:10]}" + (" (with local changes)" if host.get("git_dirty") else ""))
    return ", ".join(parts) if parts else "versions not recorded"


def number_text(x) -> str:
    """An integer with thousands separators, or the value as it is (e.g. '?')."""
    return f"{x:,}" if isinstance(x, (int, float)) else str(x)


def sizes_of(src: Source) -> str:
    d = src.doc
    if src.kind == "match":
        pools = " and ".join(f"{p['ads']:,}" for p in d["pools"])
        return (f"pools of {pools} ads (tiled from {number_text(d.get('base_ads', '?'))} generated ads, "
                f"seed {d.get('seed', '?')}); "
                f"requests per launch {', '.join(str(b) for b in d.get('batches', []))}")
    if src.kind == "score":
        dims = sorted({r["D"] for r in d["runs"]})
        precs = sorted({r["precision"] for r in d["runs"]}, key=list(PRECISION_BYTES).index)
        return (f"pool of {number_text(d.get('n_ads', '?'))} ads; D = {', '.join(map(str, dims))}; {', '.join(precs)}; "
                f"k = {d.get('k', '?')}; {d.get('arithmetic', 'float32')}")
    if src.kind == "pipeline":
        return (f"pool of {d['pool_ads']:,} ads; {d.get('precision', '?')}, D = {d.get('D', '?')}, "
                f"k = {d.get('k', '?')}; "
                f"batches {', '.join(str(t['batch']) for t in d['throughput'])}; {d.get('arithmetic', 'float32')}")
    if src.kind == "cpu":
        s = d.get("settings") or {}
        return (f"pool of {number_text(s.get('pool_ads', '?'))} ads, {s.get('requests', '?')} requests, k = {s.get('k', '?')}, "
                f"scorer table {number_text(s.get('score_rows', '?'))} rows, seed {s.get('seed', '?')}")
    if src.kind == "compare":
        return (f"{number_text(d.get('ads', '?'))} ads, {d.get('requests', '?')} requests, K = {d.get('k', '?')}, "
                f"{d.get('precision', '?')} embeddings")
    cfg = d.get("config") or {}
    truth = cfg.get("truth") or {}
    return (f"{number_text(truth.get('ads', '?'))} ads, {cfg.get('test_requests', '?')} test requests, "
            f"E = {truth.get('experts', '?')}, "
            f"D = {truth.get('dim', '?')}, seed {cfg.get('seed', '?')}, {cfg.get('precision', '?')} embeddings")


def command_of(src: Source) -> str | None:
    return (src.doc.get("provenance") or {}).get("command") or src.given_command


def provenance_line(src: Source) -> str:
    recorded = (src.doc.get("provenance") or {}).get("command")
    created = (src.doc.get("provenance") or {}).get("created")
    if recorded:
        cmd = f"command `{recorded}`"
    elif src.given_command:
        cmd = f"command `{src.given_command}` (as documented; the JSON does not record it)"
    else:
        cmd = "command not recorded in the JSON"
    return (f"`{src.name}` ({src.kind}): {device_of(src)}; {versions_of(src)}; {sizes_of(src)}; {cmd}"
            + (f"; made {created}" if created else "") + ".")


def parse_commands(pairs: Iterable[str]) -> dict[str, str]:
    """`FILE=COMMAND` pairs (FILE: a file name or path as given) -> {file name: command}."""
    out = {}
    for pair in pairs:
        name, sep, command = pair.partition("=")
        if not sep or not name.strip() or not command.strip():
            raise ReportError(f"--command {pair!r}: expected FILE=COMMAND")
        out[Path(name.strip()).name] = command.strip()
    return out


__all__ = ["KINDS", "REQUIRED", "ReportError", "Source", "command_of", "detect_kind", "device_of", "expand_paths",
           "load_source", "load_sources", "number_text", "of_kind", "parse_commands", "parse_json_text",
           "provenance_line", "sizes_of", "versions_of"]
