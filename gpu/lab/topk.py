"""The top-K kernel lab: every version of the final GPU top-K, the superseded one beside the shipped one
(`gpu/kernels/topk.py`).

Versions (`VERSIONS`, every one; the product runs `gpu.kernels.topk.SHIPPED`):
    v1 block per request   `final_topk_v1` alone: one thread block per request reads every candidate
                           of its request (milliseconds with millions of candidates)
    v2 segments            a segment stage first, in parallel over the whole GPU (shipped)
"""

from __future__ import annotations

from andromeda_nb.versions import Version, version_table

from ..kernels import topk as shipped

VERSIONS = version_table(
    Version(1, "v1 block per request", "block per request", shipped.TopkPlan(segmented=False)),
    *shipped.VERSIONS.values(),
)
SHIPPED = shipped.SHIPPED

__all__ = ["SHIPPED", "VERSIONS"]
