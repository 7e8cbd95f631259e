"""The figures `andromeda bench report` derives from benchmark JSON: one row per measured run with its
bytes and FLOPs per ad, throughput, fraction of the copy bandwidth and arithmetic intensity (the
roofline's coordinates).

FLOPs per ad: counted from what the fused kernel computes on the folded tables of
`andromeda_nb.scoring` (a multiply-add is 2 FLOPs; see `kernel_flops_per_ad`), not timed.
"""

from __future__ import annotations

from andromeda_nb.budget import total, unfused_stages
from andromeda_nb.constants import DEFAULT_D, DEFAULT_E, DEFAULT_TOP_EXPERTS, PRECISION_BYTES

from ..report.sources import Source

def kernel_flops_per_ad(kind: str, dim: int, experts: int = DEFAULT_E, top_e: int = DEFAULT_TOP_EXPERTS) -> int:
    """FLOPs the fused kernel spends on one scored ad, on the folded tables of andromeda_nb.scoring
    (a multiply-add is 2 FLOPs; a comparison, exponential or division is 1).

    moe: E gate dots (2 D E) each scaled and biased (2 E); top-k selection (E k comparisons, none when
    k = E); softmax weights (subtract and exponential per routed expert, their sum, one division:
    3 k + 1); the k routed expert dots (2 D k) each scaled, biased, weighted and accumulated (4 k).
    dot (two-tower): one dot product (2 D) and the int8 scale (1)."""
    if kind == "dot":
        return 2 * dim + 1
    select = 0 if top_e >= experts else experts * top_e
    return 2 * dim * experts + 2 * experts + select + 3 * top_e + 1 + 2 * dim * top_e + 4 * top_e


def unfused_flops_per_ad(dim: int, experts: int = DEFAULT_E, top_e: int = DEFAULT_TOP_EXPERTS) -> int:
    """FLOPs of the unfused array pipeline of bench score per ad: dequantize (D), FiLM (2 D), all E gate
    dots (2 D E) and all E expert dots (2 D E, the routed ones are taken afterwards), the gate scale
    (E), top-k by sorting (counted as E k comparisons), softmax (3 k + 1) and the weighted sum (2 k)."""
    return dim + 2 * dim + 4 * dim * experts + experts + experts * top_e + 3 * top_e + 1 + 2 * top_e


def score_points(src: Source, every_ad_eligible: bool = False) -> list[dict]:
    """One point per fused kernel run (version x kind x precision x D x eligible share) with the
    roofline figures; `every_ad_eligible`: only the runs with every ad eligible (the roofline's and the
    headline's condition: a walk over a smaller share reads fewer bytes than `bytes_per_ad` says)."""
    d = src.doc
    bw = float(d["copy_bandwidth_Bps"])
    names = {str(k): v for k, v in (d.get("versions") or {}).items()}
    out = []
    for r in d["runs"]:
        share = float(r.get("eligible", 1.0))
        if every_ad_eligible and share < 1.0:
            continue
        experts, top_e = r.get("experts", DEFAULT_E), r.get("top_e", DEFAULT_TOP_EXPERTS)
        flops = kernel_flops_per_ad(r["kind"], r["D"], experts, top_e)
        bytes_per_ad = float(r["bytes_per_ad"])
        ads = float(r["ads_per_s"])
        out.append({
            "version": r["version"], "name": names.get(str(r["version"]), f"v{r['version']}"), "kind": r["kind"],
            "precision": r["precision"], "D": r["D"], "eligible": share, "ok": bool(r.get("ok", True)),
            "ms": r.get("score_ms"),
            "topk_ms": r.get("topk_ms"), "ads_per_s": ads, "bytes_per_ad": bytes_per_ad,
            "Bps": ads * bytes_per_ad, "copy_fraction": ads * bytes_per_ad / bw, "flops_per_ad": flops,
            "intensity": flops / bytes_per_ad, "flops_per_s": ads * flops,
        })
    return out


def unfused_points(src: Source) -> list[dict]:
    d = src.doc
    bw = float(d["copy_bandwidth_Bps"])
    out = []
    for u in d.get("unfused") or []:
        D = u.get("D", DEFAULT_D)
        bytes_per_ad = total(unfused_stages(u["precision"], D))
        flops = unfused_flops_per_ad(D)
        ads = float(u["ads_per_s"])
        out.append({"precision": u["precision"], "D": D, "ms": u.get("time_ms"), "ads_per_s": ads,
                    "bytes_per_ad": bytes_per_ad, "copy_fraction": ads * bytes_per_ad / bw, "flops_per_ad": flops,
                    "intensity": flops / bytes_per_ad, "flops_per_s": ads * flops,
                    "ok": bool((u.get("check") or {}).get("ok", True))})
    return out


def cpu_scorer_points(src: Source) -> list[dict]:
    """The CPU scorer rows with D recovered from the stored table size (bytes per row = D x element
    bytes, plus a 4-byte scale for int8) and the same FLOP count as the fused kernel's MoE."""
    d = src.doc
    ceiling = float(d["bandwidth"]["ceiling_GBps"]) * 1e9
    out = []
    for r in d["scorer"]:
        row_bytes = r["table_bytes"] / r["ads"] if r.get("table_bytes") and r.get("ads") else None
        D = (round((row_bytes - (4 if r["precision"] == "int8" else 0)) / PRECISION_BYTES[r["precision"]])
             if row_bytes else DEFAULT_D)
        ads = float(r["ads_per_s"])
        bytes_per_ad = float(r["GBps"]) * 1e9 / ads
        flops = kernel_flops_per_ad("moe", D)
        out.append({"version": r["version"], "precision": r["precision"], "D": D, "shipped": bool(r.get("shipped")),
                    "ads_per_s": ads, "bytes_per_ad": bytes_per_ad, "GBps": float(r["GBps"]),
                    "copy_fraction": ads * bytes_per_ad / ceiling, "flops_per_ad": flops,
                    "intensity": flops / bytes_per_ad, "flops_per_s": ads * flops,
                    "ns_one_thread": r.get("cpu_ns_per_ad_one_thread"), "max_error": r.get("max_error")})
    return out


def match_points(src: Source) -> list[dict]:
    """One row per (pool, version, batch): pool ads/s and the napkin-math bytes per pool ad."""
    d = src.doc
    bw = d.get("copy_bandwidth_Bps")
    out = []
    for p in d["pools"]:
        for t in p["timings"]:
            bytes_total = t.get("scan_bytes_upper")
            bytes_per_ad = bytes_total / (t["batch"] * p["ads"]) if bytes_total else None
            achieved = bytes_total / t["median_s"] if bytes_total and t["median_s"] > 0 else None
            out.append({"pool": p["ads"], "version": t["version"], "batch": t["batch"], "median_s": t["median_s"],
                        "pool_ads_per_s": float(t["pool_ads_per_s"]), "bytes_per_ad": bytes_per_ad,
                        "Bps": achieved, "copy_fraction": achieved / bw if achieved and bw else None,
                        "host_prepare_s": t.get("host_prepare_s"),
                        "shipped": t["version"] == d.get("shipped_version")})
    return out


def best_per(rows: list[dict], key, value: str) -> dict:
    """The row with the largest `value` for each key(row)."""
    best: dict = {}
    for r in rows:
        k = key(r)
        if k not in best or r[value] > best[k][value]:
            best[k] = r
    return best


__all__ = ["best_per", "cpu_scorer_points", "kernel_flops_per_ad", "match_points", "score_points",
           "unfused_flops_per_ad", "unfused_points"]
