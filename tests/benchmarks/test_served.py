"""`andromeda bench served`: the in-process engine checked against the float64 reference, then served
to plain Flight clients, every served answer checked against the in-process one."""

import json

import numpy as np
import pytest

from andromeda_nb.corpus import generate_corpus
from andromeda_nb.store import load_dataset
from benchmarks import served
from tests.support.cli import run_cli


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "corpus"
    generate_corpus(out, 400, 6, 5)
    return out


def test_the_reference_check_passes_on_the_engines_answers_and_fails_on_a_wrong_one(corpus_dir):
    from migration.architectures import build_engine

    dataset = load_dataset(corpus_dir)
    engine = build_engine(dataset, "cpu")
    try:
        want = engine.retrieve(dataset.requests, 10)
    finally:
        engine.close()
    assert served.check_against_reference(dataset, want, 10, 6) == {"requests": 6, "ok": True, "failures": []}
    ids, scores = want[2]
    assert len(ids) > 1
    wrong = list(want)
    wrong[2] = (ids, np.asarray(scores) + np.float32(0.01))  # every score of one request off
    verdict = served.check_against_reference(dataset, wrong, 10, 6)
    assert not verdict["ok"] and verdict["failures"][0].startswith(f"request {dataset.requests[2].request_id}:")


@pytest.mark.e2e
def test_bench_served_prints_one_checked_result(corpus_dir, tmp_path):
    out = tmp_path / "served.json"
    result = run_cli("bench", "served", "--data", corpus_dir, "--device", "cpu", "--k", 10, "--clients", 3,
                     "--client-processes", 1, "--seconds", 1, "--repeat", 1, "--checks", 6, "--json", "--quiet",
                     "--out-file", out)
    line = json.loads(result.stdout)
    assert line == json.loads(out.read_text())
    assert line["checks_ok"] and line["reference_check"] == {"requests": 6, "ok": True, "failures": []}
    srv = line["served"]
    assert srv["requests"] > 0 and srv["n_wrong"] == 0 and srv["requests_per_s"] > 0
    assert line["target"]["met"] == (line["served_over_in_process"] >= 0.70)
    bound = line["client_bound"]  # 3 clients over the lone client's idle p50
    assert bound["requests_per_s"] == pytest.approx(3 / (srv["idle"]["latency_ms"]["p50"] * 1e-3))
    assert bound["over_in_process"] == pytest.approx(bound["requests_per_s"] / line["in_process"]["requests_per_s"])
    assert line["provenance"]["command"].startswith("andromeda bench served") or "bench served" in \
        line["provenance"]["command"]
    table = run_cli("bench", "served", "--data", corpus_dir, "--device", "cpu", "--k", 10, "--clients", 2,
                    "--client-processes", 1, "--seconds", 0.5, "--repeat", 1, "--checks", 2, "--quiet").stdout
    assert "in-process answers against the float64 reference: ok" in table and "target served" in table
    assert "over its p99 alone" in table  # the lone client's idle run, against the same server
    assert "from 2 clients with one request each in flight" in table


def test_each_engine_count_runs_against_its_own_server_and_is_reported(corpus_dir, monkeypatch):
    started = []

    def fake_served(data, device, want, k, clients, processes, seconds, wait_ms, exchange, cpus, profile,
                    request_format, ahead, switch, layout, engines, gpu_turn=False, via="front", overlap=False,
                    fronts=0):
        started.append((engines, gpu_turn) if gpu_turn else (engines, via) if via != "front" else
                       (engines, "overlap") if overlap else (engines, "fronts", fronts) if fronts else engines)
        return {"requests_per_s": 100.0 * engines, "requests": 10, "n_wrong": 0, "engines": engines,
                "latency_ms": {"p50": 1.0, "p99": 2.0}, "batching": None, "device_ms_per_batch": None,
                "server_cpu_ms_per_request": None}

    monkeypatch.setattr(served, "served", fake_served)
    result = served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, engines=[1, 2, 4],
                        progress=False)
    assert started == [1, 2, 4] and result["engines"] == [1, 2, 4]
    assert {key: srv["engines"] for key, srv in result["served_by_exchange"].items()} == \
        {"call/engines-1": 1, "call/engines-2": 2, "call/engines-4": 4}
    assert result["served"]["engines"] == 4  # the target reads the best
    assert "call/engines-2" in served.table(result)
    assert result["lone_target"]["value"] is None and result["lone_target"]["met"] is False  # no idle run: no figure
    started.clear()  # with and without the GPU turn: one engine has nobody to take turns with
    result = served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, engines=[1, 2],
                        gpu_turns=[False, True], progress=False)
    assert started == [1, 2, (2, True)]
    assert list(result["served_by_exchange"]) == ["call/engines-1/turn-off", "call/engines-2/turn-off",
                                                  "call/engines-2/turn-on"]
    started.clear()  # the front and the workers' endpoints: one engine has no workers
    result = served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, engines=[1, 2],
                        vias=["front", "workers"], progress=False)
    assert started == [1, 2, (2, "workers")]
    assert list(result["served_by_exchange"]) == ["call/engines-1/via-front", "call/engines-2/via-front",
                                                  "call/engines-2/via-workers"]
    started.clear()  # overlapped batches or not, never with a turn (a turn's holder has nothing to overlap)
    result = served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, engines=[2],
                        gpu_turns=[False, True], overlaps=[False, True], progress=False)
    assert started == [2, (2, "overlap"), (2, True)]
    assert list(result["served_by_exchange"]) == ["call/turn-off/overlap-off", "call/turn-off/overlap-on",
                                                  "call/turn-on/overlap-off"]
    started.clear()  # fronts or none; the clients of a server with fronts follow them, never the workers
    result = served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, engines=[2],
                        vias=["front", "workers"], fronts=[0, 3], progress=False)
    assert started == [2, (2, "fronts", 3), (2, "workers")]
    assert list(result["served_by_exchange"]) == ["call/via-front/fronts-0", "call/via-front/fronts-3",
                                                  "call/via-workers/fronts-0"]
    with pytest.raises(ValueError, match="fronts"):
        served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, fronts=[-1], progress=False)
    with pytest.raises(ValueError, match="vias"):
        served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, engines=[2], vias=["side"],
                   progress=False)
    with pytest.raises(ValueError, match="engines"):
        served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, engines=[0], progress=False)
    with pytest.raises(SystemExit):
        served.main(["--data", str(corpus_dir), "--engines", "0"])


