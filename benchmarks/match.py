"""`andromeda bench match`: pool ads per second of the GPU targeting index, every kernel version.

Generating 100M ads in Python is too slow, so the pool is a generated base corpus *tiled*: copy k of
base ad i is an ad with id `base_id + k * stride` and the same targeting. The per-ad device data
(residual words, program pointers, schedules and the clause programs themselves) is physically
repeated, so every byte a scan reads is real; only the custom-location table (a few thousand circles)
is shared between copies. The slots of a format hold its ads in the corpus's order, or clustered by
geography (`layout` geo, `andromeda_nb.geo_layout`: the order `bench pipeline` and the engine use).

Every answer is checked against `andromeda_nb.oracle` through `benchmarks.checks.TiledOracle` (the
oracle over the base ads, each copy answering as its base ad, whatever the layout; never the GPU's
own match): before anything is timed, the shipped kernel's answer to CHECK_REQUESTS requests and
every version against it, word for word; then the output of every timed launch (each version and
batch size), each of its requests at every slot (at a random sample of ORACLE_SAMPLE_SLOTS slots,
and ORACLE_FULL_REQUESTS requests at every slot, when the pool times the batch exceed
FULL_CHECK_SLOT_REQUESTS); the serving between update rounds, each round's touched ads and a sample
of the others; and the CPU index's timed answers. `checks` holds each entry point's counts and
`checks_ok` whether all passed.

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
CHECK_REQUESTS = 64  # the batch checked at full size before the timing (one wide group)
ORACLE_FULL_REQUESTS = 8  # requests of a timed batch checked at every slot when the pool is too large for all
ORACLE_SAMPLE_SLOTS = 4096  # random slots checked for every request of a timed batch in that case
FULL_CHECK_SLOT_REQUESTS = 1 << 32  # slots x requests of a timed batch checked at every slot, at most
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


def check_batch(oracle, words: np.ndarray, requests: Sequence[Request], rng: np.random.Generator,
                offset: int = 0) -> dict:
    """Rows of a match output (uint32[len(requests), W]) against the oracle (`benchmarks.checks.
    TiledOracle`): every request at every slot when the pool times the batch is at most
    FULL_CHECK_SLOT_REQUESTS, else every request at ORACLE_SAMPLE_SLOTS random slots and
    ORACLE_FULL_REQUESTS of them (from `offset` on, so successive batches check other requests) at
    every slot. Returns {"requests_timed", "requests_checked", "full_pool_requests", "sampled_slots",
    "ok", "failed", "first_failure"}."""
    requests = list(requests)
    n, slots = len(requests), len(oracle.slot_ad_id)
    out = {"requests_timed": n, "requests_checked": n}
    if slots * n <= FULL_CHECK_SLOT_REQUESTS:
        bad, first = oracle.check_words(words, requests)
        out.update(full_pool_requests=n, sampled_slots=0)
    else:
        sample = np.sort(rng.choice(slots, min(ORACLE_SAMPLE_SLOTS, slots), replace=False))
        bad, first = oracle.check_words(words, requests, full=False, sample=sample)
        rows = [(offset + i) % n for i in range(min(ORACLE_FULL_REQUESTS, n))]
        bad_full, first_full = oracle.check_words(words[rows], [requests[r] for r in rows], keep=False)
        bad, first = bad + bad_full, first or first_full
        out.update(full_pool_requests=len(rows), sampled_slots=len(sample))
    out.update(ok=bad == 0, failed=bad)
    if first is not None:
        out["first_failure"] = first
    return out


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
               chunk_slots: int = CHUNK_SLOTS, layout: str = "format") -> dict:
    """Every version of `versions` (match `Version`s of the kernel lab) on a pool of `copies` copies of
    the base corpus, its slots in `layout` order: checked at full size first, then timed per batch
    size, the output of every timed launch checked against the oracle (`check_batch`)."""
    from andromeda_nb.geo_layout import clustered_order

    from .checks import TiledOracle

    t0 = time.perf_counter()
    buckets = world_buckets(base.seed)
    rank = clustered_order(base.compiled.format, buckets.ad_masks(base.compiled)) if layout == "geo" else None
    index = build_tiled_index(base.compiled, copies, chunk_slots=chunk_slots, buckets=buckets, rank=rank)
    cuda.synchronize()
    build_s = time.perf_counter() - t0
    n_ads = len(index)
    log(progress, f"pool {n_ads:,} ads ({layout} layout): built in {build_s:.1f} s, "
                  f"{index.device_bytes() / n_ads:.1f} device bytes/ad")
    oracle = TiledOracle(base, index.slots.slot_ad_id)
    check_reqs = list(base.requests[:CHECK_REQUESTS])
    enc = [encode_request(r) for r in check_reqs]
    shipped = index.match_slots(enc).copy_to_host()
    t0 = time.perf_counter()
    check = check_batch(oracle, shipped, check_reqs, rng)
    check["versions_equal"] = []
    for v in versions:
        if np.array_equal(index.match_slots(enc, version=v).copy_to_host(), shipped):
            check["versions_equal"].append(v.number)
        else:
            check["ok"] = False
            check.setdefault("first_failure", f"version {v.number} differs from version {index.version} at full size")
    check["seconds"] = round(time.perf_counter() - t0, 2)
    log(progress, f"  full-size check {'passed' if check['ok'] else 'FAILED'}: {check}")
    eligible_share = float(_bits(shipped).sum()) / (len(check_reqs) * n_ads)
    live = index.live_bytes()
    result = {
        "ads": n_ads, "copies": copies, "capacity": index.capacity, "layout": layout, "build_s": round(build_s, 2),
        "device_bytes": index.device_bytes(), "device_bytes_per_ad": index.device_bytes() / n_ads,
        "live_bytes_per_ad": {k: v / n_ads for k, v in live.items()},
        "eligible_share": eligible_share, "check": check, "timings": [], "checks": {},
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
            # the output of the timed launches (each rewrites it whole), against the oracle
            timed_check = check_batch(oracle, out.copy_to_host(), cycle, rng, offset=len(result["checks"]))
            result["checks"][f"v{v.number}/b{b}"] = timed_check
            ads_per_s = b * n_ads / t["median_s"]
            groups = -(-b // group) if group else b
            # napkin math: per-slot columns and programs read once per group, output written once
            min_bytes = groups * index.capacity * slot_bytes + groups * live["programs"] + b * index.capacity / 8
            row = {"version": v.number, "batch": b, **{k: t[k] for k in ("median_s", "min_s", "reps", "clock")},
                   "ok": timed_check["ok"], "pool_ads_per_s": ads_per_s, "ms_per_request": 1e3 * t["median_s"] / b,
                   "host_prepare_s": prep_s,
                   # kernel and host preparation one after the other (no overlap): the floor of a batch
                   "pool_ads_per_s_with_host": b * n_ads / (t["median_s"] + prep_s), "scan_bytes_upper": min_bytes,
                   "scan_bandwidth_upper": min_bytes / t["median_s"], "prog_bytes_per_ad": prog_bytes}
            result["timings"].append(row)
            log(progress, f"  v{v.number} batch {b:4d}: {t['median_s'] * 1e3:9.3f} ms  {ads_per_s / 1e9:8.1f} G pool ads/s"
                          f"  ({t['reps']} reps; host prepare {prep_s * 1e3:.1f} ms; timed output vs oracle: "
                          f"{'ok' if timed_check['ok'] else 'FAILED: ' + timed_check.get('first_failure', '')})")
            del batch, out
    if updates:
        result["updates"] = bench_updates(index, base, copies, cuda, rng, progress, *updates, oracle=oracle)
        result["checks"]["updates/serve"] = result["updates"]["check"]
    result["checks_ok"] = check["ok"] and all(c["ok"] for c in result["checks"].values())
    del index
    return result


def bench_updates(index: GpuTargetingIndex, base: BaseCorpus, copies: int, cuda, rng, progress: bool,
                  rounds: int = UPDATE_ROUNDS, per_round: int = UPDATES_PER_ROUND, oracle=None) -> dict:
    """Rounds of (apply a batch of updates, serve one group of requests); the output of each round's
    serving checked against the oracle for the ads the updates touched so far (a random sample of
    UPDATE_CHECK_ADS of them) and, with `oracle` (the pool's `TiledOracle` before the updates), for a
    sample of the slots whose ads the updates left alone."""
    stride = stride_of(base.compiled)
    base_ads = base.ads
    current: dict[int, Ad] = {}  # ads whose state differs from their base copy
    next_id = stride * copies
    live_new: list[int] = []
    requests = list(base.requests[:CHECK_REQUESTS])
    enc = [encode_request(r) for r in requests]
    batch = index.prepare(enc)
    out = index.new_output(len(enc))
    apply_s = serve_s = 0.0
    n_updates = 0
    retired: set[int] = set()
    checked = failed = 0
    first_failure = None

    def check_round(bits: np.ndarray) -> None:
        """The touched ads (a sample) against the oracle on their current state, and a sample of the
        untouched copies against the oracle's answer for their base ad."""
        nonlocal checked, failed, first_failure
        touched = list(current.items())
        if len(touched) > UPDATE_CHECK_ADS:
            touched = [touched[i] for i in rng.choice(len(touched), UPDATE_CHECK_ADS, replace=False)]
        for ad_id, ad in touched:
            s = index.slots.slot_of(ad_id)
            for r, req in enumerate(requests):
                checked += 1
                if bits[r, s] != eligible(ad, req):
                    failed += 1
                    first_failure = first_failure or f"after updates: ad {ad_id} request {req.request_id}"
        for ad_id in list(retired)[:1000]:
            checked += 1
            if ad_id in index.slots:
                failed += 1
                first_failure = first_failure or f"retired ad {ad_id} still has a slot"
        if oracle is not None:
            ids = index.slots.slot_ad_id
            slots = rng.choice(len(ids), min(ORACLE_SAMPLE_SLOTS // 16, len(ids)), replace=False)
            slots = [int(s) for s in slots if 0 <= ids[s] < stride * copies and int(ids[s]) not in current
                     and oracle.slot_ad_id[s] == ids[s]]
            for r, req in enumerate(requests):
                want = oracle.base_eligible(req)[oracle.row_of_slot[slots]]
                got = bits[r, slots].astype(bool)
                checked += len(slots)
                if (got != want).any():
                    failed += int((got != want).sum())
                    s = slots[int(np.flatnonzero(got != want)[0])]
                    first_failure = first_failure or f"after updates: untouched ad {int(ids[s])} request {req.request_id}"

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
        check_round(_bits(out.copy_to_host()))  # the output of the timed serving, after its timing
    check = {"requests_timed": rounds * len(requests), "requests_checked": rounds * len(requests),
             "oracle_checks": checked, "ok": failed == 0, "failed": failed}
    if first_failure is not None:
        check["first_failure"] = first_failure
    res = {"rounds": rounds, "updates": n_updates, "apply_s": apply_s, "updates_per_s": n_updates / apply_s,
           "serve_s_between": serve_s, "touched_ads_checked": checked, "compactions": index.compactions,
           "check": check}
    log(progress, f"  updates: {res['updates_per_s']:,.0f} updates/s applied in batches of {per_round} while"
                  f" serving ({checked} checks against the oracle: {'ok' if failed == 0 else 'FAILED'})")
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
        device: str = "auto", progress: bool = True, chunk_slots: int = CHUNK_SLOTS, layout: str = "format",
        out: str | None = None) -> dict:
    """The whole GPU benchmark (version numbers of the kernel lab, default: every one that runs here);
    returns the JSON-ready result. `base`: a base corpus already made (else loaded from `base_path`
    or generated). `andromeda bench match` runs it through `benchmarks.match_both.bench_match`, which
    adds the CPU index beside it. `layout`: the slot order of every pool (format or geo)."""
    from andromeda_nb.devices import resolve

    from gpu import runtime

    from andromeda_nb.constants import LAYOUTS

    if layout not in LAYOUTS:
        raise ValueError(f"unknown slot layout {layout!r}; choose from {', '.join(LAYOUTS)}")
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
              "base_ads": len(base.ads), "seed": base.seed, "batches": list(batches), "layout": layout, "pools": [],
              "checks": {}, "checks_ok": True}
    if where == "gpu":
        result["copy_bandwidth_Bps"] = copy_bandwidth(cuda)
        log(progress, f"device-to-device copy: {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write)")
    for i, pool in enumerate(pools):
        copies = max(1, pool // len(base.ads))
        done = bench_pool(base, copies, chosen, batches, cuda, rng, progress, updates if i == 0 else None, chunk_slots,
                          layout)
        result["pools"].append(done)
        result["checks"].update({f"{done['ads']}/{name}": c for name, c in done["checks"].items()})
        result["checks"][f"{done['ads']}/full_size"] = done["check"]
        result["checks_ok"] = result["checks_ok"] and done["checks_ok"]
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
    if "checks" in result:
        failed = [f"{name} ({c.get('first_failure', '')})" for name, c in result["checks"].items() if not c.get("ok")]
        lines.append(f"checked against the oracle: the output of every timed launch, the updates' serving and the CPU "
                     f"index ({len(result['checks'])} entries): " + ("all passed" if not failed else "FAILED: " + "; ".join(failed)))
    return "\n".join(lines)
