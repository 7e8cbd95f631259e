"""What every benchmark checks, written once (docs/ARCHITECTURE.md: a benchmark checks every entry
point it times against the reference, on the inputs it times).

* `TimedAnswers`: the answers (ad ids, scores) every timed call returned, kept per entry point (a
  name such as "latency/graph" or "pipelined/direct/b64") while the timing runs (keeping them costs a
  list append: the answers are already host arrays), and checked after it. Answers that are equal
  bit for bit for the same request are checked once: the entries' counts say how many of each
  entry's answers were checked (every one of them) and how many distinct answers that took.
* `TiledOracle`: the eligible sets of a tiled pool (`benchmarks.tiling`) from `andromeda_nb.oracle`
  alone: copy c of base ad i has base ad i's targeting, status and schedule, so the oracle runs over
  the base ads once per request and the pool's slots follow by their ad ids. It never reads the
  GPU's match, so a wrong match is a failed check, not a wrong reference.
* `gate_targets`: a target is reported met only when the checks of the run passed (`met: false,
  reason: "checks failed"` otherwise).

The result's `checks` maps each entry point to `{"requests_timed", "requests_checked", "distinct",
"ok", "max_abs_err", "first_failure"}`; `checks_ok` is true when every entry was checked and passed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from andromeda_nb.oracle import eligible
from andromeda_nb.slots import EMPTY

from .tiling import stride_of


# --- the answers of timed calls -----------------------------------------------------------------------


class EntryCounts:
    """One entry point's tally: answers timed and checked, failures, the largest score error."""

    def __init__(self):
        self.timed = 0
        self.checked = 0
        self.distinct = 0
        self.failed = 0
        self.max_abs_err = 0.0
        self.first_failure: str | None = None

    def failure(self, message: str, count: int = 1) -> None:
        self.failed += count
        if self.first_failure is None:
            self.first_failure = message

    def summary(self, sampled: bool = False) -> dict:
        """`sampled`: the answers of a sample of the requests were checked (the others counted as
        timed only): ok when some were checked and none failed."""
        every = self.checked == self.timed or (sampled and self.checked > 0)
        out = {"requests_timed": self.timed, "requests_checked": self.checked, "distinct": self.distinct,
               "ok": self.failed == 0 and every and self.timed > 0, "max_abs_err": self.max_abs_err}
        if sampled:
            out["sampled"] = True
        if self.first_failure is not None:
            out["first_failure"] = self.first_failure
        return out


def _answer_key(ids, scores) -> bytes:
    ids = np.ascontiguousarray(ids, np.int64)
    scores = np.ascontiguousarray(scores, np.float32)
    return len(ids).to_bytes(8, "little") + ids.tobytes() + scores.tobytes()


class TimedAnswers:
    """The answers of every timed call, by entry point, to check after the timing."""

    def __init__(self):
        self.entries: dict[str, EntryCounts] = {}
        # request key -> answer bytes -> [ids, scores, {entry: count}]
        self._answers: dict[object, dict[bytes, list]] = {}

    def entry(self, name: str) -> EntryCounts:
        return self.entries.setdefault(name, EntryCounts())

    def add(self, name: str, keys: Sequence, answers) -> None:
        """The answers of one timed call of entry `name`: `answers[i]` (ids, scores) answers the
        request whose key (its index among the benchmark's requests) is `keys[i]`."""
        keys = list(keys)
        counts = self.entry(name)
        if len(answers) != len(keys):
            counts.timed += len(keys)
            counts.failure(f"{len(answers)} answers to {len(keys)} requests", len(keys))
            return
        counts.timed += len(keys)
        for key, (ids, scores) in zip(keys, answers):
            seen = self._answers.setdefault(key, {})
            held = seen.get(answer := _answer_key(ids, scores))
            if held is None:
                seen[answer] = held = [np.array(ids, np.int64), np.array(scores), {}]
            held[2][name] = held[2].get(name, 0) + 1

    def check(self, check_one: Callable[[object, np.ndarray, np.ndarray], tuple[bool, float, str]],
              keys: Sequence | None = None) -> dict:
        """Check every distinct answer of the requests `keys` (default: all) with `check_one(key, ids,
        scores) -> (ok, max_abs_err, message)`, one request after another (a reference made for one
        request can be dropped before the next), and count it for every entry that returned it.
        Returns `summary()`; with `keys`, the requests' sample (the rest dropped unchecked)."""
        for key in (list(self._answers) if keys is None else keys):
            for ids, scores, by_entry in self._answers.pop(key, {}).values():
                ok, err, message = check_one(key, ids, scores)
                for name, n in by_entry.items():
                    counts = self.entry(name)
                    counts.checked += n
                    counts.distinct += 1
                    counts.max_abs_err = max(counts.max_abs_err, float(err))
                    if not ok:
                        counts.failure(f"request {key}: {message}", n)
        self.sampled = keys is not None
        if self.sampled:
            self._answers.clear()
        return self.summary()

    sampled = False  # the last check was of a sample of the requests

    def summary(self) -> dict:
        return {name: counts.summary(self.sampled) for name, counts in self.entries.items()}

    @property
    def distinct_requests(self) -> int:
        """Requests with answers held (not yet checked)."""
        return len(self._answers)

    @property
    def ok(self) -> bool:
        return bool(self.entries) and all(c.summary()["ok"] for c in self.entries.values())