@pytest.mark.e2e
def test_bench_served_with_the_clients_on_the_workers_endpoints(corpus_dir):
    """`--engines 2 --via workers`: the server started with `--endpoints`, the clients spread over the two
    workers' endpoints, every answer of their first pass checked; the front relays nothing. With
    `--overlap on`: each worker's batcher overlaps its batches (serving.overlap)."""
    line = json.loads(run_cli("bench", "served", "--data", corpus_dir, "--device", "cpu", "--k", 10, "--clients", 4,
                              "--client-processes", 1, "--seconds", 1, "--repeat", 1, "--checks", 2, "--engines", 2,
                              "--via", "workers", "--overlap", "on", "--json", "--quiet").stdout)
    srv = line["served"]
    assert line["checks_ok"] and srv["via"] == "workers" and srv["engines"] == 2 and srv["overlap"] is True
    assert [e["overlap"] for e in srv["batching"]["per_engine"]] == [True, True], srv["batching"]
    assert srv["requests"] > 0 and srv["n_wrong"] == 0
    assert srv["batching"]["calls"] >= srv["requests"]  # every request reached a worker's batcher
    bad = run_cli("bench", "served", "--data", corpus_dir, "--device", "cpu", "--via", "workers", code=2)
    assert "--engines 2 or more" in bad.stderr


@pytest.mark.e2e
def test_bench_served_with_the_clients_on_the_fronts(corpus_dir):
    """`--fronts 2`: the server started with two fronts beside its one engine worker, the clients spread
    over the fronts it lists, every answer of their first pass checked; each front's batches and the
    engine's are reported."""
    line = json.loads(run_cli("bench", "served", "--data", corpus_dir, "--device", "cpu", "--k", 10, "--clients", 4,
                              "--client-processes", 1, "--seconds", 1, "--repeat", 1, "--checks", 2, "--fronts", 2,
                              "--json", "--quiet").stdout)
    srv = line["served"]
    assert line["checks_ok"] and srv["via"] == "fronts" and srv["fronts"] == 2 and srv["engines"] == 1
    assert srv["requests"] > 0 and srv["n_wrong"] == 0
    assert len(srv["front_batching"]) == 2 and sum(f["calls"] for f in srv["front_batching"]) >= srv["requests"]
    assert srv["batching"]["requests"] >= srv["requests"]  # every request reached the engine, by a front
    assert srv["engine_cpu_ms_per_request"] > 0 and srv["fronts_cpu_ms_per_request"] > 0, srv  # each process's own
    bad = run_cli("bench", "served", "--data", corpus_dir, "--device", "cpu", "--fronts", "-1", code=2)
    assert "whole numbers of at least 0" in bad.stderr


def test_the_lone_client_target_reads_loaded_over_idle_p99():
    srv = {"latency_ms": {"p50": 3.0, "p99": 9.0}, "idle": {"latency_ms": {"p50": 1.0, "p99": 2.0}}}
    assert served.lone_ratio(srv) == 4.5
    assert served.lone_ratio({"latency_ms": {"p99": 9.0}}) is None


def test_the_client_bound_is_the_clients_over_the_idle_p50():
    """32 clients, each waiting for its answer, idle p50 4 ms: at most 8,000 requests a second."""
    srv = {"latency_ms": {"p50": 9.0, "p99": 12.0}, "idle": {"latency_ms": {"p50": 4.0, "p99": 5.0}}}
    assert served.client_bound(srv, 32) == pytest.approx(8000.0)
    assert served.client_bound(srv, 16) == pytest.approx(4000.0)
    assert served.client_bound({"latency_ms": {"p50": 9.0}}, 32) is None


