"""The write-ahead log of a server that takes updates: every accepted update, numbered, on disk
before it is acknowledged.

File (`DIR/updates.log` beside the corpus by default): JSON Lines. The first line is a header, every
other line one accepted update with its sequence number; each line ends with a CRC-32:

    {"log":"andromeda-nb update log","version":2,"lineage":"3f9c...","base_seq":0,"crc":"0b1c2d3e"}
    {"seq":1,"end":2,"update":{"op":"upsert","ad":{...}},"crc":"8a7b6c5d"}
    {"seq":2,"end":2,"update":{"op":"retire","ad_id":7},"crc":"01234567"}

`end` is the sequence number of the last record of the record's call: a call's records are one
unit (records written before it existed have none, and count as a call each).

The checksum covers the line's bytes with `,"crc":"XXXXXXXX"` taken out (so a line is its record
followed by the checksum, still one JSON object) and, from version 2 on, is **chained**: a record's
CRC-32 starts from the one of the line before (`zlib.crc32(payload, previous)`), the header's from
nothing, so a line is checked against everything before it back to the header: a damaged, swapped,
copied-in or dropped line breaks the chain at that line. Version 1 logs (written before the chain)
are still read, each line against its own checksum, and appended to as version 1 until a compaction
restarts them as version 2. Sequence numbers run on from `base_seq` without a gap. `lineage` names
the corpus the log belongs to (`corpus_lineage`): a log is never replayed onto another corpus.

* **Appending** (`append`): the records of one call are written with one `write` and made durable
  with one `fdatasync` (group commit); the server acknowledges after `append` returns. A failed
  write or sync is cut back off the file and nothing is applied. Each record names the last
  sequence number of its call (`end`), so **a call is committed as a unit**: a log that ends
  before the record its last call names (a crash while that call was written, before its sync, so
  never acknowledged) loses the whole call on opening, never replays part of it.
* **The path** holds a log or nothing: a symbolic link (to anything, or dangling), anything but a
  regular file, an empty file and a file whose first line is not a log header are refused with the
  path named, never replaced or written through. A new log (and a log restarted after a
  compaction) is written aside (`PATH.new`), synced and renamed into place, so a log on disk
  always begins with its whole header.
* **Opening** (`WriteAheadLog.open`): every line is checked. The one thing repaired without a word is
  a write torn by a crash before its call was synced, so never acknowledged: a last line without its
  newline that is a beginning of the next record as it would be written (`_torn`: it opens with
  `{"seq":NEXT,"update":`, holds no zero byte, and stops before its checksum is whole, or is the
  whole record, valid, short of its newline only). It is cut off, and with it the whole records of
  its call before it (`end` names a record the file does not hold). Anything else (a complete line
  that fails its checksum, even the last one; zeros; a last line longer than a record) is damage:
  the log is refused, naming the line and the record, and never shortened by itself;
  `truncate_log` (`andromeda truncate-log`) keeps the intact records before it on purpose, the
  damaged file kept beside it. `replay` gives the records after the snapshot's sequence number, in
  order.
* **Compaction** (`serving.compaction`) folds the records into a new snapshot whose meta.json
  records the last folded sequence number (`log_seq`); `reset` then starts a new, empty log at that
  number (written aside, fsynced, renamed over the old one).
* **One owner**: a server holds an exclusive lock on `PATH.lock` while it has the log open; a second
  server (or an offline `compact`) on the same log is refused.
* **One writer per corpus**: a server that logs updates also holds `DIR/writer.lock` in its corpus
  directory (`CorpusLock`, the holder's pid written in it) for its life, so a second server on the
  same corpus is refused whatever its `--log`, naming the holder; a compaction (the server's action
  or `andromeda compact`) runs only under it. Two logs of one corpus would be two histories, and a
  compaction of one would drop the other's acknowledged updates.

`path=None` keeps the records in memory only (for processes started for one command: `retrieve
--arch remote`): nothing survives the process, and nothing claims to.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from andromeda_nb.quoting import clip, quote

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process lock
    fcntl = None

LOG_FILE = "updates.log"
MAGIC = "andromeda-nb update log"
VERSION = 2  # written: each line's checksum chained to the line before
READ_VERSIONS = (1, 2)  # 1: each line's checksum of itself alone (logs written before the chain)
_CRC_PREFIX = b',"crc":"'
_CRC_SUFFIX_LEN = len(_CRC_PREFIX) + 8 + 2  # ,"crc":"XXXXXXXX"}
WRITE_BYTES = 1 << 20  # a call's records are written about this many bytes at a time
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # never open a log, its lock or its new file through a link


class LogError(ValueError):
    """A log that cannot be used as it is; the message names the file, the line and the remedy."""

    label = "update log"  # how a server's error to its client begins


class UnreadableLine(ValueError):
    """A log line whose checksum holds but whose JSON cannot be decoded (nested too deep for the
    decoder, or not JSON): it was written so, not torn by a crash."""


@dataclass(frozen=True)
class LogRecord:
    seq: int
    update: dict  # the update object of DESIGN section 6, as accepted



def encode_line(obj: dict, chain: int | None = None) -> bytes:
    """One log line: the object's compact JSON with its checksum appended as a last key; `chain`: the
    checksum of the line before (version 2), None for a header or a version 1 line."""
    return _encode(obj, chain)[0]


def _encode(obj: dict, chain: int | None) -> tuple[bytes, int]:
    payload = json.dumps(obj, separators=(",", ":")).encode()
    crc = zlib.crc32(payload) if chain is None else zlib.crc32(payload, chain)
    return payload[:-1] + b'%s%08x"}\n' % (_CRC_PREFIX, crc), crc


def decode_line(line: bytes, chain: int | None = None) -> dict | None:
    """The object of one log line, or None when the line is incomplete or fails its checksum (chained
    from `chain`, the line before's, when given). `UnreadableLine` when the checksum holds but the
    JSON cannot be decoded (a line written so)."""
    decoded = _decode(line, chain)
    return None if decoded is None else decoded[0]


def _decode(line: bytes, chain: int | None) -> tuple[dict, int] | None:
    """(object, its checksum) of one log line, or None (see `decode_line`)."""
    if not line.endswith(b"\n"):
        return None
    body = line[:-1]
    if len(body) < _CRC_SUFFIX_LEN + 2 or body[-_CRC_SUFFIX_LEN:-10] != _CRC_PREFIX or not body.endswith(b'"}'):
        return None
    try:
        crc = int(body[-10:-2], 16)
    except ValueError:
        return None
    payload = body[:-_CRC_SUFFIX_LEN] + b"}"
    if (zlib.crc32(payload) if chain is None else zlib.crc32(payload, chain)) != crc:
        return None
    try:
        obj = json.loads(payload)
    except RecursionError:
        from andromeda_nb.jsontext import nesting_depth

        depth = nesting_depth(payload.decode("utf-8", "replace"))
        raise UnreadableLine(f"nested {depth} levels deep, deeper than the JSON decoder goes") from None
    except ValueError as exc:
        raise UnreadableLine(f"not JSON ({clip(str(exc))})") from None
    if not isinstance(obj, dict):
        raise UnreadableLine(f"a JSON {type(obj).__name__}, not an object")
    return obj, crc


def _torn(tail: bytes, want: int, chain: int | None) -> bool:
    """Whether `tail`, a last line without its newline, is what a crash in the middle of writing
    record `want` leaves: a beginning of that record as it is written (no zero byte; it opens with
    `{"seq":WANT,"update":`, or stops inside that), cut before its checksum is whole, or the whole
    record, valid, short of its newline only. A complete record followed by more bytes, or one whose
    whole checksum fails, is damage."""
    if b"\0" in tail:
        return False
    starts = (b'{"seq":%d,"end":' % want, b'{"seq":%d,"update":' % want)  # with its call's end, or before it
    if not any(tail.startswith(start) or start.startswith(tail) for start in starts):
        return False
    at = tail.rfind(_CRC_PREFIX)
    if at < 0 or len(tail) < at + _CRC_SUFFIX_LEN:
        return True
    if len(tail) > at + _CRC_SUFFIX_LEN:
        return False
    try:
        return _decode(tail + b"\n", chain) is not None
    except UnreadableLine:
        return False


def corpus_lineage(dataset) -> str:
    """The name of a corpus's line of snapshots: kept through compactions (meta.json `lineage`),
    else the sha256 of the ads.parquet its targeting was compiled from, else (a corpus made in
    memory) the fingerprint of its ad ids."""
    meta = getattr(dataset, "meta", None) or {}
    if isinstance(meta.get("lineage"), str):
        return meta["lineage"]
    entry = meta.get("targeting")
    if isinstance(entry, dict) and isinstance(entry.get("ads_sha256"), str):
        return entry["ads_sha256"][:16]
    from andromeda_nb.dataset import fingerprint

    return fingerprint(dataset.ad_ids)


def snapshot_seq(dataset) -> int:
    """The last sequence number folded into the dataset's snapshot (0: none)."""
    meta = getattr(dataset, "meta", None) or {}
    return int(meta.get("log_seq", 0))


def fsync_dir(path) -> None:
    """Make a rename or a new file in directory `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _datasync(fd: int) -> None:
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


class LogLock:
    """An exclusive, non-blocking lock on `PATH.lock` for the life of a server."""

    def __init__(self, log_path):
        self.path = Path(str(log_path) + ".lock")
        self._fd = None

    def acquire(self) -> "LogLock":
        if fcntl is None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError as exc:
            raise LogError(f"{self.path}: cannot create the log's lock file ({exc.strerror}); give --log PATH "
                           "in a writable directory, or --log off to keep updates in memory only") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise LogError(f"{self.path}: another process holds this update log (a server already serves "
                           "this corpus with it); stop it first, or give another --log PATH") from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the flock
            self._fd = None


class CorpusLock:
    """One writer per corpus directory: an exclusive, non-blocking `flock` on `DIR/writer.lock`,
    held by a server that logs updates for its life (or by an offline compaction), with the
    holder's pid and log written in the file so that a refusal can name them. A process knows the
    corpus locks it holds (`held_here`): a compaction inside a server that holds its corpus's lock
    runs under it, one elsewhere takes it for its own time."""

    FILE = "writer.lock"
    _held: dict[str, "CorpusLock"] = {}  # by resolved directory: the locks this process holds

    def __init__(self, data_dir):
        self.dir = Path(data_dir)
        self.path = self.dir / self.FILE
        self._fd = None

    @staticmethod
    def _key(data_dir) -> str:
        return str(Path(data_dir).resolve())

    @classmethod
    def held_here(cls, data_dir) -> bool:
        return cls._key(data_dir) in cls._held

    def acquire(self, log=None) -> "CorpusLock":
        """Take the lock (`log`: the holder's log path, for the refusal of another); LogError naming
        the holder when another process, or another server of this one, holds it."""
        if fcntl is None:
            return self
        key = self._key(self.dir)
        if key in self._held:
            raise LogError(f"{self.dir}: a server in this process already writes this corpus; one corpus has one "
                           "writer, whatever its --log")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError as exc:
            raise LogError(f"{self.path}: cannot create the corpus's writer lock ({exc.strerror}); a server that "
                           "logs updates holds it for its life: make the corpus directory writable, or give --log "
                           "off to keep updates in memory only") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            raise LogError(f"{self.dir}: another server writes this corpus{holder}; one corpus has one writer, "
                           "whatever its --log (two logs of one corpus are two histories, and a compaction of "
                           "one drops the other's acknowledged updates): stop that server first, or give this one "
                           "--log off (updates in memory only)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "log": None if log is None else str(log)}) + "\n").encode(), 0)
        self._fd = fd
        self._held[key] = self
        return self

    def release(self) -> None:
        if self._fd is not None:
            self._held.pop(self._key(self.dir), None)
            try:
                os.ftruncate(self._fd, 0)  # no pid left behind for the next holder's refusals to name
            except OSError:
                pass
            os.close(self._fd)  # closing releases the flock
            self._fd = None


@contextlib.contextmanager
def corpus_writer(data_dir, log=None):
    """Run the block as the corpus's one writer: under the `CorpusLock` this process holds (a server
    took it at start), or under one taken for the block; LogError naming the holder when another
    process writes the corpus."""
    if CorpusLock.held_here(data_dir):
        yield
        return
    lock = CorpusLock(data_dir).acquire(log)
    try:
        yield
    finally:
        lock.release()


def _holder(fd: int) -> str:
    """' (pid N, log PATH)' from a writer lock's file, or '' when it cannot say."""
    try:
        obj = json.loads(os.pread(fd, 4096, 0) or b"null")
        pid, log = obj.get("pid"), obj.get("log")
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(pid, int):
        return ""
    return f" (pid {pid}" + (f", log {clip(str(log))})" if log else ")")


class WriteAheadLog:
    """The log of one server (see the module docstring). Use `WriteAheadLog.open(...)` or
    `WriteAheadLog.memory(...)`."""

    def __init__(self, path: Path | None, lineage: str, base_seq: int):
        self.path = path
        self.lineage = lineage
        self.base_seq = base_seq
        self.last_seq = base_seq
        self._fd: int | None = None
        self._size = 0
        self._offsets = array("q")  # file offset of record base_seq + 1 + i
        self._crcs = array("I")  # checksum of record base_seq + 1 + i (the chain's links)
        self._header_crc: int | None = None
        self.version = VERSION
        self._memory: list[LogRecord] | None = [] if path is None else None
        self._replay: list[LogRecord] = []
        self._lock: LogLock | None = None
        self._held: list = []  # further locks released with the log (the corpus's writer lock)
        self.cut_at_open: dict | None = None  # a torn, unacknowledged last call cut when the log was opened

    # --- opening --------------------------------------------------------------------------------------
    @classmethod
    def memory(cls, lineage: str, snapshot_seq: int = 0) -> "WriteAheadLog":
        return cls(None, lineage, snapshot_seq)

    @classmethod
    def open(cls, path, *, lineage: str, snapshot_seq: int, lock: LogLock | None = None) -> "WriteAheadLog":
        """Open (or create) the log at `path` for a corpus of `lineage` whose snapshot holds every
        update up to `snapshot_seq`. `lock`: the LogLock already held (else one is taken here)."""
        path = Path(path)
        log = cls(path, lineage, snapshot_seq)
        log._lock = lock or LogLock(path).acquire()
        try:
            if check_log_path(path):
                log._load(snapshot_seq)
            else:
                log._create(snapshot_seq)
        except BaseException:
            log.close()
            raise
        return log

    def _header(self, base_seq: int) -> tuple[bytes, int]:
        return _encode({"log": MAGIC, "version": VERSION, "lineage": self.lineage, "base_seq": base_seq}, None)

    def _create(self, base_seq: int) -> None:
        """A new log holding only its header, at `base_seq`: written aside and renamed into place."""
        header, crc = self._header(base_seq)
        _write_in_place_of(self.path, header)
        self._started(base_seq, crc)
        self._open_for_append()

    def _started(self, base_seq: int, header_crc: int) -> None:
        """The state of a log that holds only a (version 2) header at `base_seq`."""
        self.base_seq = self.last_seq = base_seq
        self.version, self._header_crc = VERSION, header_crc
        self._offsets, self._crcs = array("q"), array("I")

    def _chain_before(self, index: int) -> int | None:
        """The checksum record `base_seq + 1 + index` is chained from (None: version 1, no chain)."""
        if self.version < 2:
            return None
        return self._header_crc if index == 0 else self._crcs[index - 1]

    def _open_for_append(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | _NOFOLLOW)
        self._size = os.fstat(self._fd).st_size

    def _load(self, snapshot_seq: int) -> None:
        path = self.path
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise LogError(f"{path}: cannot be read ({exc.strerror})") from None
        scan = _scan(path, data)
        if scan.lineage != self.lineage:
            raise LogError(f"{path}: belongs to another corpus (lineage {quote(scan.lineage)}, this corpus "
                           f"{self.lineage!r}); move it away to start this corpus without its updates")
        if scan.problem is not None and not scan.torn:
            raise LogError(scan.problem)
        base, records, good_end = scan.base, scan.records, scan.end
        if good_end < len(data):  # cut the torn tail (and its call) so that new records follow a whole call
            self.cut_at_open = {"records": scan.cut_records, "bytes": len(data) - good_end}
            with open(path, "r+b") as fh:
                fh.truncate(good_end)
                fh.flush()
                _datasync(fh.fileno())
        last = base + len(records)
        if snapshot_seq < base:
            raise LogError(f"{path}: starts after sequence number {base}, but the corpus snapshot holds updates "
                           f"only up to {snapshot_seq}: updates {snapshot_seq + 1}..{base} are missing")
        self.base_seq, self.last_seq, self._offsets = base, last, scan.offsets
        self.version, self._header_crc, self._crcs = scan.version, scan.header_crc, scan.crcs
        self._replay = [r for r in records if r.seq > snapshot_seq]
        if last < snapshot_seq:  # compacted past the log's end (a crash before the log was reset)
            self._replay = []
            self.reset(snapshot_seq)
            return
        self._open_for_append()

    # --- reading --------------------------------------------------------------------------------------
    def replay(self) -> list[LogRecord]:
        """The records after the snapshot, in order (what a starting server applies); once."""
        out, self._replay = self._replay, []
        return out

    def records_after(self, seq: int) -> Iterator[LogRecord]:
        """Every record with a sequence number above `seq`, in order (redelivery to a service that is
        behind). LogError when `seq` lies before the log's start (folded into a snapshot)."""
        if seq < self.base_seq:
            raise LogError(f"updates {seq + 1}..{self.base_seq} were folded into a snapshot and are no longer "
                           "in the log; restart the service from the corpus directory's current snapshot")
        if self._memory is not None:
            yield from self._memory[seq - self.base_seq:]
            return
        first = seq - self.base_seq
        if first >= len(self._offsets):
            return
        chain = self._chain_before(first)
        with open(self.path, "rb") as fh:
            fh.seek(self._offsets[first])
            for n in range(len(self._offsets) - first):
                decoded = _read_line(self.path, fh.readline(), f"of record {seq + 1 + n}", chain)
                if decoded is None:
                    raise LogError(f"{self.path}: record {seq + 1 + n} no longer reads back (its checksum differs)")
                obj, crc = decoded
                chain = None if chain is None else crc
                yield LogRecord(obj["seq"], obj["update"])

    @property
    def durable(self) -> bool:
        return self.path is not None

    # --- appending ------------------------------------------------------------------------------------
    def append(self, updates: Sequence[dict], pause=None) -> list[LogRecord]:
        """Number `updates` (objects of DESIGN section 6), write them with one `write` and make them
        durable with one `fdatasync` (group commit): on return they survive any crash; before, a
        crash leaves none of them (each names the call's last record, and an opening that finds
        the call incomplete cuts it whole). On failure
        the file is cut back to where it was and LogError says why (nothing was logged). `pause()`
        is called between records while they are encoded (a server lets retrieval go first)."""
        records = [LogRecord(self.last_seq + 1 + i, u) for i, u in enumerate(updates)]
        if not records:
            return records
        if self._memory is not None:
            self._memory.extend(records)
        else:
            lines, crcs = [], []
            chain = self._chain_before(len(self._offsets))
            end = records[-1].seq  # every record names its call's last one: the call is one unit
            for record in records:
                if pause is not None:
                    pause()
                line, crc = _encode({"seq": record.seq, "end": end, "update": record.update}, chain)
                chain = None if chain is None else crc
                lines.append(line)
                crcs.append(crc)
            start = self._size
            try:
                for group in _groups(lines):  # about a MiB a write: no one join of a 100 MB call holds the interpreter
                    view = memoryview(group)
                    while view:
                        view = view[os.write(self._fd, view):]
                _datasync(self._fd)
            except OSError as exc:
                try:
                    os.ftruncate(self._fd, start)  # never leave part of an unacknowledged call behind
                except OSError:
                    pass
                raise LogError(f"{self.path}: cannot append ({exc.strerror}); nothing was applied") from None
            for line in lines:
                self._offsets.append(self._size)
                self._size += len(line)
            self._crcs.extend(crcs)
        self.last_seq = records[-1].seq
        return records

    # --- after a compaction ---------------------------------------------------------------------------
    def reset(self, base_seq: int) -> None:
        """Start an empty log at `base_seq` (the snapshot now holds every record up to it): the new
        file is written aside, synced and renamed over the old one. Should that fail (LogError), the
        old log stays open and in use: its records up to `base_seq` are skipped on replay."""
        if base_seq < self.last_seq and self.path is not None:
            raise LogError(f"{self.path}: cannot drop records {base_seq + 1}..{self.last_seq}, the snapshot lacks them")
        if self._memory is not None:
            self._memory = []
            self.base_seq = self.last_seq = base_seq
            return
        header, header_crc = self._header(base_seq)
        try:
            _write_in_place_of(self.path, header)
        except OSError as exc:
            raise LogError(f"{self.path}: cannot start the log afresh ({exc.strerror}); it goes on as it was, and "
                           f"its records up to {base_seq} are skipped on replay (the snapshot holds them)") from None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._started(base_seq, header_crc)
        self._open_for_append()

    def hold(self, lock) -> None:
        """Release `lock` (a `CorpusLock`) when the log is closed: its owner's life is the log's."""
        self._held.append(lock)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        while self._held:
            self._held.pop().release()

    def describe(self) -> dict:
        return {"path": None if self.path is None else str(self.path), "durable": self.durable,
                **({"version": self.version} if self.durable else {}),
                "base_seq": self.base_seq, "seq": self.last_seq,
                **({"cut_at_open": self.cut_at_open} if self.cut_at_open else {})}


def _groups(lines: Sequence[bytes], size: int = WRITE_BYTES) -> Iterator[bytes]:
    """`lines` joined into runs of about `size` bytes, in order (one write each)."""
    group: list[bytes] = []
    held = 0
    for line in lines:
        group.append(line)
        held += len(line)
        if held >= size:
            yield b"".join(group)
            group, held = [], 0
    if group:
        yield b"".join(group)


def _read_line(path, line: bytes, n, chain: int | None = None) -> tuple[dict, int] | None:
    """`_decode`, a line that cannot be decoded refused as a LogError naming line `n`."""
    try:
        return _decode(line, chain)
    except UnreadableLine as exc:
        raise LogError(f"{path}: line {n} passes its checksum but cannot be read: {exc}; it was written so, "
                       "not torn by a crash: restore the log from a copy, or move it away to start from the "
                       "snapshot alone") from None


@dataclass
class _Scan:
    """What a log file holds, line by line: its header's fields, the records of its intact beginning
    (with their offsets and checksums) and where that beginning ends, and the first problem after it
    (None: none; `torn`: the problem is a torn last write, the only one repaired without a word)."""

    version: int
    lineage: str
    base: int
    header_crc: int
    records: list
    offsets: array
    crcs: array
    end: int
    ends: array = None  # the `end` (last record of its call) of each record
    problem: str | None = None
    torn: bool = False
    cut_records: int = 0  # whole records of a torn last call, cut with its torn tail

    def boundary(self) -> int:
        """The last sequence number of the intact beginning that ends a call (base: none)."""
        for i in range(len(self.records) - 1, -1, -1):
            if self.ends[i] == self.records[i].seq:
                return self.records[i].seq
        return self.base


def _scan(path: Path, data: bytes) -> _Scan:
    """Read a log's bytes (the module docstring's rules); LogError when it has no usable header."""
    parts = data.split(b"\n")  # lines end at a newline only (a damaged byte may be any other line break)
    lines = [part + b"\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    if not lines:
        raise LogError(f"{path}: is empty, so it is not an update log (a log always holds its header: it is "
                       "written aside and renamed into place); it is left as it is: remove it if it never held "
                       "an acknowledged update, or give another --log PATH")
    decoded = _read_line(path, lines[0], 1)
    if decoded is None:
        raise LogError(f"{path}: line 1 is not a valid log header: this file is not an andromeda-nb update log, "
                       "or its header is damaged; it is left as it is: move it away, or give another --log PATH")
    header, header_crc = decoded
    version = header.get("version")
    if header.get("log") != MAGIC or version not in READ_VERSIONS:
        raise LogError(f"{path}: not an andromeda-nb update log of version "
                       f"{' or '.join(map(str, READ_VERSIONS))} (header {clip(str(header))})")
    base = header.get("base_seq")
    if not isinstance(base, int) or isinstance(base, bool) or base < 0:
        raise LogError(f"{path}: header has no valid base_seq")
    scan = _Scan(version, header.get("lineage"), base, header_crc, [], array("q"), array("I"), len(lines[0]),
                 array("q"))
    chain = header_crc if version >= 2 else None
    for n, line in enumerate(lines[1:], start=2):
        want = base + 1 + len(scan.records)
        if not line.endswith(b"\n"):  # only the last line can lack its newline
            scan.torn = _torn(line, want, chain)
            if not scan.torn:
                scan.problem = _damaged(path, n, want, base, "incomplete, and not a beginning of that record "
                                                            "as a crash could leave it", 0, scan.boundary())
            break
        decoded = _read_line(path, line, n, chain)
        if decoded is None:
            why = "its checksum, chained from the line before, differs" if chain is not None else "its checksum differs"
            scan.problem = _damaged(path, n, want, base, why, len(lines) - n, scan.boundary())
            break
        obj, crc = decoded
        seq, update, end = obj.get("seq"), obj.get("update"), obj.get("end", want)
        if seq != want or not isinstance(update, dict):
            scan.problem = (f"{path}: line {n} holds sequence number {clip(repr(seq))}, expected {want}: records "
                            "are missing or out of order")
            break
        in_call = scan.ends[-1] if scan.records and scan.ends[-1] > scan.records[-1].seq else None
        if not isinstance(end, int) or isinstance(end, bool) or end < seq or (in_call is not None and end != in_call):
            expected = f"{in_call}, as the records of its call before it" if in_call is not None else f"{seq} or more"
            scan.problem = (f"{path}: line {n}, record {seq}, names {clip(repr(end))} as its call's last record, "
                            f"expected {expected}; it was written so, not torn by a crash: restore the log from a "
                            f"copy, or keep the calls before it with `andromeda truncate-log --log {path} --after "
                            f"{scan.boundary()}`")
            break
        scan.records.append(LogRecord(seq, update))
        scan.offsets.append(scan.end)
        scan.crcs.append(crc)
        scan.ends.append(end)
        scan.end += len(line)
        chain = None if chain is None else crc
    if scan.problem is None and scan.records and scan.ends[-1] > scan.records[-1].seq:
        _cut_incomplete_call(scan)
    return scan


def _cut_incomplete_call(scan: _Scan) -> None:
    """The file ends inside its last call (its records name a last one the file does not hold): a
    crash while the call was written, before its sync, so never acknowledged. The whole call goes,
    as its torn tail would: none of it is replayed."""
    keep = scan.boundary() - scan.base
    scan.cut_records = len(scan.records) - keep
    scan.end = scan.offsets[keep]
    del scan.records[keep:]
    scan.offsets, scan.crcs, scan.ends = scan.offsets[:keep], scan.crcs[:keep], scan.ends[:keep]
    scan.torn = True


def _damaged(path: Path, n: int, want: int, base: int, why: str, after: int, boundary: int) -> str:
    """The refusal of a damaged line `n` (record `want`); `boundary`: the last record before it that
    ends a call, the last one a truncation may keep (a call is kept whole or not at all)."""
    intact = ("no record before it is intact" if want - 1 == base else f"record {want - 1} before it is intact"
              if want - 2 == base else f"records {base + 1}..{want - 1} before it are intact")
    if boundary < want - 1:
        intact += (f" (records {boundary + 1}..{want - 1} belong to the damaged record's call, which is kept whole "
                   "or not at all)")
    follow = f", and {after} more line{'s' if after != 1 else ''} follow{'s' if after == 1 else ''} it" if after else ""
    return (f"{path}: line {n}, record {want}, is damaged ({why}){follow}; {intact}. The log is refused, never "
            "shortened by itself: restore it from a copy, or keep the calls before the damage on purpose with "
            f"`andromeda truncate-log --log {path} --after {boundary}` (the file as it is now is kept beside it)")


def truncate_log(path, after: int) -> dict:
    """Keep a log's records up to `after` and drop the rest, on purpose (`andromeda truncate-log`),
    for a log refused as damaged: every line up to record `after` must be intact (checksums and the
    chain). The file as it was is kept beside it (`PATH.damaged`, or `.damaged-2`, ...); the kept
    part is written aside and renamed into place. The log's lock is taken: no server may hold it."""
    path = Path(path)
    if not check_log_path(path):
        raise LogError(f"{path}: no such log")
    lock = LogLock(path).acquire()
    try:
        data = path.read_bytes()
        scan = _scan(path, data)
        last = scan.base + len(scan.records)
        if not scan.base <= after <= last:
            reason = scan.problem or f"the log ends at record {last}"
            raise LogError(f"{path}: cannot keep records through {after}: the intact records are "
                           f"{scan.base + 1}..{last} ({reason})" if last > scan.base else
                           f"{path}: cannot keep records through {after}: no record is intact ({reason})")
        if after > scan.base and scan.ends[after - scan.base - 1] != after:
            raise LogError(f"{path}: cannot keep records through {after}: record {after} is inside a call that ends at "
                           f"record {scan.ends[after - scan.base - 1]}, and a call is kept whole or not at all; keep "
                           f"through {_boundary_before(scan, after)} instead")
        end = scan.offsets[after - scan.base] if after < last else scan.end
        aside = path.with_name(path.name + ".damaged")
        k = 1
        while aside.exists() or aside.is_symlink():
            k += 1
            aside = path.with_name(f"{path.name}.damaged-{k}")
        _write_new_file(aside, data)
        _write_in_place_of(path, data[:end])
        return {"log": str(path), "kept_through": after, "dropped_bytes": len(data) - end, "kept_aside": str(aside)}
    finally:
        lock.release()


def _boundary_before(scan: _Scan, seq: int) -> int:
    """The last record at or before `seq` that ends a call (base: none)."""
    for i in range(seq - scan.base - 1, -1, -1):
        if scan.ends[i] == scan.records[i].seq:
            return scan.records[i].seq
    return scan.base


def check_log_path(path) -> bool:
    """Whether a file is at a log's `path` (False: nothing is). Refuses, naming the path, anything
    there but a regular file: a symbolic link (to a log, to any other file, or dangling), a
    directory, a device, a pipe. The contents are checked when the log is read."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise LogError(f"{path}: cannot be examined ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = f" to {quote(os.readlink(path))}"
        except OSError:
            target = ""
        raise LogError(f"{path}: is a symbolic link{target}; an update log must be a regular file or absent, "
                       "and is never written through a link: give --log the file's own path, or move the link away")
    if not stat.S_ISREG(st.st_mode):
        raise LogError(f"{path}: is not a regular file; an update log must be a regular file or absent: "
                       "give another --log PATH")
    return True


def _write_in_place_of(path: Path, data: bytes) -> None:
    """Make `path` a file holding `data`, durably: written aside (`PATH.new`), synced, renamed over
    `path` (a link there is replaced, never written through), and the directory synced."""
    tmp = path.with_name(path.name + ".new")
    _write_new_file(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _write_new_file(path: Path, data: bytes) -> None:
    """Write `path` whole and durably (file synced, then its directory), as a new file: whatever was
    at `path` (a file left by a crash, a link) is removed first, never written through."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(path.parent)


__all__ = ["LOG_FILE", "CorpusLock", "LogError", "LogLock", "corpus_writer", "LogRecord", "WriteAheadLog", "check_log_path", "corpus_lineage", "decode_line",
           "truncate_log",
           "encode_line", "fsync_dir", "snapshot_seq"]
