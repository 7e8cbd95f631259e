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
with it the remaining renames are done. A log that still holds records the new snapshot folded in
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
    LogLock,
    LogRecord,
    WriteAheadLog,
    corpus_lineage,
    fsync_dir,
    snapshot_seq,
)

COMPACT_PREFIX = ".compact-"
COMPLETE = "COMPLETE"


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
            for name in _moved_files():
                if (tmp / name).exists():
                    os.replace(tmp / name, root / name)
            fsync_dir(root)
            done.append(f"finished {tmp.name[len(COMPACT_PREFIX):]}")
        else:
            done.append(f"discarded {tmp.name[len(COMPACT_PREFIX):]}")
        shutil.rmtree(tmp)
    return done


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
    from andromeda_nb.store import ADS_FILE, META_FILE, ROW_GROUP_ADS, load_dataset, write_targeting

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
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    pq.write_table(new_table, tmp / ADS_FILE, compression="zstd", row_group_size=ROW_GROUP_ADS)
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
    recover(root)  # the swap itself, the same code a restart runs
    return {"compacted": len(records), "seq": last, "ads": len(compiled)}


def compact_corpus(data_dir, log_path=None) -> dict:
    """`andromeda compact`: fold the log of a corpus no server is running on (the log's lock is
    taken, so a running server makes this fail with a clear error; use its `compact` action)."""
    from andromeda_nb.store import load_dataset

    root = Path(data_dir)
    path = Path(log_path) if log_path is not None else root / LOG_FILE
    lock = LogLock(path).acquire()
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


__all__ = ["COMPACT_PREFIX", "COMPLETE", "compact", "compact_corpus", "recover"]
