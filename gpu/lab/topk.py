"""The top-K kernel lab: every version of the final GPU top-K, the superseded one beside the shipped one
(`gpu/kernels/topk.py`).

Versions (`VERSIONS`, every one; the product runs `gpu.kernels.topk.SHIPPED`):
    v1 block per request   `final_topk_v1` alone: one thread block per request reads every candidate
                           of its request (milliseconds with millions of candidates)
    v2 segments            a segment stage first, in parallel over the whole GPU (shipped)
    v3 warp counts         v2 with the radix select's digits counted a warp at a time: the lanes of a
                           warp holding the same digit found together (`match.any.sync`), one shared
                           atomic for them all, where v2 makes one a key, 32 on one address when the
                           scores of a warp share a digit, as close scores do in the first rounds
"""

from __future__ import annotations

from andromeda_nb.versions import Version, version_table

from ..kernels import topk as shipped

VERSIONS = version_table(
    Version(1, "v1 block per request", "block per request", shipped.TopkPlan(segmented=False)),
    *shipped.VERSIONS.values(),
    Version(3, "v3 warp counts", "segments, digits counted a warp at a time",
            shipped.TopkPlan(segmented=True, warp_counts=True)),
)
SHIPPED = shipped.SHIPPED

__all__ = ["SHIPPED", "VERSIONS"]
