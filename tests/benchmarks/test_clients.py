"""The served-path load driver (benchmarks/clients.py): clients over several processes against a real
server on 127.0.0.1, the first pass of answers checked against what each request must get."""

import os
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from serving.engine_server import EngineServer
from andromeda_nb.corpus import generate_corpus
from andromeda_nb.store import load_dataset
from benchmarks.clients import AnswerTable, drive

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands


def test_clients_over_processes_count_requests_and_wrong_answers(tmp_path):
    generate_corpus(tmp_path / "corpus", 120, 6, 4)
    dataset = load_dataset(tmp_path / "corpus")
    rng = np.random.default_rng(4)
    answers = {r.request_id: (rng.permutation(1000)[:10].astype(np.int64), np.sort(rng.random(10))[::-1].astype(np.float32))
               for r in dataset.requests}
    server = EngineServer(AnswerTable(answers), dataset)
    threading.Thread(target=server.serve, daemon=True).start()
    location = f"grpc://127.0.0.1:{server.port}"
    try:
        right = [answers[r.request_id] for r in dataset.requests]
        got = drive(location, str(tmp_path / "corpus"), k=10, clients=4, processes=2, seconds=1.0, want=right)
        assert got["requests"] > 8 and got["n_wrong"] == 0 and got["client_processes"] == 2
        wrong = [(ids[::-1], s) for ids, s in right]  # every answer reversed: the first pass of each thread fails
        got = drive(location, str(tmp_path / "corpus"), k=10, clients=2, processes=2, seconds=0.5, want=wrong)
        assert got["n_wrong"] >= 2 and got["wrong_answers"][0].startswith("request ")
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="split evenly"):
        drive(location, str(tmp_path / "corpus"), k=10, clients=3, processes=2)


def test_stream_clients_keep_one_exchange_and_reopen_it_when_the_server_ends_it(tmp_path):
    """`exchange='stream'`: each client sends its requests as batches of one exchange; the answers are
    checked as in per-call mode, and a server whose deadline (0.3 s) ends every exchange early is met
    by a new exchange, never a lost or wrong answer. Each exchange carries many requests: the
    exchanges the deadline ended (the server counts each as an error) are far fewer than the requests."""
    from serving import protocol as fl
    from serving.limits import ServiceLimits

    generate_corpus(tmp_path / "corpus", 120, 6, 5)
    dataset = load_dataset(tmp_path / "corpus")
    rng = np.random.default_rng(5)
    answers = {r.request_id: (rng.permutation(1000)[:10].astype(np.int64), np.sort(rng.random(10))[::-1].astype(np.float32))
               for r in dataset.requests}
    server = EngineServer(AnswerTable(answers), dataset, limits=ServiceLimits(deadline_s=0.3))
    threading.Thread(target=server.serve, daemon=True).start()
    location = f"grpc://127.0.0.1:{server.port}"
    try:
        right = [answers[r.request_id] for r in dataset.requests]
        got = drive(location, str(tmp_path / "corpus"), k=10, clients=2, processes=1, seconds=1.5, want=right,
                    exchange="stream")
        assert got["exchange"] == "stream" and got["n_wrong"] == 0 and got["requests"] > 20
        stats = fl.flight_action(location, "stats")
        assert stats["batching"]["requests"] >= got["requests"]
        assert stats["errors"] >= 6  # exchanges ended by the deadline (3 or more a client), each reopened
        assert got["requests"] > 4 * (stats["errors"] + 2)
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="exchange is one of"):
        drive(location, str(tmp_path / "corpus"), k=10, clients=1, exchange="pipe")


