"""Equivalence at scale: property-based tests (hypothesis) over random ads, requests and update
streams, across every implementation of targeting and of retrieval.

Targeting (exact eligible sets, DESIGN section 2; the custom-location boundary aside):
* `OracleIndex` against `CpuTargetingIndex`: many small drawn cases (hypothesis shrinks them), and
  a few seeded cases of thousands of ads, with update streams (creates, replacements, status
  changes, retirements, re-creations, updates for ids that are not live) checked between chunks;
* `OracleIndex` against `GpuTargetingIndex` under the CUDA simulator, on small pools only (the
  simulator costs about 10 ms per slot and launch), with single and batched (`apply_many`) updates;
* both again at the edges of the value ranges: ad ids above 2**62, targeting ids near 2**40 (equal
  raw ids under different keys), users at the age limits, request times on schedule boundaries.

Retrieval (top-K and scores against the float64 `ReferenceRetriever` by `andromeda_nb.compare`):
* both architectures end to end as real processes on 127.0.0.1: `RemoteRetriever` (index host and
  scoring service) and `ColocatedRetriever` on device "cpu" behind its Flight server, loading the
  corpus saved as a directory. One pair of services is started for the module and reused: every hypothesis example sends a drawn update
  stream (JSON Lines, a malformed line sometimes among them) through each service's `update` action,
  checks the acknowledgement, then compares a drawn batch of requests at a drawn K;
* `ColocatedRetriever` on device "sim" (GPU index, fused kernel and GPU top-K under the simulator)
  in process, on a tiny pool.

The stateful tests accumulate updates across examples, so they run without shrinking; every
failure names the seed of its step and the seeds of the steps before it.

CI draws a fixed set of examples (derandomized). For a longer search run pytest with `--slow` (ten
times the examples, drawn at random) or set ANDROMEDA_DRAW_SCALE=N.

Every check can fail: the meta-tests run the same property code on an index that drops one eligible
ad, on one that keeps ads eligible at their end_time (caught by the edge cases only) and on a
retriever that ignores status updates, and require a failure.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import cpu_baseline.index as cpu_index_module
from andromeda_nb import testing
from andromeda_nb.compare import boundary_excused, compare_eligible, compare_topk
from andromeda_nb.compiled import MAX_TERM_ID
from andromeda_nb.constants import DEFAULT_F, FLEX_KEYS
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import MoeModel, quantize
from andromeda_nb.oracle import OracleIndex, eligible
from andromeda_nb.reference import ReferenceRetriever
from andromeda_nb.targeting import ad_to_json, parse_ad, parse_request, request_to_json
from andromeda_nb.types import Retire, SetStatus, Upsert
from andromeda_nb.updates import LiveAds, apply_updates, read_updates
from cpu_baseline.index import CpuTargetingIndex

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

# --slow (or ANDROMEDA_DRAW_SCALE=N): N times the examples, drawn at random instead of the fixed CI draw
# (a longer local search; hypothesis prints the falsifying example and how to reproduce it)
SCALE = testing.draw_scale()
SEEDS = st.integers(0, 2**32 - 1)
BASE = settings(deadline=None, derandomize=SCALE == 1, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# examples that carry state from one to the next cannot be replayed alone: no shrinking
STATEFUL = settings(BASE, phases=(Phase.explicit, Phase.generate))

SIM_CHUNK = 32  # slots per format chunk for the simulated GPU index (production: 256)
SIM_FORMATS = 3
SIM_POOL = 200  # ads of the simulated co-located pool: one format, one 256-slot chunk until creates grow it
SIM_MAX_UPDATES = 10  # updates per step (3 in 10 of them creates)


# --- targeting: one case, any set of indexes against the oracle ------------------------------------------


class _Collect:
    """An update target that only records what it was given (for batched `apply_many`)."""

    def __init__(self):
        self.items = []

    def apply(self, update):
        self.items.append(update)


def check_match(oracle: OracleIndex, indexes: dict, requests, context: str) -> int:
    """Every index's eligible sets equal the oracle's (ids of ads within BOUNDARY_SLACK_KM of a
    custom-location radius excused). Returns the number of eligible (ad, request) pairs."""
    want = oracle.match(requests)
    for name, index in indexes.items():
        got = index.match(requests)
        assert len(got) == len(requests), f"{name}, {context}: {len(got)} answers for {len(requests)} requests"
        for request, w, g in zip(requests, want, got):
            cmp = compare_eligible(w, g)
            if not cmp.ok:  # the boundary rule, computed only where it could matter
                cmp = compare_eligible(w, g, excused=boundary_excused(oracle.ads.values(), request))
            assert cmp.ok, f"{name} vs oracle, {context}, request {request.request_id}: {cmp.message}"
    return sum(len(w) for w in want)


def index_case(factories: dict, ads, updates, requests, context: str, *, chunks: int = 2,
               inspect=None) -> tuple[int, int]:
    """Build every index and the oracle from `ads`, compare them, then apply `updates` in `chunks`
    pieces (checked against the live ids once; indexes with `apply_many` take every other piece in
    one batch) comparing after each; `inspect(indexes)` sees them at the end. Returns (eligible
    pairs seen, updates rejected)."""
    oracle = OracleIndex.build(ads)
    indexes = {name: make(ads) for name, make in factories.items()}
    live = LiveAds(a.ad_id for a in ads)
    try:
        eligible = check_match(oracle, indexes, requests, f"{context}, {len(ads)} ads, before updates")
        rejected = 0
        bounds = np.linspace(0, len(updates), chunks + 1).astype(int)
        for step, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            batched = {n: x for n, x in indexes.items() if step % 2 == 1 and hasattr(x, "apply_many")}
            collect = _Collect()
            single = [x for n, x in indexes.items() if n not in batched]
            rejected += len(apply_updates(updates[lo:hi], [oracle, collect, *single], live))
            for index in batched.values():
                index.apply_many(collect.items)
            where = f"{context}, after updates [0, {hi}) of {len(updates)}"
            for name, index in indexes.items():
                assert len(index) == len(oracle), f"{name}, {where}: {len(index)} live ads, oracle {len(oracle)}"
            eligible += check_match(oracle, indexes, requests, where)
        if inspect is not None:
            inspect(indexes)
        return eligible, rejected
    finally:
        for index in indexes.values():
            close = getattr(index, "close", None)
            if close is not None:
                close()


def index_property(factories: dict, *, max_examples: int, max_ads: int, max_updates: int, max_requests: int,
                   formats: int = DEFAULT_F, chunks: int = 2, config=BASE):
    """A hypothesis test: drawn ads, update stream (10% for ids that are not live) and requests,
    `index_case` on them."""

    @settings(config, max_examples=max_examples * SCALE)
    @given(testing.ads_and_updates(max_ads=max_ads, max_updates=max_updates, invalid=0.1, dim=8, formats=formats),
           testing.request_lists(1, max_requests))
    def prop(ads_updates, requests):
        ads, updates = ads_updates
        note(f"{len(ads)} ads, {len(updates)} updates, {len(requests)} requests")
        index_case(factories, ads, updates, requests, f"{len(updates)} updates", chunks=chunks)

    return prop


def _cpu(threads: int = 1):
    return lambda ads: CpuTargetingIndex.build(ads, threads=threads)


def _gpu_sim(ads):
    from gpu.index import GpuTargetingIndex

    return GpuTargetingIndex.build(ads, device="sim", chunk_slots=SIM_CHUNK)


test_cpu_index_equals_oracle_drawn = index_property(
    {"cpu index": _cpu()}, max_examples=400, max_ads=14, max_updates=24, max_requests=6, chunks=3)
test_cpu_index_equals_oracle_drawn.__doc__ = (
    "Many small drawn corpora and streams: the CPU inverted index equals the oracle at every step.")

test_gpu_index_sim_equals_oracle_drawn = index_property(
    {"gpu index (sim)": _gpu_sim}, max_examples=7, max_ads=12, max_updates=16, max_requests=80,
    formats=SIM_FORMATS)
test_gpu_index_sim_equals_oracle_drawn.__doc__ = (
    "The GPU index under the CUDA simulator equals the oracle on small drawn corpora, single and "
    "batched updates (up to 80 requests a draw: more than one 64-request group of a launch).")


# many more draws of the shipped kernel, each cheaper (one format: one 32-slot chunk, as the simulator's
# cost is per slot; one request group; one update piece): with the two properties above and below,
# GPU_INDEX_DRAWS drawn examples in all under the simulator
GPU_INDEX_DRAWS = 200
def _many_draws(max_requests: int):
    prop = index_property({"gpu index (sim)": _gpu_sim}, max_examples=(GPU_INDEX_DRAWS - 7 - 3) // 2, max_ads=10,
                          max_updates=12, max_requests=max_requests, formats=1, chunks=1)
    prop.__doc__ = ("The shipped GPU index kernel under the simulator on many small drawn corpora, streams "
                    "and request lists, before and after the stream (two halves, so the test workers share them).")
    return prop


test_gpu_index_sim_equals_oracle_many_draws = _many_draws(max_requests=40)
test_gpu_index_sim_equals_oracle_many_more_draws = _many_draws(max_requests=12)


# --- the same cases pushed to the edges of the value ranges ------------------------------------------------

BIG_ID_STEP = 104_729  # ids i -> MAX_TERM_ID - i * step: the top of the range, equal raw ids across keys
BIG_AD_ID = 1 << 62  # ad ids a -> BIG_AD_ID + a * 1_000_003
EDGE_AGES = (0, 12, 13, 17, 18, 19, 40, 64, 65, 66, 120)
ID_LIST_KEYS = FLEX_KEYS + ("custom_audiences", "excluded_custom_audiences", "regions", "cities", "locales")


def _big(i: int) -> int:
    return MAX_TERM_ID - int(i) * BIG_ID_STEP


def _big_ad(a: int) -> int:
    return BIG_AD_ID + int(a) * 1_000_003


def _big_ids(obj):
    """A targeting or user object with every id (lists of the id keys, region, city, locale) mapped
    by `_big`; everything else as it was."""
    if isinstance(obj, list):
        return [_big_ids(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, value in obj.items():
        if key in ID_LIST_KEYS and isinstance(value, list):
            out[key] = [_big(i) for i in value]
        elif key in ("region", "city", "locale") and isinstance(value, int):
            out[key] = _big(value)
        else:
            out[key] = _big_ids(value)
    return out


def _edge_ad(draw, ad, formats: int):
    """The ad with big ids; three in ten get a broad targeting (every country, the age bounds kept)
    so that boundaries decide their eligibility; half the open schedule bounds get closed."""
    obj = ad_to_json(ad)
    obj["ad_id"] = _big_ad(obj["ad_id"])
    if draw(st.integers(0, 9)) < 3:
        t = obj["targeting"]
        obj["targeting"] = {"geo_locations": {"countries": list(testing.COUNTRIES)},
                            **{k: t[k] for k in ("age_min", "age_max") if k in t}}
    obj["targeting"] = _big_ids(obj["targeting"])
    if obj.get("start_time") is None and draw(st.booleans()):
        obj["start_time"] = testing.T0 + draw(st.integers(-3, 3)) * testing.DAY
    if obj.get("end_time") is None and draw(st.booleans()):
        obj["end_time"] = (obj.get("start_time") or testing.T0) + draw(st.integers(1, 4)) * testing.DAY
    return parse_ad(obj, seed=0, dim=len(ad.embedding), formats=formats)


def _edge_update(draw, update, formats: int):
    if isinstance(update, Upsert):
        return Upsert(_edge_ad(draw, update.ad, formats))
    if isinstance(update, SetStatus):
        return SetStatus(_big_ad(update.ad_id), update.status)
    return Retire(_big_ad(update.ad_id))


@st.composite
def edge_cases(draw, *, max_ads: int, max_updates: int, max_requests: int, formats: int):
    """Drawn ads, updates and requests with every id at the top of its range (ad ids above 2**62,
    targeting ids near 2**40), users at the age limits, and request times on the ads' schedule
    boundaries (start inclusive, end exclusive) or one second either side."""
    ads, updates = draw(testing.ads_and_updates(max_ads=max_ads, max_updates=max_updates, invalid=0.1, dim=8,
                                                formats=formats))
    requests = draw(testing.request_lists(1, max_requests))
    ads = [_edge_ad(draw, a, formats) for a in ads]
    updates = [_edge_update(draw, u, formats) for u in updates]
    times = sorted({t for a in ads + [u.ad for u in updates if isinstance(u, Upsert)]
                    for t in (a.start_time, a.end_time) if t is not None})
    out = []
    for request in requests:
        obj = request_to_json(request)
        obj["user"] = _big_ids(obj["user"])
        if draw(st.booleans()):
            obj["user"]["age"] = draw(st.sampled_from(EDGE_AGES))
        if times and draw(st.integers(0, 9)) < 8:
            obj["context"]["time"] = draw(st.sampled_from(times)) + draw(st.sampled_from((-1, 0, 0, 1)))
        out.append(parse_request(obj, seed=0, experts=len(request.signals), width=request.signals.shape[1]))
    return ads, updates, out


def edge_property(factories: dict, *, max_examples: int, max_ads: int, max_updates: int, max_requests: int,
                  formats: int = DEFAULT_F, config=BASE):
    @settings(config, max_examples=max_examples * SCALE)
    @given(edge_cases(max_ads=max_ads, max_updates=max_updates, max_requests=max_requests, formats=formats))
    def prop(case):
        ads, updates, requests = case
        note(f"{len(ads)} ads, {len(updates)} updates, {len(requests)} requests")
        index_case(factories, ads, updates, requests, f"edge values, {len(updates)} updates")

    return prop


test_cpu_index_equals_oracle_at_the_edges = edge_property(
    {"cpu index": _cpu()}, max_examples=200, max_ads=14, max_updates=20, max_requests=8)
test_cpu_index_equals_oracle_at_the_edges.__doc__ = (
    "The CPU index equals the oracle with ids at the top of their ranges, ages at the limits and "
    "request times on schedule boundaries.")

test_gpu_index_sim_equals_oracle_at_the_edges = edge_property(
    {"gpu index (sim)": _gpu_sim}, max_examples=3, max_ads=12, max_updates=16, max_requests=80,
    formats=SIM_FORMATS)
test_gpu_index_sim_equals_oracle_at_the_edges.__doc__ = (
    "The GPU index under the simulator at the same edges.")


def test_gpu_index_sim_built_empty_takes_upserts():
    """Regression (found by the drawn property above): a GPU index built from no ads failed its
    first batch of upserts under the simulator (an empty device-to-device copy when the slot columns
    grew from zero rows)."""
    rng = np.random.default_rng(5)
    ads = testing.random_ads(rng, 40, dim=8, formats=SIM_FORMATS)
    requests = testing.random_requests(rng, 48)
    updates = [Upsert(a) for a in ads] + testing.random_updates(rng, ads, 20, invalid=0.1, dim=8,
                                                               formats=SIM_FORMATS)
    eligible, rejected = index_case({"gpu index (sim)": _gpu_sim}, [], updates, requests,
                                    "seed 5, built empty", chunks=2)
    assert eligible > 0 and rejected > 0, f"seed 5: {eligible} eligible pairs, {rejected} rejected updates"


N_REQUESTS_AT_SCALE = 100
N_UPDATES_AT_SCALE = 600


@pytest.mark.parametrize("early_merge", [False, True])
@settings(BASE, max_examples=3 * SCALE)
@given(seed=SEEDS)
def test_cpu_index_equals_oracle_thousands(early_merge, seed):
    """Thousands of seeded random ads and a few hundred updates per case; with `early_merge` the
    CPU index merges its delta segment into the main one during the stream."""
    rng = np.random.default_rng(seed)
    n_ads = int(rng.integers(2000, 4000))
    threads = int(rng.integers(1, 3))
    ads = testing.random_ads(rng, n_ads, dim=8)
    requests = testing.random_requests(rng, N_REQUESTS_AT_SCALE)
    updates = testing.random_updates(rng, ads, N_UPDATES_AT_SCALE, invalid=0.1, dim=8)
    context = f"seed {seed}, early_merge {early_merge}, threads {threads}"
    merges = []
    with pytest.MonkeyPatch.context() as mp:
        if early_merge:
            mp.setattr(cpu_index_module, "DELTA_MERGE_MIN", 8)
        eligible, rejected = index_case({"cpu index": _cpu(threads)}, ads, updates, requests, context, chunks=4,
                                        inspect=lambda indexes: merges.append(indexes["cpu index"].merges))
    print(f"{context}: {n_ads} ads, {N_REQUESTS_AT_SCALE} requests, {N_UPDATES_AT_SCALE} updates "
          f"({rejected} rejected, {merges[0]} merges), {eligible} eligible pairs")
    if early_merge:
        assert merges[0] > 0, f"{context}: the delta segment was never merged"
    assert eligible > 0 and rejected > 0, f"{context}: the case proves nothing ({eligible} eligible, {rejected} rejected)"


# --- retrieval: a world of services kept in step with the reference ------------------------------------------


def make_dataset(seed: int, n_ads: int, *, D: int, F: int, precision: str, n_requests: int = 2,
                 big_ids: bool = False) -> Dataset:
    """Random ads and a model; with `big_ids` the ad ids lie above 2**62 (shuffled)."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation([_big_ad(i) for i in range(n_ads)]) if big_ids else None
    ads = testing.random_ads(rng, n_ads, dim=D, formats=F, ids=ids)
    table = quantize(np.stack([a.embedding for a in ads]) if ads else np.empty((0, D), np.float32), precision)
    return Dataset(ads=ads, embeddings=table, requests=testing.random_requests(rng, n_requests),
                   model=MoeModel.init(seed, D=D, F=F), seed=0, precision=precision)


