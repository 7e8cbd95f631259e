"""A corpus on disk: Parquet ads and requests, model.npz and meta.json (layout in `dataset.py`),
and the JSON Lines interchange forms of DESIGN section 2.

    save_dataset(dataset, dir)        write a Dataset (its targeting compiled into targeting.npz)
    load_dataset(dir, progress=None)  read one (schema version checked first); no ad is parsed
    reindex(dir)                      parse and validate ads.parquet again and rewrite targeting.npz
    import_jsonl(ads, requests, out)  JSON Lines -> a corpus directory; rejected ads -> rejected.jsonl
    export_jsonl(dataset, dir)        a Dataset -> ads.jsonl, requests.jsonl

Embeddings are stored at the dataset's precision: a fixed-size list column of float32, float16 or
int8 values plus a float32 `scale` column (ones unless int8). Every problem with a directory (missing
file, wrong schema version, a column of the wrong type, counts that disagree with meta.json) raises
`StoreError` with a message that names the file and what is wrong.

Targeting is validated when a corpus is written (`generate` parses every ad it makes, `import`
parses and rejects as it reads) and stored twice: as the JSON text of each ad in ads.parquet (the
form users read and export) and compiled, in targeting.npz (`compiled.CompiledTargeting`, row i is
ad i, uncompressed .npy members as `np.savez` writes them plus `format_version`, each member's data
aligned to 64 bytes so that loading maps the arrays from the file: `read_npz_arrays`). meta.json's `targeting` entry records the
sha256 of targeting.npz and of the ads.parquet it was compiled from; `load_dataset` checks both, so
a targeting.npz that does not belong to its ads.parquet (either file replaced or edited) is an
error, never a silent disagreement. A corpus written before targeting.npz existed loads the slow
way (every ad parsed and compiled in memory) until `reindex` adds the file.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import mmap
import os
import struct
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__, derive, jsontext
from .compiled import COMPILED_ARRAYS, CompiledTargeting, check_compiled, check_values, has_duplicates
from .constants import PRECISIONS, SCHEMA_VERSION
from .model import STORED_DTYPES, EmbeddingTable, ModelError, MoeModel, quantize
from .progress import Advance, Phases, Say
from .types import Ad, Request, TargetingError

META_FILE = "meta.json"
ADS_FILE = "ads.parquet"
REQUESTS_FILE = "requests.parquet"
MODEL_FILE = "model.npz"
REJECTED_FILE = "rejected.jsonl"
REJECTED_REQUESTS_FILE = "rejected_requests.jsonl"
ADS_JSONL = "ads.jsonl"
REQUESTS_JSONL = "requests.jsonl"
TARGETING_FILE = "targeting.npz"
TARGETING_FORMAT = 1  # version of targeting.npz's layout (the arrays of compiled.COMPILED_ARRAYS)

Progress = Advance  # called with the number of items just done (andromeda_nb.progress)


class StoreError(ValueError):
    """A corpus directory or interchange file that cannot be used as it is."""


class _GcPause:
    """How many threads are inside `paused_gc` now, and whether the collector was on before the first."""

    lock = threading.Lock()
    holders = 0
    was_enabled = False


@contextlib.contextmanager
def paused_gc():
    """The cyclic garbage collector off while many small objects are made (bulk parsing): parsed
    ads hold no reference cycles, and with the collector on its full passes over the growing heap
    cost more than the parsing itself. Reference counting still frees everything. Threads pause it
    together: it comes back on when the last of them leaves (a server's concurrent update calls),
    not when the first does, which started a full collection over the other calls' parsed updates
    (seconds, with the interpreter held, on the 2-core machine)."""
    with _GcPause.lock:
        if _GcPause.holders == 0:
            _GcPause.was_enabled = gc.isenabled()
            gc.disable()
        _GcPause.holders += 1
    try:
        yield
    finally:
        with _GcPause.lock:
            _GcPause.holders -= 1
            if _GcPause.holders == 0 and _GcPause.was_enabled:
                gc.enable()


def file_sha256(path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


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


def ads_parquet_options(schema: pa.Schema) -> dict:
    """How ads.parquet is written (`AdsWriter`, a compaction's new snapshot): zstd, and the embeddings
    without a dictionary (dictionary pages of fp16 values took three times as long to decode when a
    corpus loads, 1.7 s of CPU per million ads on the development machine; the file is about the same
    size, 3% larger for a million fp16 ads of seed 3)."""
    return {"compression": "zstd", "use_dictionary": [name for name in schema.names if name != "embedding"]}


ROW_GROUP_ADS = 1 << 17  # ads per Parquet row group: the unit of parallel parsing (ParquetAds.group)


class AdsWriter:
    """Streams batches of ads into DIR/ads.parquet (used by `generate` for large corpora)."""

    def __init__(self, out_dir, precision: str, dim: int):
        _check_precision(precision)
        self.path = Path(out_dir) / ADS_FILE
        self.precision, self.dim = precision, dim
        self.rows = 0
        schema = ads_schema(precision, dim)
        self._writer = pq.ParquetWriter(self.path, schema, **ads_parquet_options(schema))

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch, row_group_size=ROW_GROUP_ADS)
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
               source: dict, targeting: dict | None = None) -> dict:
    """DIR/meta.json. `targeting` is what `write_targeting` returned (None: no targeting.npz)."""
    meta = {
        "schema_version": SCHEMA_VERSION,
        "seed": int(seed),
        "sizes": {"D": model.D, "E": model.E, "k": model.top_k, "F": model.F, "S": model.S},
        "precision": precision,
        "counts": {"ads": int(n_ads), "requests": int(n_requests)},
        "source": source,
        "written_by": f"andromeda-nb {__version__}",
    }
    if targeting is not None:
        meta["targeting"] = targeting
    with open(Path(out_dir) / META_FILE, "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    return meta


NPZ_ALIGN = 64  # bytes: every member's array data starts at a multiple of this in the file
_ZIP64_EXTRA = 20  # bytes zipfile adds to a local header with force_zip64 (id, size, two sizes)
_PAD_EXTRA_ID = 0xD935  # the extra field that pads a local header (the id zipalign uses)


def _write_npz(path: Path, arrays: dict) -> None:
    """An uncompressed .npz that `np.load` reads, with fixed zip timestamps (np.savez stamps the
    current time), so the same arrays always give the same bytes: same seed, same files. Each
    member's local header is padded (an extra field) so that its .npy starts at a multiple of
    NPZ_ALIGN, and with it the array data (.npy pads its header to 64 bytes): `read_npz_arrays` maps
    the arrays from the file in place. Written beside `path`, then renamed over it: a process that
    has the old file mapped keeps reading the old file, never a truncated one."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as raw, zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            start = raw.tell() + 30 + len(info.filename.encode()) + _ZIP64_EXTRA
            pad = -start % NPZ_ALIGN
            if pad:
                pad += NPZ_ALIGN if pad < 4 else 0  # an extra field is at least its 4-byte head
                info.extra = struct.pack("<HH", _PAD_EXTRA_ID, pad - 4) + bytes(pad - 4)
            with zf.open(info, "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, np.asanyarray(array), allow_pickle=False)
    os.replace(part, path)


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def read_npz_arrays(path, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The arrays `names` of a .npz written by `_write_npz` (or np.savez), as `np.load` gives them, but
    mapped from the file rather than read through zipfile: no copy, no second pass (the file's
    sha256, checked before, covers what zipfile's CRC would). The mapping is copy-on-write: a caller
    may write to an array, the file never changes. A member whose data is not aligned to its dtype
    (a file written before members were aligned) is copied out of the mapping; a compressed one, or
    one of another .npy version, is read by numpy. Raises ValueError for a missing array, an object
    array or a file that is not such a .npz."""
    names = list(names)
    try:
        with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
            members = {info.filename: info for info in zf.infolist()}
            missing = [name for name in names if f"{name}.npy" not in members]
            if missing:
                raise ValueError(f"missing arrays {', '.join(missing)}")
            view = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            return {name: _npz_member(view, fh, zf, members[f"{name}.npy"]) for name in names}
    except zipfile.BadZipFile as exc:
        raise ValueError(f"not a .npz file: {exc}") from None


def _npz_member(view: mmap.mmap, fh, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    fh.seek(info.header_offset)
    local = fh.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"{info.filename}: damaged zip entry")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    fh.seek(start)
    version = np.lib.format.read_magic(fh)
    if info.compress_type != zipfile.ZIP_STORED or version not in _NPY_HEADERS:
        with zf.open(info) as member:
            return np.lib.format.read_array(member, allow_pickle=False)
    shape, fortran, dtype = _NPY_HEADERS[version](fh)
    if dtype.hasobject:
        raise ValueError(f"{info.filename}: object arrays cannot be loaded")
    data = fh.tell()
    count = int(np.prod(shape, dtype=np.int64))
    if data + count * dtype.itemsize > start + info.file_size:
        raise ValueError(f"{info.filename}: holds fewer bytes than its shape {shape} needs")
    if count == 0:
        return np.empty(shape, dtype, order="F" if fortran else "C")
    array = np.frombuffer(view, dtype, count, data)
    if data % dtype.alignment:
        array = array.copy()
    return array.reshape(shape, order="F" if fortran else "C")


def write_targeting(out_dir, compiled: CompiledTargeting) -> dict:
    """DIR/targeting.npz from the compiled targeting of the ads in DIR/ads.parquet (row i is row i;
    call it after ads.parquet is complete). Returns the `targeting` entry of meta.json."""
    out = Path(out_dir)
    arrays = {name: np.ascontiguousarray(getattr(compiled, name)) for name in COMPILED_ARRAYS}
    path = out / TARGETING_FILE
    _write_npz(path, {"format_version": np.int64(TARGETING_FORMAT), **arrays})
    return {"file": TARGETING_FILE, "format_version": TARGETING_FORMAT, "ads": len(compiled),
            "sha256": file_sha256(path), "ads_sha256": file_sha256(out / ADS_FILE)}


# --- save -------------------------------------------------------------------------------------------


def save_dataset(dataset, out_dir, *, source: dict | None = None) -> Path:
    """Write `dataset` into `out_dir` (created if needed): meta.json, ads.parquet, targeting.npz,
    requests.parquet, model.npz. The targeting text of each ad is the object it was parsed from."""
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
    compiled = dataset.compiled
    if len(compiled) != len(ads) or not np.array_equal(compiled.ad_id, [a.ad_id for a in ads]):
        raise StoreError("the dataset's compiled targeting does not hold its ads in order")
    targeting = write_targeting(out, compiled)
    write_requests(out, (request_to_json(r) for r in dataset.requests))
    dataset.model.save(out / MODEL_FILE)
    write_meta(out, seed=dataset.seed, model=dataset.model, precision=dataset.precision,
               n_ads=len(ads), n_requests=len(dataset.requests),
               source=source or dataset.meta.get("source") or {"kind": "saved"}, targeting=targeting)
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
        meta = jsontext.loads(path.read_bytes())
    except (OSError, jsontext.JsonInputError) as exc:
        raise StoreError(f"{path}: {exc}") from None
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise StoreError(f"{path}: has no schema_version")
    if meta["schema_version"] != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: schema_version {meta['schema_version']!r}, but this andromeda-nb reads version "
            f"{SCHEMA_VERSION}; regenerate or re-import the corpus")
    for key in ("seed", "precision", "sizes", "counts"):
        if key not in meta:
            raise StoreError(f"{path}: missing {key!r}")
    _check_meta_values(path, meta)
    if meta["precision"] not in PRECISIONS:
        raise StoreError(f"{path}: precision must be one of {', '.join(PRECISIONS)}, got {meta['precision']!r}")
    for name in (ADS_FILE, REQUESTS_FILE, MODEL_FILE):
        if not (root / name).is_file():
            raise StoreError(f"{root / name}: missing")
    entry = meta.get("targeting")
    if entry is not None:
        if not isinstance(entry, dict) or entry.get("file") != TARGETING_FILE:
            raise StoreError(f"{path}: 'targeting' must name {TARGETING_FILE}, got {entry!r}")
        if not (root / TARGETING_FILE).is_file():
            raise StoreError(f"{root / TARGETING_FILE}: missing (meta.json lists it); run "
                             f"`andromeda reindex --data {root}` to rebuild it from ads.parquet")
    return meta


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_meta_values(path: Path, meta: dict) -> None:
    """The types and ranges of meta.json's entries (an edited file says which entry is wrong)."""
    if not _is_int(meta["seed"]):
        raise StoreError(f"{path}: seed: expected an integer, got {meta['seed']!r}")
    for key, lo in (("sizes", 1), ("counts", 0)):
        entry = meta[key]
        if not isinstance(entry, dict):
            raise StoreError(f"{path}: {key}: expected an object, got {entry!r}")
        for name, value in entry.items():
            if not _is_int(value) or value < lo:
                raise StoreError(f"{path}: {key}.{name}: expected an integer >= {lo}, got {value!r}")
    for name in ("ads", "requests"):
        if name not in meta["counts"]:
            raise StoreError(f"{path}: counts.{name}: missing")
    log_seq = meta.get("log_seq", 0)
    if not _is_int(log_seq) or log_seq < 0:
        raise StoreError(f"{path}: log_seq: expected an integer >= 0, got {log_seq!r}")


def _check_sizes(path: Path, meta: dict, model: MoeModel) -> None:
    """meta.json's sizes are the model's (a mismatch means one of the two files was replaced)."""
    have = {"D": model.D, "E": model.E, "k": model.top_k, "F": model.F, "S": model.S}
    for name, value in meta["sizes"].items():
        if name in have and value != have[name]:
            raise StoreError(f"{path}: sizes.{name} is {value}, but {MODEL_FILE} has {name} = {have[name]}")


def _check_parquet_schema(path: Path, schema: pa.Schema) -> int:
    """Check the column types from the file's footer; returns its number of rows."""
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # truncated or not Parquet at all
        raise StoreError(f"{path}: not a readable Parquet file ({exc})") from None
    got_schema = pf.schema_arrow
    for f in schema:
        if f.name not in got_schema.names:
            raise StoreError(f"{path}: missing column {f.name!r}")
        got = got_schema.field(f.name).type
        if got != f.type:
            raise StoreError(f"{path}: column {f.name!r} has type {got}, expected {f.type}")
    return pf.metadata.num_rows


def _read_parquet(path: Path, schema: pa.Schema, columns: list[str] | None = None) -> pa.Table:
    _check_parquet_schema(path, schema)
    try:
        return pq.read_table(path, columns=columns)
    except Exception as exc:
        raise StoreError(f"{path}: not a readable Parquet file ({exc})") from None


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


_AD_COLUMNS = ("ad_id", "status", "start_time", "end_time", "format", "targeting")


class ParquetAds:
    """Parses the ads of a corpus directory's ads.parquet (the `Dataset.ads_loader` of a loaded
    corpus; picklable). Every row goes through `targeting.parse_ad`, as at import: a row that fails
    raises StoreError naming the row."""

    def __init__(self, root, seed: int, dim: int, formats: int, progress: Progress | None = None, *,
                 ads_sha256: str | None = None, ad_ids: np.ndarray | None = None):
        self.root, self.seed, self.dim, self.formats = Path(root), seed, dim, formats
        self.progress = progress
        self.ads_sha256 = ads_sha256  # when given: ads.parquet must still be the file that was loaded
        self.ad_ids = ad_ids  # ... and hold these ids in this order

    def __getstate__(self) -> dict:
        return {**self.__dict__, "progress": None}

    def __call__(self) -> list[Ad]:
        ads: list[Ad] = []
        seen: set[int] = set()
        for chunk in self.chunks():
            ads.extend(chunk)
            seen.update(a.ad_id for a in chunk)
        if len(seen) != len(ads):
            raise StoreError(f"{self.root / ADS_FILE}: duplicate ad ids")
        return ads

    def n_groups(self) -> int:
        """Row groups of ads.parquet: the units `group` parses, for work split across processes."""
        return pq.ParquetFile(self.root / ADS_FILE).num_row_groups

    def group(self, index: int) -> list[Ad]:
        """The ads of row group `index`, parsed (ids checked against the loaded corpus)."""
        from .targeting import parse_ad

        path = self.root / ADS_FILE
        if self.ads_sha256 is not None and file_sha256(path) != self.ads_sha256:
            raise StoreError(f"{path}: has changed since the corpus was loaded; load it again")
        pf = pq.ParquetFile(path)
        lo = sum(pf.metadata.row_group(i).num_rows for i in range(index))
        table = pf.read_row_group(index, columns=list(_AD_COLUMNS))
        cols = {name: table.column(name).to_pylist() for name in _AD_COLUMNS}
        ads: list[Ad] = []
        with paused_gc():
            for i in range(len(cols["ad_id"])):
                obj = {name: cols[name][i] for name in _AD_COLUMNS[:5]}
                try:
                    obj["targeting"] = jsontext.loads(cols["targeting"][i])
                    ads.append(parse_ad(obj, seed=self.seed, dim=self.dim, formats=self.formats,
                                        derive_embedding=False, copy_targeting=False))
                except (ValueError, TargetingError) as exc:
                    raise StoreError(f"{path}: row {lo + i}: {exc}") from None
        if self.ad_ids is not None and not np.array_equal(self.ad_ids[lo : lo + len(ads)], [a.ad_id for a in ads]):
            raise StoreError(f"{path}: its ads are not the ones loaded from it before")
        return ads

    def chunks(self, rows: int = 1 << 16) -> Iterator[list[Ad]]:
        """The ads parsed `rows` at a time, in file order (a caller that streams over them holds one
        chunk of parsed ads at a time)."""
        from .targeting import parse_ad

        path = self.root / ADS_FILE
        if self.ads_sha256 is not None and file_sha256(path) != self.ads_sha256:
            raise StoreError(f"{path}: has changed since the corpus was loaded; load it again")
        _check_parquet_schema(path, ads_schema_without_embedding())
        loads = jsontext.loads
        lo = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows, columns=list(_AD_COLUMNS)):
            cols = {name: batch.column(name).to_pylist() for name in _AD_COLUMNS}
            ads: list[Ad] = []
            with paused_gc():
                for i in range(len(cols["ad_id"])):
                    obj = {name: cols[name][i] for name in _AD_COLUMNS[:5]}
                    try:
                        obj["targeting"] = loads(cols["targeting"][i])
                        # the embedding lives in `Dataset.embeddings` (row i); the Ad itself carries none
                        ads.append(parse_ad(obj, seed=self.seed, dim=self.dim, formats=self.formats,
                                            derive_embedding=False, copy_targeting=False))
                    except (ValueError, TargetingError) as exc:
                        raise StoreError(f"{path}: row {lo + i}: {exc}") from None
            if self.ad_ids is not None and not np.array_equal(self.ad_ids[lo : lo + len(ads)],
                                                              [a.ad_id for a in ads]):
                raise StoreError(f"{path}: its ads are not the ones loaded from it before")
            lo += len(ads)
            if self.progress is not None:
                self.progress(len(ads))
            yield ads
        if self.ad_ids is not None and lo != len(self.ad_ids):
            raise StoreError(f"{path}: its ads are not the ones loaded from it before")


def ads_schema_without_embedding() -> pa.Schema:
    return pa.schema([f for f in ads_schema("fp32", 1) if f.name in _AD_COLUMNS])


def read_targeting(root, meta: dict, n_ads: int, formats: int | None = None) -> CompiledTargeting:
    """DIR/targeting.npz, after checking that it is the file meta.json recorded and that it was
    compiled from the ads.parquet beside it (sha256 of both files), its arrays' shapes, and, with
    the model's number of `formats`, every value's range (`compiled.check_values`): a file edited
    with its hashes recomputed is still refused, naming the row."""
    root = Path(root)
    entry = meta["targeting"]
    path = root / TARGETING_FILE
    fix = (f"re-run `andromeda generate` / `andromeda import`, or `andromeda reindex --data {root}` to "
           f"parse and validate ads.parquet again and rebuild {TARGETING_FILE}")
    if entry.get("format_version") != TARGETING_FORMAT:
        raise StoreError(f"{path}: format_version {entry.get('format_version')!r}, this andromeda-nb reads "
                         f"{TARGETING_FORMAT}; {fix}")
    with ThreadPoolExecutor(2) as pool:  # hashlib hashes without the GIL: both files at once
        ads_sha256, sha256 = pool.map(file_sha256, (root / ADS_FILE, path))
    if ads_sha256 != entry.get("ads_sha256"):
        raise StoreError(f"{path}: stale: {ADS_FILE} has changed since {TARGETING_FILE} was compiled from it "
                         f"(its sha256 differs from the one meta.json recorded); {fix}")
    if sha256 != entry.get("sha256"):
        raise StoreError(f"{path}: not the file meta.json recorded (sha256 differs): replaced or damaged; {fix}")
    try:
        ct = CompiledTargeting(**read_npz_arrays(path, COMPILED_ARRAYS))
        check_compiled(ct)
        if formats is not None:
            check_values(ct, formats)
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: {exc}; {fix}") from None
    if len(ct) != n_ads:
        raise StoreError(f"{path}: holds {len(ct)} ads, {ADS_FILE} {n_ads}; {fix}")
    return ct


def _read_requests(root: Path, seed: int, model: MoeModel, progress: Progress | None = None) -> list[Request]:
    from .targeting import parse_request

    req_table = _read_parquet(root / REQUESTS_FILE, REQUESTS_SCHEMA)
    requests: list[Request] = []
    rids, texts = req_table.column("request_id").to_pylist(), req_table.column("request").to_pylist()
    for i in _progress_chunks(range(len(rids)), progress):
        try:
            requests.append(parse_request(jsontext.loads(texts[i]), seed=seed, experts=model.E, width=model.S,
                                          request_id=rids[i]))
        except (ValueError, TargetingError) as exc:
            raise StoreError(f"{root / REQUESTS_FILE}: row {i}: {exc}") from None
    return requests


def _meta_and_model(root: Path) -> tuple[dict, MoeModel]:
    meta = read_meta(root)
    try:
        model = MoeModel.load(root / MODEL_FILE)
    except ModelError as exc:
        raise StoreError(str(exc)) from None
    return meta, model


def load_head(data_dir) -> tuple[dict, MoeModel]:
    """A corpus directory's meta.json and model, read and checked, and none of its ads or requests:
    what checking requests for it takes."""
    return _meta_and_model(Path(data_dir))


def request_settings(data_dir) -> dict:
    """What checking this corpus's requests takes (`flight.decode_request_batch`'s seed, experts and
    width), from its meta.json."""
    meta = read_meta(data_dir)
    return {"seed": int(meta["seed"]), "experts": int(meta["sizes"]["E"]), "width": int(meta["sizes"]["S"])}


def load_requests(data_dir) -> list[Request]:
    """Only the requests of a corpus directory, parsed and validated as `load_dataset` does, without
    reading its ads (a client that sends the corpus's requests needs nothing else)."""
    root = Path(data_dir)
    meta, model = _meta_and_model(root)
    _check_parquet_schema(root / REQUESTS_FILE, REQUESTS_SCHEMA)
    return _read_requests(root, int(meta["seed"]), model)


def load_dataset(data_dir, progress: Progress | None = None, *, say: Say | None = None):
    """Read a corpus directory into a `Dataset` without parsing any ad: the compiled targeting comes
    from targeting.npz (checked to belong to ads.parquet), ids and formats from its columns, the
    embeddings from ads.parquet (`dataset.embeddings`, row i is ad i). `dataset.ads` parses
    ads.parquet on first access (the `Ad` objects carry no embedding). Requests are parsed and
    validated here. A directory without targeting.npz (written before it existed) is read the slow
    way: every ad parsed and compiled now. `progress(n)` is called as ads and requests are done;
    `say` (`andromeda_nb.progress`) is told each step as it ends, with its seconds."""
    from .dataset import Dataset

    root = Path(data_dir)
    phases = Phases(say)
    meta, model = _meta_and_model(root)
    _check_sizes(root / META_FILE, meta, model)
    precision, seed = meta["precision"], int(meta["seed"])
    schema = ads_schema(precision, model.D)
    n_rows = {"ads": _check_parquet_schema(root / ADS_FILE, schema),
              "requests": _check_parquet_schema(root / REQUESTS_FILE, REQUESTS_SCHEMA)}
    for name, got in n_rows.items():
        want = meta["counts"].get(name)
        if want != got:
            raise StoreError(f"{root / META_FILE}: says {want} {name}, the Parquet file has {got}")
    phases.say(f"loading {n_rows['ads']:,} ads from {root}")
    phases.done("meta.json and model.npz read")
    loader = ParquetAds(root, seed, model.D, model.F, progress)
    compiled, ads = None, None
    if "targeting" in meta:
        compiled = read_targeting(root, meta, n_rows["ads"], model.F)
        phases.done(f"{TARGETING_FILE} read and checked")
        loader.ads_sha256, loader.ad_ids = meta["targeting"]["ads_sha256"], compiled.ad_id
        ads_table = _read_parquet(root / ADS_FILE, schema, ["ad_id", "format", "embedding", "scale"])
        for name in ("ad_id", "format"):
            if not np.array_equal(ads_table.column(name).to_numpy(), getattr(compiled, name)):
                raise StoreError(f"{root / TARGETING_FILE}: column {name!r} differs from {ADS_FILE}'s")
        if has_duplicates(compiled.ad_id):
            raise StoreError(f"{root / ADS_FILE}: duplicate ad ids")
        if progress is not None:
            progress(len(compiled))
    else:  # written before targeting.npz existed: parse every ad now
        ads_table = _read_parquet(root / ADS_FILE, schema, ["embedding", "scale"])
        ads = loader()
    embeddings = read_embeddings(ads_table, precision, model.D)
    del ads_table
    phases.done(f"{ADS_FILE}: ids, formats and embeddings read")
    if not np.all(np.isfinite(embeddings.values)):
        row = int(np.flatnonzero(~np.all(np.isfinite(embeddings.values), axis=1))[0])
        raise StoreError(f"{root / ADS_FILE}: row {row}: embedding has a NaN or infinite value")
    bad_scale = ~(np.isfinite(embeddings.scale) & (embeddings.scale >= 0))
    if np.any(bad_scale):
        row = int(np.flatnonzero(bad_scale)[0])
        raise StoreError(f"{root / ADS_FILE}: row {row}: scale {float(embeddings.scale[row])!r} is not a finite "
                         "number >= 0")
    phases.done("embeddings checked")
    requests = _read_requests(root, seed, model, progress)
    phases.done(f"{len(requests):,} requests read")
    loader.progress = None
    return Dataset(ads=ads, embeddings=embeddings, requests=requests, model=model, seed=seed,
                   precision=precision, meta=meta, compiled=compiled, ads_loader=loader, source_dir=root)


def reindex(data_dir, progress: Progress | None = None) -> dict:
    """Parse and validate every ad of DIR/ads.parquet again (as `import` does), compile them and
    write DIR/targeting.npz, recording it in meta.json. For a corpus written before targeting.npz
    existed, or one whose ads.parquet was edited on purpose. Returns meta.json's new entry."""
    from .compiled import compile_ads

    root = Path(data_dir)
    meta = read_meta(root)
    meta.pop("targeting", None)
    try:
        model = MoeModel.load(root / MODEL_FILE)
    except ModelError as exc:
        raise StoreError(str(exc)) from None
    n_ads = _check_parquet_schema(root / ADS_FILE, ads_schema(meta["precision"], model.D))
    if meta["counts"].get("ads") != n_ads:
        raise StoreError(f"{root / META_FILE}: says {meta['counts'].get('ads')} ads, the Parquet file has {n_ads}")
    ads = ParquetAds(root, int(meta["seed"]), model.D, model.F, progress)()
    with paused_gc():
        compiled = compile_ads(ads)
    del ads
    meta["targeting"] = write_targeting(root, compiled)
    with open(root / META_FILE, "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    return meta["targeting"]


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
            if not raw.strip():
                continue
            try:  # `jsontext`: a byte-order mark skipped; bad UTF-8, deep nesting, repeated keys named
                yield line_no, jsontext.loads(raw), None
            except jsontext.JsonInputError as exc:
                yield line_no, None, f"line {line_no}: {exc}"


def _id_of(obj, key: str):
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class ImportFailed(StoreError):
    """An import that wrote nothing: no valid ad, requests given but none valid, or `strict` with a
    rejection. `summary` holds the counts and the first rejections, for the message."""

    def __init__(self, message: str, summary: ImportSummary):
        super().__init__(message)
        self.summary = summary


def refuse_existing_corpus(out_dir, force: bool) -> None:
    """Raise `StoreError` when `out_dir` already holds a corpus (its meta.json) and `force` is off:
    `generate` and `import` replace a corpus only when asked to."""
    path = Path(out_dir) / META_FILE
    if path.exists() and not force:
        raise StoreError(f"{out_dir} already holds a corpus ({META_FILE}); give --force to replace it")


def check_output_dir(out_dir) -> None:
    """Raise `StoreError` when `out_dir` cannot be a folder to write into, saying why in a person's
    terms: a file stands where it or a folder above it should be, or a folder cannot be created or
    written there (permissions, a read-only or virtual file system such as /proc). The check is made
    by doing it: the missing folders are created and a file written, then all removed again."""
    out = Path(out_dir)
    existing, missing = out.absolute(), []
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        what = "it" if existing == out.absolute() else str(existing)
        raise StoreError(f"{out_dir}: cannot be a folder: {what} is a file")
    created: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except OSError as exc:
                raise StoreError(f"{out_dir}: cannot create the folder {folder} ({exc.strerror})") from None
            created.append(folder)
        import tempfile

        try:
            fd, probe = tempfile.mkstemp(dir=out, prefix=".write-check-")
        except OSError as exc:
            raise StoreError(f"{out_dir}: cannot write into it ({exc.strerror})") from None
        os.close(fd)
        os.unlink(probe)
    finally:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _looks_like(path, key: str, probe: int = 20) -> bool:
    """The first decodable lines of a JSON Lines file are objects with `key` (an ads file given as
    requests has `ad_id`, a requests file given as ads `request_id`)."""
    seen = hits = 0
    for _, obj, _ in _json_lines(path):
        if obj is None:
            continue
        seen += 1
        hits += isinstance(obj, dict) and key in obj
        if seen >= probe:
            break
    return seen > 0 and hits == seen


def import_problem(summary: ImportSummary, ads_path, requests_path, strict: bool) -> str | None:
    """Why an import must write nothing, or None: no valid ad (an ads file with no lines included),
    a requests file with lines none of which is valid, or `strict` with any rejection."""
    swapped = ""
    if _looks_like(ads_path, "request_id") or _looks_like(requests_path, "ad_id"):
        swapped = "; its lines look like the other kind: are --ads-file and --requests-file swapped?"
    if summary.ads == 0:
        what = f"{summary.rejected_ads} line(s) rejected" if summary.rejected_ads else "it holds no ad"
        return f"no valid ad in {ads_path} ({what}){swapped}"
    if summary.requests == 0 and summary.rejected_requests:
        return f"no valid request in {requests_path} ({summary.rejected_requests} line(s) rejected){swapped}"
    if strict and (summary.rejected_ads or summary.rejected_requests):
        return (f"--strict: {summary.rejected_ads + summary.rejected_requests} line(s) were rejected; nothing was "
                "written")
    return None


def import_jsonl(ads_path, requests_path, out_dir, model_path=None, seed: int = 0, precision: str = "fp32",
                 strict: bool = False, progress: Progress | None = None, dim: int | None = None,
                 force: bool = False) -> ImportSummary:
    """Load the JSON Lines forms of DESIGN section 2 into a corpus directory.

    Every valid ad loads; every rejected ad is written to OUT/rejected.jsonl as
    {"ad_id": .., "error": ".."} (the error names the offending field's JSON path; a line that is not
    JSON names its line number; a repeated ad_id is rejected after its first appearance). Rejected
    requests go to OUT/rejected_requests.jsonl as {"request_id": .., "error": ".."}. The weights come
    from `model_path` or are made from `seed` (`MoeModel.init`, D = `dim` or 64).

    Nothing is written, and `ImportFailed` says why (`import_problem`), when no ad is valid, when the
    requests file has lines and none is valid, or with `strict` when any line is rejected. An OUT
    that already holds a corpus is replaced only with `force` (`refuse_existing_corpus`).
    """
    from .dataset import Dataset
    from .targeting import parse_ad, parse_request

    _check_precision(precision)
    refuse_existing_corpus(out_dir, force)
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
    summary = ImportSummary(out_dir=str(out), rejected_path=str(out / REJECTED_FILE))
    ads: list[Ad] = []
    ad_rejections: list[dict] = []
    first_line: dict[int, int] = {}
    with paused_gc():
        def reject(ad_id, error: str) -> None:
            summary.rejected_ads += 1
            record = {"ad_id": ad_id, "error": error}
            if len(summary.rejections) < 20:
                summary.rejections.append(record)
            ad_rejections.append(record)

        for line_no, obj, error in _json_lines(ads_path):
            if progress is not None:
                progress(1)
            if error is not None:
                reject(None, error)
                continue
            try:
                # `obj` is freshly decoded and not kept: the Ad may hold its targeting object as is
                ad = parse_ad(obj, seed=seed, dim=model.D, formats=model.F, line=line_no, derive_embedding=False,
                              copy_targeting=False)
            except TargetingError as exc:
                reject(exc.ad_id if exc.ad_id is not None else _id_of(obj, "ad_id"), str(exc))
                continue
            if ad.ad_id in first_line:
                reject(ad.ad_id, f"line {line_no}: ad {ad.ad_id}: ad_id: repeats the ad of line {first_line[ad.ad_id]}")
                continue
            first_line[ad.ad_id] = line_no
            ads.append(ad)
    requests: list[Request] = []
    request_rejections: list[dict] = []
    seen_requests: set[int] = set()
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
            record = {"request_id": rid, "error": error}
            if len(summary.rejections) < 20:
                summary.rejections.append(record)
            request_rejections.append(record)
    summary.ads, summary.requests = len(ads), len(requests)
    problem = import_problem(summary, ads_path, requests_path, strict)
    if problem:
        raise ImportFailed(problem, summary)
    out.mkdir(parents=True, exist_ok=True)
    for name, records in ((REJECTED_FILE, ad_rejections), (REJECTED_REQUESTS_FILE, request_rejections)):
        with open(out / name, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
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
    "ADS_FILE", "META_FILE", "MODEL_FILE", "REJECTED_FILE", "REQUESTS_FILE", "TARGETING_FILE", "AdsWriter",
    "ImportFailed", "ImportSummary", "ParquetAds", "StoreError", "ads_parquet_options", "ads_record_batch", "ads_schema", "check_output_dir",
    "export_jsonl",
    "file_sha256", "import_jsonl", "import_problem", "load_dataset", "load_head", "load_requests", "paused_gc", "read_meta", "read_npz_arrays", "request_settings",
    "read_targeting",
    "refuse_existing_corpus", "reindex", "save_dataset", "write_meta", "write_requests", "write_targeting",
]
