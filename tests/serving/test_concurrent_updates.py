"""Update calls from many clients at once, with retrievals between them (issue 37, point 1), on both
designs: the co-located server (CPU engine) and the remote pair (index host + scoring service).

Three threads send `update` calls while two threads retrieve at k = 4096 (every eligible ad, ranked).
What must hold on any machine, however loaded (no timing is asserted):

* every call is acknowledged (or refused cleanly, nothing applied): never an internal error;
* the calls are applied one at a time in log order: the acknowledged calls' sequence ranges tile the
  log from 1 to its end without a gap or an overlap, and each range holds exactly that call's
  accepted lines, in the call's order;
* every answer equals the float64 reference built from the log's records up to the sequence number
  the answer reports (so live state and log agree at every step), and a server started again on the
  log answers the same at the same sequence number;
* nothing is stuck: afterwards both remote services stand at the log's end, health is ok, and a new
  update is applied and seen.

Servers run in this process on 127.0.0.1 and are stopped here. Sizes are small and every loop is
bounded; the seeds are fixed and printed on failure.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import pyarrow.flight as flight

from serving import protocol as fl
from serving.limits import ServiceLimits
from andromeda_nb.reference import ReferenceRetriever
from andromeda_nb.testing import update_to_json
from andromeda_nb.updates import parse_update
from serving.wal import WriteAheadLog, corpus_lineage
from cpu_baseline.index_host import IndexHostServer
from cpu_baseline.scoring_service import ScoringServer

from tests.support.servers import D, F, assert_equals_reference, colocated_server, lines_of, saved_corpus, stop, update_stream

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

K_ALL = 4096  # above every eligible count: an answer is the whole eligible set, ranked
UPDATERS, READERS = 3, 2
CALLS_PER_UPDATER = 6
MAX_READS = 60  # per reader thread: a bound on the loop, whatever the machine's speed
SEED = 3737
# small slices and a low share: many slices, and the pacing between them, in every call
LIMITS = ServiceLimits(update_slice=3, update_cpu_share=0.2)


def _calls(dataset, seed: int) -> list[list[str]]:
    """Each updater's calls: the lines of a stream valid on its own, cut into calls of 4 to 40 lines (the
    threads' streams interleave, so some lines of one are refused after another's: a clean rejection)."""
    rng = np.random.default_rng([SEED, seed])
    sizes = [int(n) for n in rng.integers(4, 41, CALLS_PER_UPDATER)]
    stream = [json.dumps(update_to_json(u)) for u in update_stream(dataset, sum(sizes), SEED + seed)]
    calls, at = [], 0
    for n in sizes:
        calls.append(stream[at : at + n])
        at += n
    return calls


def _run(location, dataset, requests) -> tuple[list, list, list]:
    """Updaters and readers at once. Returns (acks: (lines, ack), errors: (what, exception text),
    reads: (seq, answers))."""
    acks, errors, reads = [], [], []
    lock = threading.Lock()
    updaters_done = threading.Event()
    start = threading.Barrier(UPDATERS + READERS)

    def updater(i):
        start.wait()
        for lines in _calls(dataset, i):
            try:
                ack = fl.flight_action(location, "update", "\n".join(lines), timeout=120)
                with lock:
                    acks.append((lines, ack))
            except flight.FlightError as exc:
                with lock:
                    errors.append((f"a call of {len(lines)} lines", f"{type(exc).__name__}: {str(exc)[:300]}"))

    def reader():
        start.wait()
        for _ in range(MAX_READS):
            if updaters_done.is_set():
                break
            seqs: list = []
            try:
                answers = fl.retrieve_over_flight(location, requests, K_ALL, batch_size=len(requests), seqs=seqs,
                                                  timeout=120)
            except flight.FlightError as exc:
                with lock:
                    errors.append(("a retrieval", f"{type(exc).__name__}: {str(exc)[:300]}"))
                continue
            with lock:
                reads.append((seqs[0], answers))

    updaters = [threading.Thread(target=updater, args=(i,)) for i in range(UPDATERS)]
    readers = [threading.Thread(target=reader) for _ in range(READERS)]
    for t in updaters + readers:
        t.start()
    for t in updaters:
        t.join(300)
    updaters_done.set()
    for t in readers:
        t.join(300)
    assert not any(t.is_alive() for t in updaters + readers), "a client thread is still running"
    return acks, errors, reads


def _records(log: WriteAheadLog) -> list:
    return list(log.records_after(log.base_seq))


def _check_calls_tile_the_log(acks, errors, records, context):
    """Every call acknowledged; the calls' ranges tile the log; each range holds its call's accepted lines."""
    assert not errors, f"{context}: calls failed: {errors[:3]}"
    assert len(acks) == UPDATERS * CALLS_PER_UPDATER, context
    by_seq = {r.seq: r for r in records}
    ranges = []
    for lines, ack in acks:
        rejected = {r["line"] for r in ack["rejected"]}
        assert ack["applied"] + len(rejected) == len(lines), f"{context}: {ack}"
        accepted = [json.loads(line) for n, line in enumerate(lines, start=1) if n not in rejected]
        first = ack["seq"] - ack["applied"] + 1
        if ack["applied"]:
            ranges.append((first, ack["seq"]))
        logged = [by_seq[s].update for s in range(first, ack["seq"] + 1)]
        assert logged == accepted, f"{context}: the log's records {first}..{ack['seq']} are not the call's accepted lines"
    ranges.sort()
    assert [lo for lo, _ in ranges] == [1] + [hi + 1 for _, hi in ranges[:-1]], f"{context}: ranges {ranges}"
    assert ranges[-1][1] == len(records) == records[-1].seq, f"{context}: ranges {ranges}, {len(records)} records"


def _check_answers_against_the_log(dataset, reads, records, requests, context):
    """Each answer equals the reference at the sequence number it reports, built from the log."""
    reference, at = ReferenceRetriever.build(dataset), 0
    for seq, answers in sorted(reads, key=lambda r: r[0]):
        assert seq is not None and 0 <= seq <= len(records), f"{context}: answer at seq {seq}"
        while at < seq:
            reference.apply(parse_update(records[at].update, seed=dataset.seed, dim=D, formats=F))
            at += 1
        assert_equals_reference(reference, requests, answers, K_ALL, f"{context}, answer at seq {seq}")
    return reference, at


def _final_answers(location, requests):
    seqs: list = []
    answers = fl.retrieve_over_flight(location, requests, K_ALL, batch_size=len(requests), seqs=seqs, timeout=60)
    return seqs[0], answers


def _same_answers(a, b, context):
    for (ids_a, scores_a), (ids_b, scores_b) in zip(a, b, strict=True):
        assert np.array_equal(ids_a, ids_b), context
        assert np.array_equal(scores_a, scores_b), context


def _location(server):
    return f"grpc://127.0.0.1:{server.port}"


def test_concurrent_update_calls_and_retrievals_on_the_colocated_server(tmp_path):
    context = f"co-located, seed {SEED}, {UPDATERS} updaters x {CALLS_PER_UPDATER} calls, {READERS} readers"
    root, dataset = saved_corpus(tmp_path / "corpus", 37, n_ads=160, n_requests=5)
    requests = dataset.requests
    lineage = corpus_lineage(dataset)
    server = colocated_server(dataset, log=WriteAheadLog.open(root / "updates.log", lineage=lineage, snapshot_seq=0),
                              limits=LIMITS)
    try:
        acks, errors, reads = _run(_location(server), dataset, requests)
        records = _records(server.log)
        _check_calls_tile_the_log(acks, errors, records, context)
        live_seq, live = _final_answers(_location(server), requests)
        assert live_seq == server.log.last_seq == len(records), context
        reads.append((live_seq, live))
        _check_answers_against_the_log(dataset, reads, records, requests, context)
    finally:
        stop(server)
    restarted = colocated_server(dataset, log=WriteAheadLog.open(root / "updates.log", lineage=lineage,
                                                                  snapshot_seq=0), limits=LIMITS)
    try:
        assert restarted.replayed == live_seq, context
        seq, again = _final_answers(_location(restarted), requests)
        assert seq == live_seq, context
        _same_answers(live, again, f"{context}: the live answers and a restart's at seq {seq}")
    finally:
        stop(restarted)


def _pair(dataset, log):
    scorer = ScoringServer(dataset, "grpc://127.0.0.1:0")
    host = IndexHostServer(dataset, f"grpc://127.0.0.1:{scorer.port}", "grpc://127.0.0.1:0", threads=1,
                           monitor_s=0.1, log=log, limits=LIMITS, scorer_secret=scorer.pair_secret)
    return host, scorer


def _stop_pair(host, scorer):
    host.shutdown()
    host.close_resources()
    scorer.shutdown()


def test_concurrent_update_calls_and_retrievals_on_the_remote_pair(tmp_path):
    context = f"remote pair, seed {SEED}, {UPDATERS} updaters x {CALLS_PER_UPDATER} calls, {READERS} readers"
    root, dataset = saved_corpus(tmp_path / "corpus", 38, n_ads=160, n_requests=5, precision="fp16")
    requests = dataset.requests
    lineage = corpus_lineage(dataset)
    host, scorer = _pair(dataset, WriteAheadLog.open(root / "updates.log", lineage=lineage, snapshot_seq=0))
    try:
        acks, errors, reads = _run(_location(host), dataset, requests)
        records = _records(host.log)
        _check_calls_tile_the_log(acks, errors, records, context)
        assert host.index_seq == scorer.seq == host.log.last_seq == len(records), \
            f"{context}: index {host.index_seq}, scorer {scorer.seq}, log {host.log.last_seq}"
        assert not host._pending, context
        live_seq, live = _final_answers(_location(host), requests)
        assert live_seq == len(records), context
        reads.append((live_seq, live))
        _check_answers_against_the_log(dataset, reads, records, requests, context)
        health = fl.flight_action(_location(host), "health")
        assert health["status"] == "ok" and health["seq"] == health["scorer_seq"] == live_seq, health
        # not stuck: one more call is applied to both services and seen by the next retrieval
        more = update_stream(dataset, 1, SEED)
        ack = fl.flight_action(_location(host), "update", lines_of(more))
        assert ack["seq"] == live_seq + 1 and "pending" not in ack and scorer.seq == live_seq + 1, ack
        live_seq, live = _final_answers(_location(host), requests)
        assert live_seq == ack["seq"], context
    finally:
        _stop_pair(host, scorer)
    # the host started again on its log beside a scoring service fresh from the snapshot (update 0)
    host, scorer = _pair(dataset, WriteAheadLog.open(root / "updates.log", lineage=lineage, snapshot_seq=0))
    try:
        assert host.replayed == scorer.seq == live_seq, context
        seq, again = _final_answers(_location(host), requests)
        assert seq == live_seq, context
        _same_answers(live, again, f"{context}: the live answers and a restart's at seq {seq}")
        _check_answers_against_the_log(dataset, [(seq, again)], _records(host.log), requests, context + ", restarted")
    finally:
        _stop_pair(host, scorer)


def test_a_call_whose_apply_fails_stops_further_calls_until_a_restart(tmp_path, monkeypatch):
    """Should applying a logged call fail (a fault of the engine, not of the input), the server no
    longer knows how far its live state follows its log: later calls are refused, naming the
    records, health says degraded, answers still name the last update the engine holds, and a
    restart replays the log and agrees with it."""
    root, dataset = saved_corpus(tmp_path / "corpus", 39, n_ads=80, n_requests=4)
    lineage = corpus_lineage(dataset)
    stream = update_stream(dataset, 12, SEED)
    server = colocated_server(dataset, log=WriteAheadLog.open(root / "updates.log", lineage=lineage, snapshot_seq=0),
                              limits=ServiceLimits(update_slice=2))
    try:
        assert fl.flight_action(_location(server), "update", lines_of(stream[:4]))["seq"] == 4
        real, calls = server.engine.apply, []

        def failing(update):
            calls.append(update)
            if len(calls) == 3:
                raise RuntimeError("the engine broke")
            return real(update)

        monkeypatch.setattr(server.engine, "apply", failing)
        with pytest.raises(flight.FlightInternalError, match=r"logged up to 10, but applying logged updates 7\.\.10 "
                                                             r"failed \(RuntimeError: the engine broke\)"):
            fl.flight_action(_location(server), "update", lines_of(stream[4:10]))
        monkeypatch.setattr(server.engine, "apply", real)
        with pytest.raises(flight.FlightInternalError, match="update calls are refused: applying logged updates 7"):
            fl.flight_action(_location(server), "update", lines_of(stream[10:]))
        assert server.log.last_seq == 10  # the refused call logged nothing
        health = fl.flight_action(_location(server), "health")
        assert health["status"] == "degraded" and "restart the server" in health["reasons"][0], health
        seq, answers = _final_answers(_location(server), dataset.requests)
        assert seq == 6, seq  # the engine holds updates 1..6 and says so
        _check_answers_against_the_log(dataset, [(seq, answers)], _records(server.log), dataset.requests, "failed")
    finally:
        stop(server)
    restarted = colocated_server(dataset, log=WriteAheadLog.open(root / "updates.log", lineage=lineage,
                                                                  snapshot_seq=0))
    try:
        assert restarted.replayed == 10
        assert fl.flight_action(_location(restarted), "health")["status"] == "ok"
        seq, answers = _final_answers(_location(restarted), dataset.requests)
        _check_answers_against_the_log(dataset, [(seq, answers)], _records(restarted.log), dataset.requests,
                                       "restarted")
        assert seq == 10
    finally:
        stop(restarted)