MALFORMED_LINES = (
    '{"op": "retire"}',  # ad_id missing
    '{"op": "upsert", "ad": {"ad_id": 5, "targeting": {"genders": []}}}',  # empty list
    '{"op": "status", "ad_id": 1, "status": "LIVE"}',  # unknown status
    'not json',
)


class RetrievalWorld:
    """The reference and any retrievers, fed the same update streams.

    Served retrievers (a Flight `location`, no in-process engine) get the JSON Lines through their
    `update` action and their acknowledgement is checked; in-process ones get the parsed updates.
    The reference gets what the lines parse to, checked against the live ids here; its oracle holds
    the live ads the next stream is drawn from."""

    def __init__(self, dataset: Dataset, retrievers: dict):
        self.dataset = dataset
        self.reference = ReferenceRetriever.build(dataset)
        self.retrievers = retrievers
        self.steps: list[int] = []
        self.next_request_id = 0

    @property
    def live(self) -> dict:
        return self.reference.index.ads  # OracleIndex: ad id -> Ad, current status included

    @staticmethod
    def _served(retriever) -> bool:
        return getattr(retriever, "location", None) is not None and getattr(retriever, "engine", None) is None

    def update(self, rng: np.random.Generator, n_updates: int, malformed: bool, context: str) -> int:
        """Apply a random stream to everything; returns how many updates applied. A quarter of the
        upserts copy the embedding and format of a live ad: twins score exactly alike, so answers
        must break the tie by ad id."""
        model = self.dataset.model
        live = list(self.live.values())
        updates = testing.random_updates(rng, live, n_updates, invalid=0.1, dim=model.D, formats=model.F)
        for i, u in enumerate(updates):
            if isinstance(u, Upsert) and live and rng.random() < 0.25:
                twin = live[int(rng.integers(len(live)))]
                updates[i] = Upsert(dataclasses.replace(u.ad, embedding=twin.embedding.copy(), format=twin.format))
        lines = [json.dumps(testing.update_to_json(u)) for u in updates]
        if malformed:
            lines.insert(int(rng.integers(len(lines) + 1)), MALFORMED_LINES[int(rng.integers(len(MALFORMED_LINES)))])
        parsed, bad = read_updates(lines, seed=self.dataset.seed, dim=model.D, formats=model.F)
        assert len(bad) == int(malformed), f"{context}: {len(bad)} malformed lines, expected {int(malformed)}"
        in_process = [r for r in self.retrievers.values() if not self._served(r)]
        not_live = apply_updates(parsed, [self.reference, *in_process], LiveAds(self.live))
        applied = len(parsed) - len(not_live)
        expected_rejected = sorted(r.line_no for r in bad + not_live)
        for name, retriever in self.retrievers.items():
            if self._served(retriever):
                ack = retriever.apply_lines(lines)
                got = sorted(r["line"] for r in ack["rejected"])
                assert ack["applied"] == applied and got == expected_rejected, (
                    f"{name}, {context}: acknowledged {ack}; expected {applied} applied and lines "
                    f"{expected_rejected} rejected")
        return applied

    def check(self, rng: np.random.Generator, n_requests: int, k: int, context: str) -> int:
        """Every retriever's answers equal the reference's by `compare_topk`. Returns the number of
        eligible ads summed over the requests."""
        model = self.dataset.model
        requests = testing.random_requests(rng, n_requests, experts=model.E, width=model.S,
                                           start_id=self.next_request_id)
        self.next_request_id += n_requests
        reference = [self.reference.score_eligible(r) for r in requests]
        for name, retriever in self.retrievers.items():
            answers = retriever.retrieve(requests, k)
            assert len(answers) == len(requests), f"{name}, {context}: {len(answers)} answers"
            for request, (ref_ids, result), (ids, scores) in zip(requests, reference, answers):
                cmp = compare_topk(ref_ids, result, ids, scores, k)
                assert cmp.ok, (f"{name} vs reference, {context}, k={k}, request {request.request_id} "
                                f"({len(ref_ids)} eligible of {len(self.live)} live ads): {cmp.message}")
        return sum(len(ids) for ids, _ in reference)


