"""Answers of any architecture, in the forms DESIGN section 8 fixes: K checked against its limits
(`check_k`, the one check every caller uses), a corpus's requests run through a matcher or retriever
in batches (with an update stream applied first), and the answers rendered as JSON lines or as a
readable table.

`andromeda match` and `andromeda retrieve` are thin wrappers over these functions and over
`migration.architectures`, which builds the matcher or retriever an `--arch` names.
"""

from __future__ import annotations

import json
from typing import Callable, Iterator, Sequence

import numpy as np

from .batching import in_batches
from .constants import MAX_K, SCORE_ATOL, TOPK_TIE_ATOL
from .types import Request

MATCH_BATCH = 16  # requests per call, so long runs can report progress
RETRIEVE_BATCH = 16


def apply_updates_file(path, targets: Sequence, dataset):
    """Apply an update stream (DESIGN section 6) to `targets`, the live set starting from the
    dataset's ads. Returns (number applied, list of `updates.Rejection`)."""
    from .updates import apply_update_file

    return apply_update_file(path, targets, dataset.ad_ids.tolist(), seed=dataset.seed, dim=dataset.model.D,
                             formats=dataset.model.F)


def match_all(index, requests: Sequence[Request], progress: Callable[[int], None] | None = None,
              batch: int = MATCH_BATCH) -> list[np.ndarray]:
    """Eligible ad ids (int64, ascending) per request."""
    out: list[np.ndarray] = []
    for part in in_batches(requests, batch):
        out.extend(np.asarray(ids, np.int64) for ids in index.match(part))
        if progress is not None:
            progress(len(part))
    return out


def check_k(k) -> int:
    """K of a top-K request: an int in 1..MAX_K (DESIGN section 4). A ValueError names k and the
    limit; callers with an error type of their own convert it (`serving.protocol.check_k`)."""
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k: expected an integer, got {k!r}")
    if not 1 <= int(k) <= MAX_K:
        raise ValueError(f"k: must be between 1 and {MAX_K}, got {k}")
    return int(k)


def retrieve_all(retriever, requests: Sequence[Request], k: int,
                 progress: Callable[[int], None] | None = None,
                 batch: int = RETRIEVE_BATCH) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ad ids int64, scores float32) per request, in rank order."""
    k = check_k(k)
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for part in in_batches(requests, batch):
        for ids, scores in retriever.retrieve(part, k):
            out.append((np.asarray(ids, np.int64), np.asarray(scores, np.float32)))
        if progress is not None:
            progress(len(part))
    return out


# --- rendering ---------------------------------------------------------------------------------------


def match_json_lines(requests: Sequence[Request], eligible: Sequence[np.ndarray]) -> Iterator[str]:
    """`{"request_id": .., "eligible": [ad ids ascending]}` per request (DESIGN section 8)."""
    for req, ids in zip(requests, eligible):
        yield json.dumps({"request_id": int(req.request_id), "eligible": np.sort(ids).tolist()},
                         separators=(", ", ": "))


def _request_id(request) -> int:
    """A `Request`'s id, or the id itself (a client that holds only ids renders answers the same way)."""
    return int(getattr(request, "request_id", request))


def retrieve_json_lines(requests: Sequence[Request | int], answers) -> Iterator[str]:
    """`{"request_id": .., "ads": [..], "scores": [..]}` per request (a `Request` or its id), in rank
    order. Scores are the exact float32 values (written as the shortest decimal that reads back to
    the same float32)."""
    for req, (ids, scores) in zip(requests, answers):
        yield json.dumps({
            "request_id": _request_id(req),
            "ads": ids.tolist(),
            "scores": [float(repr_float32(s)) for s in np.asarray(scores, np.float32)],
        }, separators=(", ", ": "))


def repr_float32(x) -> str:
    """The shortest decimal text that parses back to the same float32."""
    return np.format_float_positional(np.float32(x), unique=True, trim="-") if np.isfinite(x) else repr(float(x))


def match_table(requests: Sequence[Request], eligible: Sequence[np.ndarray], pool: int, show: int = 5) -> str:
    lines = [f"{'request_id':>12}  {'eligible':>9}  {'of pool':>8}  first eligible ad ids"]
    for req, ids in zip(requests, eligible):
        frac = len(ids) / pool if pool else 0.0
        more = f" ... {len(ids) - show} more" if len(ids) > show else ""
        head = " ".join(str(i) for i in ids[:show].tolist()) + more
        lines.append(f"{req.request_id:>12}  {len(ids):>9}  {frac:>8.2%}  {head}")
    return "\n".join(lines)


RETRIEVE_TABLE_SHOW = 10  # answers per row of the table; the rest are counted ("... 90 more")
# what a score in the table is, and when two architectures' answers are the same (andromeda_nb.compare)
AGREEMENT_NOTE = (f"(scores rounded to 4 places; answers agree when they hold the same ads in the same order, ads "
                  f"whose float64 reference scores lie within {TOPK_TIE_ATOL:g} in either order, and every score is "
                  f"within {SCORE_ATOL:g} of that reference (DESIGN section 4), so the last digit shown may differ "
                  f"between architectures)")


def retrieve_table(requests: Sequence[Request | int], answers, show: int = RETRIEVE_TABLE_SHOW) -> str:
    """One row per request (a `Request` or its id): how many ads came back and the first `show` of
    them with their scores, in rank order; a row that holds more says how many it hides."""
    lines = [f"{'request_id':>12}  {'returned':>8}  ads in rank order (score)"]
    hidden = False
    for req, (ids, scores) in zip(requests, answers):
        head = "  ".join(f"{a} ({s:.4f})" for a, s in zip(ids[:show].tolist(), scores[:show].tolist()))
        more = len(ids) - show
        hidden |= more > 0
        lines.append(f"{_request_id(req):>12}  {len(ids):>8}  {head}{f'  ... {more} more' if more > 0 else ''}")
    if hidden:
        lines.append(f"(the first {show} answers of each request are shown; --json prints them all)")
    if len(lines) > 1:
        lines.append(AGREEMENT_NOTE)
    return "\n".join(lines)


def fraction_summary(fractions: np.ndarray) -> dict[str, float]:
    """min / p10 / median / p90 / max of per-request eligible fractions."""
    if len(fractions) == 0:
        return {}
    q = np.percentile(fractions, [0, 10, 50, 90, 100])
    return dict(zip(("min", "p10", "median", "p90", "max"), (float(x) for x in q)))
