"""The co-located server: the `["retrieve"]` exchange of DESIGN section 5 (`serving.protocol`), with
`health`, `stats`, `update` and `compact`, around any `andromeda_nb.interfaces.Engine`: the engine
matches, scores and selects next to the ads, and only the final candidates leave the process.

Updates are durable (`serving.durable`): an `update` call is acknowledged once its accepted
updates are in the write-ahead log on disk (`serving.wal`, by default `DIR/updates.log` beside
the corpus), then applied to the engine in slices, between batches: one batch is on the engine at
a time, so an update acknowledged before a request starts is visible to it (DESIGN section 6) and
no request sees half an update. On start the server replays the log's records after its snapshot
before it listens, so the same command started again serves exactly what it acknowledged. Every
answer batch carries the sequence number of the last update it reflects (`{"seq": n}` as
app_metadata).

Requests of exchanges that arrive together share one engine batch (`serving.batcher`): a GPU
engine reads the pool once per launch whether it serves one request or sixty-four, so many plain
clients sending a request each get batch throughput; a request waits at most `batch_wait_s` (0.2 ms
by default, `serve colocated --batch-wait-ms`) for company.
"""

from __future__ import annotations

import threading

from andromeda_nb import rows
from andromeda_nb.dataset import fingerprint
from andromeda_nb.engine import warm_up

from .batcher import DEFAULT_MAX_WAIT_S, RequestBatcher
from .durable import JournaledServer, ReadGate, UpdateJournal
from .limits import DEFAULT_LIMITS
from .overlap import OverlappedBatches, UpdatesLock
from .protocol import RetrieveServer, batch_bytes
from .wal import WriteAheadLog, corpus_lineage, snapshot_seq


def _columnar_rows(batch) -> int | None:
    """A columnar request batch's requests, counted without decoding it (its calls are decoded with
    the rest of their engine batch, as one); None for a JSON batch, decoded as it is taken."""
    from .request_columns import is_columnar

    return batch.num_rows if is_columnar(batch.schema) else None


class EngineServer(JournaledServer, RetrieveServer):
    name = "colocated"

    def __init__(self, engine, dataset, location: str = "grpc://127.0.0.1:0", *, log: WriteAheadLog | None = None,
                 limits=None, guard=None, data_dir=None, batch_wait_s: float = DEFAULT_MAX_WAIT_S,
                 decode_ahead: bool = False, overlap: bool = False):
        model = dataset.model
        limits = limits or DEFAULT_LIMITS
        self.engine = engine
        self.dim, self.formats = model.D, model.F
        self.fingerprint = fingerprint(dataset.ad_ids)  # the ad id of each row of the snapshot, as the remote services
        self.lineage = corpus_lineage(dataset)
        self.data_dir = data_dir if data_dir is not None else getattr(dataset, "source_dir", None)
        self._lock = threading.Lock()  # one batch on the engine at a time; update slices between batches
        # `overlap`: the next batch's host work while the device answers the one before (serving.overlap);
        # the lock then stays with the batcher while a batch is in flight, and updates say they wait for it
        self.overlap = OverlappedBatches(engine, self._lock, lambda: self.seq) if overlap else None
        self._updates_lock = UpdatesLock(self._lock, self.overlap)
        self.gate = ReadGate()
        self.log = log if log is not None else WriteAheadLog.memory(self.lineage, snapshot_seq(dataset))
        self.seq = snapshot_seq(dataset)
        self.journal = UpdateJournal(self.log, seed=dataset.seed, dim=model.D, formats=model.F, limits=limits,
                                     gate=self.gate)
        self.replayed = self.journal.replay(self._apply, engine.__contains__)  # before anyone can call
        warm_up(engine, dataset.requests, (1, limits.max_k))  # every kernel before the first client
        rows.warm_up()  # ... and what the first update needs
        # requests of concurrent exchanges share engine batches (serving.batcher), at most
        # batch_wait_s later than alone, never more than one batch's limit of requests; the batcher
        # decodes the exchanges' batches (between batches, or a stage ahead of the engine with
        # `decode_ahead`) and encodes their answers (`submit_payload`)
        self.batcher = RequestBatcher(self._run_batch, max_wait_s=batch_wait_s, max_requests=limits.max_batch_requests,
                                      name="colocated-batcher", decode=self.decode, encode=self.encode,
                                      encode_many=self.encode_many, decode_many=self.decode_many,
                                      decode_ahead=decode_ahead, count=_columnar_rows, overlap=self.overlap)
        super().__init__(location, seed=dataset.seed, experts=model.E, width=model.S, limits=limits, guard=guard)

    @property
    def device(self) -> str:
        return self.engine.device

    def _apply(self, items) -> int:
        """Apply a slice to the engine; a request waiting for the engine cuts it short after the
        updates in hand (the journal hands over the rest after the request): one at a time, or the
        engine's `apply_run` at a time through its `apply_many` (the CPU engine: a few upserts
        compiled and stored at once), except on an engine that applies a slice in one piece
        (`apply_many` without `apply_run`: the GPU engine's one upload). Returns how many."""
        apply_many = getattr(self.engine, "apply_many", None)
        run = getattr(self.engine, "apply_run", None) if apply_many is not None else 1
        with self._updates_lock:
            done = 0
            try:
                if run is None:  # one piece for the slice, so the slice goes whole
                    apply_many([update for _, update in items])
                    done = len(items)
                while done < len(items):
                    piece = items[done : done + run]
                    if apply_many is not None:
                        apply_many([update for _, update in piece])
                    else:
                        self.engine.apply(piece[0][1])
                    done += len(piece)
                    if self.gate.busy:
                        break
                prepare = getattr(self.engine, "prepare", None)
                if prepare is not None:  # the slice's cost is paid here, not by the next request
                    prepare()
            finally:  # answers name the last update the engine holds, also when one failed to apply
                if done:
                    self.seq = items[done - 1][0].seq
        return done

    def _run_batch(self, requests, k):
        with self._lock:
            return self.engine.retrieve(requests, k), self.seq

    def serve_batch(self, batch, times=None):
        self.stats.add(bytes_in=batch_bytes(batch))
        if batch.num_rows == 0:  # nothing for the engine: checked and answered here, at the current seq
            self.decode(batch)
            return self.encode([], [], self.seq)
        return self.batcher.submit_payload(batch, times)

    def retrieve_at(self, requests, ks):
        if not requests:
            return [], self.seq
        return self.batcher.submit(requests, ks)

    def retrieve(self, requests, ks):
        return self.retrieve_at(requests, ks)[0]

    def current_seq(self) -> int:
        return self.seq

    def apply_updates(self, body: bytes, started: float) -> dict:
        ack = self.journal.submit(body, live=self.engine.__contains__, apply=self._apply)
        self.stats.add(updates=ack["applied"])
        return ack

    def health_state(self) -> tuple[str, list[str]]:
        if self.journal.failed is not None:
            return "degraded", [f"update calls are refused: {self.journal.failed}"]
        return "ok", []

    def health_info(self) -> dict:
        return {**self.engine.describe(), "fingerprint": self.fingerprint, "lineage": self.lineage,
                "log": self.log.describe(), "replayed": self.replayed}

    def extra_stats(self) -> dict:
        # device seconds in the engine's launches so far (None: no device, or the simulator)
        return {"batching": self.batcher.stats(), "call_path": self.call_path.snapshot(),
                "device_seconds": getattr(self.engine, "device_seconds", None)}

    def close_resources(self) -> None:
        self.batcher.close()
        self.engine.close()
        self.log.close()


__all__ = ["EngineServer"]
