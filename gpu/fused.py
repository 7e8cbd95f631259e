"""The device half of the co-located path: a slot-ordered embedding table on the GPU (or the simulator),
the fused scoring kernel and the final top-K, bound once and reused for every request batch.

    scorer = FusedScorer(values, scale, chunk_format, slot_ad_id, experts=E, top_e=k)
    answers = scorer.topk(elig, tabs, k)      # elig uint32 (R, S/32) device or host; tabs (R, F, TW)

`values` are row-major stored embeddings in slot order (S, D) (float32, float16 or int8); the table is
converted once to the chosen kernel version's layout (`gpu.kernels.score`). `version` is a number of
the shipped table (`gpu.kernels.score.VERSIONS`) or a `Version` of the kernel lab (`gpu/lab/score.py`);
default: the shipped one. Scratch and output buffers
are allocated for the largest batch and k seen and reused. Updates write slots (`set_slot`,
`set_slots`: the changed tiles, once each) or grow the table by whole chunks (`grow`).
"""

from __future__ import annotations

import numpy as np

from andromeda_nb.budget import stored_ad_bytes
from andromeda_nb.model import PRECISION_OF_DTYPE
from andromeda_nb.slots import CHUNK_SLOTS

from . import runtime
from .kernels import score as score_kernels
from .kernels import topk as topk_kernels

cuda = runtime.cuda()


