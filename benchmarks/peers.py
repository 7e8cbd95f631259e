"""Measured peers for `andromeda bench score`: the same scoring written in PyTorch, as a competent
PyTorch user would, timed in the same run on the same pool. PyTorch is never a dependency of the
project: where it cannot be imported or sees no GPU, the rows are skipped with the reason.

Every peer's timed scope is the project row's: the scores of the whole pool and the top K of them
(the project's `score_ms + topk_ms`).

* `torch dot eager`, `torch dot compiled`: the two-tower score `X @ u` and `torch.topk`, the second
  compiled with `torch.compile(mode=COMPILE_MODE)`.
* The MoE, per format one skinny tensor-core matrix product of the format's ads by its FiLM-folded
  [D x 2E] gate and expert vectors (the pool's ads grouped by format once, before timing, as a user
  would store them), then the gate bias, top-k routing by repeated max, softmax over the routed
  logits, the weighted expert sum and `torch.topk`; the whole function over all formats compiled
  with `torch.compile(mode=COMPILE_MODE)`, which fuses the epilogue into one pass. Three ways to
  write the products:
  - `torch moe fp16 out` (eager and compiled): fp16 tables, fp16 products (what `torch.mm` gives for
    fp16 inputs), the epilogue reading them back;
  - `torch moe fp32 out`: fp16 tables, products accumulated and written in float32 (`torch.mm`'s
    `out_dtype`);
  - `torch moe hi+lo fp32 out`: each float32 table split into an fp16 high part and the fp16 rest,
    two products in float32 summed: the table's precision, as the project's tensor-core kernel
    keeps it.

Every peer's answer is checked as the project's rows are (`benchmarks.score.check_answer`: each
score within SCORE_ATOL of the float64 reference, none of a better ad missed, rank order): a peer
that fails is reported as failing, and the ratios of `score_targets` are taken against the fastest
peer that passes.
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


def torch_peers(rows_xp, fmt_slot_xp, us, tab: np.ndarray, u: np.ndarray, top_e: int, k: int, refs: dict,
                check, progress=None) -> list[dict]:
    """Time the peers on a pool of stored fp16 rows (CuPy (n, D) float16, shared with PyTorch through
    DLPack) whose slot formats are `fmt_slot_xp`; `tab` is the request's folded table (F, TW) float32,
    `u` the two-tower vector; `refs[kind]` the float64 reference scores of every slot and their gate-tie
    mask; `check(slots, scores, ref, ties, k)` the project's answer check."""
    import torch

    log = progress or (lambda *_: None)
    X = torch.from_dlpack(rows_xp)
    n, D = X.shape
    E = us.E
    fmt = torch.from_dlpack(fmt_slot_xp).long()
    out = []

    def record(name, fn, args, kind, to_slots=None, **extra):
        t0 = time.time()
        try:
            vals, idx = fn(*args)
            torch.cuda.synchronize()
        except (RuntimeError, TypeError) as e:  # a variant this PyTorch cannot run
            out.append({"peer": name, "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
            log(f"  {name}: skipped ({type(e).__name__})")
            return
        first_s = time.time() - t0
        slots = (idx if to_slots is None else to_slots[idx]).cpu().numpy()
        c = check(slots, vals.float().cpu().numpy(), *refs[kind], k)
        t = _time(torch, lambda: fn(*args))
        row = {"peer": name, "kind": kind, "time_ms": t * 1e3, "ads_per_s": n / t, "first_call_s": round(first_s, 1),
               "check": c, "passes": bool(c["ok"]), **extra}
        out.append(row)
        log(f"  {name} fp16 D={D}: {t * 1e3:.3f} ms  {n / t / 1e9:.2f} G ads/s  (first call {first_s:.0f} s, "
            f"max error {c['max_abs_err']:.2g}, {'passes' if c['ok'] else 'FAILS'} the project's check)")

    uu = torch.tensor(u, dtype=torch.float16, device=X.device)

    def dot(X, uu):
        return torch.topk((X @ uu).float(), k)

    record("torch dot eager", dot, (X, uu), "dot")
    record("torch dot compiled", torch.compile(dot, mode=COMPILE_MODE), (X, uu), "dot", compile_mode=COMPILE_MODE)

    # grouped by format once (a layout choice, not timed), one [D x 2E] matrix per format
    order = torch.argsort(fmt, stable=True)
    Xg = X[order].contiguous()
    fmt_sorted = fmt[order].int().contiguous()
    counts = torch.bincount(fmt, minlength=tab.shape[0]).tolist()
    bounds = np.cumsum([0] + counts).tolist()
    T = torch.tensor(tab, dtype=torch.float32, device=X.device)
    W32 = torch.stack([torch.cat([T[f, : E * D].view(E, D), T[f, E * D : 2 * E * D].view(E, D)]).t()
                       for f in range(tab.shape[0])]).contiguous()  # (F, D, 2E) float32
    W = W32.half().contiguous()
    W_lo = (W32 - W.float()).half().contiguous()  # the part of each table fp16 loses
    qb = T[:, 2 * E * D : 2 * E * D + E].contiguous()
    ub = T[:, 2 * E * D + E : 2 * E * D + 2 * E].contiguous()
    lowest = torch.finfo(torch.float32).min
    live = [f for f in range(len(counts)) if counts[f]]

    def epilogue(Y, fmt_sorted, qb, ub):
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

    def moe_fp16(Xg, W, fmt_sorted, qb, ub):
        Y = torch.cat([torch.mm(Xg[bounds[f] : bounds[f + 1]], W[f]) for f in live])
        return epilogue(Y, fmt_sorted, qb, ub)

    def moe_fp32(Xg, W, fmt_sorted, qb, ub):
        Y = torch.cat([torch.mm(Xg[bounds[f] : bounds[f + 1]], W[f], out_dtype=torch.float32) for f in live])
        return epilogue(Y, fmt_sorted, qb, ub)

    def moe_hi_lo(Xg, W, W_lo, fmt_sorted, qb, ub):
        Y = torch.cat([torch.mm(Xg[bounds[f] : bounds[f + 1]], W[f], out_dtype=torch.float32)
                       + torch.mm(Xg[bounds[f] : bounds[f + 1]], W_lo[f], out_dtype=torch.float32) for f in live])
        return epilogue(Y, fmt_sorted, qb, ub)

    plain = (Xg, W, fmt_sorted, qb, ub)
    record("torch moe fp16 out eager", moe_fp16, plain, "moe", order)
    record("torch moe fp16 out compiled", torch.compile(moe_fp16, mode=COMPILE_MODE), plain, "moe", order,
           compile_mode=COMPILE_MODE)
    record("torch moe fp32 out compiled", torch.compile(moe_fp32, mode=COMPILE_MODE), plain, "moe", order,
           compile_mode=COMPILE_MODE)
    record("torch moe hi+lo fp32 out compiled", torch.compile(moe_hi_lo, mode=COMPILE_MODE),
           (Xg, W, W_lo, fmt_sorted, qb, ub), "moe", order, compile_mode=COMPILE_MODE)
    return out


class BatchedMaskedPeer:
    """A batch of R requests scored the way a competent PyTorch user would batch them: the pool's
    stored fp16 rows (CuPy (S, D), slot order, shared through DLPack) grouped by format once, a chunk
    of `chunk_slots` slots at a time (a layout choice, not timed); then for each block of up to
    `block_slots` slots of one format, one product of the block by the batch's tables of that format,
    (D x R.2E) in fp16 hi + lo parts with float32 output (the project's tolerance), the gate bias,
    top-k routing by repeated max, softmax over the routed logits, the weighted expert sum, every
    score of a slot the request's match left ineligible set to -inf, `torch.topk` per request; then
    the top k of the blocks' candidates. Dense: every (slot, request) pair is scored, eligible or not.

    `run(block_fn, tabs, elig)`: tabs float32 (R, F, TW) and elig int32 (R, S / 32) torch tensors on
    the device; `block_fn` is `block_scores` or a compiled copy of it. Returns (scores (R, <= k),
    slots (R, <= k)), -inf scores where a request has fewer than k eligible slots."""

    def __init__(self, rows_xp, chunk_format: np.ndarray, chunk_slots: int, experts: int, top_e: int, k: int,
                 block_slots: int = 1 << 18):
        import torch

        self.torch, self.E, self.top_e, self.k = torch, experts, top_e, k
        X = torch.from_dlpack(rows_xp)
        S, self.D = X.shape
        n_chunks = S // chunk_slots
        chunk_format = np.asarray(chunk_format[:n_chunks], np.int64)
        self.F = int(chunk_format.max()) + 1 if n_chunks else 0
        order = np.argsort(chunk_format, kind="stable")
        self.order = torch.as_tensor(order, device=X.device)
        self.Xp = X.view(n_chunks, chunk_slots, self.D)[self.order].reshape(S, self.D).contiguous()
        self.slot_of_pos = (self.order[:, None] * chunk_slots
                            + torch.arange(chunk_slots, device=X.device)[None, :]).reshape(-1)
        self.n_chunks, self.words_per_chunk = n_chunks, chunk_slots // 32
        block = max(chunk_slots, block_slots // chunk_slots * chunk_slots)
        self.runs = []  # (format, first, end) slot ranges of the grouped layout, at most `block` slots each
        first = 0
        for f, count in enumerate(np.bincount(chunk_format, minlength=self.F)):
            end = first + int(count) * chunk_slots
            self.runs += [(f, lo, min(end, lo + block)) for lo in range(first, end, block)]
            first = end

    def block_scores(self, Xb, Whi, Wlo, qb, ub, words):
        """Top k of one block for every request: Xb fp16 (n, D), Whi / Wlo fp16 (D, R.2E), qb / ub float32
        (R, E), words int32 (R, n / 32): (scores (R, min(k, n)), positions in the block)."""
        torch, E = self.torch, self.E
        n, R = Xb.shape[0], qb.shape[0]
        Y = (torch.mm(Xb, Whi, out_dtype=torch.float32) + torch.mm(Xb, Wlo, out_dtype=torch.float32)).view(n, R, 2 * E)
        g = Y[..., :E] + qb
        x = Y[..., E:] + ub
        lowest = torch.finfo(torch.float32).min
        gv, xv = [], []
        for _ in range(self.top_e):  # routing by repeated max, ties to the lower expert
            v, i = g.max(dim=2, keepdim=True)
            gv.append(v)
            xv.append(torch.gather(x, 2, i))
            g = g.scatter(2, i, lowest)
        s = (torch.softmax(torch.cat(gv, 2), dim=2) * torch.cat(xv, 2)).sum(2).t()  # (R, n)
        shifts = torch.arange(32, device=words.device, dtype=torch.int32)
        eligible = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(R, n)
        return torch.topk(s.masked_fill(~eligible, float("-inf")), min(self.k, n), dim=1)

    def run(self, block_fn, tabs, elig):
        torch, E, D, F = self.torch, self.E, self.D, self.F
        R = tabs.shape[0]
        W = torch.cat([tabs[:, :F, : E * D].reshape(R, F, E, D), tabs[:, :F, E * D : 2 * E * D].reshape(R, F, E, D)], 2)
        W = W.permute(1, 3, 0, 2).reshape(F, D, R * 2 * E)  # column r.2E + j: request r's gate key / expert j
        Whi = W.half()
        Wlo = (W - Whi.float()).half()
        qb = tabs[:, :F, 2 * E * D : 2 * E * D + E].permute(1, 0, 2).contiguous()  # (F, R, E)
        ub = tabs[:, :F, 2 * E * D + E : 2 * E * D + 2 * E].permute(1, 0, 2).contiguous()
        Ep = elig.view(R, self.n_chunks, self.words_per_chunk)[:, self.order].reshape(R, -1)
        vals, pos = [], []
        for f, lo, hi in self.runs:
            v, i = block_fn(self.Xp[lo:hi], Whi[f].contiguous(), Wlo[f].contiguous(), qb[f], ub[f],
                            Ep[:, lo // 32 : hi // 32].contiguous())
            vals.append(v)
            pos.append(i + lo)
        V, P = torch.cat(vals, 1), torch.cat(pos, 1)
        v, j = torch.topk(V, min(self.k, V.shape[1]), dim=1)
        return v, self.slot_of_pos[torch.gather(P, 1, j)]


def best_passing(peers: list[dict], kind: str) -> dict | None:
    """The fastest peer of `kind` ('moe' or 'dot') whose answer passed the project's check."""
    rows = [p for p in peers if p.get("kind") == kind and p.get("passes")]
    return min(rows, key=lambda p: p["time_ms"]) if rows else None


__all__ = ["BatchedMaskedPeer", "COMPILE_MODE", "best_passing", "torch_peers", "torch_reason"]