def test_call_path_accounts_each_batched_call_and_each_turnaround(tmp_path):
    """`stats` of a batching server carries `call_path`: one entry per call that went through the
    batcher, a turnaround for each batch after the first on an exchange, every phase a duration; a
    batch that fails to decode is not counted."""
    import pyarrow.flight as flight

    from serving import protocol as fl

    generate_corpus(tmp_path / "corpus", 60, 4, 9)
    dataset = load_dataset(tmp_path / "corpus")
    server = EngineServer(AnswerTable.computed(dataset, 5), dataset)
    threading.Thread(target=server.serve, daemon=True).start()
    location = f"grpc://127.0.0.1:{server.port}"
    try:
        client = flight.FlightClient(location)
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_path(*fl.RETRIEVE_PATH))
        writer.begin(fl.REQUEST_SCHEMA)
        for r in dataset.requests:  # one exchange, four batches of one request each
            writer.write_batch(fl.encode_requests_for_exchange([r], 5)[0][0])
            reader.read_chunk()
        writer.close()
        bad = fl.request_batch(dataset.requests[:1], 5)
        bad = bad.set_column(bad.schema.get_field_index("request"), "request", pa.array(["not json"], pa.utf8()))
        w2, r2 = client.do_exchange(flight.FlightDescriptor.for_path(*fl.RETRIEVE_PATH))
        w2.begin(fl.REQUEST_SCHEMA)
        w2.write_batch(bad)
        with pytest.raises(flight.FlightError):
            r2.read_chunk()
        with pytest.raises(flight.FlightError):
            w2.close()  # the exchange already failed
        path = fl.flight_action(location, "stats")["call_path"]
        assert path["calls"] == 4 and path["turnarounds"] == 3
        assert set(path["ms_per_call"]) == set(fl.CallPath.PHASES)
        assert all(v >= 0 for v in path["ms_per_call"].values()) and path["ms_per_call"]["batched"] > 0
    finally:
        server.shutdown()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is a Linux call")
