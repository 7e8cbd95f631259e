"""The side-by-side harness: both architectures, the same requests and update stream, agreement and
bytes on the wire. One full run (services on 127.0.0.1, started and stopped here) is shared by the
checks; a perturbed answer must be caught."""

import json

import numpy as np
import pytest

from andromeda_nb.corpus import generate_corpus
from andromeda_nb.budget import payload_total
from migration.harness import (check_answers, compare_eligibility, format_report, load_updates, reference_answers,
                               run_comparison)
from andromeda_nb.store import load_dataset
from andromeda_nb.testing import random_updates, update_to_json

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

SEED = 11


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    generate_corpus(out, n_ads=1500, n_requests=5, seed=SEED)
    return load_dataset(out)


@pytest.fixture(scope="module")
def updates_file(dataset, tmp_path_factory):
    rng = np.random.default_rng(SEED)
    lines = [json.dumps(update_to_json(u)) for u in random_updates(rng, dataset.ads, 60)]
    lines.insert(3, '{"op": "retire", "ad_id": 999999999}')  # never created: rejected, the rest apply
    path = tmp_path_factory.mktemp("updates") / "updates.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def report(dataset, updates_file):
    return run_comparison(dataset, k=20, device="cpu", updates_path=updates_file, traffic_requests=3)


def test_architectures_agree_after_updates(report):
    print(f"seed {SEED}, 1500 ads, 5 requests, k 20")
    assert report["eligible_equal"], report["eligibility"]
    assert report["eligibility"]["cpu_vs_oracle"]["checked"] == 5  # every request, updates applied
    assert report["reference_eligibility"] == {"oracle": 5, "cpu index (under test)": 0}
    assert "reference eligibility: oracle on 5 requests" in format_report(report)
    # --device cpu: the GPU index has no CPU form, so it is skipped with the reason (the simulator runs
    # only when asked for: test_the_gpu_index_is_checked_under_the_simulator_when_asked)
    assert report["eligibility"]["gpu_index"].startswith("the GPU index runs only as CUDA kernels")
    assert "--device sim" in report["eligibility"]["gpu_index"]
    assert report["eligibility"]["cpu_vs_gpu"]["checked"] == 0
    assert report["colocated"]["device"] == "cpu"
    assert report["scores_equal"] and report["topk_equal"], (report["remote"], report["colocated"])
    assert any("999999999" in r for r in report["updates"]["rejected"])


def test_the_gpu_index_is_checked_under_the_simulator_when_asked(dataset, updates_file):
    updates, _ = load_updates(dataset, updates_file)
    summary, cpu_sets, _ = compare_eligibility(dataset, dataset.requests, updates, device="sim", oracle_requests=5)
    assert summary["gpu_index"] == "sim" and summary["equal"], summary
    assert summary["gpu_vs_oracle"]["checked"] == 5 and summary["cpu_vs_gpu"]["checked"] == len(dataset.requests)
    assert sum(len(s) for s in cpu_sets) > 0


def test_the_gpu_index_laid_out_by_geography_is_checked_and_the_cpu_refuses_that_layout(dataset, updates_file):
    updates, _ = load_updates(dataset, updates_file)
    summary, _, _ = compare_eligibility(dataset, dataset.requests, updates, device="sim", oracle_requests=5,
                                        layout="geo")
    assert summary["gpu_index"] == "sim" and summary["equal"], summary
    assert summary["gpu_vs_oracle"]["checked"] == 5
    with pytest.raises(ValueError, match="the slot layout 'geo' is the GPU engine's: compare it with --device gpu"):
        run_comparison(dataset, k=5, device="cpu", layout="geo")


def test_an_update_stream_of_which_nothing_applies_stops_the_comparison(dataset, tmp_path):
    path = tmp_path / "updates.jsonl"
    path.write_text('{"op": "retire", "ad_id": 999999999}\n{"op": "oops"}\n')
    with pytest.raises(ValueError, match="no update of .* applies: all 2 were rejected"):
        run_comparison(dataset, k=5, device="cpu", updates_path=path)


def test_throughput_is_the_median_of_timed_runs_with_their_range(report):
    for arch in ("remote", "colocated"):
        runs = report["requests_per_second_runs"][arch]
        assert runs["runs"] == 3 and 0 < runs["min"] <= runs["median"] <= runs["max"]
        assert runs["median"] == pytest.approx(report["requests_per_second"][arch])
    assert "range over 3 runs" in format_report(report) and "e+" not in format_report(report)


def test_bytes_are_measured_per_hop(report):
    hops = report["bytes_per_hop"]
    assert set(hops["remote"]) == {"client->index host", "index host->scorer"}
    assert set(hops["colocated"]) == {"client->server"}
    # both carry the same request and answer; the remote design also ships the candidates (an int64 id
    # out, a float32 score back): the payload model of `andromeda budget` is what the relays must see
    # at least, and Arrow / gRPC framing adds no more than a few kB per hop and request
    model = report["payload_estimate"]
    for arch in ("remote", "colocated"):
        floor = payload_total(model[arch])
        assert floor <= report["bytes_per_request"][arch] <= floor + 2500 * len(hops[arch]), (arch, model[arch], hops)
    scorer_hop = model["remote"]["index host->scorer"]
    assert scorer_hop["upstream"] > 2 * scorer_hop["downstream"] > 0  # 8 B out, 4 B back per candidate
    assert report["bytes_per_request"]["remote"] > report["bytes_per_request"]["colocated"] > 0
    assert report["traffic_reduction"] == pytest.approx(
        report["bytes_per_request"]["remote"] / report["bytes_per_request"]["colocated"])
    text = format_report(report)
    assert "bytes on the wire / request" in text and "traffic reduction" in text and "payload model" in text


def test_a_limited_oracle_says_where_the_reference_eligibility_came_from(dataset):
    """With --oracle-requests 2 the other three requests' reference sets come from the CPU index, an
    index under test, and the report says so."""
    summary, index_sets, oracle_sets = compare_eligibility(dataset, dataset.requests, [], device="cpu",
                                                           oracle_requests=2)
    assert summary["oracle_requests"] == 2 and len(oracle_sets) == 2 and summary["equal"]
    _, source = reference_answers(dataset, dataset.requests, [], 10, oracle_sets, index_sets)
    assert source == {"oracle": 2, "cpu index (under test)": 3}


def test_a_wrong_answer_is_caught(dataset):
    from andromeda_nb.oracle import OracleIndex

    sets = OracleIndex.build(dataset.ads).match(dataset.requests)
    reference, _ = reference_answers(dataset, dataset.requests, [], 10, sets, sets)
    good = [(top_ids, top_scores.astype(np.float32)) for _, _, top_ids, top_scores in reference]
    assert check_answers(reference, good, 10, "good")["topk"]["ok"]
    i = next(j for j, (ids, _) in enumerate(good) if len(ids) >= 3)
    ids, scores = good[i]
    dropped = list(good)
    dropped[i] = (ids[1:], scores[1:])
    assert not check_answers(reference, dropped, 10, "dropped")["topk"]["ok"]
    shifted = list(good)
    shifted[i] = (ids, scores + np.float32(1e-3))
    assert not check_answers(reference, shifted, 10, "shifted")["scores"]["ok"]
