"""`andromeda budget`: the byte budget of `andromeda_nb.budget` (the model, counted from the data layout)
for a corpus's real requests and eligible sets (matched with the CPU inverted index), printed beside
measured figures from benchmark or compare JSON.
"""

from __future__ import annotations

from andromeda_nb.budget import budget_table, network_payload, payload_total
from andromeda_nb.constants import DEFAULT_D

EXAMPLE_ELIGIBLE = 500_000  # the illustrative pool of the published write-up: 500,000 ads pass targeting
EXAMPLE_REQUEST_BYTES = 2_000


def _network_from_dataset(dataset, k: int) -> dict:
    from serving.protocol import request_text
    from cpu_baseline.index import CpuTargetingIndex

    index = CpuTargetingIndex(dataset.compiled)  # the compiled form: no ad parsed
    sizes = [len(ids) for ids in index.match(dataset.requests)]
    index.close()
    request_bytes = [len(request_text(r).encode()) for r in dataset.requests]
    m = dataset.model
    per_request = [network_payload(b, n, k, m.D, m.E, m.F) for b, n in zip(request_bytes, sizes)]
    mean = {arch: {hop: {d: sum(p[arch][hop][d] for p in per_request) / len(per_request)
                         for d in ("upstream", "downstream")} for hop in per_request[0][arch]}
            for arch in per_request[0]}
    return {"source": "corpus", "requests": len(sizes), "eligible_mean": float(sum(sizes) / len(sizes)),
            "request_bytes_mean": float(sum(request_bytes) / len(request_bytes)), "payload": mean}


def _measured(paths) -> dict:
    """Measured figures from compare JSON (bytes on the wire) and benchmark JSON (kernel rows)."""
    from andromeda_nb.jsontext import JsonInputError, last_json_document

    out: dict = {}
    for path in paths:
        with open(path) as f:
            text = f.read()
        try:
            doc = last_json_document(text) if text.strip() else {}
        except JsonInputError as exc:
            raise ValueError(f"{path}: not JSON, nor is its last line ({exc})") from None
        if "bytes_per_request" in doc:
            out["wire_bytes_per_request"] = doc["bytes_per_request"]
            out["wire_bytes_per_hop"] = doc.get("bytes_per_hop", {})
            out["traffic_reduction"] = doc.get("traffic_reduction")
        for row in doc.get("kernels", []) if isinstance(doc, dict) else []:
            out.setdefault("kernels", []).append(row)
    return out


def build_budget(dataset=None, *, k: int = 100, dim: int | None = None, measured=()) -> dict:
    dim = dim or (dataset.model.D if dataset is not None else DEFAULT_D)
    if dataset is not None and len(dataset.requests):
        network = _network_from_dataset(dataset, k)
    else:
        network = {"source": "example", "requests": 0, "eligible_mean": float(EXAMPLE_ELIGIBLE),
                   "request_bytes_mean": float(EXAMPLE_REQUEST_BYTES),
                   "payload": network_payload(EXAMPLE_REQUEST_BYTES, EXAMPLE_ELIGIBLE, k, dim)}
    payload = network["payload"]
    remote, colocated = payload_total(payload["remote"]), payload_total(payload["colocated"])
    return {"dim": dim, "k": k, "device": budget_table(dim=dim, k=k), "network": network,
            "network_reduction": remote / max(1.0, colocated), "measured": _measured(measured)}


def format_budget(report: dict) -> str:
    lines = [f"Device memory per candidate scored (D = {report['dim']}, K = {report['k']}):",
             f"  {'precision':<10}{'fused B/ad':>12}{'unfused B/ad':>15}{'unfused/fused':>15}"]
    for row in report["device"]:
        lines.append(f"  {row['precision']:<10}{row['fused_bytes_per_ad']:>12.1f}{row['unfused_bytes_per_ad']:>15.1f}"
                     f"{row['unfused_over_fused']:>14.1f}x")
    lines.append("  unfused stages (fp16), bytes read + written per candidate:")
    for st in report["device"][1]["unfused_stages"]:
        lines.append(f"    {st['name']:<34}{st['read']:>9.1f} + {st['write']:>7.1f}")
    net = report["network"]
    src = (f"{net['requests']} requests of the corpus" if net["source"] == "corpus"
           else "the write-up's illustration")
    lines.append(f"Network payload per request ({src}; {net['eligible_mean']:,.0f} eligible ads, "
                 f"{net['request_bytes_mean']:,.0f}-byte request):")
    measured = report["measured"].get("wire_bytes_per_hop", {})
    for arch, hops in net["payload"].items():
        for hop, d in hops.items():
            wire = measured.get(arch, {}).get(hop)
            extra = f"   measured on the wire: {wire:,.0f}" if wire is not None else ""
            lines.append(f"  {arch:<10}{hop:<22}{d['upstream']:>14,.0f} up {d['downstream']:>12,.0f} down{extra}")
    lines.append(f"  remote / co-located payload: {report['network_reduction']:,.0f}x")
    if "traffic_reduction" in report["measured"]:
        lines.append(f"  remote / co-located measured on the wire: {report['measured']['traffic_reduction']:,.1f}x")
    for row in report["measured"].get("kernels", []):
        lines.append(f"  measured kernel: {row}")
    return "\n".join(lines)


__all__ = ["build_budget", "format_budget"]
