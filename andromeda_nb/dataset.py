"""A loaded corpus: what `generate` and `import` write and every command reads.

On disk (a directory; `andromeda_nb.store` reads and writes it, checking `meta.json`'s schema_version):
    meta.json        schema_version, seed, sizes (D, E, k, F, S), precision, counts, generator settings
    ads.parquet      ad_id, status, start_time, end_time, format, targeting (JSON text),
                     embedding (fixed-size list of the stored dtype), scale (float32)
    requests.parquet request_id, request (JSON text: user, context, signals), as in the Flight protocol
    model.npz        W, b, K, A, B (float32), DESIGN section 3
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .types import Ad, Request


@dataclass
class Dataset:
    ads: list[Ad]  # validated ads, in file order
    embeddings: "EmbeddingTable"  # row i belongs to ads[i]
    requests: list[Request]
    model: "MoeModel"
    seed: int
    precision: str  # "fp32" | "fp16" | "int8"
    meta: dict = field(default_factory=dict)

    @property
    def formats(self) -> np.ndarray:
        return np.fromiter((a.format for a in self.ads), np.int16, len(self.ads))

    @property
    def ad_ids(self) -> np.ndarray:
        return np.fromiter((a.ad_id for a in self.ads), np.int64, len(self.ads))


from .model import EmbeddingTable, MoeModel  # noqa: E402  (type names for the annotations above)
