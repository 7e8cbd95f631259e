"""The columnar request batch of the `["retrieve"]` exchange (docs/PROTOCOL.md, section 1).

A JSON request costs its server a parse and a check of every value in Python: about 60 us a request
on a 2-core host, the largest share of a served batch's host time (docs/BENCHMARKS.md, "The served
path"). In a columnar batch every field of DESIGN section 2's request is an Arrow column of its own
type, so a batch is checked with a few array operations however many requests it holds, and the
batches of many calls can be checked as one (`andromeda_nb.flight.decode_request_batches`).

Columns (`COLUMNS`; the JSON path each stands for is in parentheses)::

    request_id  int64, required          k  int32, required, 1..MAX_K
    age         integer, required (user.age)
    gender      integer (user.gender; null: 0)
    country     utf8 (user.country; null: none)
    region, city, locale       integer (user.<name>; null: none)
    latitude, longitude        float64 (user.<name>; null: none; both or neither)
    interests ... custom_audiences   list of integer (user.<name>; null or empty: none)
    publisher_platform, device_platform, user_os   utf8 or dictionary of utf8, required (context.<name>)
    time        integer, required (context.time)
    signals     list or fixed-size list of float, E x S values, expert by expert (signals; null:
                derived from the request id and the corpus seed, as in a JSON request without them)

Only `request_id`, `k`, `age`, the three platforms and `time` must be present; any other column may be
left out (every value null). A value breaks the same rule, with the same message naming the
request and the JSON path, as the same value in a JSON request: the fault reported is the one the
JSON checker would report first (the first faulty request; within it the first field in the order
above). Integer columns of any width are taken; a column of another type, or an unknown column, is
an error naming the column. A batch of at most `ROW_PATH_MAX` requests is checked row by row by the
JSON request's own checker instead, which costs less for a few rows than the array checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import derive
from .compiled import MAX_TERM_ID
from .constants import DEVICE_PLATFORMS, MAX_K, PUBLISHER_PLATFORMS, USER_GENDERS, USER_ID_KEYS, USER_OS
from .flight import InvalidInput, check_k
from .limits import DEFAULT_LIMITS, LimitExceeded, ServiceLimits
from .targeting import MAX_ABS_TIME, NO_LOCATION, USER_AGE_RANGE
from .types import Context, Request, TargetingError, User

_F32_MAX = float(np.finfo(np.float32).max)
_ENUMS = {"publisher_platform": PUBLISHER_PLATFORMS, "device_platform": DEVICE_PLATFORMS, "user_os": USER_OS}
_TERMS = ("region", "city", "locale")


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # int, float, str, ids, signals
    required: bool
    path: str  # the field's JSON path, which error messages name

    def arrow_type(self, values: int = 0) -> pa.DataType:
        """The type `request_columns` writes (`values`: a signals row's length)."""
        if self.kind == "int":
            return {"request_id": pa.int64(), "k": pa.int32(), "age": pa.int16(), "gender": pa.int8(),
                    "time": pa.int64()}.get(self.name, pa.int64())
        if self.kind == "float":
            return pa.float64()
        if self.kind == "str":
            return pa.utf8()
        if self.kind == "ids":
            return pa.list_(pa.int64())
        return pa.list_(pa.float32(), values)


COLUMNS: tuple[Column, ...] = (
    Column("request_id", "int", True, "request_id"),
    Column("k", "int", True, "k"),
    Column("age", "int", True, "user.age"),
    Column("gender", "int", False, "user.gender"),
    Column("country", "str", False, "user.country"),
    *(Column(name, "int", False, f"user.{name}") for name in _TERMS),
    Column("latitude", "float", False, "user.latitude"),
    Column("longitude", "float", False, "user.longitude"),
    *(Column(key, "ids", False, f"user.{key}") for key in USER_ID_KEYS),
    *(Column(name, "str", True, f"context.{name}") for name in _ENUMS),
    Column("time", "int", True, "context.time"),
    Column("signals", "signals", False, "signals"),
)
BY_NAME = {c.name: c for c in COLUMNS}
REQUIRED = tuple(c.name for c in COLUMNS if c.required)
_USER_FIELDS = tuple(c.name for c in COLUMNS if c.path.startswith("user."))
_CONTEXT_FIELDS = tuple(c.name for c in COLUMNS if c.path.startswith("context."))
# a batch of at most this many requests is checked row by row (`_decode_rows`): below it, a few
# steps a row cost less than the array checks' fixed cost (about 0.5 ms on a 2-core host)
ROW_PATH_MAX = 8


def is_columnar(schema: pa.Schema) -> bool:
    """Whether a request batch is the columnar kind (the JSON kind has a `request` column)."""
    return "request" not in schema.names and "age" in schema.names


# --- client side ----------------------------------------------------------------------------------------


def request_columns(requests: Sequence[Request], k: int | Sequence[int]) -> pa.RecordBatch:
    """A columnar request batch of `Request` objects; `k` is one value for all or one per request.
    Every column is written (signals too), so the batches of many clients have one schema and a
    server checks them together."""
    requests = list(requests)
    bad = next((r for r in requests if not isinstance(r, Request)), None)
    if bad is not None:
        raise TypeError(f"a columnar request batch is made of Request objects, got {type(bad).__name__} "
                        "(andromeda_nb.targeting.parse_request makes one from a JSON-ready dict)")
    n = len(requests)
    ks = [int(k)] * n if np.isscalar(k) else [int(x) for x in k]
    if len(ks) != n:
        raise ValueError(f"{n} requests but {len(ks)} values of k")
    users = [r.user for r in requests]
    ctx = [r.context for r in requests]
    cols: dict[str, list | pa.Array] = {
        "request_id": [int(r.request_id) for r in requests], "k": ks,
        "age": [u.age for u in users], "gender": [u.gender for u in users],
        "country": [u.country or None for u in users],
    }
    for name in _TERMS:
        cols[name] = [v if (v := getattr(u, name)) >= 0 else None for u in users]
    for name in ("latitude", "longitude"):  # NaN: no location
        cols[name] = [getattr(u, name) if u.latitude == u.latitude else None for u in users]
    for key in USER_ID_KEYS:
        cols[key] = [sorted(u.ids[key]) if u.ids.get(key) else None for u in users]
    for name in _ENUMS:
        cols[name] = [getattr(c, name) for c in ctx]
    cols["time"] = [c.time for c in ctx]
    if n:
        signals = np.stack([np.asarray(r.signals, np.float32) for r in requests])
        width = signals[0].size
        cols["signals"] = pa.FixedSizeListArray.from_arrays(pa.array(signals.reshape(-1)), width)
    else:
        width = 0
        cols["signals"] = pa.array([], BY_NAME["signals"].arrow_type(1))
    arrays = [v if isinstance(v, pa.Array) else pa.array(v, BY_NAME[name].arrow_type(width))
              for name, v in cols.items()]
    return pa.RecordBatch.from_arrays(arrays, names=list(cols))


# --- server side ----------------------------------------------------------------------------------------


@dataclass
class _Fault:
    """A check over every row: `rows` (bool, one per request) where it fails, `raise_for(row)` the error."""

    rows: np.ndarray
    error: Callable[[int], BaseException]


class _Columns:
    """A columnar batch's columns as numpy arrays, each checked for its type once."""

    def __init__(self, data: pa.RecordBatch | pa.Table):
        self.data = data
        self.n = data.num_rows
        names = data.schema.names
        unknown = [name for name in names if name not in BY_NAME]
        if unknown:
            raise InvalidInput(f"batch has unknown column(s) {', '.join(unknown)}; a columnar request batch "
                               f"has {', '.join(BY_NAME)}")
        if len(set(names)) != len(names):
            raise InvalidInput("batch has a column twice: " + ", ".join(sorted({x for x in names if names.count(x) > 1})))
        missing = [name for name in REQUIRED if name not in names]
        if missing:
            raise InvalidInput(f"batch lacks column(s) {', '.join(missing)}; a columnar request batch must have "
                               f"{', '.join(REQUIRED)}")
        for field in data.schema:
            expected = _type_fault(BY_NAME[field.name].kind, field.type)
            if expected:
                raise InvalidInput(f"column {field.name} is {field.type}; expected {expected}")

    def array(self, name: str) -> pa.Array | None:
        if name not in self.data.schema.names:
            return None
        column = self.data.column(name)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        return column

    def ints(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        """int64 values (0 where null) and the null mask (None: no null)."""
        column = self.array(name)
        if column is None:
            return np.zeros(self.n, np.int64), np.ones(self.n, bool)
        if column.type != pa.int64():
            try:
                column = column.cast(pa.int64())
            except pa.ArrowInvalid:
                raise InvalidInput(f"column {name}: a value is outside the range of int64") from None
        return _values(column, 0, np.int64)

    def floats(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        column = self.array(name)
        if column is None:
            return np.full(self.n, np.nan), np.ones(self.n, bool)
        if column.type != pa.float64():
            column = column.cast(pa.float64())
        return _values(column, np.nan, np.float64)

    def strings(self, name: str) -> list | None:
        column = self.array(name)
        if column is None:
            return None
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        return column.to_pylist()

    def lists(self, name: str, *, floats: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
        """(lengths with -1 for a null row, starts of each row's values, the values, the values' null
        mask or None), or None when the column is absent."""
        column = self.array(name)
        if column is None:
            return None
        lengths = pc.list_value_length(column).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = column.flatten()  # the values of the non-null rows, in row order
        target = pa.float64() if floats else pa.int64()
        if flat.type != target:
            try:
                flat = flat.cast(target)
            except pa.ArrowInvalid:
                raise InvalidInput(f"column {name}: a value is outside the range of int64") from None
        values, nulls = _values(flat, np.nan if floats else 0, np.float64 if floats else np.int64)
        starts = np.concatenate([[0], np.cumsum(np.maximum(lengths, 0))[:-1]]).astype(np.int64)
        return lengths, starts, values, nulls


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _type_fault(kind: str, arrow: pa.DataType) -> str | None:
    """What a column of `kind` should be, when `arrow` is not that; None when it is."""
    t = pa.types
    if kind == "int":
        return None if t.is_integer(arrow) else "an integer type"
    if kind == "float":
        return None if t.is_floating(arrow) or t.is_integer(arrow) else "a floating-point type"
    if kind == "str":
        text = _is_text(arrow) or (t.is_dictionary(arrow) and _is_text(arrow.value_type))
        return None if text else "utf8 (or a dictionary of utf8)"
    if kind == "ids":
        return None if _is_list(arrow) and t.is_integer(arrow.value_type) else "a list of integers"
    number = _is_list(arrow) and (t.is_floating(arrow.value_type) or t.is_integer(arrow.value_type))
    return None if number else "a list of floats"


def _values(column: pa.Array, fill, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    if column.null_count:
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        return np.asarray(column.fill_null(fill).to_numpy(zero_copy_only=False), dtype), nulls
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype), None


def _per_row_first(bad_items: np.ndarray, starts: np.ndarray, lengths: np.ndarray, n: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """For flat item faults `bad_items` of lists laid out by `starts` / `lengths`: a row mask, and for
    each row the index (within the row) of its first bad item."""
    rows = np.zeros(n, bool)
    first = np.zeros(n, np.int64)
    where = np.flatnonzero(bad_items)
    if len(where):
        owner = np.searchsorted(starts, where, side="right") - 1
        # the first bad item of each row: `where` is sorted, so the first occurrence of each owner
        owners, at = np.unique(owner, return_index=True)
        rows[owners] = True
        first[owners] = where[at] - starts[owners]
    return rows, first


def decode_columns(data: pa.RecordBatch | pa.Table, *, seed: int, experts: int, width: int,
                   limits: ServiceLimits = DEFAULT_LIMITS, segments: Sequence[int] | None = None
                   ) -> tuple[list[Request], list[int]]:
    """Check a columnar request batch (module docstring) and return (requests, ks). `segments`: the
    row counts of the calls concatenated in `data` (request ids need only be unique within one);
    None: one call. Raises `InvalidInput` (or `LimitExceeded` for a k over `limits.max_k`) naming the
    request and the JSON path of the first fault."""
    cols = _Columns(data)
    if cols.n <= ROW_PATH_MAX:
        return _decode_rows(data, seed=seed, experts=experts, width=width, limits=limits, segments=segments)
    n = cols.n
    rid, rid_null = cols.ints("request_id")
    _check_unique(rid, segments, rid_null)  # first, as in a JSON batch
    k, k_null = cols.ints("k")
    faults: list[_Fault] = []

    def fail(path: str, message: str) -> Callable[[int], BaseException]:
        return lambda i: InvalidInput(f"request {_rid(i)}: {path}: {message(i) if callable(message) else message}")

    def _rid(i: int):
        return None if rid_null is not None and rid_null[i] else int(rid[i])

    nulls = np.zeros(n, bool)
    for mask in (rid_null, k_null):
        if mask is not None:
            nulls |= mask
    faults.append(_Fault(nulls, lambda i: InvalidInput(f"request {_rid(i)}: null request_id or k")))
    faults.append(_Fault((k < 1) | (k > MAX_K) | (k > limits.max_k), lambda i: _k_error(int(k[i]), _rid(i), limits)))

    def required_null(name: str, mask) -> None:
        if mask is not None:
            faults.append(_Fault(mask, fail(BY_NAME[name].path, "is required")))

    def out_of_range(name: str, values, present, lo, hi) -> None:
        bad = (values < lo) | (values > hi)
        if present is not None:
            bad &= present
        faults.append(_Fault(bad, fail(BY_NAME[name].path, lambda i: f"{values[i]} is out of range {lo}..{hi}")))

    age, age_null = cols.ints("age")
    required_null("age", age_null)
    out_of_range("age", age, None if age_null is None else ~age_null, *USER_AGE_RANGE)

    gender, gender_null = cols.ints("gender")
    gender = np.where(gender_null, 0, gender) if gender_null is not None else gender
    faults.append(_Fault(~np.isin(gender, USER_GENDERS), fail(
        "user.gender", lambda i: f"{int(gender[i])!r} is not one of {', '.join(map(repr, USER_GENDERS))}")))

    country = cols.strings("country")
    if country is not None:
        bad = np.fromiter((c is not None and not (len(c) == 2 and "A" <= c[0] <= "Z" and "A" <= c[1] <= "Z")
                           for c in country), bool, n)
        faults.append(_Fault(bad, fail("user.country", lambda i: f"{country[i]!r} is not an ISO-3166 alpha-2 code "
                                                                 "(two upper-case letters)")))

    terms = {}
    for name in _TERMS:
        values, null = cols.ints(name)
        present = None if null is None else ~null
        out_of_range(name, values, present, 0, MAX_TERM_ID)
        terms[name] = np.where(null, -1, values) if null is not None else values

    lat, lat_null = cols.floats("latitude")
    lon, lon_null = cols.floats("longitude")
    has_lat = np.ones(n, bool) if lat_null is None else ~lat_null
    has_lon = np.ones(n, bool) if lon_null is None else ~lon_null
    faults.append(_Fault(has_lat != has_lon, lambda i: InvalidInput(
        f"request {_rid(i)}: user.{'longitude' if has_lat[i] else 'latitude'}: latitude and longitude come together")))
    for name, values, present, bound in (("latitude", lat, has_lat, 90.0), ("longitude", lon, has_lon, 180.0)):
        faults.append(_Fault(present & ~np.isfinite(values),
                             fail(BY_NAME[name].path, lambda i, v=values: f"must be finite, got {float(v[i])}")))
        with np.errstate(invalid="ignore"):
            bad = present & np.isfinite(values) & ((values < -bound) | (values > bound))
        faults.append(_Fault(bad, fail(BY_NAME[name].path,
                                       lambda i, v=values, b=bound: f"{float(v[i])} is out of range {-b}..{b}")))

    ids = {}
    for key in USER_ID_KEYS:
        got = cols.lists(key, floats=False)
        if got is None:
            continue
        lengths, starts, values, item_null = got
        ids[key] = (lengths, starts, values)
        if item_null is not None:
            rows, first = _per_row_first(item_null, starts, lengths, n)
            faults.append(_Fault(rows, lambda i, key=key, first=first: InvalidInput(
                f"request {_rid(i)}: user.{key}[{first[i]}]: must be an int, got null")))
        bad = (values < 0) | (values > MAX_TERM_ID)
        if item_null is not None:
            bad &= ~item_null
        rows, first = _per_row_first(bad, starts, lengths, n)
        faults.append(_Fault(rows, lambda i, key=key, first=first, starts=starts, values=values: InvalidInput(
            f"request {_rid(i)}: user.{key}[{first[i]}]: {int(values[starts[i] + first[i]])} is out of range "
            f"0..{MAX_TERM_ID}")))

    enums = {}
    for name, universe in _ENUMS.items():
        values = cols.strings(name)
        enums[name] = values
        faults.append(_Fault(np.fromiter((v is None for v in values), bool, n), fail(BY_NAME[name].path, "is required")))
        allowed = frozenset(universe)
        faults.append(_Fault(np.fromiter((v is not None and v not in allowed for v in values), bool, n),
                             fail(BY_NAME[name].path, lambda i, v=values, u=universe:
                                  f"{v[i]!r} is not one of {', '.join(map(repr, u))}")))

    time, time_null = cols.ints("time")
    required_null("time", time_null)
    out_of_range("time", time, None if time_null is None else ~time_null, -MAX_ABS_TIME, MAX_ABS_TIME)

    size = experts * width
    signals = np.empty((n, experts, width), np.float32)
    derived = np.ones(n, bool)
    got = cols.lists("signals", floats=True)
    if got is not None:
        lengths, starts, values, item_null = got
        derived = lengths < 0
        faults.append(_Fault(~derived & (lengths != size), lambda i, lengths=lengths: InvalidInput(
            f"request {_rid(i)}: signals: has {int(lengths[i])} values; expected {size} ({experts} groups of {width})")))
        good = ~derived & (lengths == size)
        if item_null is not None:
            rows, first = _per_row_first(item_null, starts, lengths, n)
            faults.append(_Fault(rows & good, lambda i, first=first: InvalidInput(
                f"request {_rid(i)}: {_signal_path(first[i], width)}: must be a number, got null")))
            values = np.where(item_null, 0.0, values)
        finite = np.isfinite(values)
        rows, first = _per_row_first(~finite, starts, lengths, n)
        faults.append(_Fault(rows & good, lambda i, first=first, starts=starts, values=values: InvalidInput(
            f"request {_rid(i)}: {_signal_path(first[i], width)}: must be finite, got {float(values[starts[i] + first[i]])}")))
        with np.errstate(invalid="ignore"):
            rows, first = _per_row_first(finite & (np.abs(values) > _F32_MAX), starts, lengths, n)
        faults.append(_Fault(rows & good, lambda i, first=first, starts=starts, values=values: InvalidInput(
            f"request {_rid(i)}: {_signal_path(first[i], width)}: {float(values[starts[i] + first[i]])} is out of range "
            f"{-_F32_MAX}..{_F32_MAX}")))
        _raise_first(faults, n)  # before the values are read as rows of `size`
        if good.any():
            take = np.flatnonzero(good)
            index = starts[take, None] + np.arange(size)[None, :]
            signals[take] = values[index].astype(np.float32).reshape(len(take), experts, width)
    _raise_first(faults, n)
    if derived.any():
        take = np.flatnonzero(derived)
        signals[take] = derive.request_signals_many(rid[take], seed, experts, width)

    # the checked columns to Request objects, one Python step per request (and per id list held)
    age_l, gender_l, time_l, rid_l = age.tolist(), gender.tolist(), time.tolist(), rid.tolist()
    region_l, city_l, locale_l = (terms[name].tolist() for name in _TERMS)
    # no location is the one NO_LOCATION object, as from a JSON request (equal requests compare equal)
    lat_l = [v if h else NO_LOCATION for v, h in zip(lat.tolist(), has_lat.tolist())]
    lon_l = [v if h else NO_LOCATION for v, h in zip(lon.tolist(), has_lon.tolist())]
    country_l = [c or "" for c in country] if country is not None else [""] * n
    user_ids: list[dict] = [{} for _ in range(n)]
    for key, (lengths, starts, values) in ids.items():
        held = np.flatnonzero(lengths > 0)
        if len(held):
            items = values.tolist()
            for i, lo, m in zip(held.tolist(), starts[held].tolist(), lengths[held].tolist()):
                user_ids[i][key] = frozenset(items[lo : lo + m])
    pubs, devs, oses = enums["publisher_platform"], enums["device_platform"], enums["user_os"]
    requests = [
        Request(request_id=rid_l[i],
                user=User(age=age_l[i], gender=gender_l[i], country=country_l[i], region=region_l[i],
                          city=city_l[i], latitude=lat_l[i], longitude=lon_l[i], locale=locale_l[i],
                          ids=user_ids[i]),
                context=Context(pubs[i], devs[i], oses[i], time_l[i]), signals=signals[i])
        for i in range(n)
    ]
    return requests, k.tolist()


def _decode_rows(data, *, seed: int, experts: int, width: int, limits: ServiceLimits, segments
                 ) -> tuple[list[Request], list[int]]:
    """A small batch request by request, by the JSON request's own checker (`parse_request`): for a
    few rows fewer steps than the array checks, with the same faults named the same way."""
    from .targeting import parse_request

    rows = data.to_pylist()
    nulls = np.fromiter((r["request_id"] is None for r in rows), bool, len(rows))
    for r in rows:
        if r["request_id"] is not None and not -(1 << 63) <= r["request_id"] < (1 << 63):
            raise InvalidInput("column request_id: a value is outside the range of int64")
    rid = np.fromiter((r["request_id"] or 0 for r in rows), np.int64, len(rows))
    _check_unique(rid, segments, nulls if nulls.any() else None)
    size = experts * width
    requests, ks = [], []
    for row in rows:
        request_id, k = row["request_id"], row["k"]
        if request_id is None or k is None:
            raise InvalidInput(f"request {request_id}: null request_id or k")
        check_k(k, request_id, limits.max_k)
        # null is absent, as a key left out of a JSON request
        obj = {"user": {name: row[name] for name in _USER_FIELDS if row.get(name) is not None},
               "context": {name: row[name] for name in _CONTEXT_FIELDS if row.get(name) is not None}}
        signals = row.get("signals")
        if signals is not None:
            if len(signals) != size:
                raise InvalidInput(f"request {request_id}: signals: has {len(signals)} values; expected {size} "
                                   f"({experts} groups of {width})")
            obj["signals"] = [signals[e * width : (e + 1) * width] for e in range(experts)]
        try:
            requests.append(parse_request(obj, seed=seed, experts=experts, width=width, request_id=request_id))
        except TargetingError as exc:
            message = exc.message.removeprefix(f"request {request_id}: ")
            raise InvalidInput(f"request {request_id}: {exc.path}: {message}" if exc.path
                               else f"request {request_id}: {message}") from None
        ks.append(k)
    return requests, ks


def _k_error(k: int, rid, limits: ServiceLimits) -> BaseException:
    try:
        check_k(k, rid, limits.max_k)
    except (InvalidInput, LimitExceeded) as exc:
        return exc
    raise AssertionError(f"k = {k} passed check_k")  # the mask and check_k disagree


def _signal_path(flat_index: int, width: int) -> str:
    return f"signals[{flat_index // width}][{flat_index % width}]"


def _raise_first(faults: list[_Fault], n: int) -> None:
    """Raise the error the JSON checker would raise first: the first faulty request's first fault."""
    firsts = [np.argmax(f.rows) for f in faults if f.rows.any()]
    if not firsts:
        return
    row = min(firsts)
    for fault in faults:
        if fault.rows[row]:
            raise fault.error(row)


def _check_unique(rid: np.ndarray, segments: Sequence[int] | None, nulls: np.ndarray | None) -> None:
    """No request id twice within one call (`segments`: the calls' row counts); null ids are left to
    the null check."""
    if len(rid) < 2:
        return
    owner = (np.zeros(len(rid), np.int64) if segments is None
             else np.repeat(np.arange(len(segments)), np.asarray(segments, np.int64)))
    if nulls is not None:
        rid, owner = rid[~nulls], owner[~nulls]
    order = np.lexsort((rid, owner))
    same = (rid[order][1:] == rid[order][:-1]) & (owner[order][1:] == owner[order][:-1])
    if same.any():
        twice = int(rid[order][1:][same][0])
        raise InvalidInput(f"request {twice}: request_id appears more than once in the batch (its answer rows "
                           "would be ambiguous)")


__all__ = ["COLUMNS", "Column", "decode_columns", "is_columnar", "request_columns"]
