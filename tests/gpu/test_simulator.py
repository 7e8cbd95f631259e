"""The simulator's repairs (`gpu.simulator`): one shared array per block however its threads race to
make it, fresh memory that reads as garbage, not zeros, and a block's barrier kept by its threads."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from gpu import runtime

cuda = runtime.cuda()

pytestmark = pytest.mark.skipif(not runtime.simulator_enabled(), reason="repairs to the CUDA simulator")


def test_threads_racing_to_a_shared_array_all_get_the_same_one():
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as Python lets them: the race at its widest
    try:
        for _ in range(100):
            shared = FakeCUDAShared(0)
            start = threading.Barrier(32)
            got = [None] * 32

            def thread(t, shared=shared, start=start, got=got):
                start.wait()
                got[t] = shared.array(256, np.uint32)  # every thread at this one line, as a kernel's do

            threads = [threading.Thread(target=thread, args=(t,)) for t in range(32)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert all(a is got[0] for a in got), f"{len({id(a) for a in got})} arrays for one line of one block"
            other = shared.array(256, np.uint32)  # another line: another array
            assert other is not got[0]
    finally:
        sys.setswitchinterval(old)


def test_fresh_device_pinned_and_local_memory_is_garbage_and_written_memory_is_kept():
    if os.environ.get("ANDROMEDA_SIM_POISON") == "0":
        pytest.skip("ANDROMEDA_SIM_POISON=0")
    d = cuda.device_array(4096, np.uint32).copy_to_host()
    p = cuda.pinned_array((64, 64), np.int32)
    like = cuda.device_array_like(np.ones(4096, np.float32)).copy_to_host()
    for name, a in (("device", d), ("pinned", p), ("device_like", like)):
        assert np.count_nonzero(a) > a.size // 2, f"{name} memory starts mostly zero"
    assert len(np.unique(d)) > 1000  # not one pattern repeated: garbage
    data = np.arange(100, dtype=np.int64)
    assert np.array_equal(cuda.to_device(data).copy_to_host(), data)  # arrays made from data are that data


def test_a_kernel_reading_shared_memory_it_never_wrote_sees_garbage():
    if os.environ.get("ANDROMEDA_SIM_POISON") == "0":
        pytest.skip("ANDROMEDA_SIM_POISON=0")

    @cuda.jit
    def unwritten(out):
        buf = cuda.shared.array(64, np.uint32)
        local = cuda.local.array(4, np.uint32)
        t = cuda.threadIdx.x
        cuda.syncthreads()
        out[0, t] = buf[t]
        out[1, t] = local[t % 4]

    out = cuda.to_device(np.zeros((2, 64), np.uint32))
    unwritten[1, 64](out)
    host = out.copy_to_host()
    assert np.count_nonzero(host[0]) > 48 and np.count_nonzero(host[1]) > 48, host


def test_the_barrier_waits_for_every_live_thread_and_a_thread_exception_ends_the_launch():
    """`syncthreads` lets a block's threads go on only once every live thread has arrived (threads that
    ended do not hold it; `syncthreads_count` counts over the block), barrier after barrier; a thread's
    exception is raised from the launch, naming the thread, and the threads waiting for it stop."""

    @cuda.jit
    def rounds(out, counts):
        buf = cuda.shared.array(64, np.int32)
        t = cuda.threadIdx.x
        for r in range(3):
            buf[t] = t + r
            cuda.syncthreads()
            out[cuda.blockIdx.x, r, t] = buf[63 - t]  # written by another thread before the barrier
            cuda.syncthreads()
        counts[cuda.blockIdx.x, 0] = cuda.syncthreads_count(t % 3 == 0)
        if t >= 40:  # these end; the rest meet at two more barriers without them
            return
        buf[t] = 100 + t
        cuda.syncthreads()
        out[cuda.blockIdx.x, 3, t] = buf[39 - t]
        cuda.syncthreads()

    out = cuda.to_device(np.zeros((2, 4, 64), np.int32))
    counts = cuda.to_device(np.zeros((2, 1), np.int32))
    rounds[2, 64](out, counts)
    got, n = out.copy_to_host(), counts.copy_to_host()
    t = np.arange(64)
    for r in range(3):
        assert (got[:, r] == 63 - t + r).all(), got[:, r]
    assert (got[:, 3, :40] == 100 + 39 - t[:40]).all() and (got[:, 3, 40:] == 0).all()
    assert n.tolist() == [[22], [22]]

    @cuda.jit
    def fails(out):
        t = cuda.threadIdx.x
        cuda.syncthreads()
        if t == 5:
            out[1000, 0] = 1  # out of range: an IndexError in thread 5 alone
        cuda.syncthreads()
        out[0, t] = 1

    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\] ctaid=\[0, 0, 0\]"):
        fails[1, 32](cuda.to_device(np.zeros((2, 32), np.int32)))


def test_numbas_low_occupancy_warning_is_off_unless_the_user_asks_for_it(monkeypatch):
    """numba warns on every launch of fewer than 128 blocks; the engine's small grids are chosen, so
    the runtime turns that warning off (a demo's terminal keeps to its own lines), but not when the
    user set NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS."""
    from numba.cuda.core import config

    from gpu import runtime

    runtime.cuda()
    assert config.CUDA_LOW_OCCUPANCY_WARNINGS == 0
    monkeypatch.setattr(config, "CUDA_LOW_OCCUPANCY_WARNINGS", 1)
    monkeypatch.setenv(runtime.LOW_OCCUPANCY_ENV, "1")
    assert runtime.quiet_launch_heuristics() is False and config.CUDA_LOW_OCCUPANCY_WARNINGS == 1
    monkeypatch.delenv(runtime.LOW_OCCUPANCY_ENV)
    assert runtime.quiet_launch_heuristics() is True and config.CUDA_LOW_OCCUPANCY_WARNINGS == 0
