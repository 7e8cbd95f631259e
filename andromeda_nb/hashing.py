"""Distinct values of a large int64 array by hashing, in one compiled pass: what a sort of every value
(np.unique) did, where the distinct values are few (terms of a vocabulary, geographic masks).

    distinct, ids = first_seen_ids(values)   # distinct[ids] == values
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import jitcache

jitcache.install()  # cached code is recompiled when any project source changes

HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of value * this pick the bucket


@njit(cache=True)
def first_seen_ids(terms):
    """(distinct int64[V]: the distinct values in order of first appearance, ids int64[T]: the index in
    `distinct` of every value), through an open-addressing table kept at most half full (a slot is
    two words, term and id, so a probe reads one cache line; id -1: an empty slot)."""
    bits = 10
    size = 1 << bits
    table = np.full(2 * size, -1, np.int64)
    distinct = np.empty(size, np.int64)
    n = 0
    ids = np.empty(len(terms), np.int64)
    for t in range(len(terms)):
        x = terms[t]
        j = np.int64((np.uint64(x) * np.uint64(HASH_MULTIPLIER)) >> np.uint64(64 - bits))
        while table[2 * j + 1] != -1 and table[2 * j] != x:
            j = (j + 1) & (size - 1)
        if table[2 * j + 1] != -1:
            ids[t] = table[2 * j + 1]
            continue
        table[2 * j] = x
        table[2 * j + 1] = n
        distinct[n] = x
        ids[t] = n
        n += 1
        if 2 * n > size:  # grow: twice the slots, every distinct term placed again
            bits += 1
            size = 1 << bits
            table = np.full(2 * size, -1, np.int64)
            grown = np.empty(size, np.int64)
            grown[:n] = distinct[:n]
            distinct = grown
            for d in range(n):
                y = distinct[d]
                k = np.int64((np.uint64(y) * np.uint64(HASH_MULTIPLIER)) >> np.uint64(64 - bits))
                while table[2 * k + 1] != -1:
                    k = (k + 1) & (size - 1)
                table[2 * k] = y
                table[2 * k + 1] = d
    return distinct[:n].copy(), ids


__all__ = ["HASH_MULTIPLIER", "first_seen_ids"]
