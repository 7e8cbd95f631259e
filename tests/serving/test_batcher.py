"""The request batcher (serving/batcher.py): concurrent calls gathered into engine batches, each
caller answered with its own requests cut to its own k, errors to every caller of a batch, bounds kept."""

import threading
import time

import numpy as np
import pytest

from serving.batcher import BatcherClosed, RequestBatcher
from tests.support.threads import run_in_threads


class FakeEngine:
    """Answers request r with ids r*1000 + 0..k-1 and scores descending; records every batch."""

    def __init__(self, delay_s=0.0, fail_on=None):
        self.batches = []
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.seq = 0

    def __call__(self, requests, k):
        self.batches.append(list(requests))
        if self.fail_on is not None and self.fail_on in requests:
            raise ValueError(f"request {self.fail_on} is bad")
        time.sleep(self.delay_s)
        self.seq += 1
        return [(np.arange(k, dtype=np.int64) + r * 1000, np.linspace(1, 0, k, dtype=np.float32)) for r in requests], self.seq


def _clients(batcher, n, per_call, ks):
    results, errors = {}, {}

    def client(i):
        reqs = list(range(i * per_call, (i + 1) * per_call))
        try:
            results[i] = batcher.submit(reqs, [ks[i % len(ks)]] * per_call)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            errors[i] = exc

    run_in_threads(client, n, timeout_s=10)
    return results, errors


def test_concurrent_calls_share_batches_and_get_their_own_answers():
    engine = FakeEngine(delay_s=0.01)
    batcher = RequestBatcher(engine, max_wait_s=0.005)
    try:
        results, errors = _clients(batcher, 24, 3, ks=(1, 5, 9))
    finally:
        batcher.close()
    assert not errors and len(results) == 24
    for i, (answers, tag) in results.items():
        k = (1, 5, 9)[i % 3]
        assert len(answers) == 3
        for r, (ids, scores) in zip(range(i * 3, i * 3 + 3), answers):
            assert ids.tolist() == [r * 1000 + j for j in range(k)] and len(scores) == k
        assert tag >= 1
    assert sum(len(b) for b in engine.batches) == 72
    assert len(engine.batches) < 24, "calls that arrive together share a batch"
    assert batcher.stats()["calls"] == 24 and batcher.stats()["batches"] == len(engine.batches)


def test_a_batch_never_exceeds_max_requests():
    engine = FakeEngine(delay_s=0.01)
    batcher = RequestBatcher(engine, max_wait_s=0.01, max_requests=8)
    try:
        results, errors = _clients(batcher, 12, 3, ks=(4,))
    finally:
        batcher.close()
    assert not errors and len(results) == 12
    assert max(len(b) for b in engine.batches) <= 8


def test_an_error_reaches_every_caller_of_its_batch_and_the_next_batch_runs():
    engine = FakeEngine(fail_on=7)
    batcher = RequestBatcher(engine, max_wait_s=0.0)
    try:
        with pytest.raises(ValueError, match="request 7 is bad"):
            batcher.submit([6, 7], [2, 2])
        answers, _ = batcher.submit([8], [3])
        assert answers[0][0].tolist() == [8000, 8001, 8002]
    finally:
        batcher.close()


def test_closed_batcher_refuses_and_bad_arguments_are_named():
    batcher = RequestBatcher(FakeEngine())
    batcher.close()
    with pytest.raises(BatcherClosed, match="shutting down"):
        batcher.submit([1], [1])
    with pytest.raises(ValueError, match="max_wait_s must not be negative"):
        RequestBatcher(FakeEngine(), max_wait_s=-1)
    open_one = RequestBatcher(FakeEngine())
    try:
        with pytest.raises(ValueError, match="2 requests but 1 values of k"):
            open_one.submit([1, 2], [3])
    finally:
        open_one.close()