def topk_check(ref_ids, reference, ids, scores, k: int) -> tuple[bool, float, str]:
    """One answer (ids, scores) against the float64 reference of its eligible ads (`ref_ids` and their
    `andromeda_nb.reference.ScoreResult`, or the rows a comparison needs of them), by DESIGN section
    4's tie-aware top-K rule (`andromeda_nb.compare.compare_topk`): (ok, the largest score error of
    the answer's rows, the first disagreement)."""
    from andromeda_nb.compare import compare_scores, compare_topk

    ref_ids = np.asarray(ref_ids, np.int64)
    ids = np.asarray(ids, np.int64)
    cmp = compare_topk(ref_ids, reference, ids, scores, k)
    err = 0.0
    if len(ids) and len(ref_ids):
        order = np.argsort(ref_ids)
        pos = np.minimum(np.searchsorted(ref_ids[order], ids), len(ref_ids) - 1)
        if (ref_ids[order][pos] == ids).all():
            err = compare_scores(reference.take(order[pos]), scores).counts.get("max_abs_err", 0.0)
    return cmp.ok, err, cmp.message


def checks_passed(checks: dict) -> bool:
    """Every entry of a result's `checks` was checked and passed (and there is at least one)."""
    return bool(checks) and all(c.get("ok") for c in checks.values())


def gate_targets(targets: dict, checks_ok: bool) -> dict:
    """`targets` ({name: {"value", "target", "met"}}) as reported: met only when the checks passed;
    otherwise `met: false` with `reason: "checks failed"` (the figure is kept, for the record)."""
    if checks_ok:
        return targets
    return {name: {**t, "met": False, "reason": "checks failed"} for name, t in targets.items()}


# --- the eligible sets of a pool: the oracle over a tiled pool, the CPU index over a corpus ----------------------------------------------------------------------


class SlotOracle:
    """What the checks of a benchmark ask of a pool's eligible sets, given `slot_mask(request)` (bool
    per slot) and `slot_ad_id`: the eligible slots, the match output row a request must have, and a
    timed match output checked against them."""

    slot_ad_id: np.ndarray

    def slot_mask(self, request) -> np.ndarray:
        raise NotImplementedError

    def eligible_slots(self, request) -> np.ndarray:
        """int64: the eligible slots of `request`, ascending."""
        return np.flatnonzero(self.slot_mask(request))

    def _sample_mask(self, request, slots: np.ndarray) -> np.ndarray:
        return self.slot_mask(request)[slots]

    def words(self, request, keep: bool = True) -> np.ndarray:
        """uint32 (capacity / 32,): the match output row `request` must have (bit s % 32 of word
        s // 32: slot s eligible); kept for the next call when `keep`."""
        key = int(request.request_id)
        kept = self.__dict__.setdefault("_words", {})
        got = kept.get(key)
        if got is None:
            got = np.packbits(self.slot_mask(request), bitorder="little").view(np.uint32)
            if keep:
                kept[key] = got
        return got

    def check_words(self, words: np.ndarray, requests: Sequence, *, full: bool = True,
                    sample: np.ndarray | None = None, keep: bool = True) -> tuple[int, str | None]:
        """Rows of a match output (uint32 (len(requests), capacity / 32)) against the oracle: every
        slot (`full`; the expected rows kept for the next call when `keep`), or the slots of `sample`
        alone. Returns (requests that differ, the first difference in words)."""
        words = np.asarray(words)
        bad, first = 0, None
        if not full:
            s = np.asarray(sample, np.int64)
            got = (words[:, s >> 5] >> (s & 31).astype(np.uint32)) & np.uint32(1)
        for r, request in enumerate(requests):
            if full:
                want = self.words(request, keep)
                differ = not np.array_equal(words[r, : len(want)], want)
                if differ and first is None:
                    gotbits = np.unpackbits(words[r, : len(want)].view(np.uint8), bitorder="little").astype(bool)
                    slot = int(np.flatnonzero(gotbits != self.slot_mask(request))[0])
                    first = (f"request {request.request_id}: slot {slot} (ad {int(self.slot_ad_id[slot])}) is "
                             f"{'eligible' if gotbits[slot] else 'not eligible'} in the match, "
                             f"{'not ' if gotbits[slot] else ''}in the oracle")
            else:
                want = self._sample_mask(request, s)
                wrong = np.flatnonzero(got[r].astype(bool) != want)
                differ = len(wrong) > 0
                if differ and first is None:
                    slot = int(s[wrong[0]])
                    first = f"request {request.request_id}: slot {slot} (ad {int(self.slot_ad_id[slot])}) differs"
            bad += bool(differ)
        return bad, first


