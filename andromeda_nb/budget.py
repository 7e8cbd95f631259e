"""The byte budget per candidate (migration step 2): what each design must move, counted from the
data layout, so it can be printed beside what was measured.

Device memory, per ad scored for one request:
* fused: the kernel reads each stored ad byte once (embedding, the int8 scale) plus the ad's
  eligibility bit, and writes nothing per ad (only the per-block top-K candidates, counted as
  amortized bytes per ad).
* unfused: the same model as separate array operations (gather, FiLM, gate, routing, routed expert
  products, score, top-K selection), each reading its inputs from and writing its outputs to device
  memory in float32 with int64 indices, as array libraries do.

Network, per request:
* remote scoring: client -> index host (the request), index host -> scorer (candidate ids and the
  user-side tables), scorer -> index host (a float32 per candidate), index host -> client (top-K).
* co-located: client -> server (the request), server -> client (top-K).
These are payload bytes; the harness measures real bytes on the wire (framing included) with a
counting relay and prints both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .constants import DEFAULT_D, DEFAULT_E, DEFAULT_F, DEFAULT_TOP_EXPERTS, INT8_SCALE_BYTES, PRECISION_BYTES

F32, I64 = 4, 8
ANSWER_ROW_BYTES = I64 + F32 + I64  # request_id, score, ad_id per returned row


@dataclass(frozen=True)
class Stage:
    name: str
    read: float
    write: float

    @property
    def total(self) -> float:
        return self.read + self.write


def stored_ad_bytes(precision: str, dim: int = DEFAULT_D) -> int:
    """Bytes of one stored ad embedding (int8 carries a float32 scale)."""
    return dim * PRECISION_BYTES[precision] + (INT8_SCALE_BYTES if precision == "int8" else 0)


def fused_stages(precision: str, dim: int = DEFAULT_D, k: int = 100, block_ads: int = 256) -> list[Stage]:
    return [
        Stage("eligibility bit", 1 / 8, 0.0),
        Stage("stored embedding", stored_ad_bytes(precision, dim), 0.0),
        # each block keeps at most min(k, block_ads) (id, score) candidates for the final top-K
        Stage("block top-K candidates", 0.0, min(k, block_ads) * (I64 + F32) / block_ads),
    ]


def unfused_stages(precision: str, dim: int = DEFAULT_D, experts: int = DEFAULT_E,
                   top: int = DEFAULT_TOP_EXPERTS) -> list[Stage]:
    """One eligible candidate through array operations that materialize every intermediate."""
    vec = dim * F32
    return [
        Stage("eligible ids (nonzero)", 1 / 8, I64),
        Stage("gather embeddings", I64 + stored_ad_bytes(precision, dim), vec),
        Stage("FiLM r = gamma*a + beta", vec + 2, vec),  # format (int16) picks the tables
        Stage("gate logits (E)", vec, experts * F32),
        Stage("top-k routing + softmax", experts * F32, top * (I64 + F32)),
        Stage("routed expert products", vec + top * (I64 + F32), top * F32),
        Stage("score", top * F32 * 2, F32),
        Stage("top-K selection (argpartition)", F32, I64),
    ]


def total(stages: list[Stage]) -> float:
    return sum(s.total for s in stages)


def user_side_bytes(dim: int = DEFAULT_D, experts: int = DEFAULT_E, formats: int = DEFAULT_F) -> int:
    """U and Q (E, D) plus per-format FiLM tables gamma and beta (F, D), float32."""
    return (2 * experts * dim + 2 * formats * dim) * F32


def network_payload(request_bytes: int, n_eligible: int, k: int, dim: int = DEFAULT_D,
                    experts: int = DEFAULT_E, formats: int = DEFAULT_F) -> dict[str, dict[str, dict[str, int]]]:
    """Payload bytes per request for both architectures, per hop (the connections a counting relay
    watches) and direction: upstream is towards the server of that hop."""
    answer = min(k, n_eligible) * ANSWER_ROW_BYTES
    return {
        "remote": {
            "client->index host": {"upstream": request_bytes, "downstream": answer},
            "index host->scorer": {"upstream": n_eligible * I64 + user_side_bytes(dim, experts, formats),
                                   "downstream": n_eligible * F32},
        },
        "colocated": {
            "client->server": {"upstream": request_bytes, "downstream": answer},
        },
    }


def payload_total(hops: dict[str, dict[str, int]]) -> float:
    return float(sum(d["upstream"] + d["downstream"] for d in hops.values()))


def budget_table(precisions=("fp32", "fp16", "int8"), dim: int = DEFAULT_D, k: int = 100) -> list[dict]:
    rows = []
    for p in precisions:
        fused, unfused = fused_stages(p, dim, k), unfused_stages(p, dim)
        rows.append({
            "precision": p,
            "dim": dim,
            "fused_bytes_per_ad": total(fused),
            "unfused_bytes_per_ad": total(unfused),
            "unfused_over_fused": total(unfused) / total(fused),
            "fused_stages": [asdict(s) for s in fused],
            "unfused_stages": [asdict(s) for s in unfused],
        })
    return rows


__all__ = [
    "Stage",
    "budget_table",
    "fused_stages",
    "network_payload",
    "payload_total",
    "stored_ad_bytes",
    "total",
    "unfused_stages",
    "user_side_bytes",
]


# --- the `andromeda budget` report ---------------------------------------------------------------------

EXAMPLE_ELIGIBLE = 500_000  # the illustrative pool of the published write-up: 500,000 ads pass targeting
EXAMPLE_REQUEST_BYTES = 2_000


def _network_from_dataset(dataset, k: int) -> dict:
    from cpu_baseline.index import CpuTargetingIndex

    from .flight import request_text

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
    import json

    out: dict = {}
    for path in paths:
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        try:
            doc = json.loads(lines[-1]) if lines else {}
        except ValueError as exc:
            raise ValueError(f"{path}: the last line is not JSON ({exc})") from None
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