def run_step(world: RetrievalWorld, seed: int, *, max_updates: int, ks, n_requests,
             require_eligible: bool) -> int:
    """One step of a world, everything drawn from (seed, step number): a stream of up to
    `max_updates` updates (a malformed line among them three times in ten) sent to every part of
    the world, then a batch of requests (a size from `n_requests`, an int or a choice of ints)
    compared at a K from `ks`."""
    rng = np.random.default_rng([seed, len(world.steps)])
    n_updates, malformed = int(rng.integers(0, max_updates + 1)), bool(rng.random() < 0.3)
    k = int(ks[rng.integers(len(ks))])
    sizes = np.atleast_1d(n_requests)
    n_requests = int(sizes[rng.integers(len(sizes))])
    context = f"step {len(world.steps)} seed {seed}"
    note(f"{context}; earlier step seeds, in order: {world.steps}")
    world.steps.append(seed)
    try:
        applied = world.update(rng, n_updates, malformed, context)
        eligible = world.check(rng, n_requests, k, context)
        if require_eligible:
            assert eligible > 0, f"{context}: no request had an eligible ad; the step proves nothing"
    except AssertionError as err:  # the world's state depends on every step before this one
        err.args = (f"{err}\n(earlier step seeds, in order: {world.steps[:-1]})",)
        raise
    print(f"{context}: {applied} of {n_updates} updates applied, malformed line {malformed}, "
          f"{len(world.live)} live ads, {n_requests} requests at k={k}, {eligible} eligible")
    return eligible


