"""What sharding needs without Ray: which shard owns an ad, a shard's slice of a corpus, the exact merge
of the shards' top-K, the per-shard update log, and routing an update stream to the owning shards.

* Ownership: `shard_of(ad_ids, n)` is a stable hash of the ad id (the splitmix64 finalizer on the
  int64 id, modulo n): the same on every machine, in every process, for any Python or numpy, and
  independent of the corpus, so an upsert of a new id and a later retire of it reach the same shard.
* Merge: a shard's answer holds its own ads only, and an ad's score does not depend on which other
  ads share its shard, so the union of the shards' top-K contains the pool's top-K; `merge_topk`
  cuts it by score descending, ties by ad id ascending (`andromeda_nb.reference.reference_topk`):
  the single engine's answer exactly.
* The log: `ShardLog` holds, per shard, the ordered update lines the router has sent it; a replica
  knows how many it has consumed (its *sequence*), so a restarted one is brought back by the lines
  after its sequence. `ShardLog` lives in memory; `DurableShardLog` keeps the same three methods
  (`append`, `since`, `seq`) over one write-ahead log per shard (`serving.wal`), so a front
  started again on the same corpus replays every acknowledged update into its fresh replicas.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from andromeda_nb.dataset import Dataset
from andromeda_nb.compiled import take_compiled
from andromeda_nb.reference import reference_topk
from andromeda_nb.types import Upsert
from andromeda_nb.updates import Rejection, read_updates

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def mix64(ad_ids) -> np.ndarray:
    """uint64 splitmix64 finalizer of each int64 id (wrapping arithmetic)."""
    z = np.asarray(ad_ids, np.int64).astype(np.uint64) + _GOLDEN
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def shard_of(ad_ids, n_shards: int) -> np.ndarray:
    """int64: the shard (0..n_shards-1) that owns each ad id."""
    if n_shards < 1:
        raise ValueError(f"the number of shards must be at least 1, got {n_shards}")
    return (mix64(ad_ids) % np.uint64(n_shards)).astype(np.int64)


def owner(ad_id: int, n_shards: int) -> int:
    return int(shard_of(np.array([ad_id], np.int64), n_shards)[0])


class ShardAds:
    """Picklable loader of a shard's parsed ads (rows of the parent's), for `Dataset.ads` on demand."""

    def __init__(self, parent_loader, rows: np.ndarray):
        self.parent_loader, self.rows = parent_loader, rows

    def __call__(self):
        ads = self.parent_loader()
        return [ads[i] for i in self.rows]


def shard_dataset(dataset: Dataset, shard: int, n_shards: int) -> Dataset:
    """The shard's slice of `dataset`: its ads (rows in corpus order), their embeddings and compiled
    targeting, the model, seed and precision; the first request only (an engine's warm-up)."""
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} is outside 0..{n_shards - 1}")
    rows = np.flatnonzero(shard_of(dataset.ad_ids, n_shards) == shard)
    loader = (ShardAds(dataset._ads_loader, rows) if dataset._ads_loader is not None and not dataset.ads_loaded
              else ShardAds(_Given(dataset.ads), rows))
    return Dataset(embeddings=dataset.embeddings.take(rows), requests=dataset.requests[:1], model=dataset.model,
                   seed=dataset.seed, precision=dataset.precision, meta={**dataset.meta, "shard": [shard, n_shards]},
                   compiled=take_compiled(dataset.compiled, rows), ads_loader=loader)


class _Given:
    def __init__(self, ads):
        self.ads = ads

    def __call__(self):
        return self.ads


