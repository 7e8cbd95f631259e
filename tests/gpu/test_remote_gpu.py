"""The 2024 picture: the remote design with its scoring service on a GPU (`serve scorer --device`,
`retrieve --arch remote --scorer-device`, migration/scorer_server.py). Under the CUDA simulator here (the
gather kernels on tiny corpora); ANDROMEDA_TEST_GPU=1 runs them on the device. Servers bind
127.0.0.1 and are started and stopped by the tests."""

import pytest
import json

import numpy as np
from click.testing import CliRunner

from serving import protocol as fl
from andromeda_nb.reference import ReferenceRetriever
from andromeda_nb.testing import KERNEL_DEVICE, random_updates, update_to_json
from cpu_baseline.index_host import IndexHostServer
from cpu_baseline.scoring_service import ScoringServer

from tests.cpu_baseline.test_remote import assert_equals_reference, make_dataset

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands



def test_a_gpu_scoring_service_behind_the_index_host_equals_the_reference_through_updates():
    from migration.scorer_server import candidate_table

    dataset, rng = make_dataset(33, n_ads=120, n_requests=4, precision="int8")
    scorer = ScoringServer(dataset, "grpc://127.0.0.1:0", table=candidate_table(dataset, KERNEL_DEVICE))
    host = IndexHostServer(dataset, f"grpc://127.0.0.1:{scorer.port}", "grpc://127.0.0.1:0", threads=1,
                           scorer_secret=scorer.pair_secret)
    location = f"grpc://127.0.0.1:{host.port}"
    try:
        assert fl.flight_action(f"grpc://127.0.0.1:{scorer.port}", "health")["device"] == KERNEL_DEVICE
        reference = ReferenceRetriever.build(dataset)
        for step in range(2):
            answers = fl.retrieve_over_flight(location, dataset.requests, 15)
            assert_equals_reference(reference, dataset.requests, answers, 15, f"{KERNEL_DEVICE} scorer, step {step}")
            assert sum(len(a[0]) for a in answers) > 0
            updates = random_updates(rng, list(reference.index.ads.values()), 12, dim=dataset.model.D)
            ack = fl.flight_action(location, "update", "\n".join(json.dumps(update_to_json(u)) for u in updates))
            assert ack["applied"] == len(updates) and not ack["rejected"]
            for update in updates:
                reference.apply(update)
        # the GPU table's device time, summed over its launches (not timed under the simulator)
        device_s = fl.flight_action(f"grpc://127.0.0.1:{scorer.port}", "stats")["device_seconds"]
        assert device_s > 0 if KERNEL_DEVICE == "gpu" else device_s is None
    finally:
        host.shutdown()
        host.close_resources()
        scorer.shutdown()


def test_cli_retrieve_remote_with_a_simulated_gpu_scorer_equals_the_reference(tmp_path):
    from cli import main

    runner = CliRunner()
    data = tmp_path / "corpus"
    made = runner.invoke(main, ["generate", "--ads", "300", "--requests", "2", "--seed", "6", "--out", str(data),
                                "--precision", "fp16", "--updates", "30", "--quiet"])
    assert made.exit_code == 0, made.output
    common = ["--data", str(data), "--k", "10", "--json", "-q", "--updates-file", str(data / "updates.jsonl")]
    ref = runner.invoke(main, ["retrieve", "--arch", "reference", *common])
    got = runner.invoke(main, ["retrieve", "--arch", "remote", "--scorer-device", "sim", *common])
    assert ref.exit_code == 0 and got.exit_code == 0, got.output
    ref_lines = [json.loads(line) for line in ref.stdout.splitlines()]
    got_lines = [json.loads(line) for line in got.stdout.splitlines()]
    assert len(got_lines) == 2 and any(r["ads"] for r in ref_lines)
    for r, g in zip(ref_lines, got_lines):
        assert g["ads"] == r["ads"] and np.allclose(g["scores"], r["scores"], atol=1e-4)