def test_stats_say_where_the_worker_spends_a_batch():
    """A batch that waits 30 ms (a device, say) shows 30 ms of `run` and almost no CPU time in it; one
    that computes shows its CPU time; the gather stays within the wait bound, and idle time counts."""

    def busy(requests, k):
        t = time.thread_time()
        while time.thread_time() - t < 0.02:  # 20 ms of this thread's CPU
            pass
        return FakeEngine()(requests, k)

    waiting = RequestBatcher(FakeEngine(delay_s=0.03), max_wait_s=0.001)
    computing = RequestBatcher(busy, max_wait_s=0.001)
    try:
        for b in (waiting, computing):
            time.sleep(0.05)  # idle before the first call
            b.submit([1], [3])
            b.submit([2], [3])
        w, c = waiting.stats()["per_batch_ms"], computing.stats()["per_batch_ms"]
        assert waiting.stats()["batches"] == computing.stats()["batches"] == 2
        assert w["run"] >= 29 and w["run_cpu"] < 10, w
        assert c["run"] >= 19 and c["run_cpu"] >= 15, c
        assert w["gather"] < 25 and c["gather"] < 25
        assert w["idle"] >= 20 and c["idle"] >= 20  # the 50 ms before the first call, over 2 batches
    finally:
        waiting.close()
        computing.close()


@pytest.mark.parametrize("ahead", [False, True])
def test_payloads_are_decoded_and_encoded_on_the_worker_and_a_bad_one_fails_alone(ahead):
    """`submit_payload`: decode and encode run on the worker thread (not the callers'), each caller
    gets its own encoded answers, a payload that does not decode fails its own caller only while the
    calls beside it are answered, and a payload with no request is encoded as an empty answer."""
    threads_seen = set()

    def decode(payload):
        threads_seen.add(threading.current_thread().name)
        if payload == "bad":
            raise ValueError("payload 'bad' does not decode")
        return list(payload), [2] * len(payload)

    def encode(requests, answers, tag):
        threads_seen.add(threading.current_thread().name)
        return {"requests": list(requests), "ids": [ids.tolist() for ids, _ in answers], "tag": tag}

    engine = FakeEngine(delay_s=0.01)
    batcher = RequestBatcher(engine, max_wait_s=0.02, decode=decode, encode=encode, name="worker-under-test",
                             decode_ahead=ahead)
    results, errors = {}, {}
    payloads = {0: (1, 2), 1: "bad", 2: (3,), 3: (), 4: (4, 5, 6)}

    def client(i):
        try:
            results[i] = batcher.submit_payload(payloads[i])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            errors[i] = exc

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in payloads]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        batcher.close()
    plain = RequestBatcher(FakeEngine())
    try:
        with pytest.raises(TypeError, match="without decode and encode"):
            plain.submit_payload((1,))
    finally:
        plain.close()
    # never a caller's thread: the worker's, and with decode_ahead the decoding thread's
    assert threads_seen == ({"worker-under-test", "worker-under-test-decode"} if ahead else {"worker-under-test"})
    assert set(errors) == {1} and "does not decode" in str(errors[1])
    assert results[3] == {"requests": [], "ids": [], "tag": None}
    for i in (0, 2, 4):
        assert results[i]["requests"] == list(payloads[i])
        assert results[i]["ids"] == [[r * 1000, r * 1000 + 1] for r in payloads[i]]
        assert results[i]["tag"] >= 1
    assert sum(len(b) for b in engine.batches) == 6


