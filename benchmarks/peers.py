"""Measured peers for `andromeda bench score`: the same scoring written in PyTorch, as a competent
PyTorch user would, timed in the same run on the same pool. PyTorch is never a dependency of the
project: where it cannot be imported or sees no GPU, the rows are skipped with the reason.

* `torch dot`: the two-tower score `X @ u` and `torch.topk`, eager.
* `torch moe compiled`: per format, the FiLM-folded gate and expert vectors as one [D x 2E] fp16
  matrix, so the 2E per-ad dots are one skinny tensor-core matrix product per format (the pool's
  ads grouped by format once, before timing, as a user would store them); then the gate bias,
  top-k routing by repeated max, softmax over the routed logits, the weighted expert sum and
  `torch.topk`, the whole function compiled with `torch.compile(mode="max-autotune-no-cudagraphs")`,
  which fuses the epilogue into one pass. Also timed eager.

Every peer's answer is checked against the float64 reference of the pool before it is timed: the
largest score error among its top-K and how many of the reference top-K it recovers.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

COMPILE_MODE = "max-autotune-no-cudagraphs"


def torch_reason() -> str | None:
    """None when PyTorch with a CUDA device is importable, else why the peers are skipped."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (it is a measured peer, never a dependency)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def _time(torch, fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def _check(ids_slots: np.ndarray, scores: np.ndarray, ref_host: np.ndarray, k: int) -> dict:
    """Peer answer (slots, scores) against the float64 reference scores of every slot."""
    want = np.argsort(-ref_host, kind="stable")[:k]
    err = np.abs(scores.astype(np.float64) - ref_host[ids_slots])
    return {"max_abs_err": float(err.max()) if len(err) else 0.0,
            "recall": float(len(set(ids_slots.tolist()) & set(want.tolist())) / max(1, len(want)))}


def torch_peers(rows_xp, fmt_slot_xp, us, tab: np.ndarray, u: np.ndarray, top_e: int, k: int, ref_moe_xp,
                ref_dot_xp, progress=None) -> list[dict]:
    """Time the peers on a pool of stored fp16 rows (CuPy (n, D) float16, shared with PyTorch through
    DLPack) whose slot formats are `fmt_slot_xp`; `tab` is the request's folded table (F, TW) float32,
    `u` the two-tower vector; `ref_*_xp` the float64 reference scores of every slot."""
    import torch

    log = progress or (lambda *_: None)
    X = torch.from_dlpack(rows_xp)
    n, D = X.shape
    E = us.E
    fmt = torch.from_dlpack(fmt_slot_xp).long()
    ref_moe = ref_moe_xp.get()
    ref_dot = ref_dot_xp.get()
    out = []

    uu = torch.tensor(u, dtype=torch.float16, device=X.device)

    def dot():
        return torch.topk((X @ uu).float(), k)

    vals, idx = dot()
    t = _time(torch, dot)
    out.append({"peer": "torch dot", "time_ms": t * 1e3, "ads_per_s": n / t,
                "check": _check(idx.cpu().numpy(), vals.cpu().numpy(), ref_dot, k)})
    log(f"  torch dot fp16 D={D}: {t * 1e3:.3f} ms  {n / t / 1e9:.2f} G ads/s")

    # grouped by format once (a layout choice, not timed), one [D x 2E] fp16 matrix per format
    order = torch.argsort(fmt, stable=True)
    Xg = X[order].contiguous()
    fmt_sorted = fmt[order].int().contiguous()
    counts = torch.bincount(fmt, minlength=tab.shape[0]).tolist()
    bounds = np.cumsum([0] + counts).tolist()
    T = torch.tensor(tab, dtype=torch.float32, device=X.device)
    W = torch.stack([torch.cat([T[f, : E * D].view(E, D), T[f, E * D : 2 * E * D].view(E, D)]).t()
                     for f in range(tab.shape[0])]).half().contiguous()  # (F, D, 2E)
    qb = T[:, 2 * E * D : 2 * E * D + E].contiguous()
    ub = T[:, 2 * E * D + E : 2 * E * D + 2 * E].contiguous()
    Y = torch.empty((n, 2 * E), dtype=torch.float16, device=X.device)
    lowest = torch.finfo(torch.float32).min

    def moe(Xg, W, fmt_sorted, qb, ub, Y):
        for f in range(len(counts)):  # one skinny tensor-core product per format
            if counts[f]:
                torch.mm(Xg[bounds[f] : bounds[f + 1]], W[f], out=Y[bounds[f] : bounds[f + 1]])
        g = Y[:, :E].float() + qb[fmt_sorted]
        x = Y[:, E:].float() + ub[fmt_sorted]
        # routing by repeated max (ties to the lower expert, as the reference), softmax over the routed
        gv, xv = [], []
        for _ in range(top_e):
            v, i = g.max(dim=1, keepdim=True)
            gv.append(v)
            xv.append(torch.gather(x, 1, i))
            g = g.scatter(1, i, lowest)
        gv, xv = torch.cat(gv, 1), torch.cat(xv, 1)
        w = torch.softmax(gv, dim=1)
        return torch.topk((w * xv).sum(dim=1), k)

    for name, fn in (("torch moe eager", moe), ("torch moe compiled", torch.compile(moe, mode=COMPILE_MODE))):
        args = (Xg, W, fmt_sorted, qb, ub, Y)
        t0 = time.time()
        vals, idx = fn(*args)
        torch.cuda.synchronize()
        first_s = time.time() - t0
        slots = order[idx].cpu().numpy()
        t = _time(torch, lambda: fn(*args))
        row = {"peer": name, "time_ms": t * 1e3, "ads_per_s": n / t, "first_call_s": round(first_s, 1),
               "check": _check(slots, vals.cpu().numpy(), ref_moe, k)}
        if name.endswith("compiled"):
            row["compile_mode"] = COMPILE_MODE
        out.append(row)
        log(f"  {name} fp16 D={D}: {t * 1e3:.3f} ms  {n / t / 1e9:.2f} G ads/s  (first call {first_s:.0f} s, "
            f"max error {row['check']['max_abs_err']:.2g}, recall {row['check']['recall']:.3f})")
    return out


__all__ = ["COMPILE_MODE", "torch_peers", "torch_reason"]
