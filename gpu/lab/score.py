"""The scoring kernel lab: every version of the fused scoring kernel, the superseded ones beside the
shipped one (`gpu/kernels/score.py`), so that `andromeda bench score` still times them and the tests
still check them against the float64 reference.

Versions (`VERSIONS`, every one; the product runs `gpu.kernels.score.SHIPPED`):
    v1 naive      one thread per ad; row-major embeddings (slot, D) in their stored dtype; the plain
                  per-ad formula of `andromeda_nb.scoring` (a loop over D per dot, a local array for
                  the E gate logits); the folded tables of every format read from global memory
    v2 tiled      one thread per ad; embeddings tile-interleaved as 32-bit words read with 16-byte
                  loads; the block's format table in shared memory, d-major, read with 16-byte loads;
                  the ad streamed one 16-byte quad at a time while all 2E dots advance; then routing
    v3 tiled x2   v2 with two ads per thread (slots t and t+128 of a chunk, 128-thread blocks), so
                  every shared-memory table load feeds two FMAs
    v4 tiled x4   four ads per thread (64-thread blocks): each table load feeds four FMAs (shipped
                  where the tensor-core kernel is not: dot kernels, fp32 storage, D = 128)
    v5 tensor cores  the 2E per-ad dots as mma.sync tiles (`gpu/kernels/score_mma.py`), registers as
                  the compiler takes them (100 at D = 64: 2 blocks per SM)
    v6 tensor cores  v5 held to 80 registers (3 blocks per SM); shipped for the MoE at fp16 and int8
                  with D = 64 until v7 measured faster where a request's match leaves few ads eligible
    v7 compacted  v6 walking only the eligible slots: each warp lists its chunk's eligible slots in
                  shared memory and gathers their rows into the m16 tiles, so the bytes read follow the
                  eligible ads (a request's match leaves 2% to 14% of a pool eligible), not the pool.
                  Shipped until v8 measured faster: at 8% eligible most of its time went to the block
                  top-K over 4096 keys, most of them empty
    v8 compacted wide  v7 over 64 chunks a block, the keys of its eligible ads kept as a list and
                  selected once. Shipped until v11, its walk on a request-major grid, measured faster for
                  batches: on the generated 10M corpus (H100, one run) a batch of 64 took 11.31 ms
                  (56.6 G pool ads/s) against v11's 8.20 ms (78.0 G)
    v10 wide, 16 chunks  v8 over 16 chunks a block: four times the blocks, for a lone request (whose
                  611 blocks of v8 over a 10M pool fill about one and a half waves of an H100). Measured
                  on the generated 10M corpus (H100, one run beside v8): one request p50 1.04 ms against
                  1.06, batches of 64 48.3 G pool ads/s against 56.3: not shipped
    v11 wide, request-major  v8 with the grid's axes swapped: blockIdx.x is the request, so the blocks of
                  the batch's requests over one range of slots are resident together and an ad eligible
                  for several of them is read from DRAM once (v8's grid runs a request's 611 blocks
                  before the next request's, and a 10M pool's 1.28 GB does not stay in a 50 MB L2).
                  Shipped until v14, the same at 128 registers, measured faster for a lone request
    v12 request-major, lone walk  v11 for batches; a batch of one request walks 16 chunks a block
                  (v10's geometry), the same output blocks, from a second kernel of the same source
                  (`LoneWalkRecipe`). Measured on the generated 10M corpus (H100, one run beside v11): one
                  request p50 1.02 ms against 1.02, batches of 64 78.3 G against 78.7: not shipped
    v13 request-major, warp counts  v11 with the block top-K's radix select counting a warp's equal
                  digits with one shared atomic (`gpu.kernels.radix`, as the lab's top-K v3). Measured on
                  the generated 10M corpus (H100, one run beside v11): one request p50 0.98 ms against
                  0.95, batches of 64 75.5 G against 79.2: not shipped (the atomics were not the cost)
    v14, v15      v11 held to 128 and 96 registers: two blocks an SM instead of three, for v11's spills
                  (ncu, batches of 64 on the generated 10M corpus: 96 million local memory requests, 94%
                  of the kernel's loads hitting L2, 37% occupancy, an instruction issued every 2.5 cycles).
                  Measured in one run beside v11 (H100, the generated 10M corpus): one request p50 0.89
                  (v14) and 0.91 ms (v15) against 0.97, the lone scoring kernel 0.19 and 0.21 against
                  0.27 ms; batches of 64 78.8 and 76.8 G against 79.3 G. v14 was shipped until v17
    v17           v14 with its free walk (the block's eligible ads counted first; a block whose ads fit
                  its list walks with no block barrier between rounds). Measured beside v14 on the
                  generated 10M corpus (H100, one lease, commit f27486f): the scoring kernel of a batch
                  of 64 5.34 ms against 6.06, batches of 64 79.1 G against 77.8 G, one request p50 0.94 ms
                  against 0.96; with every ad of a 32Mi pool eligible 2.47 ms against 2.42. Shipped
                  until v19
    v18           v17 over 128 chunks a block for batches (half the selections), 64 for a lone request
                  (`LoneWalkRecipe`): to be measured
    v19           v17 with a running floor per request: the shipped kernel (`gpu/kernels/score.py`)
    v20           v18 with v19's running floor. Measured beside v17 and v19 (H100, the generated 10M
                  corpus, one lease, commit 9294f81): the scoring kernel of a batch of 64 3.69 ms
                  against v19's 3.80, batches of 64 106.6 G against 107.5, of 256 118.0 G against
                  116.9, one request p50 0.87 ms against 0.89 and 0.92: no faster, two kernels; not
                  shipped
(v9 is the batched kernel of `gpu/lab/score_batched.py`.)

(A gate-first variant, holding the whole ad in D registers and computing only the k routed expert
dots, was written first: it saves a third of the FMAs but its fully unrolled code took numba minutes
per kernel to compile, so it is not in the table.)

v2 to v4 come from one generator, `gpu.kernels.score.tiled(ads_per_thread)`; v1 is the same kernel
skeleton with the per-ad formula below as its body.
"""

