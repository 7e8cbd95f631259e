"""The co-located architecture (`--arch colocated`): one process matches, scores and selects top-K next
to the ads, and only the final candidates leave it.

* `ColocatedEngine`: the in-process pipeline for one corpus on one device.
    - 'gpu' / 'sim': `gpu.index.GpuTargetingIndex` writes eligibility bits in slot order on the device;
      `gpu.fused.FusedScorer` holds the embeddings in the same slot order and runs the fused scoring
      kernel (per-block top-K inside) and the final top-K kernel. Per batch: the user side of every
      request once on the host (float64, folded into per-format float32 tables,
      `andromeda_nb.scoring.fold_tables`), one match launch, one scoring launch, one top-K launch.
    - 'cpu': `cpu_baseline.index.CpuTargetingIndex` matches; the same per-ad formula
      (`andromeda_nb.scoring.moe_score`) compiled by `numba.njit` scores the eligible ads; top-K in
      numpy (`gpu.kernels.topk.topk_host`).
  Updates (DESIGN section 6) go to the index and to the embedding table in the same slot.
* `ColocatedServer`: `andromeda_nb.flight.RetrieveServer` around an engine: the `["retrieve"]` exchange,
  `health`, `stats`, `update` (`andromeda serve colocated`; `python -m gpu.serve`).
* `ColocatedRetriever`: `interfaces.Retriever`. In process by default; with `served=True` or
  `traffic=True` it starts the server as a subprocess on 127.0.0.1 and talks Flight to it (through a
  counting relay with `traffic=True`, so `retrieve_traffic` reports real bytes on the wire).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from andromeda_nb.devices import resolve
from andromeda_nb.model import quantize, user_side
from andromeda_nb.rows import RowMap, fit_rows
from andromeda_nb.scoring import fold_user_side
from andromeda_nb.services import (ServedRetriever, ServiceProcess, check_same_corpus, dataset_args, fingerprint,
                                   relay_in_front, stop_all)
from andromeda_nb.types import Request, Retire, SetStatus, Update, Upsert

MAX_BATCH = 64  # requests per device launch
START_TIMEOUT_S = 180.0
SERVE_MODULE = "gpu.serve"


def _stored(ad, seed: int, dim: int, precision: str):
    emb = ad.embedding
    if emb is None:
        from andromeda_nb.derive import ad_embedding

        emb = ad_embedding(ad.ad_id, seed, dim)
    emb = np.asarray(emb, np.float32)
    if emb.shape != (dim,):
        raise ValueError(f"ad {ad.ad_id}: embedding: expected {dim} values, got {emb.shape}")
    t = quantize(emb[None, :], precision)
    return t.values[0], float(t.scale[0])


# --- CPU scoring: the same per-ad formula under numba.njit ----------------------------------------------

_cpu_kernels = {}


def _cpu_scorer():
    if "score" not in _cpu_kernels:
        from numba import njit

        from andromeda_nb.scoring import moe_score

        moe = njit(cache=True)(moe_score)

        @njit(cache=True)
        def score_rows(emb, scale, rows, formats, tab, E, D, top_e, out):
            g = np.empty(E, np.float32)
            for i in range(len(rows)):
                r = rows[i]
                out[i] = moe(emb, r, scale[r], tab, formats[r], E, D, top_e, g)

        _cpu_kernels["score"] = score_rows
    return _cpu_kernels["score"]


def cpu_scores(values, scale, rows, formats, tab, experts: int, top_e: int) -> np.ndarray:
    """float32 scores of table rows `rows` (formats per row in `formats`) for one request's folded
    table `tab` (F, TW)."""
    out = np.empty(len(rows), np.float32)
    if len(rows):
        _cpu_scorer()(values, scale, np.asarray(rows, np.int64), formats, tab, experts, values.shape[1], top_e, out)
    return out


# --- the engine -----------------------------------------------------------------------------------------


class ColocatedEngine:
    def __init__(self, dataset, device: str = "auto", *, version: int | None = None):
        self.device = resolve(device)
        self.model = dataset.model
        self.seed = dataset.seed
        self.precision = dataset.precision
        self.E, self.D, self.F, self.top_e = self.model.E, self.model.D, self.model.F, self.model.top_k
        values, scale = dataset.embeddings.values, dataset.embeddings.scale
        ids = dataset.ad_ids
        if self.device == "cpu":
            from cpu_baseline.index import CpuTargetingIndex

            self.index = CpuTargetingIndex.from_compiled(dataset.compiled)  # no ad parsed
            # numba's CPU target has no float16 arrays: fp16 values are widened to float32 (exact)
            self._values = values.astype(np.float32) if values.dtype == np.float16 else values.copy()
            self._scale = scale.copy()
            self._formats = dataset.formats.astype(np.int64)
            self._rows = RowMap(ids)
        else:
            from .fused import FusedScorer
            from .index import GpuTargetingIndex

            self.index = GpuTargetingIndex.from_compiled(dataset.compiled, device=self.device)
            slots = self.index.slots
            S = slots.capacity
            sv = np.zeros((S, self.D), values.dtype)
            ss = np.ones(S, np.float32)
            used = np.flatnonzero(slots.slot_ad_id >= 0)
            rows = RowMap(ids).rows_of(slots.slot_ad_id[used])
            sv[used] = values[rows]
            ss[used] = scale[rows]
            self.scorer = FusedScorer(sv, ss, slots.chunk_format, slots.slot_ad_id.copy(), experts=self.E,
                                      top_e=self.top_e, version=version)
        self.requests_served = 0
        self.ads_scored_bound = 0  # pool ads processed (requests x pool)

    def __len__(self) -> int:
        return len(self.index)

    # --- per request ------------------------------------------------------------------------------
    def tables(self, requests: Sequence[Request]) -> np.ndarray:
        """float32 (R, F, TW): the folded per-format tables of each request's user side."""
        return np.stack([fold_user_side(user_side(self.model, r)) for r in requests])

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        requests = list(requests)
        out: list[tuple[np.ndarray, np.ndarray]] = []
        for lo in range(0, len(requests), MAX_BATCH):
            part = requests[lo : lo + MAX_BATCH]
            out.extend(self._retrieve_cpu(part, k) if self.device == "cpu" else self._retrieve_device(part, k))
        self.requests_served += len(requests)
        return out

    def _retrieve_device(self, requests, k):
        from andromeda_nb.compiled import encode_request

        if self.scorer.n_slots != self.index.capacity:  # grown by updates
            self.scorer.grow(self.index.slots.chunk_format, self.index.slots.slot_ad_id)
        if self.index.capacity == 0:  # built from no ads, none created yet: nothing to launch over
            return [(np.empty(0, np.int64), np.empty(0, np.float32)) for _ in requests]
        tabs = self.tables(requests)
        elig = self.index.match_slots([encode_request(r) for r in requests], out=self.index.kept_output(len(requests)))
        return self.scorer.topk(elig, tabs, k)

    def _retrieve_cpu(self, requests, k):
        from .kernels.topk import topk_host

        out = []
        for request, ids in zip(requests, self.index.match(requests)):
            if not len(ids):
                out.append((np.empty(0, np.int64), np.empty(0, np.float32)))
                continue
            tab = fold_user_side(user_side(self.model, request))
            rows = self._rows.rows_of(ids)
            scores = cpu_scores(self._values, self._scale, rows, self._formats, tab, self.E, self.top_e)
            out.append(topk_host(ids, scores, k))
        return out

    # --- updates -------------------------------------------------------------------------------------
    def apply(self, update: Update) -> None:
        """Apply one update that `andromeda_nb.updates` already checked against the live ids."""
        if isinstance(update, Upsert):
            ad = update.ad
            if not 0 <= ad.format < self.F:
                raise ValueError(f"ad {ad.ad_id}: format {ad.format} is outside 0..{self.F - 1}")
            values, scale = _stored(ad, self.seed, self.D, self.precision)
        elif not isinstance(update, (SetStatus, Retire)):
            raise TypeError(f"not an update: {update!r}")
        self.index.apply(update)
        if self.device == "cpu":
            self._apply_cpu(update, *((values, scale) if isinstance(update, Upsert) else (None, None)))
            return
        if isinstance(update, Upsert):
            slots = self.index.slots
            if self.scorer.n_slots != slots.capacity:
                self.scorer.grow(slots.chunk_format, slots.slot_ad_id)
            self.scorer.set_slot(slots.slot_of(ad.ad_id), ad.ad_id, values, scale)

    def _apply_cpu(self, update, values, scale) -> None:
        if isinstance(update, Upsert):
            row, _ = self._rows.assign(update.ad.ad_id)
            n = self._rows.n_rows
            self._values = fit_rows(self._values, n)
            self._scale = fit_rows(self._scale, n, 1.0)
            self._formats = fit_rows(self._formats, n)
            self._values[row] = values
            self._scale[row] = scale
            self._formats[row] = update.ad.format
        elif isinstance(update, Retire):
            self._rows.release(update.ad_id)

    def describe(self) -> dict:
        out = {"device": self.device, "ads": len(self), "precision": self.precision, "D": self.D, "E": self.E,
               "F": self.F, "top_k": self.top_e}
        if self.device != "cpu":
            out.update(score_version=self.scorer.version, match_version=self.index.version,
                       slots=self.scorer.n_slots)
        return out

    def close(self) -> None:
        close = getattr(self.index, "close", None)
        if close is not None:
            close()


