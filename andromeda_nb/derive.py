"""Values derived deterministically from an id and the corpus seed (DESIGN section 2, interchange):
an ad line without `embedding` and a request line without `signals` get these, on every machine."""

from __future__ import annotations

import numpy as np

_EMBEDDING_STREAM = 2
_SIGNAL_STREAM = 3


def ad_embedding(ad_id: int, seed: int, dim: int) -> np.ndarray:
    """float32 (dim,), entries ~ N(0, 1/dim)."""
    rng = np.random.default_rng([seed, _EMBEDDING_STREAM, int(ad_id) & 0xFFFFFFFFFFFFFFFF])
    return (rng.standard_normal(dim) / np.sqrt(dim)).astype(np.float32)


def request_signals(request_id: int, seed: int, experts: int, width: int) -> np.ndarray:
    """float32 (experts, width), entries ~ N(0, 1)."""
    rng = np.random.default_rng([seed, _SIGNAL_STREAM, int(request_id) & 0xFFFFFFFFFFFFFFFF])
    return rng.standard_normal((experts, width)).astype(np.float32)