@pytest.fixture(scope="module")
def served_world(tmp_path_factory):
    """2,000 random ads (ids above 2**62, int8 embeddings, D 16, 4 formats) saved as a corpus
    directory; the remote architecture (index host and scoring service) and the co-located server
    on device "cpu", all subprocesses on 127.0.0.1 loading that directory (compiled targeting from
    targeting.npz, nothing parsed). The reference is built from the ads in memory."""
    from andromeda_nb.store import load_dataset, save_dataset
    from cpu_baseline.remote import RemoteRetriever
    from migration.colocated import ColocatedRetriever

    dataset = make_dataset(2026, 2000, D=16, F=4, precision="int8", big_ids=True)
    stored = load_dataset(save_dataset(dataset, tmp_path_factory.mktemp("corpus")))
    assert stored.source_dir is not None and not stored.ads_loaded
    started = []
    try:
        started.append(RemoteRetriever.build(stored))
        started.append(ColocatedRetriever.build(stored, device="cpu", served=True))
        yield RetrievalWorld(dataset, {"remote": started[0], "colocated (cpu, served)": started[1]})
    finally:
        for retriever in reversed(started):
            retriever.close()


@settings(STATEFUL, max_examples=40 * SCALE)
@given(seed=SEEDS)
def test_both_architectures_equal_reference_through_updates(served_world, seed):
    """Both architectures end to end over Flight, through drawn update streams sent to the services'
    update action: the acknowledgements the live ids predict, and answers equal to the float64
    reference (at K 4096 every eligible ad is in the answer, so the eligible sets are compared too).
    Batches of 70 requests cross the co-located engine's 64-request launches."""
    run_step(served_world, seed, max_updates=40, ks=(1, 10, 100, 4096), n_requests=(16, 16, 16, 70),
             require_eligible=True)