def test_bench_served_confines_every_thread_of_the_server_to_its_cpus():
    """`bench served --server-cpus`: every thread of the server process (its threads exist before it
    is pinned) ends on the CPUs given, and threads it starts later inherit them; a CPU this process
    may not use is refused."""
    import subprocess
    import sys

    from benchmarks import served as bench

    cpus = bench.server_cpus("1")
    assert cpus == sorted(os.sched_getaffinity(0))[:1]
    with pytest.raises(SystemExit, match="may use CPUs"):
        bench.server_cpus(str(max(os.sched_getaffinity(0)) + 1) + ",0")
    child = subprocess.Popen([sys.executable, "-c", (
        "import threading, time, sys\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('up', flush=True); sys.stdin.readline()\n"
        "t = threading.Thread(target=time.sleep, args=(30,), daemon=True); t.start()\n"
        "print('more', flush=True); time.sleep(30)\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert bench.pin(child.pid, cpus) >= 2  # the main thread and the one it started
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "more"
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) >= 3
        assert all(os.sched_getaffinity(tid) == set(cpus) for tid in tids)
    finally:
        child.kill()
        child.wait()


def test_spy_summary_reads_nested_processes_and_command_lines_with_semicolons():
    """`scripts/spy_summary.py` on py-spy's raw stacks of a process tree: a client process spawned by
    multiprocessing has ';' in its command line, which must not be taken for a frame boundary."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "spy_summary.py"
    spec = importlib.util.spec_from_file_location("spy_summary_under_test", path)
    spy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(spy)
    lines = [
        'process 10:"python bench.py";process 11:"python -c from m import a; a(fd=7) --fork";'
        "thread (0x1f): Thread-3 (client);run (t.py:1);retrieve (c.py:82) 30",
        'process 10:"python bench.py";process 11:"python -c from m import a; a(fd=7) --fork";'
        "thread (0x2f): Thread-4 (client);run (t.py:1);split (f.py:9) 10",
        'process 10:"python bench.py";process 12:"python -m serve";thread (0x3f): batcher;run (t.py:1);score (s.py:4) 60',
    ]
    result = spy.summarize(lines)
    assert result["samples"] == 100
    first, second = result["threads"]
    assert first["thread"] == "batcher" and first["process"].startswith("12 ") and first["samples"] == 60
    assert second["process"].startswith("11 ") and second["thread"] == "Thread (client)" and second["samples"] == 40
    assert dict(second["self"]) == {"retrieve (c.py:82)": 30, "split (f.py:9)": 10}
    assert dict(second["inclusive"])["run"] == 40


def test_the_front_over_answer_table_workers_serves_the_tables_answers(tmp_path):
    """`scripts/probe_served_ceiling.py --engines N`'s server: the co-located front over worker
    processes whose engine is an answer table (`benchmarks.table_worker`); clients get the CPU
    engine's answers, and every worker serves some."""
    from serving.engine_front import start_pooled_server

    generate_corpus(tmp_path / "corpus", 150, 6, 5)
    dataset = load_dataset(tmp_path / "corpus")
    right = [AnswerTable.computed(dataset, 10).answers[r.request_id] for r in dataset.requests]
    config = {"data": str(tmp_path / "corpus"), "device": "cpu", "batch_wait_s": 0.0002, "table_k": 10}
    server = start_pooled_server(dataset, "grpc://127.0.0.1:0", module="benchmarks.table_worker", config=config,
                                 engines=2)
    threading.Thread(target=server.serve, daemon=True).start()
    try:
        got = drive(f"grpc://127.0.0.1:{server.port}", str(tmp_path / "corpus"), k=10, clients=4, processes=2,
                    seconds=1.0, want=[(ids[:10], s[:10]) for ids, s in right], exchange="stream")
        assert got["requests"] > 8 and got["n_wrong"] == 0, got
        per_engine = server.extra_stats()["batching"]["per_engine"]
        assert len(per_engine) == 2 and all(e["requests"] > 0 for e in per_engine), per_engine
        assert all(s["engine"]["engine"] == "answer table (computed beforehand)" for s in server.engines.states())
    finally:
        server.shutdown()
        server.close_resources()


def test_answer_table_workers_behind_fronts_answer_requests_the_fronts_numbered_afresh(tmp_path):
    """`probe_served_ceiling.py --engines 1 --fronts 2`: the fronts number a batch's requests 0 to n - 1,
    so the table looks each up by what it holds (`content_key`); the clients on the fronts get the CPU
    engine's answers, and each front and the worker report their CPU."""
    import dataclasses

    from benchmarks.clients import content_key
    from serving.engine_front import start_pooled_server
    from serving.guard import OPEN

    generate_corpus(tmp_path / "corpus", 150, 6, 5)
    dataset = load_dataset(tmp_path / "corpus")
    table = AnswerTable.computed(dataset, 10)
    assert table.by_content is not None and len(table.by_content) == len(dataset.requests)
    renumbered = [dataclasses.replace(r, request_id=i) for i, r in enumerate(dataset.requests[::-1])]
    assert [content_key(r) for r in renumbered] == [content_key(r) for r in dataset.requests[::-1]]
    looked_up = table.retrieve(renumbered, 10)
    assert all(np.array_equal(a[0], table.answers[r.request_id][0]) for a, r in zip(looked_up, dataset.requests[::-1]))
    right = [table.answers[r.request_id] for r in dataset.requests]
    config = {"data": str(tmp_path / "corpus"), "device": "cpu", "batch_wait_s": 0.0002, "table_k": 10}
    server = start_pooled_server(dataset, "grpc://127.0.0.1:0", module="benchmarks.table_worker", config=config,
                                 engines=1, fronts=2, front_endpoint={"host": "127.0.0.1", "guard": OPEN.to_json()})
    threading.Thread(target=server.serve, daemon=True).start()
    try:
        before = server.extra_stats()
        got = drive(server.retrieve_endpoints(), str(tmp_path / "corpus"), k=10, clients=4, processes=2, seconds=1.0,
                    want=right, exchange="stream")
        assert got["requests"] > 8 and got["n_wrong"] == 0, got
        after = server.extra_stats()
        assert after["fronts"] == 2 and all(f["requests"] > 0 for f in after["front_batching"]), after
        assert after["engine_cpu_s"] > before["engine_cpu_s"] and after["front_cpu_s"] > before["front_cpu_s"]
    finally:
        server.shutdown()
        server.close_resources()


def test_clients_spread_evenly_over_several_servers(tmp_path):
    """`drive` with several locations (`scripts/probe_served_spread.py`): client i talks to server
    i mod n, so each of two servers answers half the clients."""
    generate_corpus(tmp_path / "corpus", 120, 6, 6)
    dataset = load_dataset(tmp_path / "corpus")
    table = AnswerTable.computed(dataset, 10)
    servers = [EngineServer(AnswerTable(table.answers), dataset) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve, daemon=True).start()
    try:
        right = [table.answers[r.request_id] for r in dataset.requests]
        got = drive([f"grpc://127.0.0.1:{s.port}" for s in servers], str(tmp_path / "corpus"), k=10, clients=4,
                    processes=2, seconds=1.0, want=right, exchange="stream")
        assert got["n_wrong"] == 0 and got["requests"] > 8, got
        served = [s.stats.snapshot()["requests"] for s in servers]
        assert all(n > 0 for n in served) and sum(served) >= got["requests"], served
        assert min(served) > 0.25 * max(served), served  # two clients each, in step
    finally:
        for server in servers:
            server.shutdown()


def test_the_spread_probe_measures_its_servers_against_the_engine_in_process(tmp_path):
    """`scripts/probe_served_spread.py` end to end on the CPU: the engine in process checked against
    the float64 reference and timed, two one-engine servers checked against it, the clients spread
    over them, and the ratio `bench served`'s target reads in its result."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("probe_served_spread_under_test",
                                                  Path(__file__).resolve().parents[2] / "scripts" / "probe_served_spread.py")
    probe_served_spread = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe_served_spread)

    generate_corpus(tmp_path / "corpus", 150, 6, 7)
    out = tmp_path / "spread.json"
    code = probe_served_spread.main(["--data", str(tmp_path / "corpus"), "--device", "cpu", "--servers", "2",
                                     "--clients", "2", "--client-processes", "1", "--seconds", "1", "--k", "10",
                                     "--repeat", "1", "--checks", "4", "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["n_wrong"] == 0 and result["reference_check"]["ok"], result
    assert result["reference_check"]["requests"] == 4 and result["in_process"]["batch"] == 64
    assert result["served_over_in_process"] == result["requests_per_s"] / result["in_process"]["requests_per_s"]
    assert len(result["per_server"]) == 2 and all(s["requests"] > 0 for s in result["per_server"]), result["per_server"]



def test_an_answer_table_runs_a_batch_in_steps_with_its_wait_between_launch_and_fetch():
    """`scripts/probe_served_ceiling.py --engine-ms W --engine-host-ms H --overlap`'s engine: host work at
    `begin`, the wait from `launch` to `fetch` (not ready before it), the table's answers cut to k."""
    import time

    from serving.overlap import can_overlap

    rng = np.random.default_rng(5)
    answers = {i: (rng.permutation(100)[:10].astype(np.int64), np.linspace(1, 0, 10, dtype=np.float32))
               for i in range(3)}
    table = AnswerTable(answers, wait_s=0.05, host_s=0.002)
    assert can_overlap(table)

    class R:
        def __init__(self, i):
            self.request_id = i

    t = time.perf_counter()
    begun = table.begin([R(2), R(0)])
    assert time.perf_counter() - t >= 0.002
    launched = table.launch(begun, 4)
    assert not table.ready(launched)
    got = table.fetch(launched)
    assert table.ready(launched) and time.perf_counter() - t >= 0.05
    assert [ids.tolist() for ids, _ in got] == [answers[2][0][:4].tolist(), answers[0][0][:4].tolist()]
    assert [ids.tolist() for ids, _ in table.retrieve([R(1)], 3)] == [answers[1][0][:3].tolist()]
