"""Compaction: fold a server's update log into a new snapshot of its corpus directory, atomically.

The corpus directory is the snapshot; the log (`serving.wal`) holds the updates since. A
compaction writes the state after the last logged update as new ads.parquet, targeting.npz and
meta.json (meta.json's `log_seq` says which update the snapshot ends with, `lineage` keeps the
corpus's name) into `DIR/.compact-SEQ/`, syncs each file, then writes and syncs a `COMPLETE`
marker: from that moment the compaction is decided. It then renames the three files over the old
ones (meta.json last), syncs the directory and removes the temporary one; the log is reset to
start at SEQ afterwards (`WriteAheadLog.reset`).

A crash anywhere leaves a directory `recover` puts right before anything reads it: without the
marker the half-written snapshot is discarded (the old snapshot and the whole log are intact);
with it the remaining renames are done, once the directory is checked to hold the snapshot the
marker decided (`_check_decided`: the marker names the directory's number, meta.json reads and ends
at that number, and the files to move are those meta.json records, by sha256); a marked directory
that fails the check is refused, naming it, and nothing of it is moved. A compaction that cannot
write (a read-only corpus directory, a full disk) fails with `CompactionError` saying so and
leaves the snapshot and the log as they were. A log that still holds records the new snapshot folded in
is harmless: replay skips every record up to meta.json's `log_seq`.

Unchanged ads keep their stored bytes (rows are taken from the old ads.parquet and targeting.npz
as they are, nothing re-parsed); upserted ads are compiled and stored at the corpus's precision;
status changes rewrite one value; retired ads are left out. Kept ads come first in their old
order, then every ad an update created or replaced, in the order of its last upsert.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from andromeda_nb.compiled import compile_ads, concat_compiled, take_compiled
from andromeda_nb.constants import STATUS_CODE
from andromeda_nb.model import ad_embedding_of, quantize
from andromeda_nb.types import Retire, SetStatus, TargetingError, Upsert

from .wal import (
    LOG_FILE,
    LogError,
    CorpusLock,
    LogLock,
    LogRecord,
    WriteAheadLog,
    corpus_lineage,
    fsync_dir,
    snapshot_seq,
)

COMPACT_PREFIX = ".compact-"
COMPLETE = "COMPLETE"


class CompactionError(LogError):
    """A compaction that could not be done, or a decided one that cannot be finished; the message
    says what is left on disk and what to do."""

    label = "compaction"


def _moved_files() -> tuple[str, ...]:
    from andromeda_nb.store import ADS_FILE, META_FILE, TARGETING_FILE

    return (ADS_FILE, TARGETING_FILE, META_FILE)  # meta.json last: it names the other two by hash


def recover(data_dir) -> list[str]:
    """Finish or discard any compaction of `data_dir` a crash interrupted; returns what was done
    ("finished SEQ" / "discarded SEQ") for each."""
    root = Path(data_dir)
    done = []
    for tmp in sorted(root.glob(COMPACT_PREFIX + "*")):
        if not tmp.is_dir():
            continue
        if (tmp / COMPLETE).is_file():
            _check_decided(root, tmp)
            for name in _moved_files():
                if (tmp / name).exists():
                    os.replace(tmp / name, root / name)
            fsync_dir(root)
            done.append(f"finished {tmp.name[len(COMPACT_PREFIX):]}")
        else:
            done.append(f"discarded {tmp.name[len(COMPACT_PREFIX):]}")
        shutil.rmtree(tmp)
    return done


def _check_decided(root: Path, tmp: Path) -> None:
    """A directory marked COMPLETE holds what a compaction wrote and decided, or is refused
    (`CompactionError`) before any of it is moved: the marker holds the directory's number; if
    meta.json is still there (it moves last), it reads, ends at that number, and the data files,
    in the directory or already moved, are the ones it records (sha256); if it was moved, nothing
    else is left and the corpus's meta.json ends at that number."""
    from andromeda_nb import jsontext
    from andromeda_nb.quoting import clip
    from andromeda_nb.store import ADS_FILE, META_FILE, TARGETING_FILE, file_sha256

    seq = tmp.name[len(COMPACT_PREFIX):]
    moved_some = [name for name in _moved_files() if not (tmp / name).exists()]

    def refuse(reason: str):
        where = (f"some of its files were already moved into {root}: restore the corpus directory from a copy"
                 if moved_some else "nothing of it was moved: remove it to start from the current snapshot "
                                    "and its log")
        raise CompactionError(f"{tmp}: marked {COMPLETE} but it does not hold the compacted snapshot it decided "
                              f"({reason}); {where}")

    try:
        marker = (tmp / COMPLETE).read_bytes()
        if marker.strip() != seq.encode() or not seq.isdigit():
            refuse(f"the marker says {clip(repr(marker))}, the directory's name {seq!r}")
        meta_path = tmp / META_FILE if (tmp / META_FILE).exists() else root / META_FILE
        try:
            meta = jsontext.loads(meta_path.read_bytes())
        except jsontext.JsonInputError as exc:
            refuse(f"{meta_path}: {exc}")
        if not isinstance(meta, dict) or meta.get("log_seq") != int(seq):
            got = meta.get("log_seq") if isinstance(meta, dict) else None
            refuse(f"{meta_path} ends at update {clip(repr(got))}, not {seq}")
        if meta_path.parent == root:  # meta.json moved last: everything was, and only the removal is left
            left = [p.name for p in tmp.iterdir() if p.name != COMPLETE]
            if left:
                refuse(f"meta.json was moved but {', '.join(sorted(left)[:5])} {'is' if len(left) == 1 else 'are'} left")
            return
        entry = meta.get("targeting")
        if not isinstance(entry, dict):
            refuse(f"{meta_path} records no targeting files")
        for name, key in ((ADS_FILE, "ads_sha256"), (TARGETING_FILE, "sha256")):
            path = tmp / name if (tmp / name).exists() else root / name
            if not path.is_file() or file_sha256(path) != entry.get(key):
                refuse(f"{path} is not the file its meta.json records (sha256)")
    except OSError as exc:
        raise CompactionError(f"{tmp}: marked {COMPLETE} but cannot be read ({exc.strerror}); nothing of it "
                              "was moved") from None