def test_a_batch_of_payloads_is_encoded_at_once_and_falls_back_call_by_call():
    """With `encode_many` the worker encodes every call of a batch in one go, and each caller gets its
    own part; when `encode_many` fails, each call is encoded alone, and an error there reaches only
    its own caller. With the co-located server's own encoders: each caller's rows are its answers."""
    import pyarrow as pa

    from serving import protocol as fl
    from andromeda_nb.types import Request

    server = fl.RetrieveServer.__new__(fl.RetrieveServer)  # the encoders alone, no listening server
    server.stats = fl.ServiceStats()
    many_calls = []

    def encode_many(parts, tag):
        many_calls.append(len(parts))
        if any(r[0].request_id == 13 for r, _ in parts):
            raise RuntimeError("encode_many cannot")
        return server.encode_many(parts, tag)

    def encode(requests, answers, tag):
        if requests and requests[0].request_id == 13:
            raise ValueError("request 13 does not encode")
        return server.encode(requests, answers, tag)

    def decode(payload):
        return [Request(request_id=r, user=None, context=None, signals=None) for r in payload], [3] * len(payload)

    engine = FakeEngine(delay_s=0.02)
    batcher = RequestBatcher(lambda reqs, k: engine([r.request_id for r in reqs], k), max_wait_s=0.05,
                             decode=decode, encode=encode, encode_many=encode_many)
    payloads = [(1, 2), (3,), (4, 5, 6), (7,)]
    results, errors = {}, {}

    def run(batch):
        def client(i):
            try:
                results[batch[i]] = batcher.submit_payload(batch[i])
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                errors[batch[i]] = exc

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)

    try:
        run(payloads)
        run([(11,), (12,), (13,)])  # encode_many fails: one call at a time, only 13 fails
    finally:
        batcher.close()
    assert max(many_calls) > 1  # calls did share a batch and were encoded at once
    for payload in payloads + [(11,), (12,)]:
        out, meta = results[payload]
        assert isinstance(out, pa.RecordBatch) and fl.answer_seq(type("C", (), {"app_metadata": meta})()) is not None
        got = fl.split_answers(out, list(payload))
        assert [ids.tolist() for ids, _ in got] == [[r * 1000, r * 1000 + 1, r * 1000 + 2] for r in payload]
    assert set(errors) == {(13,)} and "does not encode" in str(errors[(13,)])
    assert server.stats.snapshot()["requests"] == 9


def _payload_calls(batcher, payloads, gap_s=0.0):
    """Each payload submitted from its own thread, `gap_s` apart; (results, errors) by payload."""
    results, errors = {}, {}

    def client(p):
        try:
            results[p] = batcher.submit_payload(p)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            errors[p] = exc

    threads = []
    for p in payloads:  # daemon threads: a caller a broken batcher never answers fails the test, not the run
        threads.append(threading.Thread(target=client, args=(p,), daemon=True))
        threads[-1].start()
        time.sleep(gap_s)
    for t in threads:
        t.join(10)
    return results, errors


@pytest.mark.parametrize("ahead", [True, False])
def test_decode_ahead_decodes_while_a_batch_is_on_the_engine(ahead):
    """With `decode_ahead` a call that arrives while a batch is on the engine (which waits without the
    interpreter lock, as for a device) is decoded before that batch ends; without it, only after,
    on the worker. Every caller gets its own answer either way."""
    stamps = {}
    engine = FakeEngine(delay_s=0.3)

    def run(requests, k):
        out = engine(requests, k)
        stamps.setdefault(("ended", tuple(requests)), time.perf_counter())
        return out

    def decode(payload):
        stamps[("decoded", payload)] = time.perf_counter()
        return [payload], [2]

    batcher = RequestBatcher(run, max_wait_s=0.0, decode=decode, encode=lambda reqs, answers, tag: (reqs, tag),
                             decode_ahead=ahead)
    try:
        results, errors = _payload_calls(batcher, [1, 2], gap_s=0.1)  # 2 arrives while 1 is on the engine
    finally:
        batcher.close()
    assert not errors and results[1][0] == [1] and results[2][0] == [2]
    assert batcher.stats()["decode_ahead"] is ahead
    assert (stamps[("decoded", 2)] < stamps[("ended", (1,))]) is ahead, stamps


def test_calls_waiting_together_are_decoded_at_once_and_a_failing_group_falls_back_call_by_call():
    """`decode_many` gets every call that arrived while the decoding thread was busy; its per-call
    errors reach their own callers; when it raises, each call is decoded alone and only the bad one
    fails."""
    groups = []

    def decode(payload):
        if payload in (1, 2):
            time.sleep(0.3)  # the decoding thread is busy while the rest arrive
        if payload == 13:
            raise ValueError("payload 13 does not decode")
        return [payload], [2]

    def decode_many(payloads):
        groups.append(list(payloads))
        if 99 in payloads:
            raise RuntimeError("decode_many cannot")
        return [ValueError(f"payload {p} is odd") if p == 7 else decode(p) for p in payloads]

    for first, rest in ((1, [5, 6, 7, 8]), (2, [11, 12, 13, 99])):
        groups.clear()
        batcher = RequestBatcher(FakeEngine(), max_wait_s=0.0, decode=decode, decode_many=decode_many,
                                 encode=lambda reqs, answers, tag: reqs, decode_ahead=True)
        try:
            hold = threading.Thread(target=batcher.submit_payload, args=(first,))
            hold.start()
            time.sleep(0.1)  # `first` is being decoded; the rest arrive meanwhile
            results, errors = _payload_calls(batcher, rest)
            hold.join(10)
        finally:
            batcher.close()
        assert sorted(max(groups, key=len)) == sorted(rest), groups  # decoded together
        bad = {7} if first == 1 else {13}
        assert set(errors) == bad and all(results[p] == [p] for p in rest if p not in bad)