def test_the_served_run_starts_its_server_with_the_engines_asked(monkeypatch):
    class Started(Exception):
        pass

    def fake_process(module, args, **kw):
        raise Started(module, list(args))

    monkeypatch.setattr(served, "ServiceProcess", fake_process)
    for n in (1, 3):
        with pytest.raises(Started) as started:
            served.served("DIR", "cpu", [], 10, 2, 1, 1.0, 0.2, engines=n)
        module, args = started.value.args
        assert module == "migration.colocated_server" and args[args.index("--engines") + 1] == str(n)
        assert "--gpu-turn" not in args
    with pytest.raises(Started) as started:
        served.served("DIR", "cpu", [], 10, 2, 1, 1.0, 0.2, engines=2, gpu_turn=True)
    assert "--gpu-turn" in started.value.args[1] and "--overlap-batches" not in started.value.args[1]
    with pytest.raises(Started) as started:
        served.served("DIR", "cpu", [], 10, 2, 1, 1.0, 0.2, engines=1, overlap=True)
    assert "--overlap-batches" in started.value.args[1]


def test_cluster_runs_start_serve_cluster_and_stand_beside_the_target(corpus_dir, monkeypatch):
    """`--cluster SxR`: each pair against its own `serve cluster`, reported apart; the targets read
    `serve colocated` alone, however fast the cluster."""
    assert served.cluster_specs("1x4, 2X2") == [(1, 4), (2, 2)] and served.cluster_specs("") == []
    for bad in ("4", "1x0", "axb", "1x2x3"):
        with pytest.raises(ValueError, match=f"--cluster '{bad}'"):
            served.cluster_specs(bad)

    class Started(Exception):
        pass

    def fake_process(module, args, **kw):
        raise Started(module, list(args))

    with monkeypatch.context() as m:
        m.setattr(served, "ServiceProcess", fake_process)
        with pytest.raises(Started) as started:
            served.served("DIR", "gpu", [], 10, 2, 1, 1.0, 0.2, cluster=(2, 3))
    module, args = started.value.args
    assert module == "cli" and args[:2] == ["serve", "cluster"]
    assert args[args.index("--shards") + 1] == "2" and args[args.index("--replicas") + 1] == "3"
    assert args[args.index("--device") + 1] == "gpu" and args[args.index("--port") + 1] == "0"

    runs = []

    def fake_served(data, device, want, k, clients, processes, seconds, wait_ms, exchange, cpus, profile,
                    request_format, ahead, switch, layout, engines=1, cluster=None, gpu_turn=False, via="front",
                    overlap=False, fronts=0):
        runs.append(cluster)
        rate = 100.0 if cluster is None else 500.0 * cluster[1]
        return {"requests_per_s": rate, "requests": 10, "n_wrong": 0, "engines": engines,
                "latency_ms": {"p50": 1.0, "p99": 2.0}, "batching": None, "device_ms_per_batch": None,
                "server_cpu_ms_per_request": None}

    monkeypatch.setattr(served, "served", fake_served)
    result = served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, clusters=[(1, 2)],
                        progress=False)
    assert runs == [None, (1, 2)]
    assert list(result["served_cluster"]) == ["cluster-1x2"] and result["served"]["requests_per_s"] == 100.0
    assert result["served_over_in_process"] == 100.0 / result["in_process"]["requests_per_s"]
    assert "cluster-1x2 (serve cluster)" in served.table(result)
    with pytest.raises(ValueError, match="clusters"):
        served.run(str(corpus_dir), device="cpu", k=10, repeat=1, clients=2, checks=2, clusters=[(1, 0)],
                   progress=False)


@pytest.mark.e2e
def test_bench_served_against_serve_cluster_checks_every_answer(corpus_dir, tmp_path):
    pytest.importorskip("ray", reason='serve cluster needs Ray: pip install -e ".[test,cluster]"')
    result = run_cli("bench", "served", "--data", corpus_dir, "--device", "cpu", "--k", 10, "--clients", 4,
                     "--client-processes", 1, "--seconds", 1, "--repeat", 1, "--checks", 2, "--cluster", "1x2",
                     "--json", "--quiet")
    line = json.loads(result.stdout)
    srv = line["served_cluster"]["cluster-1x2"]
    assert line["checks_ok"] and srv["requests"] > 0 and srv["n_wrong"] == 0 and srv["server"] == "cluster"
    assert srv["batching"]["batchers"] == 2 and srv["batching"]["requests"] >= srv["requests"]
    bad = run_cli("bench", "served", "--data", corpus_dir, "--cluster", "2", code=2)
    assert "--cluster" in bad.stderr and "SHARDSxREPLICAS" in bad.stderr
