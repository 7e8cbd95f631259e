"""Warp-level operations that also run under the CUDA simulator.

    shfl_xor_i32(x, mask)   the int32 `x` of lane ^ mask (`shfl.sync.bfly`)
    sync_warp()             a barrier for the lanes of the warp (`bar.warp.sync`)
    match_any_i32(x)        the lanes of the warp whose int32 `x` equals this lane's, as a uint32 mask
                            (`match.any.sync`)
    ballot(p)               the lanes of the warp whose `p` is true, as a uint32 mask (`vote.ballot.sync`)

On the GPU they are numba's own `cuda.shfl_xor_sync`, `cuda.syncwarp`, `cuda.match_any_sync` and
`cuda.ballot_sync`. The simulator has neither
warp shuffles nor a warp barrier: there the lanes' values meet in a shared scratch array between two
block-wide barriers (`syncthreads`), so every thread of the block must reach each call (block-uniform
control flow around it). The shipped match kernel's shuffle transpose and the tensor-core scorer's
epilogue call them that way, so both run under the simulator in CI, not a stand-in.
`andromeda_nb.devices.resolve` must have chosen the device before this module is imported.
"""

from __future__ import annotations

import numpy as np

from .. import runtime

FULL_MASK = 0xFFFFFFFF
WARP = 32
SCRATCH_THREADS = 1024  # the most threads a block may have

cuda = runtime.cuda()

if runtime.simulator_enabled():

    @cuda.jit(device=True)
    def shfl_xor_i32(x, mask):
        # one array per block for this call site (the simulator keys shared arrays by source line)
        buf = cuda.shared.array(SCRATCH_THREADS, np.int64)
        t = int(cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z))
        buf[t] = np.int32(x)
        cuda.syncthreads()
        y = buf[t - t % WARP + ((t % WARP) ^ int(mask))]
        cuda.syncthreads()
        return np.int32(y)

    @cuda.jit(device=True)
    def sync_warp():
        cuda.syncthreads()

    @cuda.jit(device=True)
    def match_any_i32(x):
        buf = cuda.shared.array(SCRATCH_THREADS, np.int64)
        t = int(cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z))
        buf[t] = np.int32(x)
        cuda.syncthreads()
        first = t - t % WARP
        peers = 0
        for lane in range(WARP):
            if buf[first + lane] == np.int32(x):
                peers |= 1 << lane
        cuda.syncthreads()
        return np.uint32(peers)

    @cuda.jit(device=True)
    def ballot(p):
        buf = cuda.shared.array(SCRATCH_THREADS, np.int64)
        t = int(cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z))
        buf[t] = 1 if p else 0
        cuda.syncthreads()
        first = t - t % WARP
        votes = 0
        for lane in range(WARP):
            if buf[first + lane]:
                votes |= 1 << lane
        cuda.syncthreads()
        return np.uint32(votes)

else:
    from numba import int32

    @cuda.jit(device=True, inline=True)
    def shfl_xor_i32(x, mask):
        return cuda.shfl_xor_sync(FULL_MASK, int32(x), mask)

    @cuda.jit(device=True, inline=True)
    def sync_warp():
        cuda.syncwarp()

    @cuda.jit(device=True, inline=True)
    def match_any_i32(x):
        return cuda.match_any_sync(FULL_MASK, int32(x))

    @cuda.jit(device=True, inline=True)
    def ballot(p):
        return cuda.ballot_sync(FULL_MASK, p)


__all__ = ["ballot", "match_any_i32", "shfl_xor_i32", "sync_warp"]