SIM_WORLDS = 5  # independent worlds (spread over the test workers) ...
SIM_STEPS = 10  # ... of this many steps each: 50 steps of the co-located path under the simulator


@pytest.fixture(scope="module", params=range(SIM_WORLDS))
def sim_world(request):
    """A small pool in one format (one 256-slot chunk: the simulator's cost is per slot) for the
    co-located path on device "sim", with float16 embeddings and ids above 2**62; creates grow the
    pool by chunks (formats across chunks: tests/migration/test_colocated.py and the served world)."""
    from migration.colocated import ColocatedRetriever

    dataset = make_dataset(7 + 100 * request.param, SIM_POOL, D=16, F=1, precision="fp16", big_ids=True)
    retriever = ColocatedRetriever.build(dataset, device="sim")
    assert retriever.device == "sim"
    try:
        yield RetrievalWorld(dataset, {"colocated (sim)": retriever})
    finally:
        retriever.close()


@settings(STATEFUL, max_examples=SIM_STEPS * SCALE)
@given(seed=SEEDS)
def test_colocated_sim_equals_reference_through_updates(sim_world, seed):
    """The co-located path on the simulated GPU (the shipped match, fused scoring and top-K kernels)
    equals the reference through drawn update streams, SIM_STEPS steps in each of SIM_WORLDS worlds."""
    run_step(sim_world, seed, max_updates=SIM_MAX_UPDATES, ks=(1, 5, 64), n_requests=2, require_eligible=False)


