"""A corpus on disk: Parquet ads and requests, model.npz and meta.json (layout in `dataset.py`),
and the JSON Lines interchange forms of DESIGN section 2.

    save_dataset(dataset, dir)        write a Dataset
    load_dataset(dir, progress=None)  read and validate one (schema version checked first)
    import_jsonl(ads, requests, out)  JSON Lines -> a corpus directory; rejected ads -> rejected.jsonl
    export_jsonl(dataset, dir)        a Dataset -> ads.jsonl, requests.jsonl

Embeddings are stored at the dataset's precision: a fixed-size list column of float32, float16 or
int8 values plus a float32 `scale` column (ones unless int8). Every problem with a directory (missing
file, wrong schema version, a column of the wrong type, counts that disagree with meta.json) raises
`StoreError` with a message that names the file and what is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__, derive
from .constants import PRECISIONS, SCHEMA_VERSION
from .model import STORED_DTYPES, EmbeddingTable, ModelError, MoeModel, quantize
from .types import Ad, Request, TargetingError

META_FILE = "meta.json"
ADS_FILE = "ads.parquet"
REQUESTS_FILE = "requests.parquet"
MODEL_FILE = "model.npz"
REJECTED_FILE = "rejected.jsonl"
REJECTED_REQUESTS_FILE = "rejected_requests.jsonl"
ADS_JSONL = "ads.jsonl"
REQUESTS_JSONL = "requests.jsonl"

Progress = Callable[[int], None]  # called with the number of items just done


class StoreError(ValueError):
    """A corpus directory or interchange file that cannot be used as it is."""


_ARROW_VALUE_TYPES = {"fp32": pa.float32(), "fp16": pa.float16(), "int8": pa.int8()}


def ads_schema(precision: str, dim: int) -> pa.Schema:
    return pa.schema([
        ("ad_id", pa.int64()),
        ("status", pa.string()),
        ("start_time", pa.int64()),
        ("end_time", pa.int64()),
        ("format", pa.int16()),
        ("targeting", pa.string()),
        ("embedding", pa.list_(_ARROW_VALUE_TYPES[precision], dim)),
        ("scale", pa.float32()),
    ])


REQUESTS_SCHEMA = pa.schema([("request_id", pa.int64()), ("request", pa.string())])


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise StoreError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")


def ads_record_batch(ad_ids, statuses: list[str], start_times: list, end_times: list, formats,
                     targeting_text: list[str], table: EmbeddingTable) -> pa.RecordBatch:
    """One batch of ads.parquet rows. `targeting_text` is each ad's targeting object as JSON text;
    `start_times` / `end_times` hold ints or None (open)."""
    n, dim = table.values.shape
    values = pa.array(np.ascontiguousarray(table.values).reshape(-1), _ARROW_VALUE_TYPES[table.precision])
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.asarray(ad_ids, np.int64)),
            pa.array(statuses, pa.string()),
            pa.array(start_times, pa.int64()),
            pa.array(end_times, pa.int64()),
            pa.array(np.asarray(formats, np.int16)),
            pa.array(targeting_text, pa.string()),
            pa.FixedSizeListArray.from_arrays(values, dim),
            pa.array(np.asarray(table.scale, np.float32)),
        ],
        schema=ads_schema(table.precision, dim),
    )


class AdsWriter:
    """Streams batches of ads into DIR/ads.parquet (used by `generate` for large corpora)."""

    def __init__(self, out_dir, precision: str, dim: int):
        _check_precision(precision)
        self.path = Path(out_dir) / ADS_FILE
        self.precision, self.dim = precision, dim
        self.rows = 0
        self._writer = pq.ParquetWriter(self.path, ads_schema(precision, dim), compression="zstd")

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch, row_group_size=1 << 17)
        self.rows += batch.num_rows

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "AdsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_requests(out_dir, request_objects: Iterable[dict]) -> int:
    """DIR/requests.parquet from request objects of DESIGN section 2 (each with its request_id)."""
    ids, texts = [], []
    encode = json.JSONEncoder(separators=(",", ":")).encode
    for obj in request_objects:
        ids.append(int(obj["request_id"]))
        texts.append(encode({k: v for k, v in obj.items() if k != "request_id"}))
    table = pa.table([pa.array(ids, pa.int64()), pa.array(texts, pa.string())], schema=REQUESTS_SCHEMA)
    pq.write_table(table, Path(out_dir) / REQUESTS_FILE, compression="zstd")
    return len(ids)


def write_meta(out_dir, *, seed: int, model: MoeModel, precision: str, n_ads: int, n_requests: int,
               source: dict) -> dict:
    meta = {
        "schema_version": SCHEMA_VERSION,
        "seed": int(seed),
        "sizes": {"D": model.D, "E": model.E, "k": model.top_k, "F": model.F, "S": model.S},
        "precision": precision,
        "counts": {"ads": int(n_ads), "requests": int(n_requests)},
        "source": source,
        "written_by": f"andromeda-nb {__version__}",
    }
    with open(Path(out_dir) / META_FILE, "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    return meta


# --- save -------------------------------------------------------------------------------------------


def save_dataset(dataset, out_dir, *, source: dict | None = None) -> Path:
    """Write `dataset` into `out_dir` (created if needed): meta.json, ads.parquet, requests.parquet,
    model.npz. The targeting text of each ad is the object it was parsed from."""
    from .targeting import request_to_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _check_precision(dataset.precision)
    table = dataset.embeddings
    if table.precision != dataset.precision:
        raise StoreError(f"embeddings are stored as {table.precision}, the dataset says {dataset.precision}")
    if len(table) != len(dataset.ads):
        raise StoreError(f"{len(dataset.ads)} ads but {len(table)} embedding rows")
    encode = json.JSONEncoder(separators=(",", ":")).encode
    ads = dataset.ads
    with AdsWriter(out, dataset.precision, dataset.model.D) as writer:
        step = 1 << 16
        for lo in range(0, len(ads), step):
            part = ads[lo : lo + step]
            writer.write(ads_record_batch(
                [a.ad_id for a in part], [a.status for a in part], [a.start_time for a in part],
                [a.end_time for a in part], [a.format for a in part],
                [encode(_targeting_object(a)) for a in part], table.take(np.arange(lo, lo + len(part))),
            ))
        if not ads:
            empty = EmbeddingTable.empty(dataset.model.D, dataset.precision)
            writer.write(ads_record_batch([], [], [], [], [], [], empty))
    write_requests(out, (request_to_json(r) for r in dataset.requests))
    dataset.model.save(out / MODEL_FILE)
    write_meta(out, seed=dataset.seed, model=dataset.model, precision=dataset.precision,
               n_ads=len(ads), n_requests=len(dataset.requests),
               source=source or dataset.meta.get("source") or {"kind": "saved"})
    return out


def _targeting_object(ad: Ad) -> dict:
    if ad.targeting_json:
        return dict(ad.targeting_json)
    from .targeting import spec_to_json

    return spec_to_json(ad.targeting)


# --- load -------------------------------------------------------------------------------------------


def read_meta(data_dir) -> dict:
    """meta.json of a corpus directory, after checking that it exists and has our schema version."""
    root = Path(data_dir)
    if not root.is_dir():
        raise StoreError(f"{root}: no such corpus directory")
    path = root / META_FILE
    if not path.is_file():
        raise StoreError(f"{path}: missing (not a corpus directory made by `andromeda generate` or `import`)")
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:
        raise StoreError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise StoreError(f"{path}: has no schema_version")
    if meta["schema_version"] != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: schema_version {meta['schema_version']!r}, but this andromeda-nb reads version "
            f"{SCHEMA_VERSION}; regenerate or re-import the corpus")
    for key in ("seed", "precision", "sizes", "counts"):
        if key not in meta:
            raise StoreError(f"{path}: missing {key!r}")
    if meta["precision"] not in PRECISIONS:
        raise StoreError(f"{path}: precision must be one of {', '.join(PRECISIONS)}, got {meta['precision']!r}")
    for name in (ADS_FILE, REQUESTS_FILE, MODEL_FILE):
        if not (root / name).is_file():
            raise StoreError(f"{root / name}: missing")
    return meta


def _read_parquet(path: Path, schema: pa.Schema) -> pa.Table:
    try:
        table = pq.read_table(path)
    except Exception as exc:  # truncated or not Parquet at all
        raise StoreError(f"{path}: not a readable Parquet file ({exc})") from None
    for f in schema:
        if f.name not in table.column_names:
            raise StoreError(f"{path}: missing column {f.name!r}")
        got = table.schema.field(f.name).type
        if got != f.type:
            raise StoreError(f"{path}: column {f.name!r} has type {got}, expected {f.type}")
    return table


def read_embeddings(table: pa.Table, precision: str, dim: int) -> EmbeddingTable:
    col = table.column("embedding").combine_chunks()
    if col.null_count:
        raise StoreError(f"ads.parquet: embedding is null in {col.null_count} row(s)")
    values = col.values.to_numpy(zero_copy_only=False).reshape(len(col), dim)
    values = np.ascontiguousarray(values, STORED_DTYPES[precision])
    scale = table.column("scale").to_numpy(zero_copy_only=False).astype(np.float32)
    try:
        return EmbeddingTable(values, scale, precision)
    except ModelError as exc:
        raise StoreError(f"ads.parquet: {exc}") from None


def _progress_chunks(items: list, progress: Progress | None, step: int = 4096) -> Iterator:
    for lo in range(0, len(items), step):
        yield from items[lo : lo + step]
        if progress is not None:
            progress(len(items[lo : lo + step]))


def load_dataset(data_dir, progress: Progress | None = None):
    """Read a corpus directory into a `Dataset`, validating every ad and request with the same
    parser as `import` (an invalid row here means the files were edited by hand: StoreError naming
    the row). The embeddings are `dataset.embeddings` (row i is ads[i]); the `Ad` objects carry
    none (`Ad.embedding` is None). `progress(n)` is called as ads and requests are parsed."""
    from .dataset import Dataset
    from .targeting import parse_ad, parse_request

    root = Path(data_dir)
    meta = read_meta(root)
    try:
        model = MoeModel.load(root / MODEL_FILE)
    except ModelError as exc:
        raise StoreError(str(exc)) from None
    precision, seed = meta["precision"], int(meta["seed"])
    ads_table = _read_parquet(root / ADS_FILE, ads_schema(precision, model.D))
    req_table = _read_parquet(root / REQUESTS_FILE, REQUESTS_SCHEMA)
    for name, got in (("ads", ads_table.num_rows), ("requests", req_table.num_rows)):
        want = meta["counts"].get(name)
        if want != got:
            raise StoreError(f"{root / META_FILE}: says {want} {name}, the Parquet file has {got}")
    embeddings = read_embeddings(ads_table, precision, model.D)
    if not np.all(np.isfinite(embeddings.values)):
        row = int(np.flatnonzero(~np.all(np.isfinite(embeddings.values), axis=1))[0])
        raise StoreError(f"{root / ADS_FILE}: row {row}: embedding has a NaN or infinite value")
    cols = {name: ads_table.column(name).to_pylist() for name in
            ("ad_id", "status", "start_time", "end_time", "format", "targeting")}
    ads: list[Ad] = []
    for i in _progress_chunks(range(len(embeddings)), progress):
        obj = {name: cols[name][i] for name in ("ad_id", "status", "start_time", "end_time", "format")}
        try:
            obj["targeting"] = json.loads(cols["targeting"][i])
            # the embedding lives in `embeddings` (row i); the Ad itself carries none
            ads.append(parse_ad(obj, seed=seed, dim=model.D, formats=model.F, derive_embedding=False))
        except (ValueError, TargetingError) as exc:
            raise StoreError(f"{root / ADS_FILE}: row {i}: {exc}") from None
    if len({a.ad_id for a in ads}) != len(ads):
        raise StoreError(f"{root / ADS_FILE}: duplicate ad ids")
    requests: list[Request] = []
    rids, texts = req_table.column("request_id").to_pylist(), req_table.column("request").to_pylist()
    for i in _progress_chunks(range(len(rids)), progress):
        try:
            requests.append(parse_request(json.loads(texts[i]), seed=seed, experts=model.E, width=model.S,
                                          request_id=rids[i]))
        except (ValueError, TargetingError) as exc:
            raise StoreError(f"{root / REQUESTS_FILE}: row {i}: {exc}") from None
    return Dataset(ads=ads, embeddings=embeddings, requests=requests, model=model, seed=seed,
                   precision=precision, meta=meta)


# --- JSON Lines -------------------------------------------------------------------------------------


@dataclass
class ImportSummary:
    ads: int = 0  # loaded
    requests: int = 0
    rejected_ads: int = 0
    rejected_requests: int = 0
    rejected_path: str = ""
    out_dir: str = ""
    rejections: list[dict] = field(default_factory=list)  # the first few, for messages

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "rejections"}


def _json_lines(path) -> Iterator[tuple[int, object | None, str | None]]:
    """(line number, decoded object or None, error or None) for every non-blank line of a file."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise StoreError(f"{path}: cannot be read ({exc.strerror})") from None
    with fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield line_no, None, f"line {line_no}: not valid UTF-8 (byte {exc.start + 1})"
                continue
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield line_no, None, f"line {line_no}: not valid JSON ({exc.msg} at column {exc.colno})"
            except ValueError as exc:
                yield line_no, None, f"line {line_no}: not valid JSON ({exc})"


