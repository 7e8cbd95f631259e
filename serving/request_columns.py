"""The columnar request batch of the `["retrieve"]` exchange (docs/PROTOCOL.md, section 1).

A JSON request costs its server a parse and a check of every value in Python: about 60 us a request
on a 2-core host, the largest share of a served batch's host time (docs/BENCHMARKS.md, "The served
path"). In a columnar batch every field of DESIGN section 2's request is an Arrow column of its own
type, so a batch is checked with a few array operations however many requests it holds, and the
batches of many calls can be checked as one (`serving.protocol.decode_request_batches`).

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

The checked requests stay arrays (`RequestColumns`): a sequence of `Request` objects made one by one
as they are asked for, whose arrays the co-located GPU engine takes whole (`encoded` for the match,
`model_inputs` for the user side), so that a batch's host work has no Python step per request.
The columns are read from their Arrow buffers with numpy, not with pyarrow's compute functions: those
let go of the interpreter lock, and in a busy server each return can wait for it.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

from andromeda_nb import derive
from andromeda_nb.compiled import MAX_TERM_ID
from andromeda_nb.constants import DEVICE_PLATFORMS, MAX_K, PUBLISHER_PLATFORMS, USER_GENDERS, USER_ID_KEYS, USER_OS
from andromeda_nb.quoting import clip, quote
from andromeda_nb.targeting import MAX_ABS_TIME, NO_LOCATION, USER_AGE_RANGE
from andromeda_nb.types import Context, Request, User

from .inputs import InvalidInput, check_k, parse_batch_request
from .limits import DEFAULT_LIMITS, LimitExceeded, ServiceLimits

_F32_MAX = float(np.finfo(np.float32).max)
_ENUMS = {"publisher_platform": PUBLISHER_PLATFORMS, "device_platform": DEVICE_PLATFORMS, "user_os": USER_OS}
_ENUM_SETS = {name: frozenset(universe) for name, universe in _ENUMS.items()}
_ENUM_CODES = {name: {v: i for i, v in enumerate(universe)} for name, universe in _ENUMS.items()}
_ENUM_ARRAYS = {name: pa.array(list(universe), pa.utf8()) for name, universe in _ENUMS.items()}
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
# steps a row cost less than the array checks' fixed cost (about 0.26 ms on a 2-core host)
ROW_PATH_MAX = 6


def is_columnar(schema: pa.Schema) -> bool:
    """Whether a request batch is the columnar kind (the JSON kind has a `request` column)."""
    return "request" not in schema.names and "age" in schema.names


# --- client side ----------------------------------------------------------------------------------------


def request_columns(requests: Sequence[Request], k: int | Sequence[int], *,
                    request_ids: Sequence[int] | None = None) -> pa.RecordBatch:
    """A columnar request batch of `Request` objects; `k` is one value for all or one per request;
    `request_ids`: the ids the batch gives them (default: their own). Every column is written
    (signals too), so the batches of many clients have one schema and a server checks them
    together."""
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
    if request_ids is not None and len(request_ids) != n:
        raise ValueError(f"{n} requests but {len(request_ids)} request ids")
    cols: dict[str, list | pa.Array] = {
        "request_id": [int(r.request_id) for r in requests] if request_ids is None else request_ids, "k": ks,
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


class RequestColumns(SequenceABC):
    """Checked requests as arrays, one entry per request: a sequence of `Request` objects, each made
    when first asked for, whose arrays an engine takes whole (`encoded`, `model_inputs`) without a
    Python step per request. Slices and `concat` are RequestColumns too (what the batcher joins).

    `ids`: key -> (lengths, starts, values): request i holds values[starts[i] : starts[i] + lengths[i]];
    `publisher`, `device`, `os`: indexes into the constants' tuples; `latitude`, `longitude`: NaN for
    no location; `country`: "" for none; `signals`: float32 (n, E, S)."""

    __slots__ = ("request_id", "age", "gender", "country", "region", "city", "locale", "latitude", "longitude",
                 "ids", "publisher", "device", "os", "time", "signals", "_made")

    def __init__(self, *, request_id, age, gender, country, region, city, locale, latitude, longitude, ids,
                 publisher, device, os, time, signals):
        self.request_id, self.age, self.gender, self.country = request_id, age, gender, country
        self.region, self.city, self.locale = region, city, locale
        self.latitude, self.longitude, self.ids = latitude, longitude, ids
        self.publisher, self.device, self.os, self.time, self.signals = publisher, device, os, time, signals
        self._made: dict[int, Request] = {}

    def __len__(self) -> int:
        return len(self.request_id)

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(lo, hi, step)]
            return self._rows(lo, hi)
        n = len(self)
        i = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= i < n:
            raise IndexError(f"request {i} of {n}")
        made = self._made.get(i)
        if made is None:
            made = self._made[i] = self._request(i)
        return made

    def _rows(self, lo: int, hi: int) -> "RequestColumns":
        return RequestColumns(
            request_id=self.request_id[lo:hi], age=self.age[lo:hi], gender=self.gender[lo:hi],
            country=self.country[lo:hi], region=self.region[lo:hi], city=self.city[lo:hi],
            locale=self.locale[lo:hi], latitude=self.latitude[lo:hi], longitude=self.longitude[lo:hi],
            ids={key: (lengths[lo:hi], starts[lo:hi], values) for key, (lengths, starts, values) in self.ids.items()},
            publisher=self.publisher[lo:hi], device=self.device[lo:hi], os=self.os[lo:hi], time=self.time[lo:hi],
            signals=self.signals[lo:hi])

    @classmethod
    def concat(cls, parts: Sequence["RequestColumns"]) -> "RequestColumns":
        """The requests of `parts`, one after another."""
        parts = list(parts)
        if len(parts) == 1:
            return parts[0]
        ids = {}
        for key in {key for p in parts for key in p.ids}:
            lengths, starts, values, at = [], [], [], 0
            for p in parts:
                if key in p.ids:
                    pl, ps, pv = p.ids[key]
                    lengths.append(pl)
                    starts.append(ps + at)
                    values.append(pv)
                    at += len(pv)
                else:
                    lengths.append(np.zeros(len(p), np.int64))
                    starts.append(np.full(len(p), at, np.int64))
            ids[key] = (np.concatenate(lengths), np.concatenate(starts),
                        np.concatenate(values) if values else np.empty(0, np.int64))
        joined = {name: np.concatenate([getattr(p, name) for p in parts])
                  for name in ("request_id", "age", "gender", "region", "city", "locale", "latitude", "longitude",
                               "publisher", "device", "os", "time", "signals")}
        return cls(**joined, country=[c for p in parts for c in p.country], ids=ids)

    def _request(self, i: int) -> Request:
        lat, lon = float(self.latitude[i]), float(self.longitude[i])
        no_location = lat != lat  # the one NO_LOCATION object, as from a JSON request
        ids = {}
        for key, (lengths, starts, values) in self.ids.items():
            if lengths[i] > 0:
                ids[key] = frozenset(values[starts[i] : starts[i] + lengths[i]].tolist())
        user = User(age=int(self.age[i]), gender=int(self.gender[i]), country=self.country[i],
                    region=int(self.region[i]), city=int(self.city[i]),
                    latitude=NO_LOCATION if no_location else lat, longitude=NO_LOCATION if no_location else lon,
                    locale=int(self.locale[i]), ids=ids)
        context = Context(PUBLISHER_PLATFORMS[self.publisher[i]], DEVICE_PLATFORMS[self.device[i]],
                          USER_OS[self.os[i]], int(self.time[i]))
        return Request(request_id=int(self.request_id[i]), user=user, context=context, signals=self.signals[i])

    def record_batch(self, k: int, request_ids: np.ndarray | None = None) -> pa.RecordBatch:
        """These requests as a columnar request batch at `k` (what `request_columns` writes for the same
        requests, from the arrays: no step per request), request i numbered `request_ids[i]` (default:
        its own id)."""
        n = len(self)
        rid = self.request_id if request_ids is None else np.asarray(request_ids, np.int64)
        if len(rid) != n:
            raise ValueError(f"{n} requests but {len(rid)} request ids")

        def column(name, values, mask=None):  # as `request_columns` types it
            return pa.array(values, BY_NAME[name].arrow_type(), mask=mask)

        located = self.latitude == self.latitude
        cols = {"request_id": column("request_id", rid), "k": column("k", np.full(n, k)),
                "age": column("age", self.age), "gender": column("gender", self.gender),
                "country": column("country", [c or None for c in self.country]),
                **{name: column(name, getattr(self, name), np.asarray(getattr(self, name)) < 0)  # -1: none
                   for name in _TERMS},
                "latitude": column("latitude", self.latitude, ~located),
                "longitude": column("longitude", self.longitude, ~located)}
        for key in USER_ID_KEYS:
            got = self.ids.get(key)
            if got is None:
                cols[key] = pa.nulls(n, pa.list_(pa.int64()))
                continue
            lengths, starts, values = got
            offsets = np.zeros(n + 1, np.int32)
            np.cumsum(lengths, out=offsets[1:])
            cols[key] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values[_rows_index(starts, lengths)],
                                                                                pa.int64()))
        for name, codes in (("publisher_platform", self.publisher), ("device_platform", self.device),
                            ("user_os", self.os)):
            cols[name] = _ENUM_ARRAYS[name].take(pa.array(np.asarray(codes, np.int32)))  # utf8: a batch's IPC
            # message carries no dictionaries
        cols["time"] = column("time", self.time)
        signals = np.ascontiguousarray(self.signals, np.float32).reshape(n, -1)
        cols["signals"] = pa.FixedSizeListArray.from_arrays(pa.array(signals.reshape(-1)), signals.shape[1])
        return pa.RecordBatch.from_arrays(list(cols.values()), names=list(cols))

    def encoded(self):
        """`andromeda_nb.compiled.encode_requests` of these requests, from the arrays."""
        from andromeda_nb.compiled import country_code, encode_arrays

        n = len(self)
        country = np.fromiter(map(country_code, self.country), np.int64, n)
        id_lists = {key: (lengths, values[_rows_index(starts, lengths)])
                    for key, (lengths, starts, values) in self.ids.items() if lengths.any()}
        return encode_arrays(n, np.stack([country, self.region, self.city, self.locale], axis=1), id_lists,
                             age=self.age, gender=self.gender, latitude=self.latitude, longitude=self.longitude,
                             publisher=self.publisher, device=self.device, os=self.os, time=self.time)

    def model_inputs(self) -> tuple[np.ndarray, np.ndarray]:
        """(signals float64 (n, E, S), context vectors float64 (n, C)) for `model.user_sides`."""
        from andromeda_nb.model import context_vectors

        return self.signals.astype(np.float64), context_vectors(self.publisher, self.device, self.os, self.time)


def _rows_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indexes of the values of rows laid out by `starts` and `lengths` (none negative), row after row."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


def _is_iso2(country: str | None) -> bool:
    """An ISO-3166 alpha-2 code (two upper-case letters), or none (None)."""
    return country is None or (len(country) == 2 and "A" <= country[0] <= "Z" and "A" <= country[1] <= "Z")


@dataclass
class _Fault:
    """A check over every row: `rows` (bool, one per request) where it fails, `error(row)` its error."""

    rows: np.ndarray
    error: Callable[[int], BaseException]


class _Columns:
    """A columnar batch's columns as numpy arrays, each checked for its type once."""

    def __init__(self, data: pa.RecordBatch | pa.Table):
        self.data = data
        self.n = data.num_rows
        self._names = names = data.schema.names
        unknown = [name for name in names if name not in BY_NAME]
        if unknown:
            raise InvalidInput(f"batch has unknown column(s) {clip(', '.join(unknown))}; a columnar request batch "
                               f"has {', '.join(BY_NAME)}")
        if len(set(names)) != len(names):
            raise InvalidInput("batch has a column twice: " + clip(", ".join(sorted({x for x in names if names.count(x) > 1}))))
        missing = [name for name in REQUIRED if name not in names]
        if missing:
            raise InvalidInput(f"batch lacks column(s) {', '.join(missing)}; a columnar request batch must have "
                               f"{', '.join(REQUIRED)}")
        for field in data.schema:
            expected = _type_fault(BY_NAME[field.name].kind, field.type)
            if expected:
                raise InvalidInput(f"column {field.name} is {field.type}; expected {expected}")

    # The accessors read the Arrow buffers with numpy: a pyarrow compute call lets go of the interpreter
    # lock, and in a server whose exchange threads want it each call can wait for it to come back.
    def array(self, name: str) -> pa.Array | None:
        if name not in self._names:
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
        values, nulls = _primitive(column)
        return _as_int64(values, nulls, name), nulls

    def floats(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        column = self.array(name)
        if column is None:
            return np.full(self.n, np.nan), np.ones(self.n, bool)
        values, nulls = _primitive(column)
        values = values.astype(np.float64)
        if nulls is not None:
            values[nulls] = np.nan
        return values, nulls

    def strings(self, name: str) -> list | None:
        column = self.array(name)
        if column is None:
            return None
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        return column.to_pylist()

    def lists(self, name: str, *, floats: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
        """(lengths with -1 for a null row, starts of each row's values in the values, the values, the
        values' null mask or None), or None when the column is absent."""
        column = self.array(name)
        if column is None:
            return None
        n = len(column)
        if pa.types.is_fixed_size_list(column.type):
            size = column.type.list_size
            starts = (column.offset + np.arange(n, dtype=np.int64)) * size
            lengths = np.full(n, size, np.int64)
        else:
            offsets = np.asarray(column.offsets.to_numpy(zero_copy_only=False), np.int64)  # the slice's own
            starts, lengths = offsets[:-1], np.diff(offsets)
        nulls = _null_mask(column)
        if nulls is not None:
            lengths = np.where(nulls, -1, lengths)
        values, item_nulls = _primitive(column.values)  # the whole child: rows index it by starts
        held = np.maximum(lengths, 0)
        ends = np.cumsum(held)
        if len(values) != (int(ends[-1]) if n else 0) or (n and (starts[0] != 0 or np.any(starts[1:] != ends[:-1]))):
            # a sliced column, or null rows over values of their own: the rows' values alone, in order
            index = _rows_index(starts, held)
            values = values[index]
            item_nulls = None if item_nulls is None else item_nulls[index]
            starts = ends - held
        if item_nulls is not None and not item_nulls.any():
            item_nulls = None
        if floats:
            values = values.astype(np.float64)
            if item_nulls is not None:
                values[item_nulls] = np.nan
        else:
            values = _as_int64(values, item_nulls, name)
        return lengths, starts, values, item_nulls


def _null_mask(column: pa.Array) -> np.ndarray | None:
    """bool per entry: null (None when none is), from the validity bitmap."""
    if not column.null_count:
        return None
    bitmap = column.buffers()[0]
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[column.offset : column.offset + len(column)] == 0


def _primitive(column: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """A primitive column's values as a numpy view of its data buffer (whatever sits under a null),
    and its null mask."""
    dtype = np.dtype(column.type.to_pandas_dtype())
    data = column.buffers()[1]
    values = np.frombuffer(data, dtype, count=column.offset + len(column))[column.offset :] if len(column) \
        else np.empty(0, dtype)
    return values, _null_mask(column)


def _as_int64(values: np.ndarray, nulls: np.ndarray | None, name: str) -> np.ndarray:
    """int64 values (0 under a null); an unsigned value beyond int64 is an error naming the column."""
    if values.dtype == np.uint64:
        present = values if nulls is None else values[~nulls]
        if len(present) and present.max() > np.iinfo(np.int64).max:
            raise InvalidInput(f"column {name}: a value is outside the range of int64")
    out = values.astype(np.int64)
    if nulls is not None:
        out[nulls] = 0
    return out


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


@dataclass
class _Arrays:
    """A columnar batch's columns as numpy arrays, before any value is checked."""

    n: int
    rid: np.ndarray
    rid_null: np.ndarray | None
    k: np.ndarray
    k_null: np.ndarray | None
    ints: dict  # age, gender, region, city, locale, time -> (int64 values, null mask or None)
    country: list | None
    lat: np.ndarray
    lon: np.ndarray
    has_lat: np.ndarray
    has_lon: np.ndarray
    ids: dict  # key -> (lengths, starts, values, item null mask or None)
    enums: dict  # name -> list of str or None
    signals: tuple | None  # (lengths, starts, values, item null mask or None)


def _extract(cols: _Columns) -> _Arrays:
    n = cols.n
    rid, rid_null = cols.ints("request_id")
    k, k_null = cols.ints("k")
    lat, lat_null = cols.floats("latitude")
    lon, lon_null = cols.floats("longitude")
    ids = {}
    for key in USER_ID_KEYS:
        got = cols.lists(key, floats=False)
        if got is not None:
            ids[key] = got
    return _Arrays(
        n=n, rid=rid, rid_null=rid_null, k=k, k_null=k_null,
        ints={name: cols.ints(name) for name in ("age", "gender", *_TERMS, "time")},
        country=cols.strings("country"), lat=lat, lon=lon,
        has_lat=np.ones(n, bool) if lat_null is None else ~lat_null,
        has_lon=np.ones(n, bool) if lon_null is None else ~lon_null,
        ids=ids, enums={name: cols.strings(name) for name in _ENUMS}, signals=cols.lists("signals", floats=True))


def _valid(a: _Arrays, limits: ServiceLimits, size: int) -> bool:
    """Whether every value is right, in a few array operations (the happy path: `_faults` names the
    first fault when this says no, and finds one whenever it does)."""
    if a.rid_null is not None or a.k_null is not None:
        return False
    if a.k.min() < 1 or a.k.max() > min(MAX_K, limits.max_k):
        return False
    for name, lo, hi in (("age", *USER_AGE_RANGE), ("time", -MAX_ABS_TIME, MAX_ABS_TIME)):
        values, nulls = a.ints[name]
        if nulls is not None or values.min() < lo or values.max() > hi:
            return False
    gender, _ = a.ints["gender"]  # null: 0
    if gender.min() < 0 or gender.max() > max(USER_GENDERS):
        return False
    for name in _TERMS:
        values, nulls = a.ints[name]
        present = values if nulls is None else values[~nulls]
        if len(present) and (present.min() < 0 or present.max() > MAX_TERM_ID):
            return False
    if a.country is not None and not all(map(_is_iso2, a.country)):
        return False
    if not np.array_equal(a.has_lat, a.has_lon):
        return False
    with np.errstate(invalid="ignore"):
        if not (np.all(np.abs(a.lat[a.has_lat]) <= 90.0) and np.all(np.abs(a.lon[a.has_lon]) <= 180.0)):
            return False
    for lengths, starts, values, nulls in a.ids.values():
        if nulls is not None or (len(values) and (values.min() < 0 or values.max() > MAX_TERM_ID)):
            return False
    for name, universe in _ENUMS.items():
        if not set(a.enums[name]) <= _ENUM_SETS[name]:
            return False
    if a.signals is not None:
        lengths, starts, values, nulls = a.signals
        if nulls is not None or not np.all((lengths == size) | (lengths < 0)):
            return False
        with np.errstate(invalid="ignore"):
            if not np.all(np.abs(values) <= _F32_MAX):  # False for NaN and the infinities too
                return False
    return True


def decode_columns(data: pa.RecordBatch | pa.Table, *, seed: int, experts: int, width: int,
                   limits: ServiceLimits = DEFAULT_LIMITS, segments: Sequence[int] | None = None
                   ) -> tuple[Sequence[Request], list[int]]:
    """Check a columnar request batch (module docstring) and return (requests, ks): a
    `RequestColumns` (a sequence of `Request` objects made as they are asked for, whose arrays an
    engine can take whole), or a list for a batch checked row by row. `segments`: the row counts of
    the calls concatenated in `data` (request ids need only be unique within one); None: one call.
    Raises `InvalidInput` (or `LimitExceeded` for a k over `limits.max_k`) naming the request and the
    JSON path of the first fault."""
    cols = _Columns(data)
    if cols.n <= ROW_PATH_MAX:
        return _decode_rows(data, seed=seed, experts=experts, width=width, limits=limits, segments=segments)
    a = _extract(cols)
    _check_unique(a.rid, segments, a.rid_null)  # first, as in a JSON batch
    size = experts * width
    if not _valid(a, limits, size):
        _raise_first(_faults(a, limits, experts, width), a.n)
        raise AssertionError("the quick check found a fault the detailed checks do not")  # kept in step by tests
    n = a.n
    signals = np.empty((n, experts, width), np.float32)
    derived = np.ones(n, bool)
    if a.signals is not None:
        lengths, starts, values, _ = a.signals
        derived = lengths < 0
        take = np.flatnonzero(~derived)
        if len(take):
            index = starts[take, None] + np.arange(size)[None, :]
            signals[take] = values[index].astype(np.float32).reshape(len(take), experts, width)
    if derived.any():
        take = np.flatnonzero(derived)
        signals[take] = derive.request_signals_many(a.rid[take], seed, experts, width)
    ints = {name: values for name, (values, _) in a.ints.items()}  # a null gender reads 0 (`_as_int64`)
    for name in _TERMS:  # no region, city or locale: -1
        values, nulls = a.ints[name]
        if nulls is not None:
            ints[name] = np.where(nulls, -1, values)
    ids = {key: (lengths.clip(min=0), starts, values) for key, (lengths, starts, values, _) in a.ids.items()}
    codes = {name: np.fromiter((_ENUM_CODES[name][v] for v in a.enums[name]), np.int64, n) for name in _ENUMS}
    requests = RequestColumns(
        request_id=a.rid, age=ints["age"], gender=ints["gender"],
        country=[c or "" for c in a.country] if a.country is not None else [""] * n,
        region=ints["region"], city=ints["city"], locale=ints["locale"],
        latitude=np.where(a.has_lat, a.lat, np.nan), longitude=np.where(a.has_lon, a.lon, np.nan), ids=ids,
        publisher=codes["publisher_platform"], device=codes["device_platform"], os=codes["user_os"],
        time=ints["time"], signals=signals)
    return requests, a.k.tolist()


def _faults(a: _Arrays, limits: ServiceLimits, experts: int, width: int) -> list[_Fault]:
    """Every check, one `_Fault` each, in the order the JSON checker makes them for one request."""
    n = a.n
    rid, rid_null, k = a.rid, a.rid_null, a.k
    faults: list[_Fault] = []

    def _rid(i: int):
        return None if rid_null is not None and rid_null[i] else int(rid[i])

    def fail(path: str, message) -> Callable[[int], BaseException]:
        return lambda i: InvalidInput(f"request {_rid(i)}: {path}: {message(i) if callable(message) else message}")

    nulls = np.zeros(n, bool)
    for mask in (rid_null, a.k_null):
        if mask is not None:
            nulls |= mask
    faults.append(_Fault(nulls, lambda i: InvalidInput(f"request {_rid(i)}: null request_id or k")))
    faults.append(_Fault((k < 1) | (k > MAX_K) | (k > limits.max_k), lambda i: _k_error(int(k[i]), _rid(i), limits)))

    def required(name: str, lo, hi) -> None:
        values, null = a.ints[name]
        path = BY_NAME[name].path
        if null is not None:
            faults.append(_Fault(null, fail(path, "is required")))
        out_of_range(path, values, None if null is None else ~null, lo, hi)

    def out_of_range(path: str, values, present, lo, hi) -> None:
        bad = (values < lo) | (values > hi)
        if present is not None:
            bad &= present
        faults.append(_Fault(bad, fail(path, lambda i: f"{values[i]} is out of range {lo}..{hi}")))

    required("age", *USER_AGE_RANGE)
    gender, _ = a.ints["gender"]  # null: 0
    faults.append(_Fault(~np.isin(gender, USER_GENDERS), fail(
        "user.gender", lambda i: f"{int(gender[i])!r} is not one of {', '.join(map(repr, USER_GENDERS))}")))
    country = a.country
    if country is not None:
        bad = np.fromiter((not _is_iso2(c) for c in country), bool, n)
        faults.append(_Fault(bad, fail("user.country", lambda i: f"{quote(country[i])} is not an ISO-3166 alpha-2 code "
                                                                 "(two upper-case letters)")))
    for name in _TERMS:
        values, null = a.ints[name]
        out_of_range(BY_NAME[name].path, values, None if null is None else ~null, 0, MAX_TERM_ID)

    has_lat, has_lon = a.has_lat, a.has_lon
    faults.append(_Fault(has_lat != has_lon, lambda i: InvalidInput(
        f"request {_rid(i)}: user.{'longitude' if has_lat[i] else 'latitude'}: latitude and longitude come together")))
    for name, values, present, bound in (("latitude", a.lat, has_lat, 90.0), ("longitude", a.lon, has_lon, 180.0)):
        faults.append(_Fault(present & ~np.isfinite(values),
                             fail(BY_NAME[name].path, lambda i, v=values: f"must be finite, got {float(v[i])}")))
        with np.errstate(invalid="ignore"):
            bad = present & np.isfinite(values) & ((values < -bound) | (values > bound))
        faults.append(_Fault(bad, fail(BY_NAME[name].path,
                                       lambda i, v=values, b=bound: f"{float(v[i])} is out of range {-b}..{b}")))

    for key, (lengths, starts, values, item_null) in a.ids.items():
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

    for name, universe in _ENUMS.items():
        values = a.enums[name]
        path = BY_NAME[name].path
        faults.append(_Fault(np.fromiter((v is None for v in values), bool, n), fail(path, "is required")))
        allowed = _ENUM_SETS[name]
        faults.append(_Fault(np.fromiter((v is not None and v not in allowed for v in values), bool, n),
                             fail(path, lambda i, v=values, u=universe:
                                  f"{quote(v[i])} is not one of {', '.join(map(repr, u))}")))
    required("time", -MAX_ABS_TIME, MAX_ABS_TIME)

    size = experts * width
    if a.signals is not None:
        lengths, starts, values, item_null = a.signals
        given = lengths >= 0
        faults.append(_Fault(given & (lengths != size), lambda i: InvalidInput(
            f"request {_rid(i)}: signals: has {int(lengths[i])} values; expected {size} ({experts} groups of {width})")))
        good = given & (lengths == size)
        if item_null is not None:
            rows, first = _per_row_first(item_null, starts, lengths, n)
            faults.append(_Fault(rows & good, lambda i, first=first: InvalidInput(
                f"request {_rid(i)}: {_signal_path(first[i], width)}: must be a number, got null")))
            values = np.where(item_null, 0.0, values)
        finite = np.isfinite(values)
        rows, first = _per_row_first(~finite, starts, lengths, n)
        faults.append(_Fault(rows & good, lambda i, first=first, values=values: InvalidInput(
            f"request {_rid(i)}: {_signal_path(first[i], width)}: must be finite, got "
            f"{float(values[starts[i] + first[i]])}")))
        with np.errstate(invalid="ignore"):
            rows, first = _per_row_first(finite & (np.abs(values) > _F32_MAX), starts, lengths, n)
        faults.append(_Fault(rows & good, lambda i, first=first, values=values: InvalidInput(
            f"request {_rid(i)}: {_signal_path(first[i], width)}: {float(values[starts[i] + first[i]])} is out of "
            f"range {-_F32_MAX}..{_F32_MAX}")))
    return faults


def _decode_rows(data, *, seed: int, experts: int, width: int, limits: ServiceLimits, segments
                 ) -> tuple[list[Request], list[int]]:
    """A small batch request by request, by the JSON request's own checker (`parse_request`): for a
    few rows fewer steps than the array checks, with the same faults named the same way."""
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
        requests.append(parse_batch_request(obj, request_id, seed=seed, experts=experts, width=width))
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


__all__ = ["COLUMNS", "Column", "ROW_PATH_MAX", "RequestColumns", "decode_columns", "is_columnar", "request_columns"]
