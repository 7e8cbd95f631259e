"""The mutation runner: deliberate bugs, each planted in a fresh copy of the repository, and the tests
that must catch it.

    python scripts/mutants.py --list              one mutant a line: name, area, file
    python scripts/mutants.py                     run every mutant, print a table (exit 1 if any survives)
    python scripts/mutants.py --only NAME[,NAME]  run some
    python scripts/mutants.py --jobs 2 --json     in parallel; JSON Lines instead of the table
    python scripts/mutants.py --check             every mutant's text occurs once, its test files exist

A mutant replaces one exact piece of source text (it must occur exactly once, so a mutant that no
longer applies is reported as stale, not as caught) in a copy of the tracked files, then runs its
tests there with a fresh numba cache directory, so compiled code from the unmutated tree cannot
hide the change. A mutant is caught when the tests fail; it survives when they pass. Its tests run in
the order given and stop at the first failure, so a caught mutant is reported with the test file that
caught it (`caught_by`), the failing test and the seconds it took. A mutant that only
tests/migration/test_equivalence.py catches is a gap in its module's own tests (`gap`), and fails
the run as a survivor does. docs/TESTING.md lists the mutants and what catches each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
END_TO_END = "tests/migration/test_equivalence.py"  # a mutant first caught here has slipped past its module's own tests


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str  # relative to the repository root
    old: str  # exact source text, occurring once
    new: str
    tests: tuple[str, ...]  # pytest targets (files or node ids) that must fail
    why: str  # the bug, in words


M = Mutant
MUTANTS: list[Mutant] = [
    # --- targeting semantics: the oracle ------------------------------------------------------------
    M("age-min-exclusive", "ages", "andromeda_nb/oracle.py", "if user.age < spec.age_min:",
      "if user.age <= spec.age_min:", ("tests/core/test_oracle.py",), "a user exactly at age_min is refused"),
    M("age-max-65-bounded", "ages", "andromeda_nb/oracle.py",
      "if spec.age_max != AGE_HIGHEST and user.age > spec.age_max:", "if user.age > spec.age_max:",
      ("tests/core/test_oracle.py",), "age_max 65 no longer means 65 and older"),
    M("genders-ignored", "genders", "andromeda_nb/oracle.py",
      "if spec.genders is not None and user.gender not in spec.genders:",
      "if spec.genders is not None and user.gender not in spec.genders and False:",
      ("tests/core/test_oracle.py",), "the gender list is not applied"),
    M("flexible-any-object", "flexible_spec", "andromeda_nb/oracle.py",
      "if not all(holds_any(user, obj) for obj in spec.flexible_spec):",
      "if spec.flexible_spec and not any(holds_any(user, obj) for obj in spec.flexible_spec):",
      ("tests/core/test_oracle.py",), "flexible_spec objects ORed instead of ANDed"),
    M("exclusions-ignored", "exclusions", "andromeda_nb/oracle.py",
      "if spec.exclusions is not None and holds_any(user, spec.exclusions):",
      "if spec.exclusions is not None and holds_any(user, spec.exclusions) and False:",
      ("tests/core/test_oracle.py",), "exclusions no longer exclude"),
    M("schedule-end-inclusive", "schedules", "andromeda_nb/oracle.py",
      "if ad.end_time is not None and time >= ad.end_time:", "if ad.end_time is not None and time > ad.end_time:",
      ("tests/core/test_oracle.py",), "an ad is still shown at its end_time"),
    M("paused-is-live", "status", "andromeda_nb/oracle.py", 'return (ad.status == "ACTIVE" and',
      'return (ad.status in ("ACTIVE", "PAUSED") and', ("tests/core/test_oracle.py",), "PAUSED ads are eligible"),
    # --- distances ------------------------------------------------------------------------------------
    M("haversine-no-cos", "distances", "andromeda_nb/geo.py", "h = s * s + math.cos(p1) * math.cos(p2) * t * t",
      "h = s * s + t * t", ("tests/core/test_distances.py",), "the cos(latitude) factors of the haversine dropped"),
    M("haversine-cos-squared", "distances", "andromeda_nb/geo.py",
      "h = s * s + math.cos(p1) * math.cos(p2) * t * t", "h = s * s + math.cos(p1) * math.cos(p1) * t * t",
      ("tests/core/test_distances.py",), "cos(lat1) squared instead of cos(lat1) cos(lat2)"),
    M("oracle-distance-chord", "distances", "andromeda_nb/oracle.py",
      "return 2.0 * EARTH_RADIUS_KM * math.asin(min(1.0, chord / 2.0))", "return EARTH_RADIUS_KM * chord",
      ("tests/core/test_distances.py",), "the oracle takes the chord for the arc"),
    M("mile-factor", "radius", "andromeda_nb/constants.py", "KM_PER_MILE = 1.609344", "KM_PER_MILE = 1.6",
      ("tests/core/test_oracle.py::test_miles_are_converted",), "miles converted with 1.6 km"),
    # --- the CPU index --------------------------------------------------------------------------------
    M("popcount-widened", "cpu index", "cpu_baseline/index.py",
      "    x = x + (x >> np.uint32(8))\n    x = x + (x >> np.uint32(16))\n    return x & np.uint32(0x3F)",
      "    return (x * np.uint32(0x01010101)) >> np.uint32(24)", ("tests/core/test_deep_specs.py",),
      "the byte-sum popcount that numba does not wrap at 32 bits"),
    M("negative-hit-by-count", "exclusions", "cpu_baseline/index.py",
      "return (w & NEGATED_BIT) == 0 and _popcount32(w) == n_positive", "return _popcount32(w) == n_positive",
      ("tests/core/test_deep_specs.py",), "a negative-clause hit with one positive clause missed looks eligible"),
    M("cpu-status-ignored", "status", "cpu_baseline/index.py", "if status[s] != ACTIVE or not",
      "if status[s] == 99 or not", ("tests/cpu_baseline/test_cpu_index.py",), "the CPU index ignores status"),
    M("cpu-retire-not-dead", "updates", "cpu_baseline/index.py",
      "        slot = self._slot_of.pop(ad_id)\n        if self._cols[\"segment\"][slot] == SEG_MAIN:\n            self._main_dead += 1",
      "        slot = self._slot_of.pop(ad_id)\n        if self._cols[\"segment\"][slot] == -1:\n            self._main_dead += 1",
      ("tests/cpu_baseline/test_cpu_index.py",), "a retired ad's main postings stay live while the segment test is skipped"),
    M("cpu-merge-drops-delta", "updates", "cpu_baseline/index.py",
      "m_cclause[keep_c])] + list(self._delta_entries.values())", "m_cclause[keep_c])]",
      ("tests/cpu_baseline/test_cpu_index.py",), "a merge loses the delta's postings"),
    M("parse-ignores-share", "limits", "serving/durable.py",
      "            pace()\n            try:\n                obj = jsontext.loads",
      "            self._yield_to_readers()\n            try:\n                obj = jsontext.loads",
      ("tests/serving/test_limits.py::test_parsing_and_logging_keep_to_the_share_too",),
      "a large update call parses at full speed while retrievals arrive"),
    M("cpu-delta-keeps-stale", "updates", "cpu_baseline/index.py",
      "        if i < na and check and _in_sorted(stale, a_slot[i]):",
      "        if False and i < na and check and _in_sorted(stale, a_slot[i]):",
      ("tests/cpu_baseline/test_cpu_index.py::test_incremental_delta_equals_oracle_between_small_batches",),
      "the delta's merge keeps the postings of a replaced or retired ad"),
    M("cpu-delta-merge-order", "updates", "cpu_baseline/index.py",
      "or (b_terms[j] == a_terms[i] and b_slot[j] < a_slot[i]))",
      "or (b_terms[j] == a_terms[i] and b_slot[j] > a_slot[i]))",
      ("tests/cpu_baseline/test_cpu_index.py::test_incremental_delta_equals_oracle_between_small_batches",),
      "the delta's merge puts a term's slots out of order"),
    M("cpu-circle-radius-miles", "radius", "cpu_baseline/index.py", "if _haversine(lat, lon, circles[e, 0], circles[e, 1]) <= radius:",
      "if _haversine(lat, lon, circles[e, 0], circles[e, 1]) <= radius / 2:", ("tests/cpu_baseline/test_cpu_index.py", "tests/migration/test_equivalence.py::test_cpu_index_equals_oracle_drawn"),
      "the CPU index halves every radius"),
    M("cpu-schedule-end-inclusive", "schedules", "cpu_baseline/index.py",
      "if status[s] != ACTIVE or not (start_time[s] <= now < end_time[s]):",
      "if status[s] != ACTIVE or not (start_time[s] <= now <= end_time[s]):", ("tests/cpu_baseline/test_cpu_index.py",),
      "the CPU index still shows an ad at its end_time"),
    # --- the GPU index and its match kernel -------------------------------------------------------------
    M("gpu-pause-stays-active", "updates", "gpu/index.py", "w = int(self.resid_h[slot]) & ~K.ACTIVE_BIT",
      "w = int(self.resid_h[slot])", ("tests/gpu/test_gpu_index.py::test_update_stream_equals_oracle",),
      "a status update to PAUSED leaves the GPU index's slot active"),
    M("gpu-update-not-uploaded", "updates", "gpu/index.py",
      "self._upload_changes(sorted(changed), new_words, new_circles)",
      "self._upload_changes(sorted(changed)[1:], new_words, new_circles)",
      ("tests/gpu/test_gpu_index.py::test_update_stream_equals_oracle",),
      "the lowest changed slot of each update batch never reaches the device"),
    M("gpu-retire-keeps-slot", "updates", "gpu/index.py",
      "        self.resid_h[slot] = 0\n        self.len_h[slot] = 0\n        self.ptr_h[slot] = 0\n"
      "        self.sched_h[slot] = (NULL_START, NULL_END)\n",
      "        self.len_h[slot] = 0\n        self.ptr_h[slot] = 0\n",
      ("tests/gpu/test_gpu_index.py::test_retire_only_stream_equals_oracle",),
      "a retired ad's slot keeps its residual word and schedule, so the freed slot still answers"),
    M("gpu-format-change-keeps-slot", "updates", "gpu/index.py",
      "if slot is None or slots.format_of_slot(slot) != ad.format or (", "if slot is None or (",
      ("tests/gpu/test_gpu_index.py",),
      "an upsert that changes an ad's format keeps its slot in the old format's chunk: scored in the old format"),
    M("gpu-vocabulary-hash-stale", "updates", "gpu/index.py",
      "            self._hashed = None\n            self._dirty = False", "            self._dirty = False",
      ("tests/gpu/test_gpu_index.py",),
      "the vocabulary's hash table is kept after an upsert brings a new term: requests naming it match nothing"),
    M("match-negative-as-positive", "exclusions", "gpu/kernels/match.py", "            alive &= ~sat\n",
      "            alive &= sat\n", ("tests/gpu/test_gpu_index.py::test_random_corpus_equals_oracle",),
      "the shipped match kernel treats the negative clause as one more positive clause"),
    # --- scoring --------------------------------------------------------------------------------------
    M("softmax-sign", "softmax", "andromeda_nb/scoring.py", "w = np.float32(math.exp(best_g - gmax))",
      "w = np.float32(math.exp(gmax - best_g))", ("tests/gpu/test_score_kernels.py", "tests/cpu_baseline/test_cpu_scorer.py"),
      "the routed weights inverted"),
    M("gate-ties-upper", "softmax", "andromeda_nb/scoring.py", "if (chosen >> e) & 1 == 0 and (best < 0 or g[e] > best_g):",
      "if (chosen >> e) & 1 == 0 and (best < 0 or g[e] >= best_g):", ("tests/gpu/test_score_kernels.py",),
      "gate ties routed to the higher expert"),
    M("film-no-sqrt", "FiLM", "andromeda_nb/scoring.py",
      "out[:, :, 2 * E * D : 2 * E * D + E] = np.matmul(beta, Q.transpose(0, 2, 1)) * inv",
      "out[:, :, 2 * E * D : 2 * E * D + E] = np.matmul(beta, Q.transpose(0, 2, 1))", ("tests/gpu/test_score_kernels.py", "tests/cpu_baseline/test_cpu_scorer.py"),
      "the gate bias of the folded table loses its 1/sqrt(D)"),
    M("film-gamma-dropped", "FiLM", "andromeda_nb/scoring.py",
      "                    out[r, f, (E + e) * D + d] = U[r, e, d] * g\n",
      "                    out[r, f, (E + e) * D + d] = U[r, e, d]\n",
      ("tests/gpu/test_score_kernels.py", "tests/cpu_baseline/test_cpu_scorer.py"), "expert vectors not scaled by gamma"),
    M("int8-scale-dropped", "int8 scales", "gpu/kernels/score.py", 'sc = f" * sc_{p}" if scaled else ""',
      'sc = ""', ("tests/gpu/test_score_kernels.py",),
      "the fused CUDA-core kernel forgets the per-ad int8 scale"),
    M("compact-list-drops-last", "eligible-slot walk", "gpu/kernels/score_mma.py",
      'elif spec.compact:\n        lines.append("if i < n:")', 'elif spec.compact:\n        lines.append("if i < n - 1:")',
      ("tests/gpu/test_score_mma.py",),
      "the tensor-core kernel's walk over listed slots leaves each chunk's last eligible ad unscored"),
    M("stream-client-no-reopen", "served-path clients", "benchmarks/clients.py",
      "                self.close()\n                if attempt:\n                    raise",
      "                self.close()\n                raise",
      ("tests/benchmarks/test_clients.py::test_stream_clients_keep_one_exchange_and_reopen_it_when_the_server_ends_it",),
      "a client that keeps one exchange open stops at the first exchange the server ends"),
    M("wide-selection-overwritten", "wide eligible-slot walk", "gpu/kernels/score_mma.py",
      "            emitted += 1\n", "            emitted += 0\n",
      ("tests/gpu/test_score_mma.py::test_wide_walk_equals_the_reference",),
      "the wide walk writes every selection of its list into its first output block, then pads over it"),
    M("wide-list-loses-offsets", "wide eligible-slot walk", "gpu/kernels/score_mma.py",
      'lines.append("    offs[base + i] = o")', 'lines.append("    offs[base + i] = lane")',
      ("tests/gpu/test_score_mma.py::test_wide_walk_equals_the_reference",),
      "the wide walk's list keeps each key with the wrong slot"),
    M("request-major-reads-request-of-block-axis", "wide eligible-slot walk", "gpu/kernels/score_mma.py",
      'r_axis="x" if spec.request_major else "y"', 'r_axis="y" if spec.request_major else "y"',
      ("tests/gpu/test_score_mma.py::test_request_major_grid_equals_the_reference",
       "tests/gpu/test_score_mma.py::test_free_walk_equals_the_reference"),
      "the request-major kernel takes its request from the slot-block axis: a batch's other requests go unscored"),
    M("film-context-place-shifted", "user side", "andromeda_nb/model.py",
      "np.prod(np.diff(_GROUP_BOUNDS)[g + 1:])", "np.prod(np.diff(_GROUP_BOUNDS)[g + 2:])",
      ("tests/core/test_model.py::test_film_looked_up_by_context_equals_the_formula_for_every_context",),
      "a context's number in the FiLM table counted with the wrong place values: requests get another context's FiLM"),
    M("film-table-kept-for-new-weights", "user side", "andromeda_nb/model.py",
      "    if kept is not None and kept[0] is model.A and kept[1] is model.B:",
      "    if kept is not None:",
      ("tests/core/test_model.py::test_film_looked_up_by_context_equals_the_formula_for_every_context",),
      "a model given new FiLM weights keeps answering from the table of the old ones"),
    M("record-batch-loses-places", "columnar requests", "serving/request_columns.py",
      '                "latitude": column("latitude", self.latitude, ~located),\n',
      '                "latitude": column("latitude", self.latitude, located),\n',
      ("tests/serving/test_request_columns.py",),
      "requests written back from their arrays (what a front sends) lose the latitude of every located user"),
    M("front-keeps-client-ids", "fronts", "serving/lane_engine.py",
      "        batch = columnar_batch(requests, k, np.arange(n, dtype=np.int64))\n",
      "        batch = columnar_batch(requests, k, None)\n",
      ("tests/serving/test_lane_engine.py",),
      "a front sends its clients' own request ids to the engine: calls of two clients with one id are refused, "
      "and the answers cannot be told apart"),
    M("front-splits-answers-off-by-one", "fronts", "serving/lane_engine.py",
      "    ends = np.searchsorted(rid, np.arange(n, dtype=np.int64), side=\"right\")\n",
      "    ends = np.searchsorted(rid, np.arange(n, dtype=np.int64), side=\"left\")\n",
      ("tests/serving/test_lane_engine.py",),
      "a front hands each request the answers of the request before it"),
    M("overlap-lets-go-in-flight", "overlapped batches", "serving/batcher.py",
      "        if self._flight is None:\n            ov.release()\n        if landed is not None:",
      "        ov.release()\n        if landed is not None:",
      ("tests/serving/test_overlap.py::test_no_update_lands_between_a_batchs_launch_and_its_answers_and_updates_get_the_engine",),
      "the engine lock let go while a batch is on the device: an update lands between its launch and its answers, "
      "which then name the wrong update"),
    M("free-walk-never-selects", "wide eligible-slot walk", "gpu/kernels/score_mma.py",
      "        if listed > 0:\n            {emit_list}(keys, offs, listed, cap, hist, part, state, out_key, out_slot, r, sub0, slot0{floor_pass})",
      "        if listed < 0:\n            {emit_list}(keys, offs, listed, cap, hist, part, state, out_key, out_slot, r, sub0, slot0{floor_pass})",
      ("tests/gpu/test_score_mma.py::test_free_walk_equals_the_reference",),
      "a block that walked free never selects its list: the eligible ads of every such block go unanswered"),
    M("floor-drops-ties", "wide eligible-slot walk", "gpu/kernels/score_mma.py",
      '"keep = i < n and kk >= floor[r]"]', '"keep = i < n and kk > floor[r]"]',
      ("tests/gpu/test_score_mma.py::test_running_floor_keeps_a_tie_at_the_floor",),
      "the running floor leaves out a key equal to it: an ad tied with the k-th for the answer's last place, "
      "with the lower id, goes unanswered"),
    M("floor-counts-a-warp-once", "wide eligible-slot walk", "gpu/kernels/score_mma.py",
      'f"    cuda.atomic.add(state, {ST_KEPT}, uint32(cuda.popc(votes)))"]', 'f"    cuda.atomic.add(state, {ST_KEPT}, uint32(1))"]',
      ("tests/gpu/test_score_mma.py::test_running_floor_equals_the_reference_and_the_walk_without_it",),
      "a warp's kept keys counted as one: a list of more than k kept keys emitted whole, past its output block"),
    M("pooled-round-tiles-not-dealt", "wide eligible-slot walk", "gpu/kernels/score_mma.py",
      "            t = tt if src >= 0 else tt * {warps} + warp\n", "            t = tt if src >= 0 else tt\n",
      ("tests/gpu/test_score_mma.py::test_pooled_rounds_equal_the_reference",),
      "a pooled round's warps all run its first tiles: the rest of the round's list goes unscored"),
    M("pooled-round-entry-in-wrong-list", "wide eligible-slot walk", "gpu/kernels/score_mma.py",
      '"            if i >= pre[jj]:"', '"            if i > pre[jj]:"',
      ("tests/gpu/test_score_mma.py::test_pooled_rounds_equal_the_reference",),
      "a pooled round reads the first entry of each warp's list from the list before it"),
    M("compile-cache-index-unlocked", "compile caches", "andromeda_nb/jitcache.py",
      "        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes\n",
      "        pass\n",
      ("tests/core/test_jitcache.py::test_concurrent_writers_of_one_index_keep_every_entry_and_share_no_file",),
      "processes compiling one function at once each rewrite its cache index from what they read before the other wrote"),
    # --- updates and logs -----------------------------------------------------------------------------
    M("log-damage-taken-for-torn-tail", "update log", "serving/wal.py",
      "            scan.problem = _damaged(path, n, want, base, why, len(lines) - n, scan.boundary())\n            break",
      "            scan.problem = _damaged(path, n, want, base, why, len(lines) - n, scan.boundary())\n"
      "            scan.torn = n >= len(lines) - 1\n            break", ("tests/serving/test_wal.py",),
      "a damaged record just before the last is taken for a torn tail: the log is cut there and the last record lost"),
    M("gpu-slice-skips-embeddings", "GPU slice apply", "gpu/engine.py",
      "if isinstance(update, Upsert) and update.ad.ad_id in slots])",
      "if isinstance(update, Upsert) and update.ad.ad_id in slots and False])",
      ("tests/migration/test_colocated.py::test_the_gpu_engine_applies_a_slice_in_one_piece_as_it_applies_updates_one_by_one",),
      "a slice applied in one piece updates the targeting but leaves the upserted ads' old embeddings"),
    M("gpu-kept-output-stale", "GPU buffers kept across batches", "gpu/index.py",
      "if full is None or full.shape[1] != words or full.shape[0] < n_requests:",
      "if full is None or full.shape[0] < n_requests:",
      ("tests/gpu/test_gpu_index.py::test_kept_output_follows_the_capacity_as_it_grows",),
      "the kept match output is not remade when updates grow the pool"),
    M("scorer-buffers-per-size", "GPU buffers kept across batches", "gpu/fused.py",
      "if self._bufs_key != key or self._bufs_rows < R:",
      "if self._bufs_key != key or self._bufs_rows != R:",
      ("tests/gpu/test_topk.py::test_batches_of_changing_sizes_allocate_nothing_and_answer_right",),
      "the scorer makes its launch buffers again whenever the batch size changes"),
    M("encode-many-same-rows", "answers encoded per batch", "serving/protocol.py",
      "            row += rows", "            row += 0",
      ("tests/serving/test_batcher.py::test_a_batch_of_payloads_is_encoded_at_once_and_falls_back_call_by_call",),
      "every caller of a batch is sent the first caller's rows"),
    M("columns-last-fault-first", "columnar requests", "serving/request_columns.py",
      "    row = min(firsts)", "    row = max(firsts)",
      ("tests/serving/test_request_columns.py::test_drawn_faults_name_the_first_faulty_request_as_json_does",),
      "a columnar batch with faults in several requests names the last faulty request, not the first"),
    M("columns-ids-range-unchecked", "columnar requests", "serving/request_columns.py",
      "        bad = (values < 0) | (values > MAX_TERM_ID)", "        bad = values < 0",
      ("tests/serving/test_request_columns.py",), "an id list's values above the largest term id pass the array checks"),
    M("columns-group-fault-to-all", "columnar requests", "serving/protocol.py",
      "            for i in members:\n                out[i] = _decoded_or_error(batches[i], kw)",
      "            for i in members:\n                out[i] = InvalidInput(\"a call of the group is at fault\")",
      ("tests/serving/test_request_columns.py::test_many_calls_checked_as_one_and_a_fault_goes_to_its_call_alone",),
      "a fault in one of the calls checked together fails every call of the group"),
    M("decode-ahead-inline", "decoding a stage ahead", "serving/batcher.py",
      "        if decode is not None and decode_ahead:", "        if decode is not None and decode_ahead and False:",
      ("tests/serving/test_batcher.py::test_decode_ahead_decodes_while_a_batch_is_on_the_engine",),
      "decode_ahead is ignored: calls are decoded between batches"),
    M("closing-decode-per-call", "decoding at a batch's close", "serving/batcher.py",
      "            if call.size is not None:  # decoded with the batch's other calls when it closes",
      "            if call.size is None:  # decoded with the batch's other calls when it closes",
      ("tests/serving/test_batcher.py::test_counted_payloads_are_decoded_together_when_their_batch_closes",),
      "counted payloads are decoded one by one as they are taken, and the uncounted one is deferred"),
    M("columns-slice-offset-ignored", "columnar requests", "serving/request_columns.py",
      "count=column.offset + len(column))[column.offset :]", "count=len(column))",
      ("tests/serving/test_request_columns.py::test_sliced_batches_and_null_rows_over_values_read_only_their_own_values",),
      "a sliced columnar batch is read from the start of its buffers, not from its own first row"),
    M("columns-slice-signals-from-start", "columnar requests", "serving/request_columns.py",
      "starts = (column.offset + np.arange(n, dtype=np.int64)) * size", "starts = np.arange(n, dtype=np.int64) * size",
      ("tests/serving/test_request_columns.py",),
      "a sliced columnar batch takes its signals from the rows at the start of the buffers"),
    M("freed-memory-not-kept", "allocator setting", "serving/hostmem.py",
      "    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1",
      "    return True",
      ("tests/serving/test_hostmem.py",), "the allocator setting reports success without setting anything"),
    M("batcher-fault-kills-worker", "request batcher", "serving/batcher.py",
      "                for call in self._in_hand + (flight[0] if flight else []):\n"
      "                    if not call.done.is_set():\n                        call.error = exc\n"
      "                        call.finish()",
      "                raise",
      ("tests/serving/test_batcher.py::test_a_fault_of_the_batcher_itself_reaches_its_callers_and_the_worker_goes_on",),
      "a fault of the batcher's own kills its worker, and every caller waits for ever"),
    M("batcher-simple-queue", "request batcher", "serving/batcher.py",
      "self._queue: queue.Queue[_Call | None] = queue.Queue()",
      "self._queue: queue.Queue[_Call | None] = queue.SimpleQueue()",
      ("tests/serving/test_batcher.py::test_the_worker_waits_for_company_on_a_queue_whose_timed_get_keeps_its_timeout",),
      "the worker waits for company on a SimpleQueue, whose timed get can wait until the next call"),
    M("shard-log-skips-one", "durable shard log", "cluster/shards.py",
      "for r in self.logs[shard].records_after(seq)]", "for r in self.logs[shard].records_after(seq + 1)]",
      ("tests/cluster/test_cluster.py::test_the_durable_shard_log_keeps_its_entries_and_refuses_another_corpus",),
      "a replica catching up from the durable log misses the first entry it lacks"),
    M("update-share-ignored", "update CPU share", "serving/durable.py",
      "if share >= 1 or self.gate is None or not self.gate.active():",
      "if True:",
      ("tests/serving/test_limits.py::test_an_update_call_keeps_to_its_cpu_share_only_while_retrievals_arrive",),
      "an update call never leaves the cores to retrievals, whatever its share"),
    M("update-calls-share-a-window", "concurrent update calls", "serving/durable.py",
      "        window = _ShareWindow()  # this call's alone: calls parse at once, outside the lock",
      "        window = self.__dict__.setdefault(\"_shared_window\", _ShareWindow())  # one for every call",
      ("tests/serving/test_concurrent_updates.py::test_concurrent_update_calls_and_retrievals_on_the_colocated_server",),
      "every update call paces itself in one share window, which a call parsing resets under another's feet"),
    # --- scale-out -------------------------------------------------------------------------------------
    M("tiled-copies-not-offset", "tiled pools", "benchmarks/match.py",
      "ids = lay(base_ct.ad_id[rows][None, :] + (np.arange(first_copy, first_copy + copies, dtype=np.int64)",
      "ids = lay(base_ct.ad_id[rows][None, :] + (np.arange(0, copies, dtype=np.int64)",
      ("tests/benchmarks/test_tiled.py::test_a_tiled_engine_answers_as_the_gpu_engine_over_the_same_ads",),
      "every shard of a tiled pool lays out copies 0 onwards: the shards hold the same ads"),
    M("shards-on-one-gpu", "GPU placement", "cluster/gpus.py", "return gpus[shard % len(gpus)]", "return gpus[0]",
      ("tests/cluster/test_cluster.py::test_shard_processes_go_round_the_gpus_they_are_given",),
      "every shard process is placed on the first GPU"),
    M("shard-outlives-its-command", "shard processes", "cluster/shard_process.py",
      "        watch_parent(args.parent_pid, stop)", "        pass",
      ("tests/cluster/test_cluster.py::test_shard_processes_end_when_the_command_that_started_them_is_killed",),
      "a shard process goes on serving after the command that started it was killed"),
    M("fanout-merges-first-shard", "Flight fan-out", "benchmarks/cluster.py",
      "merged = [merge_topk([answers[i] for answers, _ in parts], self.k) for i in range(len(requests))]",
      "merged = [merge_topk([parts[0][0][i]], self.k) for i in range(len(requests))]",
      ("tests/cluster/test_cluster.py::test_shards_as_plain_processes_answer_as_one_engine_through_the_flight_fan_out",),
      "the router's Flight fan-out answers with the first shard's ads alone"),
    M("geo-mask-drops-city", "geo layout", "andromeda_nb/geo_layout.py",
      "        if u.city >= 0:\n", "        if u.city >= 0 and not u.region >= 0:\n",
      ("tests/core/test_geo_layout.py",),
      "a request's geographic mask leaves out its city's bit when it has a region, so a chunk summary can skip an eligible ad"),
    M("slots-rank-ignored", "geo layout", "andromeda_nb/slots.py",
      "            order = _order_of_permutation(rank, formats)\n            if order is None:\n"
      "                order = np.lexsort((np.arange(len(ad_ids)), rank, formats))\n",
      "            order = np.argsort(formats, kind=\"stable\")\n",
      ("tests/core/test_geo_layout.py::test_the_gpu_engine_laid_out_by_geography_answers_as_the_reference_through_updates",),
      "the slot allocator ignores the layout's rank: a geo layout is laid out as the corpus"),
    M("match-summary-ignored", "geo skip", "gpu/kernels/match.py",
      "live = (summary[first // SUMMARY_SLOTS] & gmask[g]) != uint64(0)", "live = True",
      ("tests/core/test_geo_layout.py::test_the_match_skips_blocks_no_request_of_the_group_can_match_and_reads_the_summary_to_do_so",),
      "the match kernel reads every block whatever its geographic summary"),
    M("summary-not-widened", "geo skip", "gpu/index.py", "self.summary_h[block] |= np.uint64(mask)", "pass",
      ("tests/core/test_geo_layout.py::test_upserts_take_slots_by_geography_and_summaries_are_made_again_exactly",),
      "an upsert's bits reach its block's summary only at the end of the call: the next upsert of the call takes the block for empty"),
    M("summary-not-uploaded", "geo skip", "gpu/index.py",
      "            self.d_summary[lo:hi].copy_to_device(self.summary_h[lo:hi])\n", "",
      ("tests/core/test_geo_layout.py::test_a_request_with_no_country_matches_ads_of_every_bit_and_upserts_widen_the_summary",),
      "the widened summary stays on the host: the device skips the block"),
    M("gmask-no-geo-empty", "geo skip", "gpu/index.py",
      "        elif gmask[g] == 0:\n            gmask[g] = NO_GEO_MASK\n", "",
      ("tests/core/test_geo_layout.py::test_a_request_with_no_country_matches_ads_of_every_bit_and_upserts_widen_the_summary",),
      "a group holding no geo term gets mask 0 and skips every block, ads without a geo clause included"),
    M("place-ignores-geo", "geo skip", "gpu/index.py", '''        if self.placement == "free-list":
            return None
''', "        return None\n",
      ("tests/core/test_geo_layout.py::test_upserts_take_slots_by_geography_and_summaries_are_made_again_exactly",),
      "upserts take the top of the free list: a new country's ad widens a clustered block"),
    M("every-bit-widens", "geo skip", "gpu/index.py", "if mask == GEO_ALL and self.placement == \"geo\":",
      "if False:", ("tests/core/test_geo_layout.py::test_upserts_take_slots_by_geography_and_summaries_are_made_again_exactly",),
      "an ad of every bit widens a block to every bit instead of opening a chunk of its own"),
    M("summary-not-remade", "geo skip", "gpu/index.py",
      "            self.summary_h[blocks] = np.bitwise_or.reduce(masks, axis=1)\n", "",
      ("tests/core/test_geo_layout.py::test_upserts_take_slots_by_geography_and_summaries_are_made_again_exactly",),
      "a block's summary keeps the bits of ads retired or moved away"),
    # --- launch plans and CUDA graphs ----------------------------------------------------------------
    M("plan-key-by-shape", "graphs", "gpu/graphs.py",
      "    return (type(a), a) if isinstance(a, _VALUES) else id(a)",
      "    return (type(a), a) if isinstance(a, _VALUES) else tuple(getattr(a, 'shape', ()))",
      ("tests/gpu/test_graphs.py",), "a graph keyed by its arrays' shapes: a replaced array of the same shape replays "
      "the graph of the old one"),
    M("graph-replays-first-plan", "graphs", "gpu/graphs.py",
      "        entry[0].launch(stream)\n        self.replays += 1",
      "        next(iter(self._graphs.values()))[0].launch(stream)\n        self.replays += 1",
      ("tests/gpu/test_graphs.py", "tests/gpu/test_host_prepare.py::test_engine_overlaps_preparation_and_synchronizes_once_per_batch"),
      "the cache replays the first graph it captured, whatever the plan"),
    M("split-tables-unfilled", "graphs", "gpu/pipeline.py",
      "        mark(time.perf_counter())\n        self.fill_tables(prepared, tables_of())",
      "        mark(time.perf_counter())\n        tables_of()",
      ("tests/gpu/test_graphs.py::test_the_engine_answers_the_same_from_graphs_and_step_by_step_through_updates",),
      "a lone batch's user side computed but never written to its staging buffer: scored with stale tables"),
    # --- the group tables kept on the device, the circle grid ----------------------------------------
    M("kept-tables-not-cleared", "host preparation", "gpu/index.py",
      "        return list(batch.uploads[:1]) + before, steps, after\n",
      "        return list(batch.uploads[:1]) + before, steps, []\n",
      ("tests/gpu/test_host_prepare.py",),
      "a batch's term and circle words left in the kept tables: the next batch's requests hold them too"),
    M("kept-tables-set-not-or", "host preparation", "gpu/kernels/match.py",
      "        cuda.atomic.or_(ctab, cidx[i], cbits[i])", "        ctab[cidx[i]] = cbits[i]",
      ("tests/gpu/test_host_prepare.py",),
      "two requests of a group inside one circle: the second's bit overwrites the first's"),
    M("circle-grid-no-wrap", "host preparation", "gpu/index.py",
      "                        if lo_r - dl >= -180.0:\n                            continue",
      "                        continue",
      ("tests/gpu/test_host_prepare.py",),
      "circles across the antimeridian west of the user never searched"),
    M("circle-grid-sure-inside-wide", "host preparation", "gpu/index.py",
      "    lo, hi = chord2 - margin, chord2 + margin",
      "    lo, hi = chord2 + margin, chord2 + margin",
      ("tests/gpu/test_host_prepare.py",),
      "users just outside a circle taken as inside without the exact distance"),
    M("tables-upload-dropped", "graphs", "gpu/pipeline.py",
      "        return BatchPlan(None if parts is None else parts[0] + parts[1] + parts[2], parts, list(batch.uploads[1:]),",
      "        return BatchPlan(None if parts is None else parts[0] + parts[1] + parts[2], parts, [],",
      ("tests/gpu/test_host_prepare.py::test_engine_overlaps_preparation_and_synchronizes_once_per_batch",),
      "the user-side tables staged but never copied to the device"),
    # --- request encoding ---------------------------------------------------------------------------
    M("encode-namespaces-repeated", "request encoding", "andromeda_nb/compiled.py",
      "id_terms = np.repeat(np.tile(_ID_CODES, n), counts) | ids",
      "id_terms = np.repeat(np.repeat(_ID_CODES, n), counts) | ids",
      ("tests/gpu/test_host_prepare.py::test_encode_requests_equals_encode_request",),
      "a batch's id sets namespaced namespace-major while they are listed request-major: a second "
      "request's ids land in other namespaces"),
    M("encode-ids-to-first-request", "request encoding", "andromeda_nb/compiled.py",
      "id_req = np.repeat(np.arange(n, dtype=np.int64), counts.reshape(n, len(_ID_KEYS)).sum(axis=1))",
      "id_req = np.repeat(np.zeros(n, dtype=np.int64), counts.reshape(n, len(_ID_KEYS)).sum(axis=1))",
      ("tests/gpu/test_host_prepare.py::test_encode_requests_equals_encode_request",),
      "every id of a batch given to its first request"),
    # --- the CUDA simulator's repairs ---------------------------------------------------------------
    M("sim-shared-unlocked", "simulator", "gpu/simulator.py", "    kernelapi.FakeCUDAShared.array = shared_array\n", "",
      ("tests/gpu/test_simulator.py",), "the simulator's own shared arrays: threads racing to make one get one each"),
    M("sim-poison-off", "simulator", "gpu/simulator.py",
      '_poison["on"] = os.environ.get("ANDROMEDA_SIM_POISON", "1") != "0"', '_poison["on"] = False',
      ("tests/gpu/test_simulator.py",), "fresh simulator memory reads as zeros: a read of unwritten memory passes"),
    # --- answers --------------------------------------------------------------------------------------
    M("topk-ties-descending", "top-K ties", "andromeda_nb/reference.py",
      "order = np.lexsort((ids[cand], -scores[cand]))[:k]", "order = np.lexsort((-ids[cand], -scores[cand]))[:k]",
      ("tests/core/test_reference.py", "tests/gpu/test_topk.py"), "equal scores ordered by ad id descending"),
    # --- the wire protocol ----------------------------------------------------------------------------
    M("wire-k-ignored", "wire protocol", "serving/protocol.py",
      'ks = _column_as(batch, "k", _INT32).to_pylist()', "ks = [100] * len(ids)",
      ("tests/migration/test_colocated.py::test_plain_flight_client_gets_correct_answers",),
      "a server decodes every request of a batch with k = 100 instead of the batch's k column"),
    # --- added with the checked benchmarks: one or more per module, each for its module's own tests ------
    M("targeting-miles-as-km", "radius", "andromeda_nb/targeting.py",
      'radius_km = radius if unit == "kilometer" else radius * KM_PER_MILE', "radius_km = radius",
      ("tests/core/test_targeting.py",), "a custom location's radius in miles is taken as kilometres"),
    M("targeting-age-order-off-by-one", "ages", "andromeda_nb/targeting.py", "    if age_min > age_max:\n",
      "    if age_min > age_max + 1:\n", ("tests/core/test_targeting.py",),
      "an age_min one above age_max is accepted: a spec no user can meet"),
    M("targeting-geo-optional", "targeting", "andromeda_nb/targeting.py",
      'if "geo_locations" not in obj and "custom_audiences" not in obj:',
      'if "geo_locations" not in obj and "custom_audiences" not in obj and False:', ("tests/core/test_targeting.py",),
      "a spec with neither geo_locations nor custom_audiences is accepted"),
    M("oracle-circle-boundary-open", "radius", "andromeda_nb/oracle.py",
      "return great_circle_km(user.latitude, user.longitude, latitude, longitude) <= radius_km",
      "return great_circle_km(user.latitude, user.longitude, latitude, longitude) < radius_km",
      ("tests/core/test_oracle.py", "tests/core/test_distances.py"), "a user exactly on a custom location's circle is outside it"),
    M("oracle-excluded-geo-ignored", "exclusions", "andromeda_nb/oracle.py",
      "if spec.excluded_geo_locations is not None and matches_geo(spec.excluded_geo_locations, user):",
      "if spec.excluded_geo_locations is not None and matches_geo(spec.excluded_geo_locations, user) and False:",
      ("tests/core/test_oracle.py",), "excluded_geo_locations no longer exclude"),
    M("oracle-city-ignored", "geo", "andromeda_nb/oracle.py",
      "if user.region in geo.regions or user.city in geo.cities:", "if user.region in geo.regions:",
      ("tests/core/test_oracle.py",), "a geo clause's cities are never matched"),
    M("oracle-schedule-start-exclusive", "schedules", "andromeda_nb/oracle.py",
      "if ad.start_time is not None and time < ad.start_time:", "if ad.start_time is not None and time <= ad.start_time:",
      ("tests/core/test_oracle.py",), "an ad is not yet shown at its start_time"),
    M("oracle-excluded-audiences-ignored", "exclusions", "andromeda_nb/oracle.py",
      "if excluded is not None and not audiences.isdisjoint(excluded):",
      "if excluded is not None and not audiences.isdisjoint(excluded) and False:",
      ("tests/core/test_oracle.py",), "excluded_custom_audiences no longer exclude"),
    M("compiled-open-mask-drops-first", "placements", "andromeda_nb/compiled.py",
      "        return (1 << len(universe)) - 1\n", "        return (1 << len(universe)) - 2\n",
      ("tests/core/test_compiled.py",), "a placement left open allows every value but the first"),
    M("compiled-age65-bounded", "ages", "andromeda_nb/compiled.py",
      'cols["age_max"][i] = AGE_UNBOUNDED if s.age_max >= AGE_HIGHEST else s.age_max',
      'cols["age_max"][i] = s.age_max', ("tests/core/test_compiled.py",),
      "the compiled form bounds age_max 65: users older than 65 are refused"),
    M("compiled-excluded-circles-dropped", "exclusions", "andromeda_nb/compiled.py",
      "        neg_circles += _geo_circles(spec.excluded_geo_locations)\n", "",
      ("tests/core/test_compiled.py",), "the custom locations of excluded_geo_locations never reach the negative clause"),
    M("cpu-age-max-exclusive", "ages", "cpu_baseline/index.py", "if not (age_min[s] <= age <= age_max[s]):",
      "if not (age_min[s] <= age < age_max[s]):", ("tests/cpu_baseline/test_cpu_index.py",),
      "the CPU index refuses a user exactly at age_max"),
    M("cpu-match-order-by-slot", "cpu index", "cpu_baseline/index.py", "    return out[np.argsort(keys)]\n",
      "    return out\n", ("tests/cpu_baseline/test_cpu_index.py",),
      "after updates the CPU index answers in slot order, not by ad id"),
    M("cpu-dense-words-kept", "cpu index", "cpu_baseline/index.py",
      "                word[s] = 0\n                if (_clauses_met(w, n_positive[s])",
      "                if (_clauses_met(w, n_positive[s])", ("tests/cpu_baseline/test_cpu_index.py",),
      "the dense pass leaves its clause words set: the next request starts from the last one's hits"),
    M("gpu-match-schedule-end-inclusive", "schedules", "gpu/kernels/match.py", "if start <= t and t < end:",
      "if start <= t and t <= end:", ("tests/gpu/test_gpu_index.py",),
      "the match kernel still shows an ad at its end_time"),
    M("gpu-match-age-max-ignored", "ages", "gpu/kernels/match.py",
      "    alive &= int64(ft[AMAX_OFF + ((w >> AGE_MAX_SHIFT) & 127)])\n", "",
      ("tests/gpu/test_gpu_index.py",), "the match kernel never applies age_max"),
    M("gpu-match-last-circle-skipped", "radius", "gpu/kernels/match.py",
      "while k < nc and (sat & alive) != alive:", "while k < nc - 1 and (sat & alive) != alive:",
      ("tests/gpu/test_gpu_index.py",), "the match kernel never reads a clause's last custom location"),
    M("gpu-compact-drops-last-word", "gpu index", "gpu/kernels/match.py",
      "    for i in range(int64(lengths[slot])):", "    for i in range(int64(lengths[slot]) - 1):",
      ("tests/gpu/test_gpu_index.py",), "a compaction of the clause programs loses each program's last word"),
    M("scoring-expert-bias-dropped", "FiLM", "andromeda_nb/scoring.py",
      "out[:, :, 2 * E * D + E : 2 * E * D + 2 * E] = np.matmul(beta, U.transpose(0, 2, 1))",
      "out[:, :, 2 * E * D + E : 2 * E * D + 2 * E] = 0.0",
      ("tests/gpu/test_score_kernels.py", "tests/cpu_baseline/test_cpu_scorer.py"),
      "the folded table loses the experts' bias dot(U[e], beta[f])"),
    M("scoring-gate-unscaled", "int8 scales", "andromeda_nb/scoring.py", "g[e] = acc * scale + tab[f, qb0 + e]",
      "g[e] = acc + tab[f, qb0 + e]", ("tests/gpu/test_score_kernels.py", "tests/cpu_baseline/test_cpu_scorer.py"),
      "the gate logits forget the per-ad int8 scale"),
    M("reference-topk-ties-dropped", "top-K ties", "andromeda_nb/reference.py",
      "cand = np.flatnonzero(scores >= threshold)", "cand = np.flatnonzero(scores > threshold)",
      ("tests/core/test_reference.py",), "the reference top-K drops every ad tied with the k-th score"),
    M("topk-shared-sort-short", "top-K", "gpu/kernels/topk.py", "size = 2\n    while size <= P:",
      "size = 2\n    while size < P:", ("tests/gpu/test_topk.py",),
      "the final top-K's bitonic sort in shared memory stops one merge short: answers out of rank order"),
    M("topk-warp-count-one-a-digit", "top-K", "gpu/kernels/radix.py",
      "cuda.atomic.add(hist, off + d, uint32(cuda.popc(peers)))", "cuda.atomic.add(hist, off + d, uint32(1))",
      ("tests/gpu/test_topk.py",), "top-K v3 counts one key for all the lanes of a warp holding the same digit"),
    M("topk-warp-count-every-lane", "top-K", "gpu/kernels/radix.py", "if d != HIST_BINS and (peers & below) == 0:",
      "if d != HIST_BINS:", ("tests/gpu/test_topk.py",),
      "top-K v3: every lane of a digit's group adds the group's count, not only its lowest lane"),
    M("gpu-topk-ties-descending", "top-K ties", "gpu/kernels/topk.py", "return ka > kb or (ka == kb and ia < ib)",
      "return ka > kb or (ka == kb and ia > ib)", ("tests/gpu/test_topk.py",),
      "the final top-K kernel orders equal scores by slot descending"),
    M("updates-retire-stays-live", "updates", "andromeda_nb/updates.py", "            self.ids.discard(update.ad_id)\n",
      "            pass\n", ("tests/core/test_updates.py",),
      "a retired ad stays live: a status update or a second retire of it is accepted"),
    M("wal-replays-snapshot-record", "update log", "serving/wal.py",
      "self._replay = [r for r in records if r.seq > snapshot_seq]",
      "self._replay = [r for r in records if r.seq >= snapshot_seq]", ("tests/serving/test_wal.py",),
      "the log replays the record the snapshot already holds"),
    M("wal-other-corpus-accepted", "update log", "serving/wal.py", "        if scan.lineage != self.lineage:\n",
      "        if False:\n", ("tests/serving/test_wal.py",), "a log of another corpus is replayed onto this one"),
    M("durable-call-forgets-retire", "durable journal", "serving/durable.py",
      "            self.ids.touched[update.ad_id] = False\n", "            pass\n",
      ("tests/serving/test_durable.py",),
      "within one update call, an ad retired earlier in the call still counts as live"),
    M("durable-max-updates-off-by-one", "limits", "serving/durable.py", "if n_lines > limits.max_updates:",
      "if n_lines > limits.max_updates + 1:", ("tests/serving/test_limits.py",),
      "an update call one line over --max-updates is accepted"),
    M("batcher-batch-overflows", "request batcher", "serving/batcher.py",
      "if n + size > self.max_requests and n:", "if n > self.max_requests and n:",
      ("tests/serving/test_batcher.py",), "a call that does not fit closes no batch: batches grow past max_requests"),
    M("batcher-cut-ignores-k", "request batcher", "serving/batcher.py",
      "cuts.append([(ids[:k], scores[:k]) for (ids, scores), k in zip(part, c.ks)])", "cuts.append(list(part))",
      ("tests/serving/test_batcher.py",), "every caller of a batch gets the batch's largest k answers, not its own k"),
    M("guard-reader-may-update", "guard", "serving/guard.py",
      "if held == ADMIN or (role == READER and held == READER):", "if held in (ADMIN, READER):",
      ("tests/serving/test_guard.py",), "the reader token may send updates"),
    M("guard-exposed-without-auth", "guard", "serving/guard.py",
      "        if not self.authenticated:\n", "        if False:\n",
      ("tests/serving/test_guard.py",), "a server listens beyond loopback with no token and no mutual TLS"),
    M("guard-client-certificate-not-required", "guard", "serving/guard.py",
      '            kwargs["verify_client"] = True\n', '            kwargs["verify_client"] = False\n',
      ("tests/serving/test_guard.py",), "mutual TLS asks for a client certificate but admits a caller without one"),
    M("limits-max-k-unbounded", "limits", "serving/limits.py", "if not 1 <= self.max_k <= MAX_K:",
      "if not 1 <= self.max_k:", ("tests/serving/test_limits.py",), "a --max-k above the largest k any answer may have is taken"),
    M("inputs-server-max-k-ignored", "request decoding", "serving/inputs.py", "    if k > max_k:\n",
      "    if k > MAX_K:\n", ("tests/serving/test_inputs.py",), "a request's k is checked against MAX_K alone, never the server's --max-k"),
    M("compaction-new-ad-status-lost", "compaction", "serving/compaction.py",
      'state[update.ad_id] = ("new", dataclasses.replace(entry[1], status=update.status))', "pass",
      ("tests/serving/test_wal.py",), "a compaction forgets a status change of an ad the log created"),
    M("compaction-refolds-snapshot", "compaction", "serving/compaction.py",
      "    records = [r for r in records if r.seq > base]\n", "    records = [r for r in records if r.seq >= base]\n",
      ("tests/serving/test_wal.py",), "a compaction folds again the record the snapshot already holds"),
    M("protocol-server-max-k-ignored", "request decoding", "serving/protocol.py", "        check_k(k, rid, limits.max_k)\n",
      "        check_k(k, rid)\n", ("tests/serving/test_inputs.py",),
      "JSON request batches are checked against MAX_K, never the server's --max-k"),
    M("front-update-one-worker", "engine workers", "serving/engine_front.py",
      "        for worker in workers:  # sent to every worker before any is waited for: they apply it at once\n",
      "        for worker in workers[:1]:  # sent to every worker before any is waited for: they apply it at once\n",
      ("tests/migration/test_colocated_engines.py::test_an_acknowledged_update_is_seen_by_every_worker",),
      "an acknowledged update reaches the first engine worker only: requests the others answer miss it"),
    M("front-picks-ended-worker", "engine workers", "serving/engine_front.py",
      "            if worker.ended is None and (least is None or worker.lanes.busy < least):\n",
      "            if least is None or worker.lanes.busy < least:\n",
      ("tests/migration/test_colocated_engines.py::test_a_killed_worker_fails_its_calls_by_name_and_never_hangs",),
      "the front keeps handing requests to an engine worker that has ended"),
    M("front-lists-ended-endpoints", "engine workers", "serving/engine_front.py",
      '        listed = [w for w in pool.fronts if w.ended is None] if pool.fronts else pool.live()\n',
      '        listed = [w for w in pool.fronts if w.ended is None] if pool.fronts else pool.workers\n',
      ("tests/migration/test_colocated_engines.py::test_the_workers_own_endpoints_answer_as_the_front_and_after_its_acknowledgements",),
      "the front keeps listing the endpoint of an engine worker that has ended: clients are sent where no one answers"),
    M("worker-endpoint-unguarded", "engine workers", "migration/colocated.py",
      '"guard": (guard or OPEN).to_json()}', '"guard": OPEN.to_json()}',
      ("tests/migration/test_colocated_engines.py::test_a_guarded_front_guards_its_workers_endpoints",),
      "the engine workers' own endpoints serve without the front's tokens and TLS: anyone reads past the guard"),
    M("endpoint-answers-stale-seq", "engine workers", "serving/engine_worker.py",
      "        return out, answer_metadata(seq)\n", "        return out, answer_metadata(None)\n",
      ("tests/migration/test_colocated_engines.py::test_the_workers_own_endpoints_answer_as_the_front_and_after_its_acknowledgements",),
      "a worker's endpoint answers without the seq of the last update its answers reflect"),
    M("front-reuses-abandoned-lane", "engine workers", "serving/engine_channel.py",
      "            if kept and not self.closed:\n", "            if not self.closed:\n",
      ("tests/migration/test_colocated_engines.py::test_a_call_past_its_deadline_closes_its_lane_and_the_late_answer_reaches_no_one",),
      "a request lane whose caller gave up goes back to the free ones: the late answer is read by the next call"),
    M("large-bodies-parse-at-once", "durable calls", "serving/durable.py",
      "        if size < LARGE_BODY_BYTES:\n", "        if size < LARGE_BODY_BYTES or True:\n",
      ("tests/serving/test_durable.py::test_large_bodies_parse_one_at_a_time_and_a_small_one_never_waits_behind_them",),
      "concurrent large update calls parse at once again, each a competitor for the interpreter"),
    M("turn-taken-after-gathering", "serving", "serving/batcher.py",
      "                self._take_turn()  # before gathering: the calls that come while it waits join this batch\n",
      "",
      ("tests/serving/test_batcher.py::test_with_a_turn_calls_that_wait_for_it_join_one_batch_and_engines_never_overlap",),
      "an engine waiting for the GPU turn runs the batch it had, not the calls that came meanwhile"),
    M("turn-held-while-encoding", "serving", "serving/batcher.py",
      "                self._give_turn()  # the engine has answered: the next engine may use the GPU while this encodes\n",
      "                pass\n",
      ("tests/serving/test_batcher.py::test_with_a_turn_calls_that_wait_for_it_join_one_batch_and_engines_never_overlap",),
      "the GPU turn is kept while the answers are encoded, so the engines' host work no longer overlaps"),
    M("cluster-front-one-batch-in-flight", "cluster", "cluster/front.py",
      "                         for i in range(max(1, len(self.router.replicas[0])))]\n",
      "                         for i in range(1)]\n",
      ("tests/cluster/test_cluster.py::test_the_front_batches_concurrent_exchanges_with_one_batch_in_flight_per_replica",),
      "serve cluster's front keeps one batch in flight, leaving every replica but one idle"),
    M("cluster-front-unbatched", "cluster", "cluster/front.py",
      "            answers, _ = batcher.submit(requests, ks)  # each cut to its own k\n",
      "            answers = [(i[:k], s[:k]) for (i, s), k in zip(self.router.retrieve(requests, max(ks)), ks)]\n",
      ("tests/cluster/test_cluster.py::test_the_front_batches_concurrent_exchanges_with_one_batch_in_flight_per_replica",),
      "serve cluster's front sends every exchange's requests to the shards alone"),
    # --- the demo ---------------------------------------------------------------------------------------
    M("demo-batch-answers-unchecked", "demo", "benchmarks/demo.py",
      "                and np.allclose(got[1], want[1], rtol=0.0, atol=SCORE_ATOL)):\n",
      "                and True):\n",
      ("tests/benchmarks/test_demo.py::test_the_batched_pass_stops_when_a_batch_changes_an_answer",),
      "the demo times a batch whose scores differ from the lone requests' answers"),
]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


def make_copy(dest: Path) -> None:
    for rel in tracked_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise LookupError(f"stale: the text to mutate occurs {count} times in {mutant.path}")
    path.write_text(text.replace(mutant.old, mutant.new))


def run_one(mutant: Mutant, timeout_s: float) -> dict:
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        tree = Path(tmp) / "repo"
        make_copy(tree)
        try:
            apply(mutant, tree)
        except LookupError as exc:
            return {"name": mutant.name, "area": mutant.area, "result": "stale", "detail": str(exc), "seconds": 0.0}
        env = {**os.environ, "NUMBA_CACHE_DIR": str(Path(tmp) / "numba-cache"), "PYTHONPATH": str(tree),
               "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("ANDROMEDA_TEST_GPU", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests]
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"name": mutant.name, "area": mutant.area, "result": "timeout", "seconds": time.time() - t0}
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    row = {"name": mutant.name, "area": mutant.area}
    if proc.returncode == 1:
        row["result"] = "caught"
        failed = first_failed(proc.stdout)
        if failed:
            row["caught_by"] = failed.split("::")[0]  # the first test file that failed (-x: the only one)
            row["failed_test"] = failed
            if row["caught_by"] == END_TO_END:  # its module's own test files ran first and missed it
                row["gap"] = f"caught only by {END_TO_END}: its module's own tests miss it"
    elif proc.returncode == 0:
        row["result"] = "SURVIVED"
    else:  # 2-5: interrupted, internal error, usage error, no tests collected
        row["result"] = f"error (pytest rc {proc.returncode})"
    return {**row, "detail": tail, "seconds": round(time.time() - t0, 1)}


def first_failed(stdout: str) -> str | None:
    """The node id of the first failed test in pytest's short summary ("FAILED path::test - message")."""
    for line in stdout.splitlines():
        if line.startswith("FAILED "):
            return line[len("FAILED "):].split(" - ", 1)[0].strip()
    return None


