"""Three repairs to numba-cuda's CUDA simulator, installed by `gpu.runtime.cuda` whenever it runs.

1. Shared arrays, one per block. The simulator runs each thread of a block as a Python thread, and
   its `cuda.shared.array` (numba-cuda 0.30, `simulator/kernelapi.py`, `FakeCUDAShared.array`) looks
   the array up by the caller's source line and, when it is missing, makes one and stores it, with
   no lock between the lookup and the store. Two threads that reach the line together both miss and
   each gets its own array: their writes never meet, and the block reads memory nobody wrote. On
   a loaded machine this turned the engine's answers into an empty slot's id (-1) or a slot out of
   range, now and then. `shared_array` below does the lookup and the store under one lock.

2. Memory that starts as garbage, as on the device. The simulator makes device, pinned, shared and
   local arrays with `np.empty`, which on a fresh process is mostly zeros: a kernel that reads an
   element nobody wrote then reads 0, the value that means "no candidate" or "no ad", and passes.
   Every such array is filled with random bytes (a seeded stream, the same in every run of a
   process that allocates in the same order), so a read of unwritten memory gives garbage under the
   simulator too and a check fails. `ANDROMEDA_SIM_POISON=0` turns the filling off;
   `ANDROMEDA_SIM_POISON_SEED` picks the stream.

Arrays made from host data (`to_device`, `device_array_like` of data then copied) are written before
use and are not the concern; dynamic shared memory (size 0) is left as the simulator makes it.

3. A block's barrier kept by its threads, not by polling. The simulator's `BlockManager.run`
   (`simulator/kernel.py`) loops over the block's live threads without pause, asking each whether
   it waits at `syncthreads` and whether it is alive, until every thread has ended: the loop holds
   the interpreter lock against the threads it waits for, and most of a launch's time went to it.
   `WaitingBlockManager` keeps the same rule under one condition variable: a thread arriving at the
   barrier counts itself, the last of the block's live threads to arrive (or a thread ending while
   all the others wait) lets them all go on, and a thread's exception stops the block and is raised
   from the launch, as the simulator does.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

_installed = False
_lock = threading.Lock()
_poison = {"on": True, "rng": None}


def poisoning() -> bool:
    return _poison["on"]


def fill_garbage(array: np.ndarray) -> np.ndarray:
    """Fill `array` (any dtype, contiguous or not) with bytes of the poison stream; returns it."""
    if array.size and _poison["on"]:
        with _lock:
            raw = _poison["rng"].integers(0, 256, array.size * array.dtype.itemsize, dtype=np.uint8)
        array[...] = raw.view(array.dtype).reshape(array.shape)
    return array


def _as_dtype(dtype):
    from numba.core import types
    from numba.np import numpy_support

    return numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)


def install() -> None:
    """Patch the simulator (once per process). Call only when the simulator is the device."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernelapi
    from numba.cuda.simulator.cudadrv import devicearray

    import numba.cuda as sim

    _poison["on"] = os.environ.get("ANDROMEDA_SIM_POISON", "1") != "0"
    _poison["rng"] = np.random.default_rng(int(os.environ.get("ANDROMEDA_SIM_POISON_SEED", "20261205")))

    shared_original = kernelapi.FakeCUDAShared.array

    def shared_array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's own error
            return shared_original(self, shape, dtype, alignment)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with _lock:
            array = self._allocations.get(caller)
            if array is None:
                array = self._allocations[caller] = np.empty(shape, _as_dtype(dtype))
                if _poison["on"]:
                    raw = _poison["rng"].integers(0, 256, array.nbytes, dtype=np.uint8)
                    array.view(np.uint8).reshape(-1)[:] = raw
        return array

    def local_array(self, shape, dtype, alignment=None):
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        return fill_garbage(np.empty(shape, _as_dtype(dtype)))

    kernelapi.FakeCUDAShared.array = shared_array
    kernelapi.FakeCUDALocal.array = local_array
    from numba.cuda.simulator import kernel

    kernel.BlockManager = _waiting_block_manager(kernel)

    made = {name: getattr(devicearray, name) for name in ("device_array", "pinned_array", "managed_array")}

    def device_array(*args, **kwargs):
        array = made["device_array"](*args, **kwargs)
        fill_garbage(array._ary)
        return array

    def pinned_array(*args, **kwargs):
        return fill_garbage(made["pinned_array"](*args, **kwargs))

    def managed_array(*args, **kwargs):
        return fill_garbage(made["managed_array"](*args, **kwargs))

    # the module's own functions (device_array_like, mapped_array, pinned_array_like) call these by
    # their module names; numba.cuda re-exports them under the same names
    for name, function in (("device_array", device_array), ("pinned_array", pinned_array),
                           ("managed_array", managed_array)):
        setattr(devicearray, name, function)
        if getattr(sim, name, None) is made[name]:
            setattr(sim, name, function)
    _installed = True


def _waiting_block_manager(kernel):
    """The simulator's `BlockManager` with its barrier kept under a condition variable (repair 3)."""

    class WaitingBlockThread(kernel.BlockThread):
        def run(self):
            try:
                super().run()  # an exception of the kernel is kept in self.exception
            finally:
                self._manager.ended(self)

        def syncthreads(self):
            self._manager.arrive()

    class WaitingBlockManager(kernel.BlockManager):
        def run(self, grid_point, *args):
            def target():
                self._f(*args)

            self._cv = threading.Condition()
            self._waiting = 0
            self._generation = 0
            self._failed = None
            self._abort = False
            threads = [WaitingBlockThread(target, self, grid_point, block_point, self._debug)
                       for block_point in np.ndindex(*self._block_dim)]
            self._alive = len(threads)  # every thread counted before any starts: none passes the barrier early
            for t in threads:
                t.start()
            with self._cv:
                while self._alive and self._failed is None:
                    self._cv.wait()
                failed = self._failed
            if failed is not None:
                raise failed.exception[0].with_traceback(failed.exception[1])
            for t in threads:  # as the simulator: a thread's exception, however it ended
                if t.exception:
                    raise t.exception[0].with_traceback(t.exception[1])

        def _release(self):
            self._waiting = 0
            self._generation += 1
            self._cv.notify_all()

        def arrive(self):
            if self._abort:
                raise RuntimeError("abort flag set on syncthreads call")
            with self._cv:
                generation = self._generation
                self._waiting += 1
                if self._waiting == self._alive:
                    self._release()
                else:
                    while self._generation == generation and not self._abort:
                        self._cv.wait()
            if self._abort:
                raise RuntimeError("abort flag set on syncthreads clear")

        def ended(self, thread):
            with self._cv:
                self._alive -= 1
                if thread.exception and self._failed is None and not self._abort:
                    self._failed, self._abort = thread, True  # the others stop at their next barrier
                elif self._alive and self._waiting == self._alive:
                    self._release()
                self._cv.notify_all()

    return WaitingBlockManager


__all__ = ["fill_garbage", "install", "poisoning"]
