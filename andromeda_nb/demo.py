"""`andromeda demo`: the whole path on a small built-in corpus, end to end.

Generate a seeded corpus into a temporary directory, load it back from Parquet, match every request
with the oracle, retrieve the top-K with the float64 reference retriever, check that every answer is
eligible and in rank order, and print a short summary.
"""

from __future__ import annotations

import tempfile
import time
from typing import Callable

import numpy as np

from . import corpus
from .answers import build_matcher, build_retriever, fraction_summary, match_all, retrieve_all, retrieve_table
from .store import load_dataset


class DemoError(RuntimeError):
    """The demo's own consistency check failed."""


def run_demo(n_ads: int = 2000, n_requests: int = 8, seed: int = 0, k: int = 10,
             echo: Callable[[str], None] = print, log: Callable[[str], None] = lambda m: None) -> dict:
    """Run the demo; `echo` gets the summary lines, `log` the progress lines. Returns the figures."""
    with tempfile.TemporaryDirectory(prefix="andromeda-demo-") as tmp:
        t0 = time.perf_counter()
        corpus.generate_corpus(tmp, n_ads, n_requests, seed)
        log(f"generated {n_ads} ads and {n_requests} requests (seed {seed}) in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        dataset = load_dataset(tmp)
        log(f"loaded the corpus back from Parquet in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    eligible = match_all(build_matcher(dataset, "oracle"), dataset.requests)
    match_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    retriever = build_retriever(dataset, "reference")
    answers = retrieve_all(retriever, dataset.requests, k)
    retriever.close()
    retrieve_s = time.perf_counter() - t0
    for req, ids, (top, scores) in zip(dataset.requests, eligible, answers):
        if not np.isin(top, ids).all():
            raise DemoError(f"request {req.request_id}: an answer is not eligible")
        if len(top) != min(k, len(ids)) or np.any(np.diff(scores) > 0):
            raise DemoError(f"request {req.request_id}: the answer is not the top-{k} in rank order")
    fractions = np.array([len(ids) / len(dataset.ads) for ids in eligible])
    dist = fraction_summary(fractions)
    echo(f"corpus: {len(dataset.ads)} ads, {len(dataset.requests)} requests, seed {seed}, "
         f"D={dataset.model.D}, E={dataset.model.E}, top-{dataset.model.top_k} experts")
    echo(f"match (oracle): {match_s:.2f} s; eligible per request: "
         + ", ".join(f"{key} {value:.1%}" for key, value in dist.items()))
    echo(f"retrieve (float64 reference, k={k}): {retrieve_s:.2f} s; every answer eligible and in rank order")
    echo(retrieve_table(dataset.requests, answers))
    return {"eligible_fraction": dist, "match_s": match_s, "retrieve_s": retrieve_s}