def _id_of(obj, key: str):
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def import_jsonl(ads_path, requests_path, out_dir, model_path=None, seed: int = 0, precision: str = "fp32",
                 strict: bool = False, progress: Progress | None = None, dim: int | None = None) -> ImportSummary:
    """Load the JSON Lines forms of DESIGN section 2 into a corpus directory.

    Every valid ad loads; every rejected ad is written to OUT/rejected.jsonl as
    {"ad_id": .., "error": ".."} (the error names the offending field's JSON path; a line that is not
    JSON names its line number; a repeated ad_id is rejected after its first appearance). Rejected
    requests go to OUT/rejected_requests.jsonl as {"request_id": .., "error": ".."}. The weights come
    from `model_path` or are made from `seed` (`MoeModel.init`, D = `dim` or 64). `strict` only
    marks the summary; the caller decides what a rejection means (the CLI exits non-zero).
    """
    from .dataset import Dataset
    from .targeting import parse_ad, parse_request

    _check_precision(precision)
    if model_path is not None:
        try:
            model = MoeModel.load(model_path)
        except ModelError as exc:
            raise StoreError(str(exc)) from None
        if dim is not None and dim != model.D:
            raise StoreError(f"--dim {dim} disagrees with the model's D={model.D}")
    else:
        model = MoeModel.init(seed, **({"D": dim} if dim else {}))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = ImportSummary(out_dir=str(out), rejected_path=str(out / REJECTED_FILE))
    ads: list[Ad] = []
    first_line: dict[int, int] = {}
    with open(out / REJECTED_FILE, "w") as rejected:
        def reject(ad_id, error: str) -> None:
            summary.rejected_ads += 1
            record = {"ad_id": ad_id, "error": error}
            if len(summary.rejections) < 20:
                summary.rejections.append(record)
            rejected.write(json.dumps(record) + "\n")

        for line_no, obj, error in _json_lines(ads_path):
            if progress is not None:
                progress(1)
            if error is not None:
                reject(None, error)
                continue
            try:
                ad = parse_ad(obj, seed=seed, dim=model.D, formats=model.F, line=line_no, derive_embedding=False)
            except TargetingError as exc:
                reject(exc.ad_id if exc.ad_id is not None else _id_of(obj, "ad_id"), str(exc))
                continue
            if ad.ad_id in first_line:
                reject(ad.ad_id, f"line {line_no}: ad {ad.ad_id}: ad_id: repeats the ad of line {first_line[ad.ad_id]}")
                continue
            first_line[ad.ad_id] = line_no
            ads.append(ad)
    requests: list[Request] = []
    seen_requests: set[int] = set()
    with open(out / REJECTED_REQUESTS_FILE, "w") as rejected:
        for line_no, obj, error in _json_lines(requests_path):
            if progress is not None:
                progress(1)
            rid = _id_of(obj, "request_id")
            if error is None:
                try:
                    req = parse_request(obj, seed=seed, experts=model.E, width=model.S, line=line_no)
                    if req.request_id in seen_requests:
                        error = f"line {line_no}: request {req.request_id}: request_id: repeats an earlier request"
                    else:
                        seen_requests.add(req.request_id)
                        requests.append(req)
                except TargetingError as exc:
                    error = str(exc)
            if error is not None:
                summary.rejected_requests += 1
                rejected.write(json.dumps({"request_id": rid, "error": error}) + "\n")
    emb = np.empty((len(ads), model.D), np.float32)
    missing = [i for i, a in enumerate(ads) if a.embedding is None]
    for i, a in enumerate(ads):
        if a.embedding is not None:
            emb[i] = a.embedding
    if missing:  # ads given without an embedding get derive.ad_embeddings(ad_id, seed), made in bulk
        emb[missing] = derive.ad_embeddings([ads[i].ad_id for i in missing], seed, model.D)
    table = quantize(emb, precision)
    dataset = Dataset(ads=ads, embeddings=table, requests=requests, model=model, seed=seed, precision=precision)
    save_dataset(dataset, out, source={
        "kind": "import", "ads": os.fspath(ads_path), "requests": os.fspath(requests_path),
        "model": None if model_path is None else os.fspath(model_path),
        "rejected_ads": summary.rejected_ads, "rejected_requests": summary.rejected_requests,
    })
    summary.ads, summary.requests = len(ads), len(requests)
    return summary