from __future__ import annotations

from dataclasses import dataclass

from andromeda_nb.versions import Version, version_table

from ..kernels import score as shipped
from ..kernels.score import GeneratedRecipe, KernelSpec, TensorCoreRecipe, tiled
from ..kernels.score_mma import get_mma_kernel


def _v1_body(spec: KernelSpec, apt: int) -> list[str]:
    """v1's per-ad code: the plain per-ad formula (`moe_score` or `dot_score`) of one slot."""
    if spec.kind == "moe":
        call = f"moe_score(emb, s, scale[s], tabs[r], chunk_format[s >> 8], {spec.experts}, {spec.dim}, {spec.top_e}, g)"
        lines = [f"g = cuda.local.array({spec.experts}, float32)"]
    else:
        call = f"dot_score(emb, s, scale[s], tabs[r], {spec.dim})"
        lines = []
    lines += ["s = slot", "if (elig[r, s >> 5] >> (s & 31)) & 1:", f"    k0 = f32_to_key({call})"]
    return lines


class LoneWalkKernel:
    """v12's kernel: `batch` (v11) for batches, `lone` (the same walk over fewer chunks a block, the same
    output blocks) for a batch of one request; otherwise `batch`'s interface."""

    def __init__(self, batch, lone):
        self.batch, self.lone = batch, lone

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def plan(self, emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot) -> list:
        walk = self.lone if elig.shape[0] == 1 else self.batch
        return walk.plan(emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot)

    def launch(self, emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot, stream=0):
        walk = self.lone if elig.shape[0] == 1 else self.batch
        walk.launch(emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot, stream)


@dataclass(frozen=True)
class LoneWalkRecipe(TensorCoreRecipe):
    """v12: the tensor-core recipe's kernel for batches, and for a lone request the same walk over
    `lone_chunks` chunks a block (`LoneWalkKernel`)."""

    lone_chunks: int = 16

    def build(self, spec: KernelSpec):
        batch = super().build(spec)
        s = batch.spec
        lone = get_mma_kernel(s.precision, s.dim, s.experts, s.top_e, s.mode, s.max_registers, s.compact, s.wide,
                              s.emit_at, s.out_slots, self.lone_chunks, s.request_major, free_at=s.free_at,
                              floor=s.floor)
        return LoneWalkKernel(batch, lone)


