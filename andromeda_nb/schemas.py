"""JSON Schemas (draft 2020-12) of the interchange lines of DESIGN sections 2 and 6: an ad, a request,
an update. Made here from the same constants `andromeda_nb.targeting` checks against, and published
in docs/schemas/ (`python -m andromeda_nb.schemas docs/schemas` writes them; a test keeps the files
equal to what this module makes, and checks that a line passes its schema exactly when `import` and
the update stream accept it).

The published files are for a corpus of the default sizes (D = 64 embedding values, F = 8 formats,
E = 6 signal groups of S = 16); `ad_schema(dim=..., formats=...)` and the others make them for other
sizes. What a schema of one line cannot say, and the loader still checks (each named in the schema's
`$comment`):

* an integer written with a fraction, `18.0`: JSON Schema's "integer" is the mathematical one and
  accepts it, the loader refuses it;
* NaN and infinities: not JSON, though some parsers read them;
* at most 1000 *distinct* ids across all keys of one flexible_spec object or of `exclusions` (a
  repeated id counts once, so no per-list length says it);
* an ad_id or request_id that repeats an earlier line of the file; an update for an ad that is not
  live at that point of the stream.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .compiled import MAX_TERM_ID
from .constants import (AGE_HIGHEST, AGE_LOWEST, AGE_MIN_DEFAULT, DEFAULT_D, DEFAULT_E, DEFAULT_F, DEVICE_PLATFORMS,
                        DISTANCE_UNITS, FLEX_KEYS, GENDERS, MAX_FLEXIBLE_SPEC_OBJECTS, MAX_RADIUS_KM,
                        MAX_RADIUS_MILES, PUBLISHER_PLATFORMS, SIGNAL_WIDTH, STATUSES, USER_GENDERS, USER_ID_KEYS,
                        USER_OS)
from .targeting import MAX_ABS_TIME, MAX_AD_ID, USER_AGE_RANGE, _F32_MAX

DRAFT = "https://json-schema.org/draft/2020-12/schema"
FILES = {"ad": "ad.schema.json", "request": "request.schema.json", "update": "update.schema.json"}
NOT_EXPRESSED = ("Checked by the loader and not by this schema: an integer written with a fraction (18.0) is "
                 "refused; NaN and infinities are not JSON; at most 1000 distinct ids across all keys of one "
                 "flexible_spec object or of exclusions; an id that repeats an earlier line of the file.")


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _number(lo: float | None = None, hi: float | None = None) -> dict:
    out: dict = {"type": "number"}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def _list(items: dict, *, min_items: int = 1, **extra) -> dict:
    return {"type": "array", "items": items, **({"minItems": min_items} if min_items else {}), **extra}


def _enum_list(values) -> dict:
    return _list({"enum": list(values)})


def _object(properties: dict, *, required=(), nonempty: bool = False, **extra) -> dict:
    out = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        out["required"] = list(required)
    if nonempty:
        out["minProperties"] = 1
    return {**out, **extra}


def _defs() -> dict:
    """What the ad, request and update schemas share."""
    custom_location = _object({
        "latitude": _number(-90.0, 90.0),
        "longitude": _number(-180.0, 180.0),
        "radius": {"type": "number", "exclusiveMinimum": 0},
        "distance_unit": {"enum": list(DISTANCE_UNITS)},
    }, required=("latitude", "longitude", "radius", "distance_unit"),
        allOf=[{"if": {"properties": {"distance_unit": {"const": unit}}},
                "then": {"properties": {"radius": {"maximum": limit}}}}
               for unit, limit in (("kilometer", MAX_RADIUS_KM), ("mile", MAX_RADIUS_MILES))])
    geo = _object({
        "countries": _list({"type": "string", "pattern": "^[A-Z]{2}$", "maxLength": 2}),
        "regions": {"$ref": "#/$defs/ids"},
        "cities": {"$ref": "#/$defs/ids"},
        "custom_locations": _list({"$ref": "#/$defs/custom_location"}),
    }, nonempty=True, description="ISO-3166 alpha-2 countries, region and city ids, circles; the user matches "
                                  "when any of them holds the user")
    id_object = _object({key: {"$ref": "#/$defs/ids"} for key in FLEX_KEYS}, nonempty=True,
                        description="the user matches when holding at least one id listed under any key",
                        **{"$comment": "at most 1000 distinct ids across all keys (checked by the loader)"})
    return {
        "id": _int(0, MAX_TERM_ID),
        "ids": _list({"$ref": "#/$defs/id"}, description="ids in 0..2**40-1; a repeated id counts once"),
        "time": {**_int(-MAX_ABS_TIME, MAX_ABS_TIME), "description": "unix seconds"},
        "float32": _number(-_F32_MAX, _F32_MAX),
        "custom_location": custom_location,
        "geo": geo,
        "id_object": id_object,
        "targeting": _targeting(),
    }


def _age_order() -> list[dict]:
    """age_min <= age_max, each with its default (18 and 65) when absent: one clause per value of
    age_min, since a schema cannot compare two values of the instance."""
    clauses = [{"if": {"required": ["age_min"], "properties": {"age_min": {"const": age}}},
                "then": {"properties": {"age_max": {"minimum": age}}}}
               for age in range(AGE_LOWEST + 1, AGE_HIGHEST + 1)]
    clauses.append({"if": {"not": {"required": ["age_min"]}},
                    "then": {"properties": {"age_max": {"minimum": AGE_MIN_DEFAULT}}}})
    return clauses


def _targeting() -> dict:
    return _object({
        "age_min": _int(AGE_LOWEST, AGE_HIGHEST),
        "age_max": {**_int(AGE_LOWEST, AGE_HIGHEST), "description": "65 means 65 and older"},
        "genders": _list({"enum": list(GENDERS)}),
        "geo_locations": {"$ref": "#/$defs/geo"},
        "excluded_geo_locations": {"$ref": "#/$defs/geo"},
        "locales": {"$ref": "#/$defs/ids"},
        "publisher_platforms": _enum_list(PUBLISHER_PLATFORMS),
        "device_platforms": _enum_list(DEVICE_PLATFORMS),
        "user_os": _enum_list(USER_OS),
        "flexible_spec": _list({"$ref": "#/$defs/id_object"}, maxItems=MAX_FLEXIBLE_SPEC_OBJECTS,
                               description="every object must match"),
        "exclusions": {"$ref": "#/$defs/id_object"},
        "custom_audiences": {"$ref": "#/$defs/ids"},
        "excluded_custom_audiences": {"$ref": "#/$defs/ids"},
    }, anyOf=[{"required": ["geo_locations"]}, {"required": ["custom_audiences"]}],
        allOf=_age_order(),
        description="the Marketing-API-shaped targeting spec of DESIGN section 2: every constraint present must "
                    "hold; geo_locations is required unless custom_audiences is given; age_min <= age_max after "
                    "the defaults 18 and 65")


def _ad_properties(dim: int, formats: int) -> dict:
    return {
        "ad_id": _int(0, MAX_AD_ID),
        "status": {"enum": list(STATUSES), "description": "default ACTIVE; only ACTIVE ads are eligible"},
        "start_time": {"oneOf": [{"$ref": "#/$defs/time"}, {"type": "null"}], "description": "null: open"},
        "end_time": {"oneOf": [{"$ref": "#/$defs/time"}, {"type": "null"}], "description": "null: open"},
        "format": {**_int(0, formats - 1), "description": "default 0"},
        "targeting": {"$ref": "#/$defs/targeting"},
        "embedding": _list({"$ref": "#/$defs/float32"}, min_items=dim, maxItems=dim,
                           description="absent: derived from ad_id and the corpus seed"),
    }


def _ad(dim: int, formats: int) -> dict:
    return _object(_ad_properties(dim, formats), required=("ad_id", "targeting"))


def _document(kind: str, title: str, description: str, body: dict, defs: dict) -> dict:
    return {"$schema": DRAFT, "title": title, "description": description,
            "$comment": NOT_EXPRESSED, **body, "$defs": defs}


def ad_schema(dim: int = DEFAULT_D, formats: int = DEFAULT_F) -> dict:
    """One line of an ads file (DESIGN section 2) for a corpus with `dim` embedding values and `formats`."""
    return _document("ad", "andromeda-nb ad", f"One line of an ads file (JSON Lines, DESIGN section 2), for a "
                     f"corpus of D = {dim} and F = {formats} formats.", _ad(dim, formats), _defs())


def request_schema(experts: int = DEFAULT_E, width: int = SIGNAL_WIDTH) -> dict:
    """One line of a requests file (DESIGN section 2) for a model of `experts` signal groups of `width`."""
    maybe = lambda schema: {"oneOf": [schema, {"type": "null"}]}  # noqa: E731  (null: unknown)
    user = _object({
        "age": _int(*USER_AGE_RANGE),
        "gender": {"enum": list(USER_GENDERS), "description": "0 unknown (the default), 1 male, 2 female"},
        "country": maybe({"type": "string", "pattern": "^[A-Z]{2}$", "maxLength": 2}),
        "region": maybe({"$ref": "#/$defs/id"}),
        "city": maybe({"$ref": "#/$defs/id"}),
        "latitude": maybe(_number(-90.0, 90.0)),
        "longitude": maybe(_number(-180.0, 180.0)),
        "locale": maybe({"$ref": "#/$defs/id"}),
        **{key: _list({"$ref": "#/$defs/id"}, min_items=0) for key in USER_ID_KEYS},
    }, required=("age",), allOf=[
        {"if": {"required": [a], "properties": {a: {"type": "number"}}},
         "then": {"required": [b], "properties": {b: {"type": "number"}}}}
        for a, b in (("latitude", "longitude"), ("longitude", "latitude"))],
        description="absent country, region, city, locale or coordinates are unknown and match no list; "
                    "latitude and longitude come together")
    context = _object({
        "publisher_platform": {"enum": list(PUBLISHER_PLATFORMS)},
        "device_platform": {"enum": list(DEVICE_PLATFORMS)},
        "user_os": {"enum": list(USER_OS)},
        "time": {"$ref": "#/$defs/time"},
    }, required=("publisher_platform", "device_platform", "user_os", "time"))
    body = _object({
        "request_id": _int(-(1 << 63), (1 << 63) - 1),
        "user": user,
        "context": context,
        "signals": _list(_list({"$ref": "#/$defs/float32"}, min_items=width, maxItems=width), min_items=experts,
                         maxItems=experts, description="absent: derived from request_id and the corpus seed"),
    }, required=("request_id", "user", "context"))
    defs = {name: value for name, value in _defs().items() if name in ("id", "time", "float32")}
    return _document("request", "andromeda-nb request", f"One line of a requests file (JSON Lines, DESIGN "
                     f"section 2), for a model of E = {experts} signal groups of S = {width}; the Flight "
                     "request column carries the same object, its id in a column of its own.", body, defs)


def update_schema(dim: int = DEFAULT_D, formats: int = DEFAULT_F) -> dict:
    """One line of an update stream (DESIGN section 6)."""
    ops = {
        "upsert": _object({"op": {"const": "upsert"}, "ad": {"$ref": "#/$defs/ad"}}, required=("op", "ad")),
        "status": _object({"op": {"const": "status"}, "ad_id": _int(0, MAX_AD_ID), "status": {"enum": list(STATUSES)}},
                          required=("op", "ad_id", "status")),
        "retire": _object({"op": {"const": "retire"}, "ad_id": _int(0, MAX_AD_ID)}, required=("op", "ad_id")),
    }
    body = {"type": "object", "required": ["op"], "properties": {"op": {"enum": list(ops)}},
            "allOf": [{"if": {"properties": {"op": {"const": op}}, "required": ["op"]}, "then": schema}
                      for op, schema in ops.items()]}
    defs = {**_defs(), "ad": _ad(dim, formats)}
    return _document("update", "andromeda-nb update", "One line of an update stream (JSON Lines, DESIGN section 6), "
                     "applied in order: upsert creates or replaces an ad, status sets one, retire removes one "
                     "(a status or retire for an ad that is not live is rejected by the stream, not the schema).",
                     body, defs)


def schemas() -> dict[str, dict]:
    """The published schemas, by file name (docs/schemas/)."""
    return {FILES["ad"]: ad_schema(), FILES["request"]: request_schema(), FILES["update"]: update_schema()}


def render(schema: dict, width: int = 110) -> str:
    """Indented JSON whose small values (objects and lists that fit in `width` columns) stay on one
    line, so a reader sees one rule per line."""

    def dump(value, indent: int, used: int = 0) -> str:
        flat = json.dumps(value)
        if not isinstance(value, (dict, list)) or indent + used + len(flat) <= width:
            return flat
        pad = " " * (indent + 2)
        if isinstance(value, list):
            inner = [pad + dump(v, indent + 2) for v in value]
        else:
            inner = [f"{pad}{json.dumps(k)}: {dump(v, indent + 2, len(json.dumps(k)) + 2)}" for k, v in value.items()]
        close = "]" if isinstance(value, list) else "}"
        return ("[" if isinstance(value, list) else "{") + "\n" + ",\n".join(inner) + "\n" + " " * indent + close

    return dump(schema, 0) + "\n"


def write(out_dir) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in schemas().items():
        (out / name).write_text(render(schema))
        written.append(out / name)
    return written


if __name__ == "__main__":
    for path in write(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas"):
        print(path)