def test_colocated_sim_built_empty_takes_upserts():
    """Regression: the co-located engine on the GPU path could not be built from a corpus with no
    ads (the tiled embedding table of zero slots), nor answer before its first create."""
    from migration.colocated import ColocatedRetriever

    dataset = make_dataset(8, 0, D=16, F=1, precision="int8")
    retriever = ColocatedRetriever.build(dataset, device="sim")
    try:
        world = RetrievalWorld(dataset, {"colocated (sim), built empty": retriever})
        rng = np.random.default_rng(8)
        assert world.check(rng, 2, 5, "seed 8, no ads") == 0
        ads = testing.random_ads(rng, 120, dim=16, formats=1)
        apply_updates([Upsert(a) for a in ads], [world.reference, retriever], LiveAds())
        assert world.check(rng, 1, 5, "seed 8, after 120 creates") > 0
    finally:
        retriever.close()


# --- every check can fail -----------------------------------------------------------------------------------


class DropsOneEligible:
    """A wrong index: the CPU index, except that the highest eligible id of the first request with
    any eligible ad is left out."""

    def __init__(self, inner):
        self.inner = inner

    def match(self, requests):
        out = self.inner.match(requests)
        for i, ids in enumerate(out):
            if len(ids):
                out[i] = ids[:-1]
                break
        return out

    def apply(self, update):
        self.inner.apply(update)

    def __len__(self):
        return len(self.inner)