class TiledOracle(SlotOracle):
    """Eligible slots of a tiled pool (`slot_ad_id`: the index's ad id per slot, EMPTY for a free
    slot) for the base corpus `base`'s requests, from `andromeda_nb.oracle.eligible` over the base
    ads: every copy of a base ad answers as the base ad does, whatever the slot order (the format's
    or the geographic layout's)."""

    def __init__(self, base, slot_ad_id: np.ndarray):
        self.ads = sorted(base.ads, key=lambda a: a.ad_id)
        base_ids = np.asarray([a.ad_id for a in self.ads], np.int64)
        stride = stride_of(base.compiled)
        ids = np.asarray(slot_ad_id, np.int64)
        used = ids != EMPTY
        row = np.searchsorted(base_ids, np.where(used, ids % stride, 0))
        row = np.minimum(row, len(base_ids) - 1)
        known = used & (base_ids[row] == ids % stride)
        if not (known == used).all():
            raise ValueError("a slot holds an ad that is no copy of a base ad")
        self.row_of_slot = np.where(used, row, len(base_ids)).astype(np.int64)  # len(base): no ad
        self.slot_ad_id = ids
        self._base: dict[int, np.ndarray] = {}
        self._words: dict[int, np.ndarray] = {}

    def base_eligible(self, request) -> np.ndarray:
        """bool (base ads + 1,): base ad i (by id ascending) eligible for `request`; the last entry,
        False, stands for an empty slot."""
        key = int(request.request_id)
        got = self._base.get(key)
        if got is None:
            got = np.zeros(len(self.ads) + 1, bool)
            got[:-1] = np.fromiter((eligible(a, request) for a in self.ads), bool, len(self.ads))
            self._base[key] = got
        return got

    def slot_mask(self, request) -> np.ndarray:
        """bool (capacity,): slot s eligible for `request`."""
        return self.base_eligible(request)[self.row_of_slot]

    def _sample_mask(self, request, slots: np.ndarray) -> np.ndarray:
        return self.base_eligible(request)[self.row_of_slot[slots]]

SAMPLE_FROM = 1 << 16  # ads parsed for the oracle sample of a corpus pool


