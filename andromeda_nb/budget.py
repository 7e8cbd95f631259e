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
counting relay and prints both (`migration.budget` holds the `andromeda budget` report, which counts
a corpus's eligible sets for it).
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
