"""Values derived deterministically from an id and the corpus seed (DESIGN section 2, interchange):
an ad line without `embedding` and a request line without `signals` get these, on every machine.

The values come from a counter-based hash, so a million rows are made in one vectorized pass and a
single row (`ad_embedding`) equals the same row made in bulk (`ad_embeddings`). Each entry is a
centered sum of four 16-bit uniform draws taken from one 64-bit hash of (seed, stream, id, entry),
scaled to the stated variance: bell-shaped and close to normal. Only integer arithmetic and one
correctly rounded float64 multiply are involved, so every platform gets the same bits.
"""

from __future__ import annotations

import math

import numpy as np

_EMBEDDING_STREAM = 2
_SIGNAL_STREAM = 3

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MASK64 = 0xFFFFFFFFFFFFFFFF
_LANE = np.uint64(0xFFFF)
# four 16-bit lanes sum to 0..4*65535; the centre is 2*65535 and one lane's variance is ~65536^2/12
_CENTRE = 2 * 65535
_UNIT_STD = math.sqrt(3.0) / 65536.0  # (sum - centre) * this has variance ~1 (exactly (65536^2-1)/65536^2)
_ROWS_PER_PASS = 32768  # bounds the temporaries of the bulk functions to a few tens of MB


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MUL1
    x = x ^ (x >> np.uint64(27))
    x = x * _MUL2
    return x ^ (x >> np.uint64(31))


def _row_keys(ids: np.ndarray, seed: int, stream: int) -> np.ndarray:
    base = _mix(np.asarray([(int(seed) & _MASK64)], np.uint64) + _GOLDEN * np.uint64(stream))
    return _mix(base ^ ids.astype(np.int64).view(np.uint64))


def _bell(ids, seed: int, stream: int, width: int, std: float) -> np.ndarray:
    """float32 (len(ids), width): entry (i, j) from hash(seed, stream, ids[i], j), mean 0, std `std`."""
    ids = np.ascontiguousarray(np.asarray(ids, np.int64).reshape(-1))
    out = np.empty((len(ids), width), np.float32)
    scale = _UNIT_STD * std
    with np.errstate(over="ignore"):
        counters = _GOLDEN * np.arange(1, width + 1, dtype=np.uint64)
        for lo in range(0, len(ids), _ROWS_PER_PASS):
            keys = _row_keys(ids[lo : lo + _ROWS_PER_PASS], seed, stream)
            h = _mix(keys[:, None] + counters[None, :])
            lanes = (h & _LANE) + ((h >> np.uint64(16)) & _LANE)
            lanes += ((h >> np.uint64(32)) & _LANE) + (h >> np.uint64(48))
            out[lo : lo + len(keys)] = (lanes.astype(np.int64) - _CENTRE).astype(np.float64) * scale
    return out


def ad_embeddings(ad_ids, seed: int, dim: int) -> np.ndarray:
    """float32 (len(ad_ids), dim), entries approximately N(0, 1/dim); row i depends only on
    (seed, ad_ids[i])."""
    return _bell(ad_ids, seed, _EMBEDDING_STREAM, dim, 1.0 / math.sqrt(dim))


def ad_embedding(ad_id: int, seed: int, dim: int) -> np.ndarray:
    """float32 (dim,), entries approximately N(0, 1/dim); equal to the row of `ad_embeddings`."""
    return ad_embeddings([ad_id], seed, dim)[0]


def request_signals_many(request_ids, seed: int, experts: int, width: int) -> np.ndarray:
    """float32 (len(request_ids), experts, width), entries approximately N(0, 1)."""
    flat = _bell(request_ids, seed, _SIGNAL_STREAM, experts * width, 1.0)
    return flat.reshape(len(flat), experts, width)


def request_signals(request_id: int, seed: int, experts: int, width: int) -> np.ndarray:
    """float32 (experts, width), entries approximately N(0, 1)."""
    return request_signals_many([request_id], seed, experts, width)[0]
