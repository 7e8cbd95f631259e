"""GPU targeting index: every targeting rule of DESIGN section 2, evaluated for every ad in parallel.

Output layout (the contract with the fused scoring kernel, `gpu/kernels/score.py`)
-----------------------------------------------------------------------------------
`GpuTargetingIndex.match_slots(encoded_requests)` returns a numba device array

    eligible   uint32[B, W]   B = number of requests given, W = capacity // 32
                              bit (s % 32) of eligible[r, s // 32] is 1 when slot s holds an ad that
                              request r may be shown; 0 for ineligible ads and for empty slots.

Slots are the ones of `andromeda_nb.slots.SlotAllocator` (`index.slots`): format-grouped chunks of
CHUNK_SLOTS (256) slots, so W is a multiple of 8 and every aligned group of 8 words belongs to one
format. The embedding table of the co-located path is laid out in the same slot order
(`index.slots.slot_ad_id[s]` is the ad id of slot s, EMPTY (-1) when free), so the scoring kernel
reads bit s and row s with no id translation. `capacity` grows by whole chunks when an upsert needs a
slot of a format with no free slot left; `index.capacity` and `index.slots.capacity` tell the current
value, and slot-indexed arrays of other parts must be extended to it (new slots start empty).

Requests are evaluated in groups of 32: one pass over the per-ad columns serves a whole group (bit r of
a per-ad 32-bit mask is request r of the group). The output is written once per request and slot word.
"""