# --- the server -----------------------------------------------------------------------------------------


def make_server(dataset, location: str = "grpc://127.0.0.1:0", device: str = "auto", version: int | None = None):
    """A `ColocatedServer` (class defined here so that pyarrow.flight loads only when serving)."""
    from andromeda_nb.flight import RetrieveServer

    class ColocatedServer(RetrieveServer):
        name = "colocated"

        def __init__(self):
            self.engine = ColocatedEngine(dataset, device, version=version)
            model = dataset.model
            super().__init__(location, seed=dataset.seed, experts=model.E, width=model.S)
            self._lock = threading.Lock()  # one batch on the device at a time; updates between batches
            if dataset.requests:  # compile / load every kernel before the first client
                self.engine.retrieve(dataset.requests[:1], 1)

        def retrieve(self, requests, ks):
            if not requests:
                return []
            with self._lock:
                answers = self.engine.retrieve(requests, max(ks))
            return [(ids[:k], scores[:k]) for (ids, scores), k in zip(answers, ks)]

        def apply_updates(self, text: str) -> dict:
            from andromeda_nb.updates import IndexLiveIds, apply_updates, read_updates, update_answer

            updates, rejections = read_updates(text.splitlines(), seed=self.seed, dim=model_dim, formats=model_f)
            with self._lock:
                not_live = apply_updates(updates, [self.engine], IndexLiveIds(self.engine.index))
            applied = len(updates) - len(not_live)
            self.stats.add(updates=applied)
            return update_answer(applied, rejections + not_live)

        def health_info(self) -> dict:
            return {**self.engine.describe(), "fingerprint": corpus_fingerprint}

        def close_resources(self) -> None:
            self.engine.close()

    model_dim, model_f = dataset.model.D, dataset.model.F
    corpus_fingerprint = fingerprint(dataset.ad_ids)  # the ad id of each row at start, as the remote services
    return ColocatedServer()