def export_jsonl(dataset, out_dir) -> tuple[Path, Path]:
    """Write OUT/ads.jsonl and OUT/requests.jsonl (DESIGN section 2). Embeddings are written as the
    float32 values they dequantize to, so an fp32 corpus round-trips exactly."""
    from .targeting import ad_to_json, request_to_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    floats = dataset.embeddings.dequantize().astype(np.float32)
    ads_path, req_path = out / ADS_JSONL, out / REQUESTS_JSONL
    with open(ads_path, "w") as fh:
        for i, ad in enumerate(dataset.ads):
            obj = ad_to_json(ad)
            obj["embedding"] = floats[i].astype(np.float64).tolist()
            fh.write(json.dumps(obj, separators=(",", ":")) + "\n")
    with open(req_path, "w") as fh:
        for req in dataset.requests:
            fh.write(json.dumps(request_to_json(req), separators=(",", ":")) + "\n")
    return ads_path, req_path


__all__ = [
    "ADS_FILE", "META_FILE", "MODEL_FILE", "REJECTED_FILE", "REQUESTS_FILE", "AdsWriter", "ImportSummary",
    "StoreError", "ads_record_batch", "ads_schema", "export_jsonl", "import_jsonl", "load_dataset",
    "read_meta", "save_dataset", "write_meta", "write_requests",
]
