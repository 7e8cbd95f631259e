"""Overlapped engine batches (serving/overlap.py, serving/batcher.py's `overlap`): the next batch prepared
while the one before is on the device, every caller answered with its own requests, errors to their own
batch, a lone call never held for company, and no update landing between a batch's launch and its
answers."""

import threading
import time

import numpy as np
import pytest

from serving.batcher import GpuTurn, RequestBatcher
from serving.overlap import OverlappedBatches, UpdatesLock, can_overlap
from tests.support.threads import run_in_threads


class SteppedEngine:
    """An engine that runs a batch in steps, its "device" a wait of `device_s` after the launch. Request r
    answers ids r * 1000 + version + 0..k-1, `version` read when the answers are made (at `fetch`): an
    update applied between a batch's launch and its fetch shows as answers that do not match the batch's
    tag. Records every step in `log` as (step, batch number, requests)."""

    max_batch = 16

    def __init__(self, device_s=0.003, fail_begin=None, fail_fetch=None):
        self.device_s, self.fail_begin, self.fail_fetch = device_s, fail_begin, fail_fetch
        self.version = 0
        self.log = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.alone = []
        self._n = 0

    def begin(self, requests, alone=False):
        requests = list(requests)
        if self.fail_begin is not None and self.fail_begin in requests:
            raise ValueError(f"request {self.fail_begin} does not prepare")
        self._n += 1
        self.log.append(("begin", self._n, requests))
        self.alone.append(alone)
        return self._n, requests

    def launch(self, begun, k):
        n, requests = begun
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.log.append(("launch", n, requests))
        return n, requests, k, time.perf_counter() + self.device_s

    def ready(self, launched):
        return time.perf_counter() >= launched[3]

    def fetch(self, launched):
        n, requests, k, ready = launched
        time.sleep(max(0.0, ready - time.perf_counter()))
        self.in_flight -= 1
        self.log.append(("fetch", n, requests))
        if self.fail_fetch is not None and self.fail_fetch in requests:
            raise RuntimeError(f"the device failed on request {self.fail_fetch}")
        v = self.version
        return [(np.arange(k, dtype=np.int64) + r * 1000 + v, np.linspace(1, 0, k, dtype=np.float32))
                for r in requests]

    def retrieve(self, requests, k):  # the batch in one piece: for batches past max_batch
        self.log.append(("retrieve", 0, list(requests)))
        v = self.version
        return [(np.arange(k, dtype=np.int64) + r * 1000 + v, np.linspace(1, 0, k, dtype=np.float32))
                for r in requests]


class Server:
    """What EngineServer does around an engine: one lock, the seq of the last update, updates under
    the lock as an update takes it (UpdatesLock)."""

    def __init__(self, engine, **batcher_options):
        self.engine, self.lock, self.seq = engine, threading.Lock(), 0
        self.overlap = OverlappedBatches(engine, self.lock, lambda: self.seq)
        self.updates_lock = UpdatesLock(self.lock, self.overlap)
        self.batcher = RequestBatcher(self.run, overlap=self.overlap, **batcher_options)

    def run(self, requests, k):
        with self.lock:
            return self.engine.retrieve(requests, k), self.seq

    def update(self):
        with self.updates_lock:
            self.engine.version += 1
            self.seq += 1


def _submit_many(batcher, n_clients, calls_each, per_call=2, k=3, think_s=0.004):
    """Clients each sending `calls_each` calls one after another, a random pause of up to `think_s`
    between them (so that calls arrive while a batch is on the device, not all in one wave)."""
    got, errors = [], []

    def client(i):
        rng = np.random.default_rng(i)
        for j in range(calls_each):
            time.sleep(rng.uniform(0, think_s))
            reqs = [(i * calls_each + j) * per_call + x for x in range(per_call)]
            try:
                answers, tag = batcher.submit(reqs, [k] * per_call)
                got.append((reqs, answers, tag))
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                errors.append((reqs, exc))

    run_in_threads(client, n_clients)
    return got, errors


def _check(got, k=3):
    for reqs, answers, tag in got:
        assert len(answers) == len(reqs)
        for r, (ids, scores) in zip(reqs, answers):
            assert ids.tolist() == [r * 1000 + tag + j for j in range(k)], (r, tag, ids)
            assert len(scores) == k


def test_the_next_batch_is_prepared_while_the_one_before_is_on_the_device_and_every_caller_gets_its_own():
    engine = SteppedEngine(device_s=0.004)
    server = Server(engine, max_wait_s=0.001)
    try:
        got, errors = _submit_many(server.batcher, n_clients=12, calls_each=10)
    finally:
        server.batcher.close()
    assert not errors and len(got) == 120
    _check(got)
    # somewhere a batch was prepared while the one before it was launched and not yet fetched
    launched, overlapped = set(), 0
    for step, n, _ in engine.log:
        if step == "begin" and launched:
            overlapped += 1
        if step == "launch":
            launched.add(n)
        elif step == "fetch":
            launched.discard(n)
    assert overlapped > 0, "no batch was prepared while another was on the device"
    assert engine.most_in_flight == 1  # two staging buffers: never two batches launched and unfetched
    stats = server.batcher.stats()
    assert stats["overlap"] and stats["requests"] == 240 and stats["batches"] == sum(
        1 for step, _, _ in engine.log if step in ("launch", "retrieve"))
    assert not server.lock.locked(), "the engine lock stays held with no batch in flight"