def merge_topk(parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top k of the shards' answers (each (ad ids int64, scores float32) of disjoint ads): score
    descending, ties by ad id ascending."""
    ids = np.concatenate([np.asarray(i, np.int64) for i, _ in parts]) if parts else np.empty(0, np.int64)
    scores = np.concatenate([np.asarray(s, np.float32) for _, s in parts]) if parts else np.empty(0, np.float32)
    return reference_topk(ids, scores, k)


# --- updates ----------------------------------------------------------------------------------------


@dataclass
class ShardLog:
    """The ordered update lines each shard has been sent: entry i of shard s is (line number in the
    stream it came from, JSON line). A replica's sequence is the number of entries it has consumed.
    In memory; a durable log implements the same `append`, `since` and `seq`."""

    shards: int
    entries: list[list[tuple[int, str]]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.entries = self.entries or [[] for _ in range(self.shards)]

    def append(self, shard: int, lines: Sequence[tuple[int, str]]) -> int:
        """Add lines at the end of the shard's log; returns the sequence they start at."""
        with self._lock:
            start = len(self.entries[shard])
            self.entries[shard].extend(lines)
            return start

    def since(self, shard: int, seq: int) -> list[tuple[int, str]]:
        """The entries after the first `seq`."""
        with self._lock:
            return list(self.entries[shard][seq:])

    def seq(self, shard: int) -> int:
        """The sequence a replica holding every entry of the shard is at."""
        with self._lock:
            return len(self.entries[shard])

    def describe(self) -> dict:
        return {"path": None, "durable": False, "seq": [len(e) for e in self.entries]}

    def close(self) -> None:
        pass


class DurableShardLog:
    """`ShardLog` on disk: one `serving.wal.WriteAheadLog` per shard in `directory`
    (`shard-S-of-N.log`), each line made durable (one fdatasync per append) before the router sends it
    to a replica, so before any update is acknowledged. A log belongs to one corpus snapshot and one
    shard count (its lineage: another corpus, a compacted snapshot or another N is refused, naming the
    file), and to one front at a time (the WAL's lock)."""

    def __init__(self, directory, dataset: Dataset, shards: int):
        from pathlib import Path

        from serving.wal import WriteAheadLog, corpus_lineage, snapshot_seq

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        lineage = f"{corpus_lineage(dataset)}@{snapshot_seq(dataset)}"
        self.logs = []
        self._lock = threading.Lock()
        try:
            for s in range(shards):
                self.logs.append(WriteAheadLog.open(self.directory / f"shard-{s}-of-{shards}.log",
                                                    lineage=f"{lineage} shard {s} of {shards}", snapshot_seq=0))
        except BaseException:
            self.close()
            raise

    def append(self, shard: int, lines: Sequence[tuple[int, str]]) -> int:
        """Add lines at the end of the shard's log, durably; returns the sequence they start at."""
        with self._lock:
            start = self.logs[shard].last_seq
            self.logs[shard].append([json.loads(line) for _, line in lines])
            return start

    def since(self, shard: int, seq: int) -> list[tuple[int, str]]:
        """The entries after the first `seq`, as (sequence number, JSON line)."""
        with self._lock:
            return [(r.seq, json.dumps(r.update)) for r in self.logs[shard].records_after(seq)]

    def seq(self, shard: int) -> int:
        with self._lock:
            return self.logs[shard].last_seq

    def describe(self) -> dict:
        return {"path": str(self.directory), "durable": True, "seq": [log.last_seq for log in self.logs]}

    def close(self) -> None:
        for log in self.logs:
            log.close()


def route_updates(text_or_lines, n_shards: int, *, seed: int, dim: int, formats: int
                  ) -> tuple[list[list[tuple[int, str]]], list[Rejection]]:
    """Split an update stream by owning shard: per shard the well-formed lines as (line number, line)
    in stream order, and the malformed lines rejected (with their line numbers). Whether a status
    or retire names a live ad is for the owning shard to say: only it holds that ad."""
    lines = text_or_lines.splitlines() if isinstance(text_or_lines, str) else list(text_or_lines)
    updates, malformed = read_updates(lines, seed=seed, dim=dim, formats=formats)
    per_shard: list[list[tuple[int, str]]] = [[] for _ in range(n_shards)]
    if updates:
        ids = np.array([u.ad.ad_id if isinstance(u, Upsert) else u.ad_id for _, u in updates], np.int64)
        for (line_no, _), shard in zip(updates, shard_of(ids, n_shards)):
            raw = lines[line_no - 1]
            per_shard[int(shard)].append((line_no, raw if isinstance(raw, str) else json.dumps(raw)))
    return per_shard, malformed


__all__ = ["DurableShardLog", "ShardAds", "ShardLog", "merge_topk", "mix64", "owner", "route_updates", "shard_dataset", "shard_of"]