def problems() -> list[str]:
    """What keeps a mutant from being planted as written: a name used twice, a text to mutate that does
    not occur exactly once in its file, a test file that does not exist."""
    out, seen = [], set()
    for m in MUTANTS:
        if m.name in seen:
            out.append(f"{m.name}: the name is used twice")
        seen.add(m.name)
        path = ROOT / m.path
        count = path.read_text().count(m.old) if path.is_file() else 0
        if count != 1:
            out.append(f"{m.name}: its text occurs {count} times in {m.path}")
        out += [f"{m.name}: no test file {t.split('::')[0]}" for t in m.tests if not (ROOT / t.split("::")[0]).is_file()]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Plant deliberate bugs in copies of the tree and check the tests catch them.")
    ap.add_argument("--list", action="store_true", help="print one mutant a line and exit")
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    ap.add_argument("--json", action="store_true", help="JSON Lines instead of the table")
    ap.add_argument("--check", action="store_true",
                    help="check that every mutant's text occurs exactly once and its test files exist, and exit")
    args = ap.parse_args(argv)
    if args.check:
        found = problems()
        print("\n".join(found) if found else f"{len(MUTANTS)} mutants, each text once, every test file there")
        return 1 if found else 0
    names = {m.name for m in MUTANTS}
    if len(names) != len(MUTANTS):
        raise SystemExit("mutant names must be unique")
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:<26} {m.area:<14} {m.path:<32} {m.why}")
        return 0
    chosen = MUTANTS
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - names)
        if unknown:
            raise SystemExit(f"unknown mutant(s): {', '.join(unknown)}; see --list")
        chosen = [m for m in MUTANTS if m.name in wanted]
    results = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(lambda m: run_one(m, args.timeout), chosen):
            results.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{row['name']:<26} {row['area']:<14} {row['result']:<22} {row['seconds']:>7.1f} s  "
                      f"{row.get('caught_by', '')}", flush=True)
    caught = sum(r["result"] == "caught" for r in results)
    late = [r["name"] for r in results if r.get("gap")]
    summary = [f"{caught} of {len(results)} mutants caught"]
    if late:  # a module's own test file should catch the mutants of its module
        summary.append(f"caught only once {END_TO_END} ran (gaps in the module tests, to close): {', '.join(late)}")
    print("\n".join(summary), file=sys.stderr if args.json else sys.stdout)
    return 0 if caught == len(results) and not late else 1


if __name__ == "__main__":
    sys.exit(main())
