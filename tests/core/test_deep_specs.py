"""Deep specs: ads with 1 to 28 positive clauses, every one satisfied by the user, beside twins with
exactly one clause the user misses, each also with an exclusion the user holds or does not hold, on
every index and through update streams.

Random corpora rarely hold an ad with more than five positive clauses all satisfied, so a counting
error that only shows from nine clauses on (a popcount whose byte sum did not wrap at 32 bits) went
unseen by the drawn equivalence tests; and that error hid a second one, an ad missing one positive
clause whose negative clause was hit (one bit short, one bit over: the count looked right). Here the
oracle first proves each case means what it says, then every index must agree with it exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from andromeda_nb import testing
from andromeda_nb.constants import DEFAULT_E, SIGNAL_WIDTH
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import MoeModel, quantize
from andromeda_nb.oracle import OracleIndex
from andromeda_nb.targeting import parse_ad, parse_request
from andromeda_nb.types import Retire, Upsert
from andromeda_nb.updates import LiveAds, apply_updates
from cpu_baseline.index import CpuTargetingIndex, _popcount32

DIM = 8
FORMATS = 3
SIM_CHUNK = 32
DEPTHS = range(1, testing.MAX_POSITIVE_CLAUSES + 1)
FILLERS = 200  # broad ads every deep user reaches: the CPU index then takes its dense pass
CONTEXT = {"publisher_platform": "facebook", "device_platform": "mobile", "user_os": "iOS",
           "time": testing.T0}


# per depth n, ads 10_000 + 8n + variant; (eligible for user n?, starts from the twin?, exclusion?)
VARIANTS = {
    0: (True, False, None),  # every positive clause met
    1: (False, True, None),  # one positive clause missed
    2: (True, False, "not held"),  # an exclusion the user does not hold
    3: (False, False, "held"),  # an exclusion the user holds
    4: (False, True, "held"),  # one positive clause missed and the exclusion held
}


def variant_id(n: int, variant: int) -> int:
    return 10_000 + 8 * n + variant


def _exclude(ad: dict, user: dict, held: bool) -> dict:
    audience = user["custom_audiences"][0] if held and user.get("custom_audiences") else None
    key = "excluded_custom_audiences" if audience is not None else "exclusions"
    if key == "exclusions":
        ids = user.get("interests", [])
        if held:
            ident = ids[0] if ids else (1 << 39) + 5
            user["interests"] = sorted({*ids, ident})
        else:
            ident = (1 << 39) + 7  # never drawn for a user: see deep_spec_pair
        value = {"interests": [ident]}
    else:
        value = [audience]
    return {**ad, "targeting": {**ad["targeting"], key: value}}


def deep_world(seed: int):
    """(deep ads, twins, fillers, requests): for each depth n, the variants of `VARIANTS` around an
    ad with n positive clauses all satisfied by request n's user; `deep` holds the variants the user
    should see, `twins` the others."""
    rng = np.random.default_rng(seed)
    deep, twins, requests = [], [], []
    for n in DEPTHS:
        user, ad, twin = testing.deep_spec_pair(rng, n, ad_id=0, fail_id=0, formats=FORMATS)
        for variant, (eligible, from_twin, exclusion) in VARIANTS.items():
            obj = {**(twin if from_twin else ad), "ad_id": variant_id(n, variant)}
            if exclusion is not None:
                obj = _exclude(obj, user, exclusion == "held")
            (deep if eligible else twins).append(parse_ad(obj, seed=0, dim=DIM, formats=FORMATS))
        requests.append(parse_request({"request_id": n, "user": user, "context": CONTEXT}, seed=0,
                                              experts=DEFAULT_E, width=SIGNAL_WIDTH))
    fillers = [parse_ad({"ad_id": i, "format": i % FORMATS, "targeting": {"geo_locations": {"countries": ["US"]}}},
                        seed=0, dim=DIM, formats=FORMATS) for i in range(FILLERS)]
    return deep, twins, fillers, requests


def assert_cases_hold(oracle: OracleIndex, requests, context: str) -> None:
    """The oracle sees each depth's variants as `VARIANTS` says (the generator means what it says)."""
    for request, ids in zip(requests, oracle.match(requests)):
        n = request.request_id
        for variant, (eligible, _, _) in VARIANTS.items():
            if variant_id(n, variant) in oracle.ads:
                assert (variant_id(n, variant) in ids) == eligible, (
                    f"{context}: depth {n}, variant {variant}: the oracle says eligible = {not eligible}")


def assert_equal_to_oracle(oracle: OracleIndex, indexes: dict, requests, context: str) -> None:
    want = oracle.match(requests)
    for name, index in indexes.items():
        got = index.match(requests)
        for request, w, g in zip(requests, want, got):
            missing = sorted(set(w.tolist()) - set(g.tolist()))
            extra = sorted(set(g.tolist()) - set(w.tolist()))
            assert not missing and not extra, (
                f"{name}, {context}, depth {request.request_id}: missing {missing}, extra {extra}")


