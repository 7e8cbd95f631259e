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
from .graphs import Copy, run_plan
from .kernels import score as score_kernels
from .kernels import topk as topk_kernels
from .kernels.tiles import TILE_ADS, to_tiles

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
        self._bufs_key, self._bufs_rows = None, 0

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
        self._bufs_key, self._bufs_rows = None, 0
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
        return values if self.kernel.layout == "rows" else to_tiles(values)

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
            tiles.add(slot // TILE_ADS)
        T = TILE_ADS
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
        self._bufs_key, self._bufs_rows = None, 0

    # --- scoring --------------------------------------------------------------------------------------
    def _buffers(self, R: int, k: int):
        """The launch buffers for `R` requests at `k`: views of the first R rows of one set of device
        (and pinned host) arrays the scorer keeps. The set grows to the largest batch seen (a power of
        two) and is remade only when k or the pool changes, so batches of changing sizes, as a server's
        are, allocate nothing (an allocation or a free synchronizes the device); the views of each
        batch size are made once."""
        key = (k, self.n_slots)
        if self._bufs_key != key or self._bufs_rows < R:
            rows = runtime.kept_rows(R, self._bufs_rows if self._bufs_key == key else 0)
            nb = score_kernels.n_blocks(self.n_slots, self.kernel.ads_per_block)
            cap = score_kernels.cap_for(k, self.kernel.ads_per_block)
            P = topk_kernels.scratch_size(k)
            n_seg = topk_kernels.n_segments(nb * cap)
            self._full = dict(
                cand_key=cuda.device_array((rows, nb, cap), np.uint32),
                cand_slot=cuda.device_array((rows, nb, cap), np.int32),
                sk=cuda.device_array((rows, P), np.uint32),
                ss=cuda.device_array((rows, P), np.int32),
                sid=cuda.device_array((rows, P), np.int64),
                out_id=cuda.device_array((rows, k), np.int64),
                out_score=cuda.device_array((rows, k), np.float32),
                out_count=cuda.device_array(rows, np.int32),
                seg_key=cuda.device_array((rows, n_seg, k), np.uint32),
                seg_slot=cuda.device_array((rows, n_seg, k), np.int32),
            )
            self._shared = {}  # pinned host buffers and the tables' upload state, for every view (see fetch)
            self._views = {}
            self._bufs_key, self._bufs_rows = key, rows
        b = self._views.get(R)
        if b is None:
            b = self._views[R] = {name: arr[:R] for name, arr in self._full.items()}
            b["shared"], b["rows"] = self._shared, R
        return b

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
        d_elig = elig if not isinstance(elig, np.ndarray) else cuda.to_device(np.ascontiguousarray(elig, np.uint32))
        d_tabs = tabs
        if isinstance(tabs, np.ndarray):  # into a device buffer kept with the others: no allocation per call
            d_tabs = self._upload_tables(self._buffers(elig.shape[0], k), np.ascontiguousarray(tabs, np.float32),
                                         stream)
        score, topk, b = self.plan(d_elig, d_tabs, k)
        run_plan(score, stream)
        if mark is not None:
            mark.record(stream)
        run_plan(topk, stream)
        return b

    def plan(self, elig, tabs, k: int) -> tuple[list, list, dict]:
        """Scoring and final top-K of `launch` as `gpu.graphs` plans (scoring, top-K), with `elig` and
        `tabs` (float32 (R, F, TW)) on the device, and the buffers the answers land in (`answer_plan`,
        `answers`)."""
        R = elig.shape[0]
        b = self._buffers(R, k)
        cap = score_kernels.cap_for(k, self.kernel.ads_per_block)
        score = self.kernel.plan(self.d_emb, self.d_scale, self.d_chunk_format, elig, tabs, cap,
                                 b["cand_key"], b["cand_slot"])
        topk = topk_kernels.version(None).recipe.plan(b["cand_key"], b["cand_slot"], cap, self.d_slot_ad_id, k, b, R)
        return score, topk, b

    def answer_plan(self, b) -> list:
        """The copies of a launch's answers into the pinned host buffers kept with `b`, as plan steps;
        `answers(b, R)` reads them once the stream has been synchronized."""
        hosts = self._answer_hosts(b)
        return [Copy(host, b[name], to_host=True) for name, host in zip(("out_count", "out_id", "out_score"), hosts)]

    def answers(self, b, R: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ad ids, scores) of each of the R requests, from the pinned buffers `answer_plan` copied into."""
        counts, ids, scores = self._answer_hosts(b)
        return [(ids[r, : counts[r]].copy(), scores[r, : counts[r]].copy()) for r in range(R)]

    def _answer_hosts(self, b) -> tuple:
        """Pinned host buffers for the answers of `b`'s rows (count, ids, scores): the first rows of one
        set kept with the others, the views made once per batch size."""
        hosts = b.get("hosts")
        if hosts is None:
            shared = b["shared"]
            if shared.get("host_count") is None:
                full = self._full
                shared["host_count"] = cuda.pinned_array(full["out_count"].shape, np.int32)
                shared["host_id"] = cuda.pinned_array(full["out_id"].shape, np.int64)
                shared["host_score"] = cuda.pinned_array(full["out_score"].shape, np.float32)
            n = b["rows"]
            hosts = b["hosts"] = (shared["host_count"][:n], shared["host_id"][:n], shared["host_score"][:n])
        return hosts

    def _upload_tables(self, b: dict, tabs: np.ndarray, stream):
        """The request tables into the device buffer kept with `b`, stream-ordered after any kernel
        still reading it. On a stream the copy goes through a pinned host buffer, so it is truly
        asynchronous: the host goes on to launch scoring and top-K while the match kernel before it
        still runs (from pageable memory the host would wait for the stream to reach the copy). The
        pinned buffer is refilled only once the copy of the previous launch is done (an event). Both
        buffers hold the scorer's largest batch; a batch uses its first rows."""
        shared, R = b["shared"], tabs.shape[0]
        if shared.get("tabs") is None or shared["tabs"].shape[1:] != tabs.shape[1:]:
            shape = (self._bufs_rows, *tabs.shape[1:])
            shared["tabs"] = cuda.device_array(shape, np.float32)
            shared["host_tabs"] = cuda.pinned_array(shape, np.float32) if stream else None
            shared["tabs_copied"] = None
            shared["tabs_views"] = {}
        views = shared["tabs_views"].get(R)
        if views is None:
            host = shared["host_tabs"]
            views = shared["tabs_views"][R] = (shared["tabs"][:R], None if host is None else host[:R])
        device, host = views
        if not stream or host is None:
            device.copy_to_device(tabs, stream=stream)
            return device
        if shared["tabs_copied"] is not None:
            shared["tabs_copied"].synchronize()  # the previous launch's copy has read the pinned buffer
        np.copyto(host, tabs)
        device.copy_to_device(host, stream=stream)
        if shared["tabs_copied"] is None:
            shared["tabs_copied"] = cuda.event()
        shared["tabs_copied"].record(stream)
        return device

    def fetch(self, b, R: int, stream=0) -> list[tuple[np.ndarray, np.ndarray]]:
        """The answers of a launch, to the host. On a stream: three asynchronous copies into pinned
        buffers kept with the others (the first R rows of each), then one synchronization; on the
        default stream each copy waits."""
        if not stream:
            counts = b["out_count"].copy_to_host()
            ids = b["out_id"].copy_to_host()
            scores = b["out_score"].copy_to_host()
            return [(ids[r, : counts[r]].copy(), scores[r, : counts[r]].copy()) for r in range(R)]
        run_plan(self.answer_plan(b), stream)
        stream.synchronize()
        return self.answers(b, R)

    def final_topk(self, b, cap: int, k: int, R: int, stream=0, version=None) -> None:
        """The final top-K of the per-block candidates in `b` (gpu.kernels.topk; default: its shipped
        version)."""
        topk_kernels.version(version).recipe.launch(b["cand_key"], b["cand_slot"], cap, self.d_slot_ad_id, k, b, R,
                                                    stream)


__all__ = ["FusedScorer"]