class EndInclusive(OracleIndex):
    """A wrong index: the oracle, except that an ad is still eligible at its end_time."""

    def match(self, requests):
        def later_end(ad):
            return ad if ad.end_time is None else dataclasses.replace(ad, end_time=ad.end_time + 1)

        return [np.asarray(sorted(i for i, ad in self.ads.items() if eligible(later_end(ad), r)), np.int64)
                for r in requests]


class IgnoresStatus:
    """A wrong retriever: the co-located engine, except that status updates never reach it."""

    def __init__(self, inner):
        self.inner = inner

    def apply(self, update):
        if not isinstance(update, SetStatus):
            self.inner.apply(update)

    def retrieve(self, requests, k):
        return self.inner.retrieve(requests, k)


NO_SHRINK = settings(BASE, phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False)


@pytest.mark.filterwarnings("ignore:Generating overly large repr")
def test_wrong_index_is_caught_by_the_same_property():
    """An index that leaves out one eligible ad fails the drawn property that the CPU index passes."""
    prop = index_property({"cpu index dropping one": lambda ads: DropsOneEligible(CpuTargetingIndex.build(ads))},
                          max_examples=30, max_ads=14, max_updates=24, max_requests=6, config=NO_SHRINK)
    with pytest.raises(AssertionError, match=r"cpu index dropping one vs oracle.*eligible ad\(s\) missing"):
        prop()