class CorpusOracle(SlotOracle):
    """Eligible slots of a corpus of distinct ads (a loaded `Dataset`) laid out in an index's slots
    (`slot_ad_id`). Running the oracle over every ad of a 10M corpus for every request would take
    hours, so the sets come from the CPU index (`cpu_baseline.index.CpuTargetingIndex`, built from the
    corpus's compiled targeting: never the GPU's match), and the CPU index is itself held to
    `andromeda_nb.oracle.eligible` on `sample` ads parsed from the corpus's own files, for every request
    asked about (`sample_check`: a failure there fails the run's checks). One request's mask is kept
    (a 10M-slot mask per request would not fit many). A pool of distinct copies (`benchmarks.copies`)
    brings its own `matcher()` (a scan of its compiled targeting: an index over 100M copies would not
    fit the host) and `sample_ads` (copies of the corpus's first ads, spread over every copy)."""

    def __init__(self, dataset, slot_ad_id: np.ndarray, sample: int = 2000, seed: int = 0):
        from cpu_baseline.index import CpuTargetingIndex

        self.dataset = dataset
        self.slot_ad_id = np.asarray(slot_ad_id, np.int64)
        # a pool of copies brings its own matcher over its compiled targeting (benchmarks.copies)
        self.cpu = dataset.matcher() if hasattr(dataset, "matcher") else CpuTargetingIndex.from_compiled(dataset.compiled)
        used = np.flatnonzero(self.slot_ad_id != EMPTY)
        order = np.argsort(self.slot_ad_id[used], kind="stable")
        self._ids, self._slots = self.slot_ad_id[used][order], used[order]
        self.sample_size = sample
        self.seed = seed
        self._sample = None  # (ads, their ids) parsed on first use
        self._held: tuple = (None, None)
        self._by_copy: dict[int, np.ndarray] = {}  # a pool of copies: eligible ads per copy, by request
        self.sample_checked = self.sample_failed = 0
        self.sample_first_failure: str | None = None

    def _sample_ads(self):
        if self._sample is None:  # drawn from the first SAMPLE_FROM ads of the file (parsing them all
            # would take minutes at 10M); over a pool of copies, from every copy of those
            if hasattr(self.dataset, "sample_ads"):
                chosen = self.dataset.sample_ads(self.sample_size, self.seed, SAMPLE_FROM)
            else:
                ads = next(iter(self.dataset.ad_chunks(SAMPLE_FROM)), [])
                rng = np.random.default_rng(self.seed)
                pick = rng.choice(len(ads), min(self.sample_size, len(ads)), replace=False)
                chosen = [ads[i] for i in sorted(pick.tolist())]
            self._sample = (chosen, np.asarray([a.ad_id for a in chosen], np.int64))
        return self._sample

    def eligible_ids(self, request) -> np.ndarray:
        """int64: the ids of the ads eligible for `request`, ascending (the CPU index's), after the
        oracle sample check."""
        ids = self.cpu.match([request])[0]
        if hasattr(self.dataset, "copy_of_ids"):
            self._by_copy[int(request.request_id)] = np.bincount(self.dataset.copy_of_ids(ids),
                                                                 minlength=self.dataset.plan.copies)
        ads, sample_ids = self._sample_ads()
        want = np.fromiter((eligible(a, request) for a in ads), bool, len(ads))
        got = np.isin(sample_ids, ids)
        self.sample_checked += 1
        if not np.array_equal(got, want):
            self.sample_failed += 1
            if self.sample_first_failure is None:
                bad = int(np.flatnonzero(got != want)[0])
                self.sample_first_failure = (f"request {request.request_id}: ad {int(sample_ids[bad])} is "
                                             f"{'eligible' if got[bad] else 'not eligible'} in the CPU index, "
                                             f"{'not ' if got[bad] else ''}in the oracle")
        return ids

    def slot_mask(self, request) -> np.ndarray:
        key = int(request.request_id)
        if self._held[0] != key:
            ids = self.eligible_ids(request)
            mask = np.zeros(len(self.slot_ad_id), bool)
            mask[self._slots[np.searchsorted(self._ids, ids)]] = True
            self._held = (key, mask)
        return self._held[1]

    def eligible_shares(self) -> dict | None:
        """Over a pool of copies (`benchmarks.copies`), the mean share eligible over the requests asked
        about: of the corpus (copy 0), of copies 1 on, of the whole pool; None over a corpus."""
        if not self._by_copy:
            return None
        counts = np.stack(list(self._by_copy.values())).astype(np.float64) / len(self.dataset.plan.base)
        out = {"requests": len(counts), "base": float(counts[:, 0].mean()), "pool": float(counts.mean())}
        out["copies"] = float(counts[:, 1:].mean()) if counts.shape[1] > 1 else out["base"]
        out["per_copy"] = [round(float(x), 5) for x in counts.mean(axis=0)]
        return out

    def sample_check(self) -> dict:
        """The oracle sample check as an entry of a result's `checks`."""
        out = {"requests_timed": self.sample_checked, "requests_checked": self.sample_checked,
               "distinct": self.sample_checked, "ok": self.sample_checked > 0 and self.sample_failed == 0,
               "max_abs_err": 0.0, "ads_sampled": self.sample_size}
        if self.sample_first_failure is not None:
            out["first_failure"] = self.sample_first_failure
        return out


__all__ = ["CorpusOracle", "EntryCounts", "SlotOracle", "TiledOracle", "TimedAnswers", "checks_passed", "gate_targets", "topk_check"]
