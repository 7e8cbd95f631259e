"""`andromeda quality`'s kernel step: kernel ads per second of the quality experiment's trained models
(`andromeda_nb.quality`), where a CUDA GPU is usable: the fused scoring kernel of
`gpu.fused.FusedScorer` (scoring and per-block top-K, then the final top-K) run with each model's
folded user-side tables, on the quality corpus laid out in slot order (format-uniform chunks) and
replicated until the table is far larger than the GPU's L2 cache (DESIGN section 7).

Before anything is timed, each model's kernel answer on the unreplicated corpus is checked against
the float64 reference (`andromeda_nb.compare.compare_topk`, DESIGN section 4) for every request of the
batch. Figures: median over `repeats` of one batch of `requests` requests, timed with CUDA events after
a warm-up; ads/s = requests x live slots / time. Under the CUDA simulator the same code runs at tiny
sizes (a check of the path, not a speed) and is timed with the host clock.
"""

from __future__ import annotations

import time

import numpy as np

from andromeda_nb.compare import compare_topk
from andromeda_nb.devices import gpu_usable, resolve, simulator_enabled
from andromeda_nb.model import MoeModel, quantize, two_tower_vector, user_side
from andromeda_nb.reference import reference_scores, two_tower_scores
from andromeda_nb.scoring import dot_table, fold_user_side
from andromeda_nb.slots import CHUNK_SLOTS, EMPTY
from andromeda_nb.types import Request

DEFAULT_SLOTS = 1 << 24  # about 16.8 M slots: 1.1 GB at int8, 4.3 GB at fp32, far beyond L2


