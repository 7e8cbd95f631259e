"""Pools of *distinct copies* of a corpus, for `bench pipeline --data DIR --copies N`: pools past what
one run can generate (100M ads), made in memory from a stored corpus's compiled targeting and
embeddings, where every copy of an ad is an ad of its own.

Copy 0 is the corpus itself. Copy c >= 1 of ad i differs from ad i (and from every other copy) in:

* its id: `ad_id + c * stride` (`stride`: the corpus's largest id + 1, as `benchmarks.tiling`);
* its places and audiences: every country, region, city, flexible_spec id (each key on its own) and
  custom audience it names, in its targeting and its exclusions alike, goes through copy c's
  permutation of the corpus's terms of that kind. A permutation moves a term only among the terms of
  its kind the corpus uses about as often (within a factor of 1.2, `BAND_RATIO`: a *band*), so a copy
  targets popular places and interests as often as the corpus does and a request finds about the
  same share of the pool eligible (a permutation over all of a kind pairs popular ads with rare user
  ids: on a generated 1M corpus, 24 requests, bands of a factor 1.5 left copies 12% less eligible than
  the corpus, 1.2 1%, at the price of more popular terms alone in their band: 21% of the corpus's term
  uses keep their value in a copy, against 10%). A term alone in its band keeps its value. Locales are kept;
* its custom-location circles: each centre moved by up to `JITTER_DEG` degrees in latitude and in
  longitude (hashed from the copy, the ad's id and the circle's place in the ad; reflected at the
  poles, wrapped at the antimeridian), radius and unit kept;
* its schedule: start and end moved by the same number of seconds, up to `SHIFT_S` either way
  (hashed from the copy and the ad's id); an open end stays open;
* its embedding: `derive.ad_embeddings` of its own id and the corpus seed, at the corpus's precision,
  what `andromeda generate` stores for an ad of that id.

Status, format, ages, genders, locales and placements are the ad's. Everything is made from the
compiled arrays (`copy_compiled`: numpy and numba over whole arrays, no Python object per ad);
`copy_ad` makes copy c of one parsed `Ad` the slow way (its JSON line transformed, then
`targeting.parse_ad`, so a copy is a valid ad by construction), and tests hold the two equal array
for array. The checks of `bench pipeline` parse copies with `copy_ad` for their oracle sample.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import njit, prange

from andromeda_nb import derive
from andromeda_nb.compiled import (
    NS_CITY, NS_COUNTRY, NS_CUSTOM_AUDIENCE, NS_FLEX, NS_REGION, NULL_END, NULL_START, TERM_SHIFT,
    CompiledTargeting, country_code, term,
)
from andromeda_nb.dataset import Dataset
from andromeda_nb.measure import log
from andromeda_nb.model import EmbeddingTable, quantize
from cpu_baseline.index import haversine, in_sorted, residual_ok

BAND_RATIO = 1.2  # a band: the terms of one kind whose use counts lie within this factor of each other
JITTER_DEG = 0.05  # a circle's centre moves up to this far in latitude and in longitude (about 5.5 km)
SHIFT_S = 2 * 86_400  # a schedule moves up to this many seconds either way
MAX_TIME = 1 << 62  # DESIGN section 2: |t| <= 2**62
MAX_AD_ID = (1 << 63) - 1
PERMUTED_NAMESPACES = (NS_COUNTRY, NS_REGION, NS_CITY, *NS_FLEX.values(), NS_CUSTOM_AUDIENCE)
HOW_COPIES_DIFFER = {
    "ad_id": "ad_id + copy * stride",
    "places": "countries, regions and cities permuted per copy among the corpus's places of the same kind used "
              f"about as often (within a factor of {BAND_RATIO:g})",
    "audiences": "flexible_spec ids (each key on its own) and custom audiences permuted the same way",
    "circles": f"centres moved up to {JITTER_DEG} degrees in latitude and in longitude, radius kept",
    "schedule": f"start and end moved together by up to {SHIFT_S} s",
    "embedding": "derive.ad_embeddings of the copy's own id and the corpus seed, at the corpus's precision",
    "kept": "status, format, ages, genders, locales, placements",
}
_STREAM_TERMS, _STREAM_SHIFT, _STREAM_CIRCLE = 21, 22, 23
_MASK64 = (1 << 64) - 1


def _hash(seed: int, stream: int, *keys) -> np.ndarray:
    """uint64: SplitMix64 of (seed, stream, keys...) elementwise; keys are int arrays or ints."""
    with np.errstate(over="ignore"):
        h = derive._mix(np.asarray([(int(seed) & _MASK64)], np.uint64) + derive._GOLDEN * np.uint64(stream))
        for k in keys:
            h = derive._mix(h ^ (np.asarray(k, np.int64).astype(np.uint64) + derive._GOLDEN))
    return h


def _unit(h: np.ndarray) -> np.ndarray:
    """float64 in [-1, 1) from a uint64 hash (its top 53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (2.0 / (1 << 53)) - 1.0


def schedule_shift(seed: int, copy: int, base_ids) -> np.ndarray:
    """int64 seconds copy `copy` of the ads `base_ids` moves their schedules by (0 for copy 0)."""
    base_ids = np.asarray(base_ids, np.int64)
    if copy == 0:
        return np.zeros(len(base_ids), np.int64)
    h = _hash(seed, _STREAM_SHIFT, copy, base_ids)
    return (h % np.uint64(2 * SHIFT_S + 1)).astype(np.int64) - SHIFT_S


def shift_times(times: np.ndarray, shift: np.ndarray, null: int) -> np.ndarray:
    """int64: `times` moved by `shift`, kept within |t| <= 2**62; `null` (an open side) stays."""
    moved = np.clip(times + np.where(times == null, 0, shift), -MAX_TIME, MAX_TIME)
    return np.where(times == null, null, moved)


def move_circles(seed: int, copy: int, base_ids, local, lat, lon) -> tuple[np.ndarray, np.ndarray]:
    """(latitude, longitude) float64 of circles of copy `copy`: circle `local[j]` (its place among its
    ad's circles, geo_locations' then excluded_geo_locations') of the ad `base_ids[j]` at (lat[j],
    lon[j]), moved by up to JITTER_DEG in each; a latitude past a pole moves the other way, a
    longitude past the antimeridian wraps. Copy 0 keeps them."""
    lat, lon = np.asarray(lat, np.float64), np.asarray(lon, np.float64)
    if copy == 0:
        return lat.copy(), lon.copy()
    base_ids, local = np.asarray(base_ids, np.int64), np.asarray(local, np.int64)
    dlat = _unit(_hash(seed, _STREAM_CIRCLE, copy, base_ids, local, 0)) * JITTER_DEG
    dlon = _unit(_hash(seed, _STREAM_CIRCLE, copy, base_ids, local, 1)) * JITTER_DEG
    up = lat + dlat
    new_lat = np.where((up > 90.0) | (up < -90.0), lat - dlat, up)
    new_lon = lon + dlon
    new_lon = np.where(new_lon > 180.0, new_lon - 360.0, np.where(new_lon < -180.0, new_lon + 360.0, new_lon))
    return new_lat, new_lon


def term_bands(terms: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64 per distinct term (`terms` ascending, `counts` its uses): its band, namespace and use
    count in one key (terms of one band may be permuted among each other); -1 for a term that is
    never permuted (its namespace is not in PERMUTED_NAMESPACES)."""
    ns = terms >> TERM_SHIFT
    level = np.floor(np.log(counts.astype(np.float64)) / np.log(BAND_RATIO)).astype(np.int64)
    band = ns * 4096 + level
    return np.where(np.isin(ns, PERMUTED_NAMESPACES), band, -1)


@dataclass
class CopyPlan:
    """What makes `copies` distinct copies of the compiled corpus `base`: its distinct terms (`keys`,
    ascending) and the term each becomes in each copy (`mapped`, (copies, K); row 0 is `keys`)."""

    base: CompiledTargeting
    copies: int
    seed: int
    keys: np.ndarray
    mapped: np.ndarray

    @classmethod
    def of(cls, base: CompiledTargeting, copies: int, seed: int) -> "CopyPlan":
        if copies < 1:
            raise ValueError(f"copies: at least 1, got {copies}")
        stride = int(base.ad_id.max()) + 1 if len(base) else 1
        if len(base) and (copies - 1) * stride > MAX_AD_ID - int(base.ad_id.max()):
            raise ValueError(f"{copies} copies of ids up to {stride - 1} pass the largest ad id, 2**63 - 1")
        keys, counts = np.unique(base.terms, return_counts=True)
        bands = term_bands(keys, counts)
        mapped = np.empty((copies, len(keys)), np.int64)
        mapped[:] = keys[None, :]
        order = np.argsort(bands, kind="stable")
        sorted_bands = bands[order]
        starts = np.flatnonzero(np.r_[True, sorted_bands[1:] != sorted_bands[:-1]])
        groups = [order[a:b] for a, b in zip(starts, np.r_[starts[1:], len(order)]) if sorted_bands[a] >= 0]
        for c in range(1, copies):
            for g in groups:
                if len(g) > 1:
                    rng = np.random.default_rng([seed & _MASK64, _STREAM_TERMS, c, int(bands[g[0]])])
                    mapped[c, g] = keys[g[rng.permutation(len(g))]]
        return cls(base, copies, seed, keys, mapped)

    @property
    def stride(self) -> int:
        return int(self.base.ad_id.max()) + 1 if len(self.base) else 1

    @property
    def n_ads(self) -> int:
        return len(self.base) * self.copies

    def map_terms(self, copy: int, terms) -> np.ndarray:
        """int64: the terms (of the corpus) that `terms` become in copy `copy`."""
        terms = np.asarray(terms, np.int64)
        at = np.searchsorted(self.keys, terms)
        if len(terms) and not np.array_equal(self.keys[np.minimum(at, len(self.keys) - 1)], terms):
            raise ValueError("a term the corpus does not use")
        return self.mapped[copy, at]

    def copy_of_ids(self, ad_ids) -> np.ndarray:
        """int64: the copy each pool ad id belongs to."""
        return np.asarray(ad_ids, np.int64) // self.stride

    def fixed_share(self) -> float:
        """The share of the corpus's permutable term uses that keep their value in copy 1 (terms alone
        in their band, or a permutation's fixed points)."""
        if self.copies < 2 or not len(self.base.terms):
            return 0.0
        at = np.searchsorted(self.keys, self.base.terms)
        movable = np.isin(self.keys >> TERM_SHIFT, PERMUTED_NAMESPACES)[at]
        return float(((self.mapped[1, at] == self.keys[at]) & movable).sum() / max(1, movable.sum()))

    @cached_property
    def circle_owner(self) -> tuple[np.ndarray, np.ndarray]:
        """(ad row, place among the ad's circles) of every circle of the corpus (int64 (Q,) each)."""
        ct = self.base
        clause_of = np.repeat(np.arange(len(ct.clause_negative), dtype=np.int64), np.diff(ct.circle_ptr))
        ad_of_clause = np.repeat(np.arange(len(ct), dtype=np.int64), np.diff(ct.clause_ptr))
        ad = ad_of_clause[clause_of]
        local = np.arange(len(ct.circles), dtype=np.int64) - ct.circle_ptr[ct.clause_ptr[ad]]
        return ad, local


@njit(cache=True, nogil=True)
def _map_sort_terms(term_ptr, at, mapped, out):
    """out[t] = mapped[at[t]] for every term t, each clause's terms (term_ptr int64[M+1]) sorted
    ascending (at int64[T]: the term's index among the corpus's distinct terms; mapped int64[K]: one
    copy's terms; out int64[T]). Serial, without the GIL: `copy_compiled` runs one copy a thread."""
    for j in range(len(term_ptr) - 1):
        lo, hi = term_ptr[j], term_ptr[j + 1]
        for t in range(lo, hi):
            v = mapped[at[t]]
            u = t
            while u > lo and out[u - 1] > v:
                out[u] = out[u - 1]
                u -= 1
            out[u] = v


def copy_compiled(plan: CopyPlan, progress=False, workers: int | None = None) -> CompiledTargeting:
    """The compiled targeting of every copy of `plan`, copy after copy (row c * N + i is copy c of
    ad i): equal, array for array, to `compile_ads` of `copy_ad` of every ad in that order. The copies
    are made `workers` at a time (default: one a core), each on a thread of its own."""
    ct, copies = plan.base, plan.copies
    n, m, t, q = len(ct), len(ct.clause_negative), len(ct.terms), len(ct.circles)
    at = np.searchsorted(plan.keys, ct.terms)
    out = {}
    for name in ("ad_id", "status", "format", "start_time", "end_time", "age_min", "age_max", "gender_mask",
                 "publisher_mask", "device_mask", "os_mask", "n_positive"):
        a = getattr(ct, name)
        out[name] = np.empty(copies * n, a.dtype)
    out["clause_negative"] = np.empty(copies * m, np.uint8)
    out["terms"] = np.empty(copies * t, np.int64)
    out["circles"] = np.empty((copies * q, 3), np.float64)
    for ptr, step in (("clause_ptr", m), ("term_ptr", t), ("circle_ptr", q)):
        p = getattr(ct, ptr)
        out[ptr] = np.empty(copies * (len(p) - 1) + 1, np.int64)
        out[ptr][-1] = copies * step
    circle_ad, circle_local = plan.circle_owner

    def one_copy(c):  # writes copy c's slices only; numpy and the term kernel run without the GIL
        rows = slice(c * n, (c + 1) * n)
        for name in ("status", "format", "age_min", "age_max", "gender_mask", "publisher_mask", "device_mask",
                     "os_mask", "n_positive"):
            out[name][rows] = getattr(ct, name)
        out["ad_id"][rows] = ct.ad_id + c * plan.stride
        shift = schedule_shift(plan.seed, c, ct.ad_id)
        out["start_time"][rows] = shift_times(ct.start_time, shift, NULL_START)
        out["end_time"][rows] = shift_times(ct.end_time, shift, NULL_END)
        out["clause_negative"][c * m:(c + 1) * m] = ct.clause_negative
        for ptr, step in (("clause_ptr", m), ("term_ptr", t), ("circle_ptr", q)):
            p = getattr(ct, ptr)
            k = len(p) - 1
            out[ptr][c * k:(c + 1) * k] = p[:-1] + c * step
        _map_sort_terms(ct.term_ptr, at, plan.mapped[c], out["terms"][c * t:(c + 1) * t])
        lat, lon = move_circles(plan.seed, c, ct.ad_id[circle_ad], circle_local, ct.circles[:, 0], ct.circles[:, 1])
        block = out["circles"][c * q:(c + 1) * q]
        block[:, 0], block[:, 1], block[:, 2] = lat, lon, ct.circles[:, 2]

    with ThreadPoolExecutor(min(copies, workers or os.cpu_count() or 1)) as pool:
        for done, _ in enumerate(pool.map(one_copy, range(copies)), 1):
            log(progress, f"copies: targeting of {done} of {copies} copies made")
    return CompiledTargeting(**out)


def copy_embeddings(plan: CopyPlan, base: EmbeddingTable, seed: int, workers: int | None = None,
                    progress=False) -> EmbeddingTable:
    """The stored embeddings of every copy, copy after copy: copy 0's are the corpus's own rows, copy
    c's are `derive.ad_embeddings` of its ids and the corpus seed, stored at the corpus's precision
    (`model.quantize`), made over `workers` threads (numpy's integer kernels run without the GIL)."""
    n, dim, copies = len(plan.base), base.values.shape[1], plan.copies
    values = np.empty((copies * n, dim), base.values.dtype)
    scale = np.empty(copies * n, np.float32)
    values[:n], scale[:n] = base.values, base.scale
    step = 1 << 16
    jobs = [(c, lo) for c in range(1, copies) for lo in range(0, n, step)]

    def make(job):
        c, lo = job
        ids = plan.base.ad_id[lo:lo + step] + c * plan.stride
        table = quantize(derive.ad_embeddings(ids, seed, dim), base.precision)
        rows = slice(c * n + lo, c * n + lo + len(ids))
        values[rows], scale[rows] = table.values, table.scale

    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        for i, _ in enumerate(pool.map(make, jobs)):
            if (i + 1) % max(1, len(jobs) // 10) == 0:
                log(progress, f"copies: embeddings {100 * (i + 1) // len(jobs)}% made")
    return EmbeddingTable(values, scale, base.precision)


# --- eligible sets over the copies' compiled targeting, for the checks -------------------------------


@njit(cache=True, parallel=True)
def _scan(user_terms, age, gender, lat, lon, publisher, device, os_, now, status, start_time, end_time, age_min,
          age_max, gender_mask, publisher_mask, device_mask, os_mask, clause_ptr, n_positive, term_ptr, terms,
          circle_ptr, circles, out):
    """out[i] = 1 when ad i of the compiled arrays is eligible for the encoded request (user_terms
    int64[U] sorted; out uint8[N]): every positive clause holds a user term or a circle around the
    user's point, the negative clause none, the residuals pass (cpu_baseline.index's tests)."""
    for i in prange(len(status)):
        ok = residual_ok(i, age, gender, publisher, device, os_, now, status, start_time, end_time, age_min,
                          age_max, gender_mask, publisher_mask, device_mask, os_mask)
        j0 = clause_ptr[i]
        j = j0
        while ok and j < clause_ptr[i + 1]:
            hit = False
            for t in range(term_ptr[j], term_ptr[j + 1]):
                if in_sorted(user_terms, terms[t]):
                    hit = True
                    break
            q = circle_ptr[j]
            while not hit and q < circle_ptr[j + 1]:
                hit = haversine(lat, lon, circles[q, 0], circles[q, 1]) <= circles[q, 2]
                q += 1
            ok = hit if j - j0 < n_positive[i] else not hit
            j += 1
        out[i] = ok


class CompiledScan:
    """Eligible ads of a request by one scan of compiled targeting over every core (numba `prange`),
    no index built: what the checks of a pool of copies use where the CPU index would not fit (the
    index of 10M copies took 8.7 GB and 93 s to build on a 2-core machine; a 100M pool's would outgrow
    a 128 GB host). The same interface as `cpu_baseline.index.CpuTargetingIndex.match`; tests hold it
    equal to that index and to the oracle, and every run holds it to the oracle on a sample."""

    def __init__(self, ct: CompiledTargeting):
        self.ct = ct
        self._out = np.zeros(len(ct), np.uint8)

    def match(self, requests) -> list[np.ndarray]:
        """Eligible ad ids per request: int64, ascending."""
        from andromeda_nb.compiled import encode_request

        ct, got = self.ct, []
        for r in requests:
            e = encode_request(r)
            _scan(e.terms, e.age, e.gender, e.latitude, e.longitude, e.publisher, e.device, e.os, e.time, ct.status,
                  ct.start_time, ct.end_time, ct.age_min, ct.age_max, ct.gender_mask, ct.publisher_mask,
                  ct.device_mask, ct.os_mask, ct.clause_ptr, ct.n_positive, ct.term_ptr, ct.terms, ct.circle_ptr,
                  ct.circles, self._out)
            got.append(np.sort(ct.ad_id[self._out.view(bool)]))
        return got


# --- one copy of one parsed ad, the slow way ----------------------------------------------------------


def _country(code: int) -> str:
    return chr(65 + code // 26) + chr(65 + code % 26)


def copy_ad(plan: CopyPlan, ad, copy: int, *, dim: int = 4, formats: int | None = None):
    """Copy `copy` of the parsed `Ad` `ad` (an ad of the corpus `plan` was made from), made from its
    JSON line (`targeting.ad_to_json`) and parsed (`targeting.parse_ad`, no embedding): the ad whose
    compiled form row c * N + i of `copy_compiled` holds."""
    from andromeda_nb.constants import DEFAULT_F
    from andromeda_nb.targeting import ad_to_json, parse_ad

    obj = ad_to_json(ad)
    obj.pop("embedding", None)
    obj["ad_id"] = int(ad.ad_id) + copy * plan.stride
    shift = int(schedule_shift(plan.seed, copy, [ad.ad_id])[0])
    for key, null in (("start_time", NULL_START), ("end_time", NULL_END)):
        if obj[key] is not None:
            obj[key] = int(shift_times(np.asarray([obj[key]], np.int64), np.asarray([shift]), null)[0])
    t = obj["targeting"]

    def mapped(ns, ids):
        return plan.map_terms(copy, [term(ns, i) for i in ids]) & ((1 << TERM_SHIFT) - 1)

    circles = []  # (the geo object, its list of custom locations), in compile order
    for key in ("geo_locations", "excluded_geo_locations"):
        geo = t.get(key)
        if geo is None:
            continue
        if geo.get("countries"):
            codes = mapped(NS_COUNTRY, [country_code(x) for x in geo["countries"]])
            geo["countries"] = [_country(int(x)) for x in codes]
        for name, ns in (("regions", NS_REGION), ("cities", NS_CITY)):
            if geo.get(name):
                geo[name] = [int(x) for x in mapped(ns, geo[name])]
        circles += geo.get("custom_locations") or []
    if circles:
        lat, lon = move_circles(plan.seed, copy, np.full(len(circles), ad.ad_id), np.arange(len(circles)),
                                [c["latitude"] for c in circles], [c["longitude"] for c in circles])
        for c, a, o in zip(circles, lat.tolist(), lon.tolist()):
            c["latitude"], c["longitude"] = a, o
    for obj_ in [*(t.get("flexible_spec") or []), *([t["exclusions"]] if t.get("exclusions") else [])]:
        for key, ids in obj_.items():
            obj_[key] = [int(x) for x in mapped(NS_FLEX[key], ids)]
    for key in ("custom_audiences", "excluded_custom_audiences"):
        if t.get(key):
            t[key] = [int(x) for x in mapped(NS_CUSTOM_AUDIENCE, t[key])]
    return parse_ad(obj, seed=plan.seed, dim=dim, formats=DEFAULT_F if formats is None else formats,
                    derive_embedding=False, copy_targeting=False)


class CopiedAds:
    """The ads of a pool of copies, parsed (`Dataset.ads_loader` of a `CopiesDataset`): copy after
    copy, each made by `copy_ad` from the corpus's parsed ads."""

    def __init__(self, base: Dataset, plan: CopyPlan):
        self.base, self.plan = base, plan

    def __call__(self) -> list:
        return [a for chunk in self.chunks() for a in chunk]

    def chunks(self, rows: int = 1 << 16):
        for c in range(self.plan.copies):
            for chunk in self.base.ad_chunks(rows):
                yield [copy_ad(self.plan, a, c, dim=self.base.model.D, formats=self.base.model.F) for a in chunk]


class CopiesDataset(Dataset):
    """A `Dataset` of `copies` distinct copies of the corpus `base` (row c * N + i: copy c of ad i), its
    requests, model, seed and precision the corpus's. `sample_ads` gives the oracle sample of the
    checks: ads spread over every copy, each parsed by `copy_ad`."""

    def __init__(self, base: Dataset, plan: CopyPlan, compiled: CompiledTargeting, embeddings: EmbeddingTable):
        super().__init__(embeddings=embeddings, requests=base.requests, model=base.model, seed=base.seed,
                         precision=base.precision, compiled=compiled, ads_loader=CopiedAds(base, plan),
                         meta={**base.meta, "copies": plan.copies})
        self.base, self.plan = base, plan

    def sample_ads(self, count: int, seed: int, first: int) -> list:
        """`count` copies drawn at random (`seed`) among every copy of the corpus's first `first` ads,
        parsed by `copy_ad`, in row order."""
        ads = next(iter(self.base.ad_chunks(first)), [])
        rng = np.random.default_rng(seed)
        rows = np.sort(rng.choice(len(ads) * self.plan.copies, min(count, len(ads) * self.plan.copies),
                                  replace=False))
        return [copy_ad(self.plan, ads[r % len(ads)], int(r // len(ads)), dim=self.model.D, formats=self.model.F)
                for r in rows.tolist()]

    def copy_of_ids(self, ad_ids) -> np.ndarray:
        return self.plan.copy_of_ids(ad_ids)

    def matcher(self) -> CompiledScan:
        """The eligible sets the checks read (`benchmarks.checks.CorpusOracle`): a scan of the copies'
        compiled targeting."""
        return CompiledScan(self.compiled)

    def describe(self) -> dict:
        return {"pool": "distinct copies", "copies": self.plan.copies, "base_ads": len(self.plan.base),
                "stride": self.plan.stride, "copies_differ": HOW_COPIES_DIFFER,
                "terms_kept_in_copy_1": round(self.plan.fixed_share(), 4)}


def copies_bytes(base: Dataset, copies: int) -> int:
    """Host bytes the copies' compiled targeting and embeddings take."""
    return copies * (base.compiled.nbytes + base.embeddings.values.nbytes + base.embeddings.scale.nbytes)


def available_bytes() -> int | None:
    """The host memory the kernel says is available (/proc/meminfo's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_copies(base: Dataset, copies: int, progress=False) -> CopiesDataset:
    """`copies` distinct copies of the loaded corpus `base` (`copies` >= 1; 1 is the corpus itself).
    Refuses (ValueError) when the copies' arrays alone would not fit the available host memory."""
    if copies < 1:
        raise ValueError(f"copies: at least 1, got {copies}")
    need, free = copies_bytes(base, copies), available_bytes()
    log(progress, f"copies: {copies} distinct copies of {len(base.compiled):,} ads make {copies * len(base.compiled):,} "
        f"ads, about {need / 1e9:.1f} GB of host memory (targeting and embeddings; the engine's "
        f"build takes more)" + ("" if free is None else f", {free / 1e9:.1f} GB available"))
    if free is not None and need > free:
        raise ValueError(f"{copies} copies of {len(base.compiled):,} ads need about {need / 1e9:.1f} GB of host "
                         f"memory for their targeting and embeddings alone, {free / 1e9:.1f} GB is available: "
                         "ask for fewer copies")
    plan = CopyPlan.of(base.compiled, copies, base.seed)
    log(progress, f"copies: {len(plan.keys):,} distinct terms permuted within their bands")
    compiled = copy_compiled(plan, progress)
    embeddings = copy_embeddings(plan, base.embeddings, base.seed, progress=progress)
    return CopiesDataset(base, plan, compiled, embeddings)




def warp_mix(slot_ad_id: np.ndarray, stride: int, warp: int = 32) -> dict:
    """How a layout mixes copies (`slot_ad_id`: the index's ad id per slot, -1 for a free slot): over
    the warps of `warp` slots that are full, the share holding copies of one ad only, and the mean
    number of distinct ads of the corpus a warp holds copies of."""
    ids = np.asarray(slot_ad_id, np.int64)
    n = len(ids) // warp * warp
    rows = ids[:n].reshape(-1, warp)
    rows = rows[(rows >= 0).all(axis=1)]
    if not len(rows):
        return {"full_warps": 0, "one_base_ad": 0.0, "distinct_base_ads_mean": 0.0}
    base = np.sort(rows % stride, axis=1)
    distinct = 1 + (base[:, 1:] != base[:, :-1]).sum(axis=1)
    return {"full_warps": int(len(rows)), "one_base_ad": round(float((distinct == 1).mean()), 4),
            "distinct_base_ads_mean": round(float(distinct.mean()), 2)}


__all__ = ["BAND_RATIO", "CopiesDataset", "CopyPlan", "HOW_COPIES_DIFFER", "copies_bytes", "copy_ad",
           "CompiledScan", "copy_compiled", "copy_embeddings", "make_copies", "move_circles", "schedule_shift", "warp_mix"]