def test_counted_payloads_are_decoded_together_when_their_batch_closes():
    """Without decode_ahead, payloads `count` can size are decoded together when the batch closes, on
    the worker (one `decode_many` for the batch's calls); one it cannot size (None) is decoded as it is
    taken; a counted payload that does not decode fails its own caller, and the batch goes on."""
    groups, singles, threads_seen = [], [], set()

    def decode(payload):
        threads_seen.add(threading.current_thread().name)
        singles.append(payload)
        if payload == ("bad",):
            raise ValueError("payload 'bad' does not decode")
        return list(payload), [2] * len(payload)

    def decode_many(payloads):
        groups.append(list(payloads))
        out = []
        for p in payloads:
            try:
                out.append(decode(p))
            except ValueError as exc:
                out.append(exc)
        return out

    count = lambda payload: None if payload[0] == "plain" else len(payload)  # noqa: E731
    engine = FakeEngine(delay_s=0.05)

    def run(requests, k):
        return engine([r for r in requests if r != "plain"] + [0] * requests.count("plain"), k)

    batcher = RequestBatcher(run, max_wait_s=0.2, decode=decode, decode_many=decode_many, count=count,
                             encode=lambda reqs, answers, tag: list(reqs), name="closing")
    try:
        payloads = [(1, 2), (3,), ("bad",), ("plain",), (4, 5, 6)]
        results, errors = _payload_calls(batcher, payloads, gap_s=0.01)
    finally:
        batcher.close()
    assert set(errors) == {("bad",)} and "does not decode" in str(errors[("bad",)])
    for p in [(1, 2), (3,), (4, 5, 6), ("plain",)]:
        assert results[p] == list(p)
    counted = [(1, 2), (3,), ("bad",), (4, 5, 6)]
    assert any(sorted(g, key=str) == sorted(counted, key=str) for g in groups), groups  # one decode for the batch
    assert not any(("plain",) in g for g in groups)  # the one count could not size: decoded as taken
    assert threads_seen == {"closing"}
    assert sum(len(b) for b in engine.batches) == 7 and len(engine.batches) == 1


def test_a_fault_of_the_batcher_itself_reaches_its_callers_and_the_worker_goes_on():
    """A fault outside the engine and the codecs (here a `count` that answers a string) fails the calls
    the worker holds, with that error, instead of killing the worker and leaving every caller waiting;
    the next calls are served."""
    count = lambda payload: "many" if payload == (13,) else len(payload)  # noqa: E731
    batcher = RequestBatcher(FakeEngine(), max_wait_s=0.05, decode=lambda p: (list(p), [2] * len(p)),
                             decode_many=lambda ps: [(list(p), [2] * len(p)) for p in ps], count=count,
                             encode=lambda reqs, answers, tag: list(reqs))
    try:
        results, errors = _payload_calls(batcher, [(1,), (13,)], gap_s=0.01)
        assert (13,) in errors and isinstance(errors[(13,)], TypeError)
        later, none = _payload_calls(batcher, [(5, 6), (7,)])
    finally:
        batcher.close()
    assert not none and later == {(5, 6): [5, 6], (7,): [7]}