def slot_table(embedding: np.ndarray, formats: np.ndarray, precision: str, copies: int = 1):
    """The corpus in slot order: ads grouped by format into chunks of CHUNK_SLOTS (the last chunk of a
    format padded with EMPTY slots), the whole repeated `copies` times with ad ids offset by N per
    copy. Returns (values (S, D) stored dtype, scale float32 (S,), chunk_format int32 (S/256,),
    slot_ad_id int64 (S,))."""
    table = quantize(embedding, precision)
    n = len(table)
    rows, chunk_format = [], []
    for f in np.unique(formats).tolist():
        ids = np.flatnonzero(formats == f)
        chunks = -(-len(ids) // CHUNK_SLOTS)
        padded = np.full(chunks * CHUNK_SLOTS, EMPTY, np.int64)
        padded[: len(ids)] = ids
        rows.append(padded)
        chunk_format += [f] * chunks
    slot_rows = np.concatenate(rows)
    live = slot_rows != EMPTY
    values = np.zeros((len(slot_rows), table.D), table.values.dtype)
    values[live] = table.values[slot_rows[live]]
    scale = np.ones(len(slot_rows), np.float32)
    scale[live] = table.scale[slot_rows[live]]
    slot_ad_id = np.concatenate([np.where(live, slot_rows + c * n, EMPTY) for c in range(copies)])
    return (np.tile(values, (copies, 1)), np.tile(scale, copies),
            np.tile(np.asarray(chunk_format, np.int32), copies), slot_ad_id)


def eligibility_words(slot_ad_id: np.ndarray, requests: int) -> np.ndarray:
    """uint32 (requests, S/32): every live slot eligible (bit s % 32 of word s // 32)."""
    live = (slot_ad_id != EMPTY).reshape(-1, 32).astype(np.uint64)
    words = (live << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32)
    return np.tile(words, (requests, 1))


def _tables(name: str, model: MoeModel, requests: list[Request]) -> np.ndarray:
    if name == "two_tower":
        return np.stack([dot_table(two_tower_vector(model, r), model.E, model.F) for r in requests])
    return np.stack([fold_user_side(user_side(model, r)) for r in requests])


def kernel_throughput(models: dict[str, MoeModel], embedding: np.ndarray, formats: np.ndarray,
                      requests: list[Request], *, precision: str = "fp32", k: int = 100,
                      slots: int = DEFAULT_SLOTS, repeats: int = 20, device: str = "auto") -> dict:
    """Ads per second of the fused kernel per model (name -> MoeModel; "two_tower" runs the dot
    kernel). Returns {"skipped": reason} when no CUDA GPU is usable (device "auto" or "gpu") or
    device is "cpu"; "sim" runs the path under the simulator (slots and repeats should be tiny)."""
    if device == "cpu":
        return {"skipped": "--device cpu: the fused kernel is measured on a CUDA GPU"}
    if device == "auto" and simulator_enabled():
        return {"skipped": "the CUDA simulator is on (a check of the path, not a speed)"}
    if device == "auto" and not gpu_usable():
        return {"skipped": "no usable CUDA GPU"}  # not a fallback: nothing runs in its place
    try:
        where = resolve(device, kernels=True, what="the fused kernel's measurement")
    except RuntimeError as exc:
        return {"skipped": str(exc)}
    from gpu import runtime
    from gpu.fused import FusedScorer  # imports numba.cuda: only after the device choice

    cuda = runtime.cuda()
    n = len(embedding)
    copies = max(1, slots // max(n, 1))
    values, scale, chunk_format, slot_ad_id = slot_table(embedding, formats, precision, copies)
    live = int((slot_ad_id != EMPTY).sum())
    d_elig = cuda.to_device(eligibility_words(slot_ad_id, len(requests)))
    out = {"device": _device_name(cuda, where), "precision": precision, "slots": int(len(slot_ad_id)),
           "live_slots": live, "requests": len(requests), "k": k, "repeats": repeats,
           "checked": "top-K equal to the float64 reference (DESIGN section 4) before timing",
           "ms": {}, "ads_per_second": {}}
    check = slot_table(embedding, formats, precision, 1)
    d_check_elig = cuda.to_device(eligibility_words(check[3], len(requests)))
    table = quantize(embedding, precision)
    ids = np.arange(n, dtype=np.int64)
    for name, model in models.items():
        kind, top_e = ("dot", 1) if name == "two_tower" else ("moe", model.top_k)
        tabs = np.ascontiguousarray(_tables(name, model, requests), np.float32)
        checker = FusedScorer(check[0].copy(), *check[1:], experts=model.E, top_e=top_e, kind=kind)
        for r, (got_ids, got_scores) in zip(requests, checker.topk(d_check_elig, cuda.to_device(tabs), k)):
            if name == "two_tower":
                ref = two_tower_scores(two_tower_vector(model, r), table, ids)
            else:
                ref = reference_scores(model, user_side(model, r), table, ids, formats)
            verdict = compare_topk(ids, ref, got_ids, got_scores, k)
            if not verdict.ok:
                raise AssertionError(f"{name}: the kernel's top-{k} for request {r.request_id} differs from the "
                                     f"reference: {verdict.message}")
        del checker
        scorer = FusedScorer(values.copy(), scale, chunk_format, slot_ad_id, experts=model.E, top_e=top_e,
                             kind=kind)
        d_tabs = cuda.to_device(tabs)
        scorer.topk(d_elig, d_tabs, k)  # warm-up: compiles and allocates
        times = [_timed(cuda, where, lambda: scorer.topk(d_elig, d_tabs, k)) for _ in range(repeats)]
        ms = float(np.median(times))
        out["ms"][name] = ms
        out["ads_per_second"][name] = len(requests) * live / (ms / 1e3)
        out["kernel_version"] = scorer.version
        del scorer
    return out


def _timed(cuda, where: str, fn) -> float:
    if where == "sim":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = cuda.event(), cuda.event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(cuda.event_elapsed_time(start, end))


def _device_name(cuda, where: str) -> str:
    if where == "sim":
        return "CUDA simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def measure_result(result, *, device: str = "auto", slots: int = DEFAULT_SLOTS, requests: int = 8,
                   repeats: int = 20) -> dict:
    """`kernel_throughput` of a finished quality run's models on its corpus and first test requests."""
    from andromeda_nb.quality.truth import World

    cfg = result.config
    world = World(cfg.truth, cfg.seed)
    test = world.test_users(min(requests, cfg.test_requests))
    return kernel_throughput(result.models, world.ads.embedding, world.ads.format,
                             [test.request(i) for i in range(len(test))], precision=cfg.precision,
                             k=cfg.recall_k, slots=slots, repeats=repeats, device=device)


__all__ = ["DEFAULT_SLOTS", "eligibility_words", "kernel_throughput", "measure_result", "slot_table"]
