"""The 'tiles' layout of stored embeddings that the tiled and tensor-core scoring kernels read
(`gpu.kernels.score`'s docstring draws it): slots in tiles of 32 (one warp), an ad's words in quads
of 4 (16 bytes), so the 32 lanes of a warp loading quad q of their ads read 512 contiguous bytes."""

from __future__ import annotations

import numpy as np

from andromeda_nb.constants import PRECISION_BYTES

TILE_ADS = 32
QUAD_WORDS = 4


def words_per_ad(precision: str, dim: int) -> int:
    if (dim * PRECISION_BYTES[precision]) % (4 * QUAD_WORDS):
        raise ValueError(f"D = {dim} at {precision}: an ad must fill whole 16-byte quads (D multiple of 16)")
    return dim * PRECISION_BYTES[precision] // 4


def to_tiles(values: np.ndarray) -> np.ndarray:
    """Row-major stored values (S, D) (S a multiple of 32) -> 'tiles' uint32 words."""
    values = np.ascontiguousarray(values)
    S = values.shape[0]
    if S % TILE_ADS:
        raise ValueError(f"slot count {S} is not a multiple of {TILE_ADS}")
    words = values.view(np.uint32).reshape(S, values.shape[1] * values.itemsize // 4)  # S may be 0
    V = words.shape[1] // QUAD_WORDS
    return np.ascontiguousarray(words.reshape(S // TILE_ADS, TILE_ADS, V, QUAD_WORDS).transpose(0, 2, 1, 3)).reshape(-1)


def from_tiles(words: np.ndarray, dtype, dim: int) -> np.ndarray:
    """Inverse of `to_tiles`: (S, D) values of `dtype`."""
    w_per_ad = dim * np.dtype(dtype).itemsize // 4
    V = w_per_ad // QUAD_WORDS
    t = np.asarray(words, np.uint32).reshape(-1, V, TILE_ADS, QUAD_WORDS).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(t).reshape(-1, w_per_ad).view(dtype).reshape(-1, dim)


def tiles_on_device(values_dev, xp):
    """`to_tiles` for a device array (CuPy `xp`), without a host copy."""
    S = values_dev.shape[0]
    words = values_dev.view(xp.uint32).reshape(S, -1)
    V = words.shape[1] // QUAD_WORDS
    return xp.ascontiguousarray(words.reshape(S // TILE_ADS, TILE_ADS, V, QUAD_WORDS).transpose(0, 2, 1, 3)).reshape(-1)


__all__ = ["QUAD_WORDS", "TILE_ADS", "from_tiles", "tiles_on_device", "to_tiles", "words_per_ad"]