class FusedScorer:
    def __init__(self, values: np.ndarray, scale: np.ndarray, chunk_format: np.ndarray, slot_ad_id: np.ndarray,
                 *, experts: int, top_e: int, version=None, kind: str = "moe"):
        values = np.ascontiguousarray(values)
        if values.dtype not in PRECISION_OF_DTYPE:
            raise ValueError(f"stored embeddings must be float32, float16 or int8, got {values.dtype}")
        self.precision = PRECISION_OF_DTYPE[values.dtype]
        self.dim = values.shape[1]
        self.experts, self.top_e, self.kind = experts, top_e, kind
        self.kernel_version = score_kernels.version(version, kind, self.precision, self.dim)
        self.kernel = score_kernels.get_kernel(self.kernel_version, kind, self.precision, self.dim, experts, top_e)
        self._values = values  # host copy in slot order: updates patch it and the device table
        self._scale = np.ascontiguousarray(scale, np.float32)
        self._chunk_format = np.ascontiguousarray(chunk_format, np.int32)
        self._slot_ad_id = np.ascontiguousarray(slot_ad_id, np.int64)
        self._check_shapes()
        self._upload()
        self._bufs_key = None

    @classmethod
    def on_device(cls, d_emb, d_scale, chunk_format: np.ndarray, slot_ad_id: np.ndarray, *, precision: str,
                  dim: int, experts: int, top_e: int, version=None, kind: str = "moe") -> "FusedScorer":
        """A scorer over a table already on the device in the version's layout (benchmarks: pools
        generated on the GPU). Such a scorer takes no updates."""
        self = cls.__new__(cls)
        self.precision, self.dim, self.experts, self.top_e, self.kind = precision, dim, experts, top_e, kind
        self.kernel_version = score_kernels.version(version, kind, precision, dim)
        self.kernel = score_kernels.get_kernel(self.kernel_version, kind, precision, dim, experts, top_e)
        self._values = None
        self._chunk_format = np.ascontiguousarray(chunk_format, np.int32)
        self._slot_ad_id = np.ascontiguousarray(slot_ad_id, np.int64)
        self.d_emb, self.d_scale = d_emb, d_scale
        self.d_chunk_format = cuda.to_device(self._chunk_format)
        self.d_slot_ad_id = cuda.to_device(self._slot_ad_id)
        self._bufs_key = None
        return self

    @property
    def version(self) -> int:
        """The number of the scoring kernel this scorer runs."""
        return self.kernel_version.number

    # --- device state -------------------------------------------------------------------------------
    def _check_shapes(self):
        S = self._values.shape[0]
        if S % CHUNK_SLOTS or self._chunk_format.shape[0] * CHUNK_SLOTS != S:
            raise ValueError(f"{S} slots do not match {self._chunk_format.shape[0]} chunks of {CHUNK_SLOTS}")
        if self._scale.shape != (S,) or self._slot_ad_id.shape != (S,):
            raise ValueError("scale and slot_ad_id must have one entry per slot")

    def _device_values(self, values: np.ndarray) -> np.ndarray:
        return values if self.kernel.layout == "rows" else score_kernels.to_tiles(values)

    def _upload(self):
        self.d_emb = cuda.to_device(self._device_values(self._values))
        self.d_scale = cuda.to_device(self._scale)
        self.d_chunk_format = cuda.to_device(self._chunk_format)
        self.d_slot_ad_id = cuda.to_device(self._slot_ad_id)

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one stored embedding row: what scoring an eligible ad reads of the table."""
        return stored_ad_bytes(self.precision, self.dim)

    @property
    def n_slots(self) -> int:
        return self._chunk_format.shape[0] * CHUNK_SLOTS

    def set_slot(self, slot: int, ad_id: int, values: np.ndarray | None, scale: float = 1.0) -> None:
        """Write one slot (an upsert: new values; a retire: ad_id EMPTY and values None)."""
        self.set_slots([(slot, ad_id, values, scale)])

    def set_slots(self, writes) -> None:
        """Write several slots, each `(slot, ad_id, values | None, scale)` as `set_slot` takes it, in
        order: the host copy first, then every changed tile (32 slots) copied to the device once, with
        its scales and ad ids, into views of the device arrays (no allocation, no kernel: three small
        copies a tile, where assigning device array items allocates and launches for each)."""
        tiles = set()
        for slot, ad_id, values, scale in writes:
            self._slot_ad_id[slot] = ad_id
            if values is not None:
                self._values[slot] = values
                self._scale[slot] = scale
            tiles.add(slot // score_kernels.TILE_ADS)
        T = score_kernels.TILE_ADS
        for t in sorted(tiles):
            lo, hi = t * T, (t + 1) * T
            tile = np.ascontiguousarray(self._device_values(self._values[lo:hi]))
            n = tile.shape[0]  # rows (layout 'rows') or words of the 32 slots (layout 'tiles')
            self.d_emb[lo * n // T : hi * n // T].copy_to_device(tile)
            self.d_scale[lo:hi].copy_to_device(self._scale[lo:hi])
            self.d_slot_ad_id[lo:hi].copy_to_device(self._slot_ad_id[lo:hi])

    def grow(self, chunk_format: np.ndarray, slot_ad_id: np.ndarray) -> None:
        """The slot allocator grew by whole chunks: extend the table (new slots empty) and re-upload."""
        S = len(slot_ad_id)
        extra = S - self.n_slots
        if extra < 0:
            raise ValueError("the table never shrinks")
        self._values = np.concatenate([self._values, np.zeros((extra, self.dim), self._values.dtype)])
        self._scale = np.concatenate([self._scale, np.ones(extra, np.float32)])
        self._chunk_format = np.ascontiguousarray(chunk_format, np.int32)
        self._slot_ad_id = np.ascontiguousarray(slot_ad_id, np.int64).copy()
        self._check_shapes()
        self._upload()
        self._bufs_key = None

    # --- scoring --------------------------------------------------------------------------------------
    def _buffers(self, R: int, k: int):
        key = (R, k, self.n_slots)
        if self._bufs_key != key:
            nb = score_kernels.n_blocks(self.n_slots, self.kernel.ads_per_block)
            cap = score_kernels.cap_for(k, self.kernel.ads_per_block)
            P = topk_kernels.scratch_size(k)
            n_seg = topk_kernels.n_segments(nb * cap)
            self._bufs = dict(
                cand_key=cuda.device_array((R, nb, cap), np.uint32),
                cand_slot=cuda.device_array((R, nb, cap), np.int32),
                sk=cuda.device_array((R, P), np.uint32),
                ss=cuda.device_array((R, P), np.int32),
                sid=cuda.device_array((R, P), np.int64),
                out_id=cuda.device_array((R, k), np.int64),
                out_score=cuda.device_array((R, k), np.float32),
                out_count=cuda.device_array(R, np.int32),
                seg_key=cuda.device_array((R, n_seg, k), np.uint32),
                seg_slot=cuda.device_array((R, n_seg, k), np.int32),
            )
            self._bufs_key = key
        return self._bufs

    def topk(self, elig, tabs, k: int, stream=0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Top-k (ad ids int64, scores float32) per request. `elig` uint32 (R, S/32), `tabs` float32
        (R, F, TW); either may be a host or a device array."""
        R = elig.shape[0]
        if R == 0:
            return []
        if elig.shape[1] * 32 != self.n_slots:
            raise ValueError(f"eligibility covers {elig.shape[1] * 32} slots, the table {self.n_slots}")
        b = self.launch(elig, tabs, k, stream)
        return self.fetch(b, R, stream)

    def launch(self, elig, tabs, k: int, stream=0, mark=None) -> dict:
        """Launch scoring and final top-K (asynchronous); returns the buffers `fetch` reads. `mark`, a
        CUDA event, is recorded between the two (benchmarks time the kernels apart with it)."""
        R = elig.shape[0]
        b = self._buffers(R, k)
        d_elig = elig if not isinstance(elig, np.ndarray) else cuda.to_device(np.ascontiguousarray(elig, np.uint32))
        d_tabs = tabs
        if isinstance(tabs, np.ndarray):  # into a device buffer kept with the others: no allocation per call
            d_tabs = self._upload_tables(b, np.ascontiguousarray(tabs, np.float32), stream)
        cap = score_kernels.cap_for(k, self.kernel.ads_per_block)
        self.kernel.launch(self.d_emb, self.d_scale, self.d_chunk_format, d_elig, d_tabs, cap,
                           b["cand_key"], b["cand_slot"], stream)
        if mark is not None:
            mark.record(stream)
        self.final_topk(b, cap, k, R, stream)
        return b

    def _upload_tables(self, b: dict, tabs: np.ndarray, stream):
        """The request tables into the device buffer kept with `b`, stream-ordered after any kernel
        still reading it. On a stream the copy goes through a pinned host buffer, so it is truly
        asynchronous: the host goes on to launch scoring and top-K while the match kernel before it
        still runs (from pageable memory the host would wait for the stream to reach the copy). The
        pinned buffer is refilled only once the copy of the previous launch is done (an event)."""
        if b.get("tabs") is None or tuple(b["tabs"].shape) != tabs.shape:
            b["tabs"] = cuda.device_array(tabs.shape, np.float32)
            b["host_tabs"] = cuda.pinned_array(tabs.shape, np.float32) if stream else None
            b["tabs_copied"] = None
        if not stream or b.get("host_tabs") is None:
            b["tabs"].copy_to_device(tabs, stream=stream)
            return b["tabs"]
        if b["tabs_copied"] is not None:
            b["tabs_copied"].synchronize()  # the previous launch's copy has read the pinned buffer
        np.copyto(b["host_tabs"], tabs)
        b["tabs"].copy_to_device(b["host_tabs"], stream=stream)
        if b["tabs_copied"] is None:
            b["tabs_copied"] = cuda.event()
        b["tabs_copied"].record(stream)
        return b["tabs"]

    def fetch(self, b, R: int, stream=0) -> list[tuple[np.ndarray, np.ndarray]]:
        """The answers of a launch, to the host. On a stream: three asynchronous copies into pinned
        buffers kept with the others, then one synchronization; on the default stream each copy waits."""
        if not stream:
            counts = b["out_count"].copy_to_host()
            ids = b["out_id"].copy_to_host()
            scores = b["out_score"].copy_to_host()
        else:
            if b.get("host_count") is None:
                b["host_count"] = cuda.pinned_array(b["out_count"].shape, np.int32)
                b["host_id"] = cuda.pinned_array(b["out_id"].shape, np.int64)
                b["host_score"] = cuda.pinned_array(b["out_score"].shape, np.float32)
            counts, ids, scores = b["host_count"], b["host_id"], b["host_score"]
            b["out_count"].copy_to_host(counts, stream=stream)
            b["out_id"].copy_to_host(ids, stream=stream)
            b["out_score"].copy_to_host(scores, stream=stream)
            stream.synchronize()
        return [(ids[r, : counts[r]].copy(), scores[r, : counts[r]].copy()) for r in range(R)]

    def final_topk(self, b, cap: int, k: int, R: int, stream=0, version=None) -> None:
        """The final top-K of the per-block candidates in `b` (gpu.kernels.topk; default: its shipped
        version)."""
        topk_kernels.version(version).recipe.launch(b["cand_key"], b["cand_slot"], cap, self.d_slot_ad_id, k, b, R,
                                                    stream)


__all__ = ["FusedScorer"]