def test_the_worker_waits_for_company_on_a_queue_whose_timed_get_keeps_its_timeout():
    """The worker's timed wait for more calls must end at its deadline even when nothing more comes.
    CPython's queue.SimpleQueue.get(timeout=t) does not promise that (a free lock taken with nothing
    queued, then a deadline passed while the thread was not running, turns into a wait without end:
    a whole suite once stalled there), so both of the batcher's queues are queue.Queue. Then, rounds
    of two calls in quick succession followed by silence: each round is answered."""
    import queue

    for decode_ahead in (False, True):
        engine = FakeEngine()
        batcher = RequestBatcher(engine, max_wait_s=0.0002, decode=lambda p: (p, [3] * len(p)),
                                 encode=lambda requests, answers, tag: answers, decode_ahead=decode_ahead)
        try:
            queues = [batcher._queue] + ([batcher._inbox] if decode_ahead else [])
            assert all(type(q) is queue.Queue for q in queues)
            for round_ in range(100):
                done = []
                threads = [threading.Thread(target=lambda r=r: done.append(batcher.submit_payload([r])))
                           for r in (2 * round_, 2 * round_ + 1)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(5)
                assert len(done) == 2, f"round {round_}: a call was not answered within 5 s"
        finally:
            batcher.close()


def _turn_is_free(path) -> bool:
    """Whether nobody holds the turn on `path` (a try without waiting, on a descriptor of its own)."""
    import fcntl
    import os

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing gives back a lock taken here
    return True


def test_with_a_turn_calls_that_wait_for_it_join_one_batch_and_engines_never_overlap(tmp_path):
    """Batchers sharing a `GpuTurn` (one file, a descriptor each, as engine processes have): calls that
    arrive while another holds the turn leave as one batch when it comes; two batchers' engine runs
    never overlap; the turn is given back before the answers are encoded."""
    from serving.batcher import GpuTurn

    path = tmp_path / "gpu.turn"
    outside = GpuTurn(path)
    runs, lock = [], threading.Lock()
    free_at_encode = []

    def engine(name):
        def run(requests, k):
            t0 = time.perf_counter()
            assert not _turn_is_free(path), "an engine runs without the turn"
            time.sleep(0.005)
            with lock:
                runs.append((name, len(requests), t0, time.perf_counter()))
            return [(np.array([r], np.int64), np.array([1.0], np.float32)) for r in requests], None
        return run

    def encode(requests, answers, tag):
        free_at_encode.append(_turn_is_free(path))
        return [int(ids[0]) for ids, _ in answers]

    batchers = [RequestBatcher(engine(name), max_wait_s=0.0, turn=GpuTurn(path), name=name,
                               decode=lambda payload: (payload, [1] * len(payload)), encode=encode)
                for name in ("a", "b")]
    got, errors = {}, []

    def ask(batcher, i):
        try:
            got[i] = batcher.submit_payload([i])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    try:
        outside.acquire()  # the GPU is someone else's: a's first call waits for it, the rest pile up
        first = threading.Thread(target=ask, args=(batchers[0], 0))
        first.start()
        deadline = time.monotonic() + 10
        while not batchers[0]._in_hand:  # taken: the worker waits for the turn (or is about to)
            assert time.monotonic() < deadline, "a's worker never took the first call"
            time.sleep(0.001)
        rest = [threading.Thread(target=ask, args=(batchers[0], i)) for i in range(1, 6)]
        for t in rest:
            t.start()
        while batchers[0]._queue.qsize() < 5:
            assert time.monotonic() < deadline, "the calls did not queue"
            time.sleep(0.001)
        outside.release()
        for t in [first, *rest]:
            t.join(10)
        assert runs == [("a", 6, runs[0][2], runs[0][3])], "the six calls leave as one batch"
        # then both batchers at once, many calls each: their engine runs never overlap
        many = [threading.Thread(target=ask, args=(batchers[i % 2], 100 + i)) for i in range(40)]
        for t in many:
            t.start()
        for t in many:
            t.join(10)
    finally:
        for b in batchers:
            b.close()
        outside.close()
    assert not errors, errors
    assert all(got[i] == [i] for i in [*range(6), *range(100, 140)])
    assert {name for name, *_ in runs} == {"a", "b"}
    spans = sorted((t0, t1) for _, _, t0, t1 in runs)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), "two engines ran at once"
    assert sum(n for _, n, _, _ in runs) == 46
    assert free_at_encode[:6] == [True] * 6, "the turn held while the first batch's answers were encoded"
    stats = batchers[0].stats()
    assert stats["turn"] and stats["per_batch_ms"]["turn_wait"] > 0