# --- the retriever --------------------------------------------------------------------------------------


class ColocatedRetriever(ServedRetriever):
    """`interfaces.Retriever` for the co-located architecture: in process, or over Flight to a server
    (retrieve, traffic, updates and actions: `andromeda_nb.services.ServedRetriever`)."""

    server_name = "the co-located server"

    def __init__(self, engine: ColocatedEngine | None = None, *, location: str | None = None, process=None,
                 relays=None, tmpdir=None, timeout_s: float = 60.0):
        self.engine = engine
        self.location = location
        self.process = process
        self.relays = relays or {}
        self._tmpdir = tmpdir
        self.timeout_s = timeout_s
        self.client = None
        self.device = engine.device if engine is not None else None
        if location is not None:
            import pyarrow.flight as flight

            from andromeda_nb.flight import flight_action

            self.client = flight.connect(location)
            self.device = flight_action(location, "health", client=self.client).get("device")

    @classmethod
    def build(cls, dataset, device: str = "auto", *, served: bool = False, traffic: bool = False,
              host: str | None = None, version: int | None = None, **options) -> "ColocatedRetriever":
        if options:
            raise TypeError(f"unknown option(s) for the co-located retriever: {', '.join(options)}")
        if not (served or traffic or host):
            return cls(ColocatedEngine(dataset, device, version=version))
        from andromeda_nb.flight import location_of, wait_until_healthy

        proc, tmp, relays = None, None, {}
        data_dir = getattr(dataset, "source_dir", None)  # read from a directory: the server loads it
        try:
            if host is None:  # a dataset made in memory travels as a pickle
                source, tmp = dataset_args(dataset, data_dir, prefix="andromeda-colocated-")
                args = [*source, "--device", device]
                if version is not None:
                    args += ["--version", str(version)]
                proc = ServiceProcess(SERVE_MODULE, args, name="the co-located server", start_timeout_s=START_TIMEOUT_S)
                host = proc.location
            location = location_of(host)
            wait_until_healthy(location, timeout=30.0)
            if proc is not None and data_dir is not None:
                check_same_corpus(location, dataset, data_dir, "the co-located server")
            if traffic:
                relays["client->server"] = relay_in_front(location)
                location = relays["client->server"].location
            return cls(location=location, process=proc, relays=relays, tmpdir=tmp)
        except BaseException:
            stop_all([proc] if proc is not None else [], relays, tmp)
            raise

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.engine is not None:
            return self.engine.retrieve(requests, k)
        return super().retrieve(requests, k)

    def apply(self, update: Update) -> None:
        if self.engine is not None:
            self.engine.apply(update)
            return
        super().apply(update)

    def close(self) -> None:
        self.close_client()
        stop_all([self.process] if self.process is not None else [], self.relays, self._tmpdir)
        self._tmpdir = None
        if self.engine is not None:
            self.engine.close()


__all__ = ["ColocatedEngine", "ColocatedRetriever", "cpu_scores", "make_server"]
