"""The JSON Schemas of docs/schemas/ (andromeda_nb.schemas) against what the project accepts: the
files are what the module makes and valid draft 2020-12 schemas; on data/sample the valid lines pass
and each deliberately malformed one fails (or is named as a rule a one-line schema cannot state);
generated valid ads, requests and updates pass; and thousands of single-field mutations of valid
lines pass their schema exactly when the parser `import` and the update stream use accepts them,
with `import` itself run on a file of them."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from andromeda_nb import schemas
from andromeda_nb.constants import DEFAULT_D, DEFAULT_E, DEFAULT_F, SIGNAL_WIDTH
from andromeda_nb.targeting import parse_ad, parse_request, request_to_json
from andromeda_nb.testing import random_ad_json, random_ads, random_request_json, random_requests, random_updates, \
    update_to_json
from andromeda_nb.types import TargetingError
from andromeda_nb.updates import parse_update

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"
SCHEMA_DIR = ROOT / "docs" / "schemas"
SEED = 19


def _validator(kind: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads((SCHEMA_DIR / schemas.FILES[kind]).read_text()))


AD, REQUEST, UPDATE = (_validator(k) for k in ("ad", "request", "update"))


def _parses(kind: str, obj) -> bool:
    try:
        if kind == "ad":
            parse_ad(obj, seed=0, dim=DEFAULT_D, formats=DEFAULT_F)
        elif kind == "request":
            parse_request(obj, seed=0, experts=DEFAULT_E, width=SIGNAL_WIDTH)
        else:
            parse_update(obj, seed=0, dim=DEFAULT_D, formats=DEFAULT_F)
    except TargetingError:
        return False
    return True


def _lines(path: Path) -> list[tuple[int, object | None]]:
    out = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append((n, json.loads(text)))
        except ValueError:
            out.append((n, None))
    return out


def test_the_files_are_what_the_module_makes_and_valid_schemas():
    for name, schema in schemas.schemas().items():
        assert (SCHEMA_DIR / name).read_text() == schemas.render(schema), \
            f"docs/schemas/{name} is stale: run python -m andromeda_nb.schemas docs/schemas"
        Draft202012Validator.check_schema(schema)
    assert sorted(p.name for p in SCHEMA_DIR.glob("*.json")) == sorted(schemas.FILES.values())


def test_the_sample_ads_valid_pass_and_each_malformed_one_fails():
    spec = importlib.util.spec_from_file_location("make_sample", ROOT / "data" / "make_sample.py")
    make_sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_sample)
    malformed = {line: path for line, _, path in make_sample.MALFORMED}
    lines = _lines(SAMPLE / "ads.jsonl")
    assert len(lines) == 200
    for n, obj in lines:
        if n not in malformed:
            errors = [e.message for e in AD.iter_errors(obj)]
            assert not errors, f"ads.jsonl line {n} is valid, the schema says {errors[:2]}"
        elif obj is None:
            assert n == 143, "the one line that is not JSON at all"
        elif n == 200:  # a repeat of line 1's ad_id: a rule across lines, named in the schema's $comment
            assert AD.is_valid(obj) and obj["ad_id"] == lines[0][1]["ad_id"]
            assert "repeats an earlier line" in AD.schema["$comment"]
        else:
            errors = list(AD.iter_errors(obj))
            assert errors, f"ads.jsonl line {n} ({malformed[n]}) passes the schema"


def test_the_sample_requests_and_updates():
    for n, obj in _lines(SAMPLE / "requests.jsonl"):
        assert REQUEST.is_valid(obj), f"requests.jsonl line {n}"
    verdicts = {n: (obj is not None and UPDATE.is_valid(obj)) for n, obj in _lines(SAMPLE / "updates.jsonl")}
    assert all(verdicts[n] for n in range(1, 27)), verdicts
    # 27 and 28 name ads that are not live at that point of the stream: the stream rejects them
    assert verdicts[27] and verdicts[28] and not verdicts[29] and not verdicts[30]
    assert "not live" in UPDATE.schema["description"]


def test_generated_valid_lines_pass():
    rng = np.random.default_rng(SEED)
    for i in range(200):
        ad = random_ad_json(rng, i)
        assert AD.is_valid(ad), (SEED, i, list(AD.iter_errors(ad))[:1])
        req = random_request_json(rng, i)
        assert REQUEST.is_valid(req), (SEED, i, list(REQUEST.iter_errors(req))[:1])
    ads = random_ads(rng, 40, dim=DEFAULT_D)
    for req in random_requests(rng, 20):
        assert REQUEST.is_valid(request_to_json(req))
    for update in random_updates(rng, ads, 150, dim=DEFAULT_D):
        line = update_to_json(update)
        assert UPDATE.is_valid(line), (SEED, line)


# --- mutations: one field of a valid line changed, the schema's verdict against the parser's ----------------

_KEYS = ("ad_id", "status", "format", "targeting", "embedding", "age_min", "age_max", "genders", "geo_locations",
         "countries", "regions", "cities", "custom_locations", "latitude", "longitude", "radius", "distance_unit",
         "flexible_spec", "interests", "behaviors", "exclusions", "custom_audiences", "locales", "user", "context",
         "age", "gender", "country", "region", "city", "locale", "publisher_platform", "device_platform", "user_os",
         "time", "signals", "op", "ad", "request_id", "unknown", "start_time", "end_time")
_STRINGS = ("US", "us", "USA", "U", "US\n", "facebook", "tiktok", "mobile", "iOS", "kilometer", "mile", "ACTIVE",
            "PAUSED", "upsert", "status", "retire", "", "18")


def _value(rnd: random.Random, depth: int = 0):
    """A random JSON value near the edges of what the format allows (no float with an integer value,
    no NaN: the two things a schema cannot tell apart, named in its $comment)."""
    kind = rnd.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.choice((True, False))
    if kind == 2:
        return rnd.choice((-1, 0, 1, 2, 3, 12, 13, 17, 18, 30, 40, 65, 66, 80, 81, 90, 91, 120, 121, 180, 181,
                           (1 << 40) - 1, 1 << 40, (1 << 62), (1 << 62) + 1, (1 << 63) - 1, 1 << 63, -(1 << 63) - 1))
    if kind == 3:
        return rnd.choice((0.5, -0.5, 12.5, 49.9, 50.5, 79.9, 80.5, 89.5, 90.5, 1e-3, -179.5, 180.5, 3.5e38))
    if kind in (4, 5):
        return rnd.choice(_STRINGS)
    if kind in (6, 7):
        return [_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    return {rnd.choice(_KEYS): _value(rnd, depth + 1) for _ in range(rnd.randrange(3))}


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj[:3]):
            yield from _paths(value, prefix + (i,))


def mutate(obj, rnd: random.Random):
    """`obj` with one change: a value replaced, a key removed, or a key added, at a random place."""
    out = copy.deepcopy(obj)
    path = rnd.choice([p for p in _paths(out) if p])
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    action = rnd.randrange(4)
    if action == 0 and isinstance(parent, dict):
        del parent[last]
    elif action == 1 and isinstance(parent, dict):
        parent[rnd.choice(_KEYS)] = _value(rnd)
    else:
        parent[last] = _value(rnd)
    return out


def _valid_lines(rng: np.random.Generator):
    ad = random_ad_json(rng, 7)
    ad["targeting"].setdefault("geo_locations", {})["custom_locations"] = [
        {"latitude": 40.0, "longitude": -74.0, "radius": 12.5, "distance_unit": "mile"}]
    ad["targeting"]["flexible_spec"] = [{"interests": [1, 2], "behaviors": [3]}]
    ad["embedding"] = rng.standard_normal(DEFAULT_D).tolist()
    request = random_request_json(rng, 3)
    request["user"].update(latitude=40.5, longitude=-74.1, region=5, city=6)
    request["signals"] = rng.standard_normal((DEFAULT_E, SIGNAL_WIDTH)).tolist()
    updates = [{"op": "upsert", "ad": ad}, {"op": "status", "ad_id": 7, "status": "PAUSED"},
               {"op": "retire", "ad_id": 7}]
    return {"ad": [ad], "request": [request], "update": updates}


@pytest.mark.parametrize("kind", ["ad", "request", "update"])
def test_a_mutated_line_passes_its_schema_exactly_when_the_parser_accepts_it(kind):
    rnd, rng = random.Random(SEED), np.random.default_rng(SEED)
    validator = {"ad": AD, "request": REQUEST, "update": UPDATE}[kind]
    bases = _valid_lines(rng)[kind]
    counts = {True: 0, False: 0}
    for i in range(1500):
        obj = mutate(bases[i % len(bases)], rnd)
        accepted = _parses(kind, obj)
        assert validator.is_valid(obj) == accepted, (
            f"seed {SEED}, mutation {i}: the parser {'accepts' if accepted else 'rejects'} it, the schema "
            f"{'does not' if accepted else 'does'}: {json.dumps(obj)[:600]}")
        counts[accepted] += 1
    assert min(counts.values()) > 50, counts  # both verdicts are exercised


def test_import_accepts_exactly_the_lines_the_schema_passes(tmp_path):
    from andromeda_nb.store import import_jsonl

    rnd, rng = random.Random(SEED + 1), np.random.default_rng(SEED + 1)
    base = _valid_lines(rng)["ad"][0]
    lines = []
    for i in range(400):
        obj = mutate(base, rnd) if i % 3 else dict(base)
        if isinstance(obj, dict):
            obj["ad_id"] = 10_000 + i  # distinct ids: the one rule across lines stays out of it
        lines.append(obj)
    (tmp_path / "ads.jsonl").write_text("".join(json.dumps(o) + "\n" for o in lines))
    summary = import_jsonl(tmp_path / "ads.jsonl", SAMPLE / "requests.jsonl", tmp_path / "out", seed=7)
    rejected_lines = {int(json.loads(x)["error"].split(":")[0].split()[1])
                      for x in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()}
    schema_rejects = {n for n, obj in enumerate(lines, 1) if not AD.is_valid(obj)}
    assert rejected_lines == schema_rejects, (sorted(rejected_lines ^ schema_rejects)[:10], SEED + 1)
    assert summary.ads == 400 - len(schema_rejects) and 0 < len(schema_rejects) < 400


def test_what_the_schema_cannot_say_is_named_and_the_loader_refuses():
    ad = {"ad_id": 1, "targeting": {"geo_locations": {"countries": ["US"]}, "age_min": 18.0}}
    assert AD.is_valid(ad) and not _parses("ad", ad), "18.0: JSON Schema's integer accepts it"
    many = {"ad_id": 2, "targeting": {"geo_locations": {"countries": ["US"]},
                                      "flexible_spec": [{"interests": list(range(600)),
                                                         "behaviors": list(range(600))}]}}
    assert AD.is_valid(many) and not _parses("ad", many), "1200 distinct ids in one object"
    repeated = {"ad_id": 3, "targeting": {"geo_locations": {"countries": ["US"]},
                                          "flexible_spec": [{"interests": [5] * 1500}]}}
    assert AD.is_valid(repeated) and _parses("ad", repeated), "a repeated id counts once, for both"
    for text in ("18.0", "NaN", "1000 distinct ids", "repeats an earlier line"):
        assert text in AD.schema["$comment"]


def _ad(**targeting):
    return {"ad_id": 1, "targeting": {"geo_locations": {"countries": ["US"]}, **targeting}}


def _request(**user):
    return {"request_id": 1, "user": {"age": 30, **user},
            "context": {"publisher_platform": "facebook", "device_platform": "mobile", "user_os": "iOS", "time": 0}}


@pytest.mark.parametrize("kind,obj,accepted", [
    ("ad", _ad(age_max=15), False),  # below the default age_min 18
    ("ad", _ad(age_max=18), True),
    ("ad", _ad(age_min=40, age_max=30), False),
    ("ad", _ad(age_min=40, age_max=40), True),
    ("ad", _ad(age_min=65), True),  # age_max defaults to 65
    ("ad", {"ad_id": 1, "targeting": {"geo_locations": {"countries": ["US\n"]}}}, False),
    ("ad", {"ad_id": 1, "targeting": {"custom_audiences": [5]}}, True),
    ("ad", {"ad_id": 1, "targeting": {"geo_locations": {}}}, False),
    ("ad", _ad(geo_locations={"custom_locations": [{"latitude": 0, "longitude": 0, "radius": 80,
                                                    "distance_unit": "kilometer"}]}), True),
    ("ad", _ad(geo_locations={"custom_locations": [{"latitude": 0, "longitude": 0, "radius": 50.5,
                                                    "distance_unit": "mile"}]}), False),
    ("ad", _ad(geo_locations={"custom_locations": [{"latitude": 0, "longitude": 0, "radius": 0,
                                                    "distance_unit": "mile"}]}), False),
    ("ad", _ad(flexible_spec=[{"interests": [1]}] * 25), True),
    ("ad", _ad(flexible_spec=[{"interests": [1]}] * 26), False),
    ("ad", _ad(exclusions={}), False),
    ("ad", _ad(genders=[True]), False),
    ("ad", dict(_ad(), embedding=[0.5] * 63), False),
    ("ad", dict(_ad(), format=8), False),
    ("ad", dict(_ad(), start_time=None, end_time=1 << 62), True),
    ("request", _request(latitude=1.5), False),  # latitude and longitude come together
    ("request", _request(latitude=1.5, longitude=None), False),
    ("request", _request(latitude=None, longitude=None, country=None, region=None), True),
    ("request", _request(interests=[]), True),
    ("request", _request(gender=None), False),
    ("request", dict(_request(), signals=[[0.0] * 16] * 5), False),
    ("update", {"op": "upsert", "ad": _ad(), "ad_id": 1}, False),
    ("update", {"op": "status", "ad_id": 1, "status": "GONE"}, False),
    ("update", {"op": "retire", "ad_id": -1}, False),
])
def test_edge_cases_agree(kind, obj, accepted):
    validator = {"ad": AD, "request": REQUEST, "update": UPDATE}[kind]
    assert _parses(kind, obj) == accepted, "the parser's verdict, as DESIGN section 2 states it"
    assert validator.is_valid(obj) == accepted, list(validator.iter_errors(obj))[:2]