def _sync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fold(dataset, records: list[LogRecord]):
    """The state after `records`: (rows of the snapshot kept, {row: new status}, ads created or
    replaced in order)."""
    from andromeda_nb.updates import parse_update

    model = dataset.model
    state: dict[int, tuple] = {int(a): ("old", i) for i, a in enumerate(dataset.compiled.ad_id.tolist())}
    statuses: dict[int, str] = {}
    for record in records:
        try:
            update = parse_update(record.update, seed=dataset.seed, dim=model.D, formats=model.F)
        except TargetingError as exc:
            raise LogError(f"record {record.seq} does not parse ({exc})") from None
        if isinstance(update, Upsert):
            state.pop(update.ad.ad_id, None)
            state[update.ad.ad_id] = ("new", update.ad)
            continue
        entry = state.get(update.ad_id)
        if entry is None:
            raise LogError(f"record {record.seq}: ad {update.ad_id} is not live at that point; the log does not "
                           "belong to this snapshot")
        if isinstance(update, Retire):
            del state[update.ad_id]
        elif isinstance(update, SetStatus):
            if entry[0] == "old":
                statuses[entry[1]] = update.status
            else:
                state[update.ad_id] = ("new", dataclasses.replace(entry[1], status=update.status))
    kept = np.asarray(sorted(v[1] for v in state.values() if v[0] == "old"), np.int64)
    created = [v[1] for v in state.values() if v[0] == "new"]
    alive = set(kept.tolist())  # a status change of a row later retired or replaced does not count
    return kept, {row: s for row, s in statuses.items() if row in alive}, created


def _new_ads_table(dataset, created, schema: pa.Schema) -> pa.Table:
    from andromeda_nb.store import _targeting_object, ads_record_batch

    model = dataset.model
    emb = np.stack([ad_embedding_of(a, dataset.seed, model.D) for a in created]) if created else \
        np.empty((0, model.D), np.float32)
    table = quantize(emb, dataset.precision)
    encode = json.JSONEncoder(separators=(",", ":")).encode
    batch = ads_record_batch([a.ad_id for a in created], [a.status for a in created],
                             [a.start_time for a in created], [a.end_time for a in created],
                             [a.format for a in created], [encode(_targeting_object(a)) for a in created], table)
    return pa.Table.from_batches([batch]).cast(schema)


