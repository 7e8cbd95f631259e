"""Shared by the service reliability tests (test_inputs, test_wal, test_durability, test_consistency,
test_guard, test_limits, test_lifecycle): small corpora, servers in this process and as processes,
test certificates, and corpora edited on disk with their hashes recomputed (as a careful attacker
or a careless operator would)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andromeda_nb import store
from andromeda_nb.compare import compare_topk
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import MoeModel, quantize
from andromeda_nb.reference import ReferenceRetriever
from andromeda_nb.testing import random_ads, random_requests, random_updates, update_to_json
from serving.certificates import CertificateToolMissing, make_local_certificates

SEED = 0  # random_requests / random_ads derive with seed 0
D, F = 16, 8


def small_dataset(seed: int, n_ads: int = 200, n_requests: int = 6, precision: str = "fp32") -> Dataset:
    rng = np.random.default_rng(seed)
    ads = random_ads(rng, n_ads, dim=D, formats=F)
    requests = random_requests(rng, n_requests)
    table = quantize(np.stack([a.embedding for a in ads]), precision)
    return Dataset(ads=ads, embeddings=table, requests=requests, model=MoeModel.init(seed, D=D, F=F), seed=SEED,
                   precision=precision)


def saved_corpus(path: Path, seed: int, **kw):
    """A small corpus saved at `path` and read back (source_dir, meta and lineage as a served one)."""
    store.save_dataset(small_dataset(seed, **kw), path)
    return path, store.load_dataset(path)


def update_stream(dataset, n: int, seed: int) -> list:
    """`n` valid updates against the dataset's ads, in order (every one applies after the ones before)."""
    return random_updates(np.random.default_rng(seed), dataset.ads, n, dim=D, formats=F)


def lines_of(updates) -> str:
    return "\n".join(json.dumps(update_to_json(u)) for u in updates)


def reference_at(dataset, updates) -> ReferenceRetriever:
    reference = ReferenceRetriever.build(dataset)
    for update in updates:
        reference.apply(update)
    return reference


def assert_equals_reference(reference, requests, answers, k, context):
    """Top-K equal to the float64 reference (and, with k above every eligible count, the eligible set
    equal to the oracle's: the reference's index is the oracle)."""
    assert len(answers) == len(requests), context
    for request, (ids, scores) in zip(requests, answers):
        ref_ids, result = reference.score_eligible(request)
        cmp = compare_topk(ref_ids, result, ids, scores, k)
        assert cmp.ok, f"{context}, request {request.request_id}, k={k}: {cmp.message}"


def colocated_server(dataset, **kw):
    """The co-located server on the CPU engine, in this process, on a free loopback port."""
    from serving.engine_server import EngineServer
    from cpu_baseline.engine import CpuEngine

    return EngineServer(CpuEngine(dataset), dataset, "grpc://127.0.0.1:0", **kw)


def location(server, scheme: str = "grpc") -> str:
    return f"{scheme}://127.0.0.1:{server.port}"


def stop(server) -> None:
    server.shutdown()
    server.close_resources()


def make_certificates(root: Path) -> dict:
    """`serving.certificates.make_local_certificates`, the test skipped where openssl is missing."""
    try:
        return make_local_certificates(root)
    except CertificateToolMissing:
        pytest.skip("needs the openssl command to make test certificates")


def edit_corpus(root: Path, *, compiled: dict | None = None, ads_column: dict | None = None,
                meta: dict | None = None) -> None:
    """Edit a corpus directory in place and recompute the hashes meta.json records, so only the value
    checks can catch the edit: `compiled` {array: function(array) -> array} on targeting.npz,
    `ads_column` {column: function(list) -> list} on ads.parquet, `meta` {key: value}."""
    root = Path(root)
    if ads_column:
        table = pq.read_table(root / store.ADS_FILE)
        for name, fn in ads_column.items():
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.schema.field(i), pa.array(fn(table.column(name).to_pylist()),
                                                                         table.schema.field(i).type))
        pq.write_table(table, root / store.ADS_FILE)
    with np.load(root / store.TARGETING_FILE, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    for name, fn in (compiled or {}).items():
        arrays[name] = fn(arrays[name].copy())
    store._write_npz(root / store.TARGETING_FILE, arrays)
    doc = json.loads((root / store.META_FILE).read_text())
    doc["targeting"]["sha256"] = store.file_sha256(root / store.TARGETING_FILE)
    doc["targeting"]["ads_sha256"] = store.file_sha256(root / store.ADS_FILE)
    doc.update(meta or {})
    (root / store.META_FILE).write_text(json.dumps(doc))


def process_running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


ORPHAN_PATIENCE_S = 120.0  # how long an orphaned process may take to see its parent gone and end: the
# wait returns as soon as they have ended, and a loaded machine can take many seconds to stop a server


def ends_within(pids, seconds: float = ORPHAN_PATIENCE_S) -> list[int]:
    """Wait up to `seconds` for every process of `pids` to end; the ones still running."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(process_running(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if process_running(p)]
