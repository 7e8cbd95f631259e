"""The co-located server: the `["retrieve"]` exchange of DESIGN section 5 (`andromeda_nb.flight`), with
`health`, `stats` and `update`, around any `andromeda_nb.interfaces.Engine`: the engine matches,
scores and selects next to the ads, and only the final candidates leave the process.

One batch is on the engine at a time; updates apply between batches, so an update acknowledged
before a request starts is visible to it (DESIGN section 6).
"""

from __future__ import annotations

import threading

from .flight import RetrieveServer
from .services import fingerprint
from .updates import IndexLiveIds, apply_updates, read_updates, update_answer


class EngineServer(RetrieveServer):
    name = "colocated"

    def __init__(self, engine, dataset, location: str = "grpc://127.0.0.1:0"):
        model = dataset.model
        super().__init__(location, seed=dataset.seed, experts=model.E, width=model.S)
        self.engine = engine
        self.dim, self.formats = model.D, model.F
        self.fingerprint = fingerprint(dataset.ad_ids)  # the ad id of each row at start, as the remote services
        self._lock = threading.Lock()  # one batch on the engine at a time; updates between batches
        if dataset.requests:  # compile / load every kernel before the first client
            self.engine.retrieve(dataset.requests[:1], 1)

    def retrieve(self, requests, ks):
        if not requests:
            return []
        with self._lock:
            answers = self.engine.retrieve(requests, max(ks))
        return [(ids[:k], scores[:k]) for (ids, scores), k in zip(answers, ks)]

    def apply_updates(self, text: str) -> dict:
        updates, rejections = read_updates(text.splitlines(), seed=self.seed, dim=self.dim, formats=self.formats)
        with self._lock:
            not_live = apply_updates(updates, [self.engine], IndexLiveIds(self.engine))
        applied = len(updates) - len(not_live)
        self.stats.add(updates=applied)
        return update_answer(applied, rejections + not_live)

    def health_info(self) -> dict:
        return {**self.engine.describe(), "fingerprint": self.fingerprint}

    def close_resources(self) -> None:
        self.engine.close()


__all__ = ["EngineServer"]
