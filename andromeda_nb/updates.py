"""The update stream of DESIGN section 6: parsing it, checking it against the live ads, applying it.

A stream is JSON Lines, applied in order:

    {"op": "upsert", "ad": {...an ad line of DESIGN section 2...}}   create, or replace every field
    {"op": "status", "ad_id": 7, "status": "PAUSED"}
    {"op": "retire", "ad_id": 7}                                     gone; the id may come back by upsert

Two kinds of rejection, each with its line number and reason, each changing nothing while the
updates around it still apply:
* malformed lines (bad JSON, unknown op, unknown key, a malformed ad): `read_updates` reports them;
* a status or retire for an id that is not live (never created, or retired): `LiveAds` reports them
  when the stream is applied, because whether an id is live depends on the updates before it.

`apply_updates(updates, targets, live)` does the second check and applies each accepted update, in
order, to every target (anything with `.apply(update)`: `OracleIndex`, the CPU and GPU indexes, the
retrievers), so every index sees exactly the same accepted stream. A server checks a stream against
the index it updates (`IndexLiveIds`) and acknowledges it with `update_answer`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from . import jsontext
from .constants import DEFAULT_F, STATUSES
from .jsontext import DEFAULT_MAX_DEPTH
from .targeting import MAX_AD_ID, _Checker, _is_int, _type_name, ad_to_json, parse_ad
from .types import Retire, SetStatus, TargetingError, Upsert, Update

OPS = ("upsert", "status", "retire")
OP_KEYS = {"upsert": ("op", "ad"), "status": ("op", "ad_id", "status"), "retire": ("op", "ad_id")}


@dataclass(frozen=True)
class Rejection:
    """An update that changed nothing: its 1-based line (None when it did not come from a file),
    the ad id when one could be read, and why."""

    line_no: int | None
    ad_id: int | None
    reason: str

    def to_json(self) -> dict:
        return {"line": self.line_no, "ad_id": self.ad_id, "error": self.reason}

    def __str__(self) -> str:
        where = f"line {self.line_no}: " if self.line_no is not None else ""
        who = f"ad {self.ad_id}: " if self.ad_id is not None else ""
        return f"{where}{who}{self.reason}"


def parse_update(obj: Any, *, seed: int, dim: int, formats: int = DEFAULT_F,
                 line: int | None = None) -> Update:
    """One update object to an `Upsert`, `SetStatus` or `Retire`. Raises `TargetingError` whose path
    is relative to the update line (`ad.targeting.genders[0]`, `status`)."""
    chk = _Checker(None, line)
    if not isinstance(obj, Mapping):
        chk.fail("", f"an update must be a JSON object, got {_type_name(obj)}")
    ad_id = obj.get("ad_id")
    if _is_int(ad_id) and 0 <= ad_id <= MAX_AD_ID:  # named in any error below
        chk.ad_id = int(ad_id)
    if "op" not in obj:
        chk.fail("op", f"is required (one of {', '.join(OPS)})")
    op = chk.enum(obj["op"], "op", OPS)
    if op != "upsert" and "ad_id" in obj:
        chk.ad_id = chk.int(obj["ad_id"], "ad_id", 0, MAX_AD_ID)
    chk.object(obj, "", OP_KEYS[op])
    for key in OP_KEYS[op]:
        if key not in obj:
            chk.fail(key, f"is required for op {op!r}")
    if op == "upsert":
        try:
            return Upsert(parse_ad(obj["ad"], seed=seed, dim=dim, formats=formats, line=line))
        except TargetingError as err:
            path = f"ad.{err.path}" if err.path else "ad"
            raise TargetingError(err.ad_id, path, err.message, line=line) from None
    if op == "status":
        return SetStatus(chk.ad_id, chk.enum(obj["status"], "status", STATUSES))
    return Retire(chk.ad_id)


def _lines(lines_or_path) -> Iterable[Any]:
    """The lines of a file (as bytes: each line is decoded on its own, so one that is not UTF-8 is
    rejected by number and the rest still read), or the given lines or objects."""
    if isinstance(lines_or_path, (str, os.PathLike)):
        try:
            f = open(lines_or_path, "rb")
        except OSError as exc:
            raise ValueError(f"{os.fspath(lines_or_path)}: cannot be read ({exc.strerror})") from None
        with f:
            yield from f
    else:
        yield from lines_or_path


def _reason(err: TargetingError) -> str:
    return f"{err.path}: {err.message}" if err.path else err.message


def read_updates(lines_or_path, *, seed: int, dim: int, formats: int = DEFAULT_F,
                 max_depth: int = DEFAULT_MAX_DEPTH) -> tuple[list[tuple[int, Update]], list[Rejection]]:
    """Parse a JSON Lines update stream: a path, or an iterable of lines (str or bytes) or of
    already-decoded objects. Blank lines are skipped; line numbers are 1-based; a byte-order mark
    before the first line is skipped. Returns the well-formed updates as (line_no, update) in order
    and the malformed lines (not UTF-8, not JSON, nested deeper than `max_depth`, a repeated key,
    not an update) as `Rejection`s."""
    updates: list[tuple[int, Update]] = []
    rejections: list[Rejection] = []
    for line_no, raw in enumerate(_lines(lines_or_path), start=1):
        if isinstance(raw, (str, bytes)):
            if not raw.strip():
                continue
            try:
                obj = jsontext.loads(raw, max_depth=max_depth)
            except jsontext.JsonInputError as err:
                rejections.append(Rejection(line_no, None, f"malformed JSON: {err}"))
                continue
        else:
            obj = raw
        try:
            updates.append((line_no, parse_update(obj, seed=seed, dim=dim, formats=formats, line=line_no)))
        except TargetingError as err:
            rejections.append(Rejection(line_no, err.ad_id, _reason(err)))
    return updates, rejections


class LiveAds:
    """The set of live ad ids, checked and advanced one update at a time."""

    def __init__(self, ad_ids: Iterable[int] = ()):
        self.ids: set[int] = {int(i) for i in ad_ids}

    def __contains__(self, ad_id: int) -> bool:
        return ad_id in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def check(self, update: Update) -> str | None:
        """Why `update` cannot apply now, or None when it can. An upsert always can."""
        if isinstance(update, Upsert):
            return None
        if isinstance(update, (SetStatus, Retire)):
            if update.ad_id not in self.ids:
                op = "status" if isinstance(update, SetStatus) else "retire"
                return f"{op}: ad {update.ad_id} does not exist (never created, or retired)"
            return None
        return f"not an update: {update!r}"

    def record(self, update: Update) -> None:
        """Advance the live set past an accepted update."""
        if isinstance(update, Upsert):
            self.ids.add(update.ad.ad_id)
        elif isinstance(update, Retire):
            self.ids.discard(update.ad_id)

    def accept(self, update: Update) -> str | None:
        """`check`, and `record` when it passes; returns the reason of a rejection or None."""
        reason = self.check(update)
        if reason is None:
            self.record(update)
        return reason


class IndexLiveIds(LiveAds):
    """The live ids as held by a container that applying the updates advances by itself (an index:
    `ad_id in index`), so a server checks a stream against the index it updates without a second
    copy of the ids: `record` has nothing to do."""

    def __init__(self, ids):
        self.ids = ids

    def record(self, update: Update) -> None:
        pass


def update_answer(applied: int, rejections: Iterable[Rejection]) -> dict:
    """A service's acknowledgement of an update stream: `{"applied": n, "rejected": [{"line", "ad_id",
    "error"}, ...]}`, the rejections by line."""
    ordered = sorted(rejections, key=lambda r: r.line_no or 0)
    return {"applied": applied, "rejected": [r.to_json() for r in ordered]}


def _ad_id_of(update: Update) -> int | None:
    if isinstance(update, Upsert):
        return update.ad.ad_id
    return getattr(update, "ad_id", None)


def apply_updates(updates: Iterable[tuple[int, Update] | Update], targets: Sequence[Any], live: LiveAds
                  ) -> list[Rejection]:
    """Check each update (a bare `Update` or a `(line_no, Update)` pair) against `live` in order and
    apply the accepted ones to every target; return the rejected ones."""
    rejections: list[Rejection] = []
    for item in updates:
        line_no, update = item if isinstance(item, tuple) else (None, item)
        reason = live.accept(update)
        if reason is not None:
            rejections.append(Rejection(line_no, _ad_id_of(update), reason))
            continue
        for target in targets:
            target.apply(update)
    return rejections


def upsert_runs(updates: Iterable[Update]) -> Iterable[list[Update]]:
    """`updates` in order, in groups an engine may apply at once: a run of upserts of distinct ads
    (a second upsert of an ad in the run begins the next run), or one status change or retire.
    Applying the groups in order, each run's upserts together, equals applying the updates one by one."""
    run: list[Update] = []
    ids: set[int] = set()
    for update in updates:
        if isinstance(update, Upsert):
            ad_id = int(update.ad.ad_id)
            if ad_id in ids:
                yield run
                run, ids = [], set()
            run.append(update)
            ids.add(ad_id)
            continue
        if run:
            yield run
            run, ids = [], set()
        yield [update]
    if run:
        yield run


class UpdateLog:
    """Live ids plus the targets they guard: `submit` one update (from a stream or a service) at a
    time; rejected ones are kept in `rejections`."""

    def __init__(self, targets: Sequence[Any], ad_ids: Iterable[int]):
        self.targets = list(targets)
        self.live = LiveAds(ad_ids)
        self.rejections: list[Rejection] = []
        self.applied = 0

    def submit(self, update: Update, line_no: int | None = None) -> Rejection | None:
        rejected = apply_updates([(line_no, update)], self.targets, self.live)
        if rejected:
            self.rejections.extend(rejected)
            return rejected[0]
        self.applied += 1
        return None


def nothing_applied(source, applied: int, rejections: Sequence[Rejection]) -> str | None:
    """Why an update stream given to a command was of no use, or None: it held no update, or every
    one of its lines was rejected (the command then exits non-zero instead of answering as if no
    stream had been given)."""
    if applied:
        return None
    if not rejections:
        return f"{source} holds no update"
    return f"no update of {source} applies: all {len(rejections)} were rejected (first: {rejections[0]})"


def apply_update_file(lines_or_path, targets: Sequence[Any], ad_ids: Iterable[int], *, seed: int, dim: int,
                      formats: int = DEFAULT_F) -> tuple[int, list[Rejection]]:
    """Read a stream (what `--updates-file FILE` does) and apply it to every target, the live set starting
    from `ad_ids`. Returns (number applied, every rejection, malformed or not live, by line)."""
    updates, malformed = read_updates(lines_or_path, seed=seed, dim=dim, formats=formats)
    not_live = apply_updates(updates, targets, LiveAds(ad_ids))
    rejections = sorted(malformed + not_live, key=lambda r: r.line_no or 0)
    return len(updates) - len(not_live), rejections


def update_to_json(update: Update) -> dict:
    """The update-stream line of DESIGN section 6 (what `parse_update` reads back)."""
    if isinstance(update, Upsert):
        return {"op": "upsert", "ad": ad_to_json(update.ad)}
    if isinstance(update, SetStatus):
        return {"op": "status", "ad_id": int(update.ad_id), "status": update.status}
    return {"op": "retire", "ad_id": int(update.ad_id)}