@pytest.mark.filterwarnings("ignore:Generating overly large repr")
def test_schedule_off_by_one_is_caught_at_the_edges():
    """An index that keeps an ad eligible at its end_time is caught by the edge property (request
    times on the boundaries), while random times almost never land on a boundary."""
    prop = edge_property({"end-inclusive": EndInclusive.build}, max_examples=40, max_ads=14, max_updates=20,
                         max_requests=8, config=NO_SHRINK)
    with pytest.raises(AssertionError, match=r"end-inclusive vs oracle.*not eligible but returned"):
        prop()


def test_wrong_retriever_is_caught_by_the_same_property():
    """A retriever that misses status updates fails the step property within a few steps, while the
    same engine receiving every update passes them."""
    from migration.colocated import ColocatedRetriever

    dataset = make_dataset(99, 400, D=16, F=4, precision="fp32")
    engines = [ColocatedRetriever.build(dataset, device="cpu") for _ in range(2)]
    worlds = {
        "stale": RetrievalWorld(dataset, {"stale": IgnoresStatus(engines[0])}),
        "good": RetrievalWorld(dataset, {"good": engines[1]}),
    }

    @settings(NO_SHRINK, max_examples=8)
    @given(seed=SEEDS)
    def prop(name, seed):
        run_step(worlds[name], seed, max_updates=40, ks=(4096,), n_requests=16, require_eligible=False)

    try:
        with pytest.raises(AssertionError, match=r"stale vs reference"):
            prop("stale")
        prop("good")
    finally:
        for engine in engines:
            engine.close()
    assert len(worlds["good"].steps) == 8
    assert len(worlds["stale"].steps) < 8