VERSIONS = version_table(
    Version(1, "v1 naive", "thread per ad, row-major, plain formula, tables in global memory",
            GeneratedRecipe("rows", 1, _v1_body, staged_tables=False)),
    Version(2, "v2 tiled", "16-byte loads of tiled words, shared d-major format table, streamed dots", tiled(1)),
    Version(3, "v3 tiled x2", "v2 with two ads per thread", tiled(2)),
    Version(5, "v5 tensor cores", "the 2E per-ad dots as mma.sync m16n8k16 tiles, registers unbounded",
            TensorCoreRecipe(None)),
    Version(6, "v6 tensor cores", "the 2E per-ad dots as mma.sync m16n8k16 tiles over fp16 hi + lo tables, one "
            "ad per lane in the epilogue, 4096 ads per block top-K, 80 registers (score_mma.py; MoE only)",
            TensorCoreRecipe(80)),
    Version(7, "v7 compacted", "the 2E per-ad dots as mma.sync m16n8k16 tiles over fp16 hi + lo tables, over each "
            "chunk's eligible slots only (listed in shared memory, rows gathered by slot), one ad per lane in the "
            "epilogue, 4096 ads per block top-K, 80 registers (score_mma.py; MoE only)",
            TensorCoreRecipe(80, compact=True)),
    Version(8, "v8 compacted wide", "v7 over 16,384 slots a block, its eligible ads' keys kept as a list: one "
            "block top-K over the eligible ads of 64 chunks instead of one over the 4096 keys of every 16 "
            "(score_mma.py; MoE only)", TensorCoreRecipe(80, compact=True, wide=True)),
    Version(11, "v11 wide, request-major", "v8 (the compacted walk over 16,384 slots a block, its eligible ads' "
            "keys kept as a list) with the grid's axes swapped, (requests, blocks): the blocks of a batch's requests "
            "over the same slots run side by side, so an ad eligible for several requests is read from DRAM once "
            "and then from L2 (score_mma.py; MoE only)",
            TensorCoreRecipe(80, compact=True, wide=True, request_major=True)),
    *shipped.VERSIONS.values(),
    Version(12, "v12 request-major, lone walk of 16 chunks", "v11 for batches; a batch of one request walks 16 "
            "chunks a block (v10's geometry: four times the blocks, the same output blocks), so that one request's "
            "walk fills the GPU", LoneWalkRecipe(80, compact=True, wide=True, request_major=True, lone_chunks=16)),
    Version(13, "v13 request-major, warp counts", "v11 with its block top-K's radix select counting the lanes of a "
            "warp that hold the same digit with one shared atomic (match.any.sync), where v11 makes one a key: 32 on "
            "one address when a warp's scores share a digit, as close scores do in the select's first rounds",
            TensorCoreRecipe(80, compact=True, wide=True, request_major=True, warp_counts=True)),
    Version(15, "v15 request-major, 96 registers", "v11 held to 96 registers: two blocks an SM, fewer spills than "
            "at 80", TensorCoreRecipe(96, compact=True, wide=True, request_major=True)),
    Version(16, "v16 request-major, pooled rounds", "v14 with a round of the walk whose listed chunks share one "
            "format run as one list, its 32-row tiles dealt to the warps in turn: ceil(total / 32) tiles a round instead "
            "of a partial tile for every warp's chunk (a mixed round runs the warps' own lists, as v14)",
            TensorCoreRecipe(128, compact=True, wide=True, request_major=True, pooled=True)),
    Version(18, "v18 free walk, 128 chunks a block for batches", "v17 walking 128 chunks (32,768 slots) a block "
            "for a batch, so a request's list is selected half as often (a match's 2% to 14% of 32,768 slots mostly "
            "still fit the list at once), and v17's 64 for a lone request, whose 611 blocks over a 10M pool would "
            "otherwise be 306 (1.2 waves of an H100); the same output blocks either way",
            LoneWalkRecipe(128, compact=True, wide=True, request_major=True, free_at=4096, chunks=128, lone_chunks=64)),
    Version(17, "v17 request-major, free walk", "v14 (the compacted walk over 16,384 slots a block on a (requests, "
            "blocks) grid, its eligible ads' keys kept as a list, 128 registers) with the block's eligible ads counted "
            "first: a block whose eligible ads fit its list at once walks its chunks without the two block barriers a "
            "round (each warp through its own chunks, waiting for no other) and selects its list once; a block with "
            "more runs v14's rounds (score_mma.py; MoE only)",
            TensorCoreRecipe(128, compact=True, wide=True, request_major=True, free_at=4096)),
    Version(20, "v20 v18 with the running floor", "v18 (128 chunks a block for batches, 64 for a lone request) "
            "with v19's running floor",
            LoneWalkRecipe(128, compact=True, wide=True, request_major=True, free_at=4096, chunks=128, lone_chunks=64,
                           floor=True)),
    Version(14, "v14 request-major, 128 registers", "v8 (the compacted walk over 16,384 slots a block, its eligible "
            "ads' keys kept as a list) with the grid's axes swapped, (requests, blocks): the blocks of a batch's "
            "requests over the same slots run side by side, so an ad eligible for several requests is read from DRAM "
            "once and then from L2; 128 registers a thread, two blocks an SM, where v11 (the same at 80, three "
            "blocks) spills (score_mma.py; MoE only)",
            TensorCoreRecipe(128, compact=True, wide=True, request_major=True)),
    Version(10, "v10 wide, 16 chunks", "v8 over 4,096 slots a block (one output block each): four times the "
            "blocks, for a lone request, whose 611 blocks of v8 over a 10M pool fill about one and a half waves "
            "of an H100", TensorCoreRecipe(80, compact=True, wide=True, chunks=16)),
)
SHIPPED = shipped.SHIPPED

__all__ = ["SHIPPED", "VERSIONS"]
