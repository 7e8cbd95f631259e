"""`andromeda bench match`: pool ads per second of the GPU targeting index, every kernel version.

Generating 100M ads in Python is too slow, so the pool is a generated base corpus *tiled*: copy k of
base ad i is an ad with id `base_id + k * stride` and the same targeting. The per-ad device data
(residual words, program pointers, schedules and the clause programs themselves) is physically
repeated, so every byte a scan reads is real; only the custom-location table (a few thousand circles)
is shared between copies. Before anything is timed, the full-size answer is checked against the
oracle: every copy of an ad must agree with the base ad (the whole pool, every request of the check
batch), the base ads against `andromeda_nb.oracle.eligible` (all of them for some requests, a random
sample of slots for the rest), and every kernel version against the shipped one, word for word.

Timing follows DESIGN section 7: CUDA events around the kernel launch, warm-up launches first, the
median of repeated launches. Pool ads per second = requests x live ads / kernel time (labelled
"kernel"). Request preparation on the host (`host_prepare`: encoding, term lookup, group and circle
tables, upload) is timed separately and reported beside, with the rate of kernel and preparation one
after the other ("+host"; a serving loop overlaps them, gpu/engine.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from andromeda_nb.measure import copy_bandwidth as copy_rate
from andromeda_nb.measure import log, package_version, repeat_timed, software
from andromeda_nb.provenance import write_result
from andromeda_nb.compiled import CompiledTargeting, encode_request, encode_requests
from andromeda_nb.geo_layout import world_buckets
from andromeda_nb.oracle import eligible
from andromeda_nb.slots import CHUNK_SLOTS, EMPTY, SlotAllocator
from .tiling import BaseCorpus, load_or_generate_base, stride_of
from andromeda_nb.types import Ad, Request, Retire, SetStatus, Upsert
from andromeda_nb.versions import Version

from gpu.index import GpuTargetingIndex, Vocabulary, clause_programs, resid_words

BASE_ADS = 32_768
CHECK_REQUESTS = 64  # the batch checked at full size (one wide group)
ORACLE_FULL_REQUESTS = 8  # requests checked against the oracle on every base ad
ORACLE_SAMPLE_SLOTS = 4096  # random slots checked against the oracle for every check request
BATCHES = (64, 256)  # requests per launch
WARMUP = 2
MIN_REPS, MAX_REPS = 5, 50
REP_BUDGET_S = 1.5  # stop repeating a measurement after this much kernel time (at least MIN_REPS)
UPDATE_ROUNDS, UPDATES_PER_ROUND = 20, 1000
UPDATE_CHECK_ADS = 2000  # touched ads checked against the oracle after the update rounds


# --- tiled pools on the device -------------------------------------------------------------------------


class TiledSlotMap:
    """ad id -> slot for a tiled pool, computed instead of stored (a dict of 100M entries would take
    minutes to build), with an overlay for the ids that updates moved, added or removed."""

    def __init__(self, base_ids: np.ndarray, base_slot0: np.ndarray, block_step: np.ndarray, copies: int, stride: int,
                 first_copy: int = 0):
        self._order = np.argsort(base_ids)
        self._ids = base_ids[self._order]
        self._slot0 = base_slot0[self._order]  # slot of copy 0
        self._step = block_step[self._order]  # slots between copies (ads of the base row's format)
        self.copies, self.stride, self.first_copy = copies, stride, first_copy
        self._moved: dict[int, int] = {}
        self._gone: set[int] = set()
        self._n = copies * len(base_ids)

    def _computed(self, ad_id: int) -> int | None:
        k, base = divmod(int(ad_id), self.stride)
        k -= self.first_copy
        if not 0 <= k < self.copies:
            return None
        i = int(np.searchsorted(self._ids, base))
        if i >= len(self._ids) or self._ids[i] != base:
            return None
        return int(self._slot0[i] + k * self._step[i])

    def __contains__(self, ad_id) -> bool:
        if ad_id in self._moved:
            return True
        return ad_id not in self._gone and self._computed(ad_id) is not None

    def __getitem__(self, ad_id) -> int:
        if ad_id in self._moved:
            return self._moved[ad_id]
        s = None if ad_id in self._gone else self._computed(ad_id)
        if s is None:
            raise KeyError(ad_id)
        return s

    def __setitem__(self, ad_id, slot) -> None:
        if ad_id not in self:
            self._n += 1
        self._gone.discard(ad_id)
        self._moved[ad_id] = slot

    def pop(self, ad_id):
        slot = self[ad_id]
        self._moved.pop(ad_id, None)
        if self._computed(ad_id) is not None:
            self._gone.add(ad_id)
        self._n -= 1
        return slot

    def __len__(self) -> int:
        return self._n


def build_tiled_index(base_ct: CompiledTargeting, copies: int, *, version: int | None = None,
                      device: str = "auto", spare: float = 0.01, chunk_slots: int = CHUNK_SLOTS,
                      first_copy: int = 0, rank: np.ndarray | None = None, buckets=None) -> GpuTargetingIndex:
    """A GpuTargetingIndex over `copies` copies of the base ads, laid out exactly as
    `GpuTargetingIndex.from_compiled(tile_compiled(base_ct, copies))` would lay it out (slots grouped
    by format, copies in order inside a format), built from the base's programs by repetition.
    `first_copy`: the copies are numbered from it (ids base_id + (first_copy + k) * stride), so pools
    built with disjoint ranges of copies hold disjoint ads (the shards of a tiled pool). `rank` (one
    number per base ad, e.g. `andromeda_nb.geo_layout.clustered_order`): a format's slots hold its base
    ads in that order, each base ad's copies side by side: the order that one sort by rank over the
    whole tiled corpus gives (ties by copy), so a cluster spans every copy, as it would in a corpus of
    that size. `buckets`: the index's `GeoBuckets` (default hashed)."""
    if copies < 1 or first_copy < 0:
        raise ValueError(f"a tiled pool needs at least one copy from copy 0 on, got {copies} from {first_copy}")
    index = GpuTargetingIndex(device=device, version=version)
    index.vocab = Vocabulary(base_ct.terms)
    dense = index.vocab.dense_bulk(base_ct.terms)
    stride = stride_of(base_ct)
    fmt = base_ct.format.astype(np.int64)
    slot_ids, chunk_fmt, used_parts = [], [], []
    resid_parts, start_parts, len_parts, prog_parts, st_parts, en_parts, geo_parts = [], [], [], [], [], [], []
    if buckets is not None:
        index.geo = buckets
    masks = index.geo.ad_masks(base_ct)
    base_slot0 = np.zeros(len(base_ct), np.int64)
    block_step = np.zeros(len(base_ct), np.int64)
    words = 0
    cap = 0
    for f in np.unique(fmt):
        rows = np.flatnonzero(fmt == f)
        if rank is not None:
            rows = rows[np.argsort(np.asarray(rank)[rows], kind="stable")]
        n_f = len(rows) * copies
        n_chunks = -(-int(n_f * (1.0 + spare)) // chunk_slots)
        ranked = rank is not None
        # (copies, rows): copy k of base row i; laid out copy after copy, or (ranked) row after row
        lay = (lambda m: m.T.ravel()) if ranked else (lambda m: m.ravel())
        rep = (lambda v: np.repeat(v, copies)) if ranked else (lambda v: np.tile(v, copies))
        ids = lay(base_ct.ad_id[rows][None, :] + (np.arange(first_copy, first_copy + copies, dtype=np.int64)
                                                  * stride)[:, None])
        block = np.full(n_chunks * chunk_slots, EMPTY, np.int64)
        block[:n_f] = ids
        slot_ids.append(block)
        chunk_fmt += [int(f)] * n_chunks
        used_parts.append(cap + np.arange(n_f, dtype=np.int64))
        base_slot0[rows] = cap + np.arange(len(rows)) * (copies if ranked else 1)
        block_step[rows] = 1 if ranked else len(rows)
        prog, start, length = clause_programs(base_ct, rows, dense)
        k = np.arange(copies, dtype=np.int64)
        prog_parts.append(np.tile(prog, copies))
        start_parts.append(lay(start[None, :] + (words + k * len(prog))[:, None]))
        len_parts.append(rep(length))
        resid_parts.append(rep(resid_words(base_ct, rows)))
        geo_parts.append(rep(masks[rows]))
        st_parts.append(rep(base_ct.start_time[rows]))
        en_parts.append(rep(base_ct.end_time[rows]))
        words += len(prog) * copies
        cap += len(block)
    slots = SlotAllocator(chunk_slots)
    slots.slot_ad_id = np.concatenate(slot_ids) if slot_ids else np.empty(0, np.int64)
    slots.chunk_format = np.asarray(chunk_fmt, np.int16)
    slots._slot_of = TiledSlotMap(base_ct.ad_id, base_slot0, block_step, copies, stride, first_copy)
    slots.rebuild_free()
    cat = np.concatenate
    index._install(slots, cat(used_parts), cat(resid_parts), cat(start_parts), cat(len_parts), cat(prog_parts),
                   cat(st_parts), cat(en_parts), base_ct.circles, cat(geo_parts))
    return index


# --- checks ------------------------------------------------------------------------------------------


def _bits(words: np.ndarray) -> np.ndarray:
    """uint32[B, W] -> uint8[B, 32 W] (bit s of a row = slot s)."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1, bitorder="little")


def check_full_size(index: GpuTargetingIndex, base: BaseCorpus, copies: int, words: np.ndarray,
                    requests: Sequence[Request], rng: np.random.Generator, ads_by_id: dict | None = None) -> dict:
    """Check the answer `words` (uint32[len(requests), W]) of a tiled pool against the oracle.
    Returns counts; raises AssertionError on the first disagreement."""
    ct = base.compiled
    stride = stride_of(ct)
    bits = _bits(words)
    slot_ids = index.slots.slot_ad_id
    used = np.flatnonzero(slot_ids != EMPTY)
    assert not bits[:, slot_ids == EMPTY].any(), "an empty slot is marked eligible"
    # 1. every copy agrees with copy 0 of the same base ad (the whole pool, every request): in the
    # tiled layout a format's slots hold copy 0 of its base ads, then copy 1, ... (build_tiled_index)
    slot_format = index.slots.slot_format()
    base_slot = np.zeros(len(ct), np.int64)
    sorted_ids = np.sort(ct.ad_id)
    for f in np.unique(ct.format):
        n_f = int((ct.format == f).sum())
        first = int(np.flatnonzero(slot_format == f)[0])
        block = bits[:, first:first + n_f * copies].reshape(len(requests), copies, n_f)
        assert (block == block[:, :1, :]).all(), f"copies of one base ad of format {f} disagree"
        ids0 = slot_ids[first:first + n_f]
        assert (ids0 < stride).all() and (slot_ids[first + (copies - 1) * n_f:first + copies * n_f] // stride == copies - 1).all()
        base_slot[np.searchsorted(sorted_ids, ids0)] = first + np.arange(n_f)
    base_bits = bits[:, base_slot]
    ads = {a.ad_id: a for a in base.ads} if ads_by_id is None else ads_by_id
    checked = 0
    # 2. base ads against the oracle: all of them for the first requests
    for r, req in enumerate(requests[:ORACLE_FULL_REQUESTS]):
        want = np.fromiter((eligible(ads[int(a)], req) for a in sorted_ids.tolist()), np.uint8, len(sorted_ids))
        bad = np.flatnonzero(want != base_bits[r])
        assert len(bad) == 0, f"request {req.request_id}: base ad {int(sorted_ids[bad[0]])} differs from the oracle"
        checked += len(sorted_ids)
    # 3. random slots of the whole pool against the oracle, every request
    sample = rng.choice(used, min(ORACLE_SAMPLE_SLOTS, len(used)), replace=False)
    for s in sample.tolist():
        ad = ads[int(slot_ids[s] % stride)]
        for r, req in enumerate(requests):
            assert bits[r, s] == eligible(ad, req), f"slot {s} (ad {int(slot_ids[s])}) request {req.request_id}"
            checked += 1
    return {"pool_ads_checked_against_copies": int(len(used) * len(requests)), "oracle_checks": checked}


# --- timing ------------------------------------------------------------------------------------------


def time_kernel(cuda, launch: Callable[[], None], budget_s: float = REP_BUDGET_S) -> dict:
    """Median kernel time in seconds over repeated launches timed with CUDA events, after warm-up.
    The CUDA simulator has no event timer (its events read -1 ms): there the host clock times each
    launch to its end, and the result says so under "clock"."""
    from andromeda_nb.devices import simulator_enabled

    for _ in range(WARMUP):
        launch()
    cuda.synchronize()
    start, stop = cuda.event(), cuda.event()

    def timed_once() -> float:
        start.record()
        launch()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3

    def host_timed_once() -> float:
        t0 = time.perf_counter()
        launch()
        cuda.synchronize()
        return time.perf_counter() - t0

    if simulator_enabled():
        result = repeat_timed(host_timed_once, min_reps=1, max_reps=MIN_REPS, budget_s=budget_s, clock_name="host clock")
        return {**result, "clock": "host (the CUDA simulator has no event timer)"}
    return {**repeat_timed(timed_once, min_reps=MIN_REPS, max_reps=MAX_REPS, budget_s=budget_s,
                           clock_name="CUDA event timer"), "clock": "CUDA events"}


def copy_bandwidth(cuda, nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write (DESIGN section 7)."""
    n = nbytes // 4
    a = cuda.to_device(np.arange(n, dtype=np.uint32))
    b = cuda.device_array(n, np.uint32)
    t = time_kernel(cuda, lambda: b.copy_to_device(a), budget_s=0.5)
    del a, b
    return copy_rate(nbytes, t["median_s"])


def host_prepare(index: GpuTargetingIndex, requests: Sequence[Request], version=None):
    """The host's share of one batch, as this benchmark counts it: the requests encoded and prepared
    for kernel `version` (term lookup, group tables, circle table, upload) into the buffers the index
    keeps, as a serving loop does (`prepare(..., reuse=True)`: valid until the second call after it)."""
    return index.prepare(encode_requests(requests), version=version, reuse=True)


def bench_pool(base: BaseCorpus, copies: int, versions: Sequence[Version], batches: Sequence[int], cuda,
               rng: np.random.Generator, progress: bool, updates: tuple[int, int] | None,
               chunk_slots: int = CHUNK_SLOTS) -> dict:
    """Every version of `versions` (match `Version`s of the kernel lab) on a pool of `copies` copies of
    the base corpus: checked at full size first, then timed per batch size."""
    t0 = time.perf_counter()
    index = build_tiled_index(base.compiled, copies, chunk_slots=chunk_slots, buckets=world_buckets(base.seed))
    cuda.synchronize()
    build_s = time.perf_counter() - t0
    n_ads = len(index)
    log(progress, f"pool {n_ads:,} ads: built in {build_s:.1f} s, {index.device_bytes() / n_ads:.1f} device bytes/ad")
    check_reqs = list(base.requests[:CHECK_REQUESTS])
    enc = [encode_request(r) for r in check_reqs]
    shipped = index.match_slots(enc).copy_to_host()
    t0 = time.perf_counter()
    check = check_full_size(index, base, copies, shipped, check_reqs, rng)
    for v in versions:
        other = index.match_slots(enc, version=v).copy_to_host()
        assert np.array_equal(other, shipped), f"version {v.number} differs from version {index.version} at full size"
    check["versions_equal"] = [v.number for v in versions]
    check["seconds"] = round(time.perf_counter() - t0, 2)
    log(progress, f"  full-size check passed: {check}")
    eligible_share = float(_bits(shipped).sum()) / (len(check_reqs) * n_ads)
    live = index.live_bytes()
    result = {
        "ads": n_ads, "copies": copies, "capacity": index.capacity, "build_s": round(build_s, 2),
        "device_bytes": index.device_bytes(), "device_bytes_per_ad": index.device_bytes() / n_ads,
        "live_bytes_per_ad": {k: v / n_ads for k, v in live.items()},
        "eligible_share": eligible_share, "check": check, "timings": [],
    }
    slot_bytes = 4 + 8  # resid + prog_ptr: read once per slot and group
    prog_bytes = live["programs"] / n_ads
    for v in versions:
        group = v.recipe.group  # requests per group; 0: one thread per (slot, request)
        for b in batches:
            if not group and b != min(batches):
                continue  # the naive kernel costs one thread per (slot, request): the smallest batch says enough
            cycle = [base.requests[i % len(base.requests)] for i in range(b)]
            batch = host_prepare(index, cycle, v)
            out = index.new_output(b)
            t0 = time.perf_counter()
            host_prepare(index, cycle, v)
            prep_s = time.perf_counter() - t0
            budget = REP_BUDGET_S if group else REP_BUDGET_S / 3
            t = time_kernel(cuda, lambda: index.run(batch, out, version=v), budget)
            ads_per_s = b * n_ads / t["median_s"]
            groups = -(-b // group) if group else b
            # napkin math: per-slot columns and programs read once per group, output written once
            min_bytes = groups * index.capacity * slot_bytes + groups * live["programs"] + b * index.capacity / 8
            row = {"version": v.number, "batch": b, **{k: t[k] for k in ("median_s", "min_s", "reps", "clock")},
                   "pool_ads_per_s": ads_per_s, "ms_per_request": 1e3 * t["median_s"] / b,
                   "host_prepare_s": prep_s,
                   # kernel and host preparation one after the other (no overlap): the floor of a batch
                   "pool_ads_per_s_with_host": b * n_ads / (t["median_s"] + prep_s), "scan_bytes_upper": min_bytes,
                   "scan_bandwidth_upper": min_bytes / t["median_s"], "prog_bytes_per_ad": prog_bytes}
            result["timings"].append(row)
            log(progress, f"  v{v.number} batch {b:4d}: {t['median_s'] * 1e3:9.3f} ms  {ads_per_s / 1e9:8.1f} G pool ads/s"
                          f"  ({t['reps']} reps; host prepare {prep_s * 1e3:.1f} ms)")
            del batch, out
    if updates:
        result["updates"] = bench_updates(index, base, copies, cuda, rng, progress, *updates)
    del index
    return result


def bench_updates(index: GpuTargetingIndex, base: BaseCorpus, copies: int, cuda, rng, progress: bool,
                  rounds: int = UPDATE_ROUNDS, per_round: int = UPDATES_PER_ROUND) -> dict:
    """Rounds of (apply a batch of updates, serve one group of requests); then check the touched ads
    and a random sample against the oracle."""
    stride = stride_of(base.compiled)
    base_ads = base.ads
    current: dict[int, Ad] = {}  # ads whose state differs from their base copy
    next_id = stride * copies
    live_new: list[int] = []
    enc = [encode_request(r) for r in base.requests[:CHECK_REQUESTS]]
    batch = index.prepare(enc)
    out = index.new_output(len(enc))
    apply_s = serve_s = 0.0
    n_updates = 0
    retired: set[int] = set()
    for _ in range(rounds):
        ups = []
        for _ in range(per_round):
            op = rng.random()
            if op < 0.3:  # create a new ad with some base ad's targeting
                src = base_ads[rng.integers(len(base_ads))]
                ad = dataclasses.replace(src, ad_id=next_id, format=int(rng.integers(8)))
                next_id += 1
                live_new.append(ad.ad_id)
                current[ad.ad_id] = ad
                ups.append(Upsert(ad))
                continue
            ad_id = int(rng.integers(copies)) * stride + int(base_ads[rng.integers(len(base_ads))].ad_id)
            if ad_id in retired:
                continue
            old = current.get(ad_id) or base.by_id[ad_id % stride]
            if op < 0.55:  # replace targeting (and sometimes format)
                src = base_ads[rng.integers(len(base_ads))]
                ad = dataclasses.replace(src, ad_id=ad_id, format=old.format if rng.random() < 0.8 else int(rng.integers(8)))
                current[ad_id] = ad
                ups.append(Upsert(ad))
            elif op < 0.9:
                status = ("ACTIVE", "PAUSED")[int(rng.integers(2))]
                current[ad_id] = dataclasses.replace(old, ad_id=ad_id, status=status)
                ups.append(SetStatus(ad_id, status))
            else:
                retired.add(ad_id)
                current.pop(ad_id, None)
                ups.append(Retire(ad_id))
        t0 = time.perf_counter()
        index.apply_many(ups)
        apply_s += time.perf_counter() - t0
        n_updates += len(ups)
        if index.capacity // 32 != out.shape[1]:
            out = index.new_output(len(enc))
        t0 = time.perf_counter()
        index.run(batch, out)
        cuda.synchronize()
        serve_s += time.perf_counter() - t0
    words = index.match_slots(enc).copy_to_host()
    bits = _bits(words)
    touched = list(current.items())
    if len(touched) > UPDATE_CHECK_ADS:
        touched = [touched[i] for i in rng.choice(len(touched), UPDATE_CHECK_ADS, replace=False)]
    checked = 0
    for ad_id, ad in touched:
        s = index.slots.slot_of(ad_id)
        for r, req in enumerate(base.requests[:CHECK_REQUESTS]):
            assert bits[r, s] == eligible(ad, req), f"after updates: ad {ad_id} request {req.request_id}"
            checked += 1
    for ad_id in list(retired)[:1000]:
        assert ad_id not in index.slots, f"retired ad {ad_id} still has a slot"
    res = {"rounds": rounds, "updates": n_updates, "apply_s": apply_s, "updates_per_s": n_updates / apply_s,
           "serve_s_between": serve_s, "touched_ads_checked": checked, "compactions": index.compactions}
    log(progress, f"  updates: {res['updates_per_s']:,.0f} updates/s applied in batches of {per_round} while"
                  f" serving ({checked} checks of touched ads passed)")
    return res


def kernel_resources(versions: Sequence[Version]) -> dict:
    """Registers and local memory per thread of each compiled match kernel (after the first run)."""
    out = {}
    for v in versions:
        kernel = v.recipe.kernel
        try:
            regs = kernel.get_regs_per_thread()
            local = kernel.get_local_mem_per_thread()
            out[v.number] = {"regs": list(regs.values()) if isinstance(regs, dict) else regs,
                             "local_bytes": list(local.values()) if isinstance(local, dict) else local}
        except Exception as exc:  # not compiled yet, or an older numba-cuda
            out[v.number] = {"error": str(exc)}
    return out


def environment(cuda) -> dict:
    """The environment stamp of a GPU result: software versions and the device."""
    env = software()
    if package_version("numba-cuda"):
        env["numba_cuda"] = package_version("numba-cuda")
    try:
        dev = cuda.get_current_device()
        env["device"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        env["compute_capability"] = list(dev.compute_capability)
        env["sms"] = dev.MULTIPROCESSOR_COUNT
    except Exception:
        env["device"] = "CUDA simulator"
    return env


def run(*, pools: Sequence[int], versions: Sequence[int] | None = None, batches: Sequence[int] = BATCHES,
        base_ads: int = BASE_ADS, requests: int = 256, seed: int = 7, base_path: str | None = None,
        base: BaseCorpus | None = None, updates: tuple[int, int] | None = (UPDATE_ROUNDS, UPDATES_PER_ROUND),
        device: str = "auto", progress: bool = True, chunk_slots: int = CHUNK_SLOTS, out: str | None = None) -> dict:
    """The whole GPU benchmark (version numbers of the kernel lab, default: every one that runs here);
    returns the JSON-ready result. `base`: a base corpus already made (else loaded from `base_path`
    or generated). `andromeda bench match` runs it through `benchmarks.match_both.bench_match`, which
    adds the CPU index beside it."""
    from andromeda_nb.devices import resolve

    from gpu import runtime

    where = resolve(device, kernels=True, what="the GPU index")
    cuda = runtime.cuda()
    from gpu.kernels import match as shipped
    from gpu.lab import match as lab

    if versions is None:
        versions = [v for v in lab.VERSIONS if where == "gpu" or not lab.VERSIONS[v].gpu_only]
    chosen = [lab.VERSIONS[v] for v in versions]
    if base is None:
        base = load_or_generate_base(base_path, base_ads, requests, seed, progress)
    rng = np.random.default_rng(seed)
    result = {"benchmark": "match", "environment": environment(cuda), "device_kind": where,
              "versions": list(versions),
              "shipped_version": shipped.SHIPPED if where == "gpu" else shipped.SIMULATOR_FALLBACK,
              "base_ads": len(base.ads), "seed": base.seed, "batches": list(batches), "pools": []}
    if where == "gpu":
        result["copy_bandwidth_Bps"] = copy_bandwidth(cuda)
        log(progress, f"device-to-device copy: {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write)")
    for i, pool in enumerate(pools):
        copies = max(1, pool // len(base.ads))
        result["pools"].append(bench_pool(base, copies, chosen, batches, cuda, rng, progress,
                                          updates if i == 0 else None, chunk_slots))
        if out:  # what is measured so far survives an interrupted run
            write_result(result, out, "match")
    if where == "gpu":
        result["kernel_resources"] = kernel_resources(chosen)
        log(progress, f"registers / local bytes per thread: {result['kernel_resources']}")
    if out:
        write_result(result, out, "match")
    return result


def table(result: dict) -> str:
    lines = [f"{'pool ads':>12} {'version':>7} {'batch':>5} {'ms/launch':>10} {'host ms':>8} {'G/s kernel':>11} "
             f"{'G/s +host':>10} {'ms/request':>10}"]
    for p in result["pools"]:
        for t in p["timings"]:
            with_host = t.get("pool_ads_per_s_with_host", float("nan"))
            lines.append(f"{p['ads']:>12,} {t['version']:>7} {t['batch']:>5} {t['median_s'] * 1e3:>10.3f} "
                         f"{t['host_prepare_s'] * 1e3:>8.2f} {t['pool_ads_per_s'] / 1e9:>11.1f} {with_host / 1e9:>10.1f} "
                         f"{t['ms_per_request']:>10.4f}")
    lines.append("G/s kernel: pool ads/s of the kernel alone; G/s +host: with the host's preparation of the batch "
                 "(encoding, tables, upload) added, not overlapped")
    return "\n".join(lines)