def test_a_call_that_comes_while_a_batch_is_on_the_device_is_prepared_before_that_batch_is_fetched():
    """The first call teaches the batcher the device time (0.3 s); the second is on the device when the
    third comes, which waits in the queue until the device has about the host's share left, then is
    prepared before the second is fetched."""
    engine = SteppedEngine(device_s=0.3)
    server = Server(engine, max_wait_s=0.0)
    out = {}
    first = threading.Thread(target=lambda: out.setdefault("a", server.batcher.submit([1], [2])))
    try:
        server.batcher.submit([0], [2])
        first.start()
        deadline = time.perf_counter() + 10
        while ("launch", 2, [1]) not in engine.log and time.perf_counter() < deadline:
            time.sleep(0.001)
        out["b"] = server.batcher.submit([2], [2])
        first.join(10)
    finally:
        server.batcher.close()
    assert [(step, n) for step, n, _ in engine.log] == [("begin", 1), ("launch", 1), ("fetch", 1), ("begin", 2),
                                                        ("launch", 2), ("begin", 3), ("fetch", 2), ("launch", 3),
                                                        ("fetch", 3)]
    assert engine.alone == [True, True, False]
    assert 0.2 < server.batcher._device_est < 1.0
    assert out["a"][0][0][0].tolist() == [1000, 1001] and out["b"][0][0][0].tolist() == [2000, 2001]
    assert not server.lock.locked()


def test_a_lone_call_is_answered_without_waiting_for_another():
    engine = SteppedEngine(device_s=0.002)
    server = Server(engine, max_wait_s=0.0)
    try:
        t = time.perf_counter()
        answers, tag = server.batcher.submit([5], [2])
        took = time.perf_counter() - t
        answers2, _ = server.batcher.submit([6], [2])
    finally:
        server.batcher.close()
    assert answers[0][0].tolist() == [5000, 5001] and answers2[0][0].tolist() == [6000, 6001] and tag == 0
    assert took < 2.0
    assert engine.alone[:2] == [True, True], "a batch with none in flight ahead of it is begun alone"
    assert not server.lock.locked()


def test_an_error_preparing_a_batch_reaches_its_callers_only_and_the_batch_in_flight_is_answered():
    engine = SteppedEngine(device_s=0.004, fail_begin=13)
    server = Server(engine, max_wait_s=0.001)
    try:
        got, errors = _submit_many(server.batcher, n_clients=8, calls_each=6, per_call=1)
    finally:
        server.batcher.close()
    assert len(got) + len(errors) == 48
    assert errors and all("does not prepare" in str(exc) for _, exc in errors)
    assert 13 in {r for reqs, _ in errors for r in reqs}  # its batch's callers, and no other batch's
    assert not {r for reqs, _ in errors for r in reqs} & {r for _, _, reqs in engine.log for r in reqs}
    _check(got)
    assert {r for reqs, _, _ in got for r in reqs} == set(range(48)) - {r for reqs, _ in errors for r in reqs}
    assert not server.lock.locked()


def test_a_device_error_reaches_the_callers_of_that_batch_and_the_next_batch_runs():
    engine = SteppedEngine(device_s=0.001, fail_fetch=7)
    server = Server(engine, max_wait_s=0.0)
    try:
        with pytest.raises(RuntimeError, match="device failed on request 7"):
            server.batcher.submit([6, 7], [2, 2])
        answers, _ = server.batcher.submit([8], [3])
    finally:
        server.batcher.close()
    assert answers[0][0].tolist() == [8000, 8001, 8002]
    assert not server.lock.locked()


def test_no_update_lands_between_a_batchs_launch_and_its_answers_and_updates_get_the_engine():
    """Answers are made at fetch from the engine's version then, and carry the seq read at launch: an
    update between the two would show as ids that do not match the tag. Updates run throughout and
    each gets the engine within a bounded wait, the batcher landing its batch in flight for it."""
    engine = SteppedEngine(device_s=0.003)
    server = Server(engine, max_wait_s=0.001)
    stop, waits = threading.Event(), []

    def updater():
        while not stop.is_set():
            t = time.perf_counter()
            server.update()
            waits.append(time.perf_counter() - t)
            time.sleep(0.002)

    u = threading.Thread(target=updater)
    u.start()
    try:
        got, errors = _submit_many(server.batcher, n_clients=10, calls_each=12)
    finally:
        stop.set()
        u.join(10)
        server.batcher.close()
    assert not errors and len(got) == 120
    _check(got)  # ids offset by the version at fetch == the tag read at launch, for every answer
    assert server.seq >= 5 and len({tag for _, _, tag in got}) > 1, "updates ran between the batches"
    assert max(waits) < 5.0


def test_a_batch_past_one_launch_runs_in_one_piece_after_the_one_in_flight():
    engine = SteppedEngine(device_s=0.002)
    server = Server(engine, max_wait_s=0.0)
    try:
        answers, _ = server.batcher.submit(list(range(40)), [2] * 40)  # past max_batch (16)
    finally:
        server.batcher.close()
    assert [a[0].tolist() for a in answers] == [[r * 1000, r * 1000 + 1] for r in range(40)]
    assert [step for step, _, _ in engine.log] == ["retrieve"]
    assert not server.lock.locked()


def test_overlap_and_a_turn_are_refused_together_and_an_engine_without_steps_is_named(tmp_path):
    engine = SteppedEngine()
    ov = OverlappedBatches(engine, threading.Lock(), lambda: 0)
    turn = GpuTurn(str(tmp_path / "turn"))
    try:
        with pytest.raises(ValueError, match="turn or overlaps"):
            RequestBatcher(lambda r, k: ([], 0), overlap=ov, turn=turn)
    finally:
        turn.close()

    class OnePiece:
        def retrieve(self, requests, k):
            return []

    assert can_overlap(engine) and not can_overlap(OnePiece())
    with pytest.raises(TypeError, match="OnePiece does not run a batch in steps"):
        OverlappedBatches(OnePiece(), threading.Lock(), lambda: 0)