def test_compare_shows_three_designs_that_answer_alike(tmp_path):
    """compare with a simulated GPU scorer beside the CPU one: three columns, every answer equal to
    the reference, the co-located design with the fewest bytes; the same device twice runs once."""
    from cli import main
    from migration.harness import scorer_columns

    assert scorer_columns(("cpu", "cpu", "sim")) == [("remote", "cpu"), ("remote_sim", "sim")]
    runner = CliRunner()
    data = tmp_path / "corpus"
    made = runner.invoke(main, ["generate", "--ads", "250", "--requests", "2", "--seed", "8", "--out", str(data),
                                "--precision", "int8", "--updates", "20", "--quiet"])
    assert made.exit_code == 0, made.output
    args = ["compare", "--data", str(data), "--device", "cpu", "--scorer-devices", "cpu,sim", "--runs", "1",
            "--traffic-requests", "1", "--k", "10", "--updates-file", str(data / "updates.jsonl"), "-q"]
    table = runner.invoke(main, args)
    assert table.exit_code == 0, table.output
    assert "remote, CPU scorer" in table.stdout and "remote, SIM scorer" in table.stdout
    assert "what co-location adds on top of SIM scoring" in table.stdout
    assert "network on every hop: loopback" in table.stdout
    shaped = runner.invoke(main, [*args, "--json", "--link-latency-us", "100", "--link-gbps", "25"])
    assert shaped.exit_code == 0, shaped.output
    report = json.loads(shaped.stdout.splitlines()[-1])
    assert report["link"] == "100 us, 25 Gb/s"
    assert min(report["latency_ms"][n]["p50"] for n in report["architectures"]) >= 0.2  # two 100 us crossings at least
    assert report["architectures"] == ["remote", "remote_sim", "colocated"]
    assert report["topk_equal"] and report["scores_equal"] and report["remote_sim"]["device"] == "sim"
    b = report["bytes_per_request"]
    assert b["remote_sim"] > b["colocated"] and b["remote"] > b["colocated"]
    # host CPU per request of every service the designs started, read from /proc around the timed runs
    cpu = report["host_cpu_ms_per_request"]
    assert set(cpu["remote"]) == {"index host (match, top-K)", "scoring service"}
    assert set(cpu["colocated"]) == {"co-located server (match, scoring, top-K)"}
    # (/proc counts in clock ticks of 10 ms: two requests may read 0 on a fast service)
    assert all(ms >= 0 for design in cpu.values() for ms in design.values()), cpu
    assert "host CPU ms / request" in table.stdout and "  index host" in table.stdout
    # no GPU service here (the simulator's time is no device's): no busy fraction, and no row for it
    assert report["gpu_busy_fraction"] == {n: {} for n in report["architectures"]}
    assert "GPU busy" not in table.stdout


def test_gpu_busy_fraction_is_the_services_device_time_over_the_timed_wall_time():
    """measure() reads each service's device seconds around the timed runs: a service busy for
    half of every request's time reads about 0.5, one that never says reads nothing."""
    import time

    from migration.harness import measure

    class HalfBusy:
        def __init__(self):
            self.busy_s = 0.0

        def retrieve(self, requests, k):
            time.sleep(0.02 * len(requests))
            self.busy_s += 0.01 * len(requests)
            return [(np.zeros(0, np.int64), np.zeros(0, np.float32)) for _ in requests]

        def device_seconds(self):
            return {"scorer": self.busy_s, "index host": None}

        def retrieve_traffic(self, requests, k):
            return self.retrieve(requests, k), [{} for _ in requests]

    m = measure(HalfBusy(), list(range(5)), 10, traffic_requests=1, runs=2)
    assert set(m.gpu_busy) == {"scorer"}
    assert 0.3 < m.gpu_busy["scorer"] <= 0.5, m.gpu_busy