def test_popcount_counts_every_bit():
    """The CPU index's clause count: every bit count 0..32 and random words, top bit included."""
    rng = np.random.default_rng(0)
    words = [(1 << n) - 1 for n in range(33)] + [0x80000000 | ((1 << n) - 1) for n in range(32)]
    words += rng.integers(0, 1 << 32, 5000, dtype=np.uint64).tolist()
    for w in words:
        assert int(_popcount32(np.uint32(w))) == bin(int(w)).count("1"), f"popcount of {int(w):#010x}"


def _cpu_indexes(ads):
    return {
        "cpu index (dense pass)": CpuTargetingIndex.build(ads, threads=1),
        "cpu index (sparse walk)": CpuTargetingIndex.build(ads, threads=2, spare=50.0),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_index_finds_every_depth_built_and_through_updates(seed):
    """Built with every deep ad (main segment), then from fillers alone with the deep ads and twins
    upserted (delta segment), merged, replaced by their twins and back, retired and re-created."""
    deep, twins, fillers, requests = deep_world(seed)
    context = f"seed {seed}"
    oracle = OracleIndex.build(fillers + deep + twins)
    assert_cases_hold(oracle, requests, context)
    indexes = _cpu_indexes(fillers + deep + twins)
    assert_equal_to_oracle(oracle, indexes, requests, f"{context}, built")

    oracle = OracleIndex.build(fillers)
    indexes = _cpu_indexes(fillers)
    live = LiveAds(a.ad_id for a in fillers)
    stages = [
        ("deep ads and twins upserted (delta)", [Upsert(a) for a in deep + twins]),
        ("merged", []),
        ("deep ads replaced by twins' targeting", [Upsert(_with_id(t, a.ad_id)) for a, t in zip(deep, twins)]),
        ("and back", [Upsert(a) for a in deep]),
        ("retired", [Retire(a.ad_id) for a in deep]),
        ("re-created", [Upsert(a) for a in deep]),
    ]
    for name, updates in stages:
        assert not apply_updates(updates, [oracle, *indexes.values()], live), f"{context}, {name}: rejected"
        if name == "merged":
            for index in indexes.values():
                index.merge()
        assert_equal_to_oracle(oracle, indexes, requests, f"{context}, {name}")
    assert_cases_hold(oracle, requests, f"{context}, at the end")


def _with_id(ad, ad_id: int):
    import dataclasses

    return dataclasses.replace(ad, ad_id=ad_id)


def test_gpu_index_sim_finds_every_depth_through_updates():
    """The GPU index under the simulator, built and through a batch of upserts; the requests are
    repeated to 84 so that deep users sit in both halves of a 64-request group and in a second one."""
    from gpu.index import GpuTargetingIndex

    if testing.KERNEL_DEVICE == "gpu":
        pytest.skip("the simulator is chosen per process; the GPU run checks the device index instead")
    deep, twins, fillers, requests = deep_world(3)
    fillers = fillers[:40]
    many = requests * 3
    oracle = OracleIndex.build(fillers + deep + twins)
    assert_cases_hold(oracle, requests, "seed 3")
    built = GpuTargetingIndex.build(fillers + deep + twins, device="sim", chunk_slots=SIM_CHUNK)
    assert_equal_to_oracle(oracle, {"gpu index (sim), built": built}, many, "seed 3")

    oracle = OracleIndex.build(fillers)
    grown = GpuTargetingIndex.build(fillers, device="sim", chunk_slots=SIM_CHUNK)
    live = LiveAds(a.ad_id for a in fillers)
    updates = [Upsert(a) for a in deep + twins] + [Upsert(_with_id(t, a.ad_id)) for a, t in zip(deep[::2], twins[::2])]
    assert not apply_updates(updates, [oracle], live)
    grown.apply_many(updates)
    assert_equal_to_oracle(oracle, {"gpu index (sim), upserted": grown}, many, "seed 3, after upserts")


def test_colocated_cpu_path_finds_every_depth_through_updates():
    """The co-located engine on the CPU: with k above the pool size its answer is the eligible set."""
    from cpu_baseline.engine import CpuEngine

    deep, twins, fillers, requests = deep_world(4)
    fillers = fillers[:50]
    ads = fillers + deep[::2] + twins[::2]
    table = quantize(np.stack([a.embedding for a in ads]), "fp32")
    dataset = Dataset(ads=ads, embeddings=table, requests=requests, model=MoeModel.init(4, D=DIM, F=FORMATS),
                      seed=0, precision="fp32")
    engine = CpuEngine(dataset)
    oracle = OracleIndex.build(ads)
    k = 4096

    def check(context):
        for request, want, (ids, _) in zip(requests, oracle.match(requests), engine.retrieve(requests, k)):
            assert sorted(ids.tolist()) == want.tolist(), f"co-located cpu, {context}, depth {request.request_id}"

    check("built")
    updates = [Upsert(a) for a in deep[1::2] + twins[1::2]]
    assert not apply_updates(updates, [oracle, engine], LiveAds(a.ad_id for a in ads))
    check("after upserts")
    assert_cases_hold(oracle, requests, "seed 4, after upserts")
