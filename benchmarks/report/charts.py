"""The charts of `andromeda bench report` (matplotlib, the optional extra `plots`), under OUT/benchmarks/:

    roofline.png   per measured run: the scoring kernels (FLOP/byte against FLOP/s) and the match
                   kernels (pool ads per byte moved against pool ads/s) under the device-to-device
                   copy bandwidth measured in the same run; the CPU scorer under the CPU copy bandwidth
    match.png      pool ads/s against pool size, every GPU match kernel version and the CPU index
    pipeline.png   co-located pipeline pool ads/s by batch size, and per-request latency p50 / p99
                   beside the remote-scoring baseline
    traffic.png    bytes on the wire per request and hop, both architectures
"""

from __future__ import annotations

from pathlib import Path

from ..report.figures import best_per, cpu_scorer_points, match_points, score_points, unfused_points
from ..report.sources import Source, device_of, number_text, of_kind

CHART_DIR = "benchmarks"


PLOTS_MISSING = "matplotlib is not installed (pip install 'andromeda-nb[plots]')"

CHART_KINDS = {"roofline": ("score", "match", "cpu"), "match": ("match", "cpu"),
               "pipeline": ("pipeline", "cpu", "compare"), "traffic": ("compare", "cpu")}


PREC_COLORS = {"fp32": "tab:blue", "fp16": "tab:orange", "int8": "tab:green"}


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _pyplot():
    """(matplotlib.pyplot, None), or (None, why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, PLOTS_MISSING
    return plt, None


def _log_axis(ax, which: str, values, unit: str = "", plain: bool = False) -> None:
    """A log axis with engineering labels (10 G, 100 G, ...; plain numbers such as 0.5 with `plain`);
    the 2 and 5 of each decade labelled too when the values span less than two decades."""
    from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, NullFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = ax.xaxis if which == "x" else ax.yaxis

    def formatter():
        return FuncFormatter(lambda v, _: f"{v:g}") if plain else EngFormatter(unit=unit)

    axis.set_major_formatter(formatter())
    values = [v for v in values if v and v > 0]
    if values and max(values) / min(values) < 100:
        axis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        axis.set_minor_formatter(formatter())
    else:
        axis.set_minor_formatter(NullFormatter())


def _value_axis(ax, values, unit: str = "") -> None:
    """y axis of a bar chart: log when the values span more than 20x, else linear from zero."""
    from matplotlib.ticker import EngFormatter

    values = [v for v in values if v and v > 0]
    if values and max(values) / min(values) > 20:
        _log_axis(ax, "y", [min(values) / 2, max(values) * 2], unit)
        ax.set_ylim(min(values) / 2, max(values) * 2)
    else:
        ax.yaxis.set_major_formatter(EngFormatter(unit=unit))
        ax.set_ylim(0, max(values) * 1.15 if values else 1)


def _ceiling(ax, bw: float, xs: list[float], label: str) -> None:
    lo, hi = min(xs) / 3, max(xs) * 3
    ax.plot([lo, hi], [bw * lo, bw * hi], "-", color="black", linewidth=1.2, label=label)


def _roofline_panels(sources: list[Source]) -> list[tuple]:
    panels = []
    for s in of_kind(sources, "score"):
        pts = score_points(s, every_ad_eligible=True)
        for D in sorted({p["D"] for p in pts}):
            panels.append(("score", s, D, [p for p in pts if p["D"] == D],
                           [u for u in unfused_points(s) if u["D"] == D]))
    for s in of_kind(sources, "match"):
        if s.doc.get("copy_bandwidth_Bps") and any(p["bytes_per_ad"] for p in match_points(s)):
            panels.append(("match", s, None, [p for p in match_points(s) if p["bytes_per_ad"]], []))
    for s in of_kind(sources, "cpu"):
        panels.append(("cpu", s, None, cpu_scorer_points(s), []))
    return panels


def _short_device(s: Source) -> str:
    return device_of(s).split(" (")[0]


def chart_roofline(plt, sources: list[Source], path) -> bool:
    panels = _roofline_panels(sources)
    if not panels:
        return False
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.8 * rows), dpi=110, squeeze=False)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    for ax, (kind, s, D, pts, uf) in zip(axes.ravel(), panels):
        if kind == "match":
            bw = float(s.doc["copy_bandwidth_Bps"])
            versions = sorted({p["version"] for p in pts})
            batches = sorted({p["batch"] for p in pts})
            for p in pts:
                x = 1.0 / p["bytes_per_ad"]
                ax.scatter([x], [p["pool_ads_per_s"]], marker=MARKERS[batches.index(p["batch"]) % len(MARKERS)],
                           color=f"C{versions.index(p['version'])}", s=36, zorder=3)
            _ceiling(ax, bw, [1.0 / p["bytes_per_ad"] for p in pts], f"copy bandwidth {bw / 1e12:.2f} TB/s (same run)")
            for i, v in enumerate(versions):
                ax.scatter([], [], color=f"C{i}", marker="o", label=f"match v{v}")
            for j, b in enumerate(batches):
                ax.scatter([], [], color="gray", marker=MARKERS[j % len(MARKERS)], label=f"{b} requests / launch")
            ax.set_xlabel("pool ads per byte moved (per request)")
            ax.set_ylabel("pool ads / s")
            ax.set_title(f"{_short_device(s)}: match kernels ({s.label})", fontsize=9)
        else:
            if kind == "score":
                bw = float(s.doc["copy_bandwidth_Bps"])
                title = f"{_short_device(s)}: fused scoring, D = {D} ({s.label})"
                ceiling = f"copy bandwidth {bw / 1e12:.2f} TB/s (same run)"
            else:
                bw = float(s.doc["bandwidth"]["ceiling_GBps"]) * 1e9
                title = f"{_short_device(s)}: CPU scorer ({s.label})"
                ceiling = f"copy bandwidth {bw / 1e9:.1f} GB/s (same run)"
            versions = sorted({p["version"] for p in pts})
            for p in pts:
                color = PREC_COLORS.get(p["precision"], "gray")
                hollow = p.get("kind") == "dot"
                marker = MARKERS[versions.index(p["version"]) % len(MARKERS)]
                ax.scatter([p["intensity"]], [p["flops_per_s"]], marker=marker, s=40, zorder=3,
                           facecolors="none" if hollow else color, edgecolors=color, linewidths=1.3)
                if not p.get("ok", True):
                    ax.annotate("check failed", (p["intensity"], p["flops_per_s"]), fontsize=7, color="red")
            for u in uf:
                ax.scatter([u["intensity"]], [u["flops_per_s"]], marker="x", s=40, zorder=3,
                           color=PREC_COLORS.get(u["precision"], "gray"))
            xs = [p["intensity"] for p in pts] + [u["intensity"] for u in uf]
            _ceiling(ax, bw, xs, ceiling)
            for prec, color in PREC_COLORS.items():
                if any(p["precision"] == prec for p in pts):
                    ax.scatter([], [], color=color, marker="o", label=prec)
            names = {p["version"]: p.get("name", f"v{p['version']}") for p in pts}
            for i, v in enumerate(versions):
                ax.scatter([], [], color="gray", marker=MARKERS[i % len(MARKERS)], label=names[v])
            if any(p.get("kind") == "dot" for p in pts):
                ax.scatter([], [], facecolors="none", edgecolors="gray", marker="o", label="hollow: two-tower dot")
            if uf:
                ax.scatter([], [], color="gray", marker="x", label="unfused CuPy")
            ax.set_xlabel("arithmetic intensity (FLOP / byte)")
            ax.set_ylabel("achieved FLOP / s")
            ax.set_title(title, fontsize=9)
        xs = [o.get_offsets()[:, 0] for o in ax.collections if len(o.get_offsets())]
        ys = [o.get_offsets()[:, 1] for o in ax.collections if len(o.get_offsets())]
        _log_axis(ax, "x", [float(v) for a in xs for v in a], plain=True)
        line_ys = [float(v) for line in ax.lines for v in line.get_ydata()]
        _log_axis(ax, "y", [float(v) for a in ys for v in a] + line_ys)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Kernels against the measured bandwidth ceiling (float32 arithmetic)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def chart_match(plt, sources: list[Source], path) -> bool:
    series = []  # (label, points, format, style keywords)
    matches = of_kind(sources, "match")
    for i, s in enumerate(matches):
        latest = i == len(matches) - 1  # earlier runs dashed and lighter
        best = best_per(match_points(s), lambda p: (p["version"], p["pool"]), "pool_ads_per_s")
        for v in sorted({k[0] for k in best}):
            pts = sorted((k[1], best[k]["pool_ads_per_s"]) for k in best if k[0] == v)
            label = f"GPU v{v}" + (" (shipped)" if v == s.doc.get("shipped_version") else "")
            series.append((label + (f", {s.label}" if len(matches) > 1 else ""), pts, "-o" if latest else "--o",
                           {"color": f"C{(v - 1) % 10}", "alpha": 1.0 if latest else 0.45}))
        cpu = s.doc.get("cpu_index")
        if cpu:
            series.append((f"CPU index, {cpu.get('threads', '?')} threads ({s.label})",
                           [(cpu["ads"], cpu["pool_ads_per_s"])], "*",
                           {"color": "black", "alpha": 1.0 if latest else 0.45}))
    for s in of_kind(sources, "cpu"):
        m = s.doc.get("match")
        if m:
            series.append((f"CPU index, {m.get('threads', '?')} threads ({_short_device(s)}, {s.label})",
                           [(m["pool_ads"], m["pool_ads_per_s"])], "D", {"color": "black"}))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for label, pts, fmt, style in series:
        ax.plot([x for x, _ in pts], [y for _, y in pts], fmt, label=label, markersize=6, **style)
    _log_axis(ax, "x", [x for _, pts, _, _ in series for x, _ in pts])
    _log_axis(ax, "y", [y for _, pts, _, _ in series for _, y in pts])
    ax.set_xlabel("pool size (ads)")
    ax.set_ylabel("pool ads / s (best batch)")
    devices = sorted({_short_device(s) for s in sources if s.kind == "match"})
    ax.set_title(f"Targeting match throughput ({', '.join(devices) or 'CPU'})", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def chart_pipeline(plt, sources: list[Source], path) -> bool:
    pipes = of_kind(sources, "pipeline")
    cpus = [s for s in of_kind(sources, "cpu") if s.doc.get("end_to_end")]
    compares = [s for s in of_kind(sources, "compare") if s.doc.get("pool_ads_per_second")]
    if not (pipes or cpus or compares):
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.0, 4.6), dpi=110)
    for s in pipes:
        tp = s.doc["throughput"]
        left.plot([t["batch"] for t in tp], [t["pool_ads_per_s"] for t in tp], "-o",
                  label=f"co-located, {s.doc['pool_ads']:,} ads ({_short_device(s)})")
    for s in cpus:
        e, st = s.doc["end_to_end"], s.doc.get("settings") or {}
        if e.get("batched_pool_ads_per_s"):
            left.plot([e.get("requests", st.get("requests", 1))], [e["batched_pool_ads_per_s"]], "ks",
                      label=f"remote scoring, {st.get('pool_ads', 0):,} ads ({_short_device(s)})")
    for s in compares:
        d = s.doc
        for arch, style in (("remote", "k^"), ("colocated", "r^")):
            if arch in d["pool_ads_per_second"]:
                left.plot([1], [d["pool_ads_per_second"][arch]], style,
                          label=f"{arch} via compare, {d.get('ads', 0):,} ads, one request at a time")
    left.set_xscale("log", base=2)
    from matplotlib.ticker import FuncFormatter

    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    _log_axis(left, "y", [float(v) for line in left.lines for v in line.get_ydata()])
    left.set_xlabel("requests per batch")
    left.set_ylabel("pool ads / s")
    left.set_title("Throughput", fontsize=10)
    left.grid(True, which="major", alpha=0.3)
    left.legend(fontsize=7)
    bars = [(f"co-located, {s.doc['pool_ads']:,} ads\n{_short_device(s)}\n{s.label}", s.doc["latency_ms"])
            for s in pipes]
    bars += [(f"remote, {number_text((s.doc.get('settings') or {}).get('pool_ads', '?'))} ads\n{_short_device(s)}\n{s.label}",
              s.doc["end_to_end"]["latency_ms"]) for s in cpus]
    if bars:
        xs = range(len(bars))
        left_edges = [x - 0.2 for x in xs]
        right.bar(left_edges, [b[1]["p50"] for b in bars], 0.4, label="p50", color="tab:blue")
        right.bar([x + 0.2 for x in xs], [b[1]["p99"] for b in bars], 0.4, label="p99", color="tab:red")
        for x, (_, lat) in zip(xs, bars):
            right.annotate(f"{lat['p99']:.2f}", (x + 0.2, lat["p99"]), ha="center", va="bottom", fontsize=7)
        right.set_xticks(list(xs))
        right.set_xticklabels([b[0] for b in bars], fontsize=8)
        _value_axis(right, [b[1][q] for b in bars for q in ("p50", "p99")])
        right.set_ylabel("ms per request (one at a time)")
        right.legend(fontsize=8)
    else:
        right.text(0.5, 0.5, "no latency figures in these sources", ha="center", va="center")
    right.set_title("Latency per request", fontsize=10)
    right.grid(True, axis="y", which="both", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def chart_traffic(plt, sources: list[Source], path) -> bool:
    groups = []  # (label, {hop: bytes})
    for s in of_kind(sources, "compare"):
        for arch in ("remote", "colocated"):
            hops = (s.doc.get("bytes_per_hop") or {}).get(arch)
            if hops:
                groups.append((f"{arch}\n{s.label}", hops))
            elif arch in s.doc["bytes_per_request"]:
                groups.append((f"{arch}\n{s.label}", {"all hops": s.doc["bytes_per_request"][arch]}))
    for s in of_kind(sources, "cpu"):
        hops = (s.doc.get("end_to_end") or {}).get("traffic_bytes_per_request")
        if hops:
            groups.append((f"remote\n{s.label}", {h: v["mean_total"] for h, v in hops.items()}))
    if not groups:
        return False
    hop_names = list(dict.fromkeys(h for _, hops in groups for h in hops))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.6), dpi=110)
    width = 0.8 / len(hop_names)
    for j, hop in enumerate(hop_names):
        xs = [i + (j - (len(hop_names) - 1) / 2) * width for i, (_, hops) in enumerate(groups) if hop in hops]
        ys = [hops[hop] for _, hops in groups if hop in hops]
        ax.bar(xs, ys, width, label=hop, color=f"C{j}")
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:,.0f}", (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g[0] for g in groups], fontsize=8)
    _value_axis(ax, [v for _, hops in groups for v in hops.values()], "B")
    ax.set_ylabel("bytes on the wire per request")
    ax.set_title("Network traffic per request and hop (counting relays)", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.25)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


CHARTS = {"roofline": chart_roofline, "match": chart_match, "pipeline": chart_pipeline, "traffic": chart_traffic}


def write_charts(sources: list[Source], chart_dir) -> tuple[dict[str, str], str | None]:
    """Draw every chart the sources have data for. Returns ({name: file name}, None), or ({}, why the
    charts were skipped)."""
    plt, why = _pyplot()
    if plt is None:
        return {}, why
    chart_dir = Path(chart_dir)
    chart_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, draw in CHARTS.items():
        file = f"{name}.png"
        if draw(plt, sources, chart_dir / file):
            written[name] = file
    return written, None


__all__ = ["CHARTS", "CHART_DIR", "CHART_KINDS", "PLOTS_MISSING", "write_charts"]