def compact(data_dir, records: Iterable[LogRecord], *, lineage: str | None = None) -> dict:
    """Fold `records` (the log's, in order) into a new snapshot of `data_dir`, atomically (see the
    module docstring). Records the snapshot already holds are skipped. Returns
    `{"compacted": n, "seq": last folded, "ads": ads in the new snapshot}`. The caller holds the
    log (no update may be logged meanwhile) and resets it to the returned seq afterwards."""
    from andromeda_nb.store import ADS_FILE, load_dataset

    root = Path(data_dir)
    recover(root)
    dataset = load_dataset(root)
    lineage = lineage or corpus_lineage(dataset)
    base = snapshot_seq(dataset)
    records = [r for r in records if r.seq > base]
    for i, r in enumerate(records):
        if r.seq != base + 1 + i:
            raise LogError(f"record {r.seq} follows {base + i}: the records to fold have a gap")
    if not records:
        return {"compacted": 0, "seq": base, "ads": dataset.n_ads}
    last = records[-1].seq
    kept, statuses, created = _fold(dataset, records)
    old = pq.read_table(root / ADS_FILE)
    schema = old.schema
    kept_table = old.take(pa.array(kept))
    if statuses:
        column = kept_table.column("status").to_pylist()
        position = {int(row): i for i, row in enumerate(kept)}
        for row, status in statuses.items():
            column[position[row]] = status
        kept_table = kept_table.set_column(schema.get_field_index("status"), "status", pa.array(column, pa.string()))
    new_table = pa.concat_tables([kept_table, _new_ads_table(dataset, created, schema)]).combine_chunks()
    compiled_kept = take_compiled(dataset.compiled, kept)
    if statuses:
        position = {int(row): i for i, row in enumerate(kept)}
        for row, status in statuses.items():
            compiled_kept.status[position[row]] = STATUS_CODE[status]
    compiled = concat_compiled([compiled_kept, compile_ads(created)])
    del old, kept_table

    tmp = root / f"{COMPACT_PREFIX}{last}"
    try:
        _write_decided(root, tmp, dataset, new_table, compiled, base, last, lineage)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # undecided: nothing of it counts
        raise CompactionError(f"{root}: cannot write the compacted snapshot ({exc.strerror or exc}"
                              f"{': ' + str(exc.filename) if exc.filename else ''}); nothing changed: the snapshot "
                              "and the log are as they were") from None
    try:
        recover(root)  # the swap itself, the same code a restart runs
    except OSError as exc:
        raise CompactionError(f"{root}: the compaction to update {last} is decided but its files could not be moved "
                              f"into place ({exc.strerror}); the next start finishes it (the log keeps every "
                              "update meanwhile)") from None
    return {"compacted": len(records), "seq": last, "ads": len(compiled)}


def _write_decided(root: Path, tmp: Path, dataset, new_table, compiled, base: int, last: int, lineage: str) -> None:
    """The new snapshot into `tmp`, each file synced, then the COMPLETE marker that decides it."""
    from andromeda_nb.store import ADS_FILE, META_FILE, ROW_GROUP_ADS, ads_parquet_options, write_targeting

    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    pq.write_table(new_table, tmp / ADS_FILE, row_group_size=ROW_GROUP_ADS, **ads_parquet_options(new_table.schema))
    targeting = write_targeting(tmp, compiled)
    meta = json.loads(json.dumps(dataset.meta))
    source = meta.get("source") or {}
    meta.update({
        "counts": {**meta["counts"], "ads": len(compiled)},
        "targeting": targeting,
        "log_seq": last,
        "lineage": lineage,
        "source": {"kind": "compacted", "from_seq": base, "to_seq": last,
                   "original": source.get("original", source) if source.get("kind") == "compacted" else source},
    })
    with open(tmp / META_FILE, "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    for name in _moved_files():
        _sync_file(tmp / name)
    with open(tmp / COMPLETE, "w") as fh:  # the decision: from here on `recover` finishes the swap
        fh.write(f"{last}\n")
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    fsync_dir(root)


def compact_corpus(data_dir, log_path=None) -> dict:
    """`andromeda compact`: fold the log of a corpus no server is running on (the log's lock is
    taken, so a running server makes this fail with a clear error; use its `compact` action)."""
    from andromeda_nb.store import load_dataset

    root = Path(data_dir)
    path = Path(log_path) if log_path is not None else root / LOG_FILE
    writer = CorpusLock(root).acquire(log=path.resolve())  # a server writing this corpus makes this fail
    try:
        lock = LogLock(path).acquire()
    except BaseException:
        writer.release()
        raise
    try:
        recover(root)
        if not path.exists():
            dataset = load_dataset(root)
            return {"compacted": 0, "seq": snapshot_seq(dataset), "ads": dataset.n_ads, "log": str(path)}
        dataset = load_dataset(root)
        log = WriteAheadLog.open(path, lineage=corpus_lineage(dataset), snapshot_seq=snapshot_seq(dataset), lock=lock)
        try:
            result = compact(root, log.records_after(log.base_seq), lineage=log.lineage)
            log.reset(result["seq"])
        finally:
            log._lock = None  # released below, once
            log.close()
        return {**result, "log": str(path)}
    finally:
        lock.release()
        writer.release()


__all__ = ["COMPACT_PREFIX", "COMPLETE", "CompactionError", "compact", "compact_corpus", "recover"]
