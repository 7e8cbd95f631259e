"""The migration demo runs end to end on a small corpus and reports figures that hang together."""

import pytest

from migration.demo import run_demo


@pytest.fixture(scope="module")
def demo_run():
    lines = []
    figures = run_demo(n_ads=1200, n_requests=3, seed=4, k=10, device="cpu", echo=lines.append,
                       kernel_rows=1 << 14)
    return figures, "\n".join(lines)


def test_demo_walks_the_five_steps(demo_run):
    figures, text = demo_run
    for header in ("1. Find the bottleneck", "2. The byte budget", "3. One tower versus experts",
                   "4. Co-location and its traffic", "5. The fused kernel and int8", "Side by side"):
        assert header in text
    report = figures["compare"]
    assert report["eligible_equal"] and report["scores_equal"] and report["topk_equal"]
    assert report["bytes_per_request"]["remote"] > report["bytes_per_request"]["colocated"] > 0


def test_demo_figures_are_measured(demo_run):
    figures, _ = demo_run
    kernels = figures["kernels"]
    assert kernels["device"] == "cpu" and kernels["rows"] == 1 << 14
    for precision in ("fp32", "fp16", "int8"):
        assert kernels["fused"][precision]["ads_per_s"] > 0
        assert kernels["unfused"][precision]["ads_per_s"] > 0
    assert set(figures["quality"]["recall"]) == {"two_tower", "moe_k1", "moe_k2", "moe_k4", "dense"}
    assert figures["budget"]["network"]["source"] == "corpus"


def test_on_a_cpu_the_demo_explains_itself(demo_run):
    figures, text = demo_run
    assert figures["device"] == "cpu"
    explanation = text[text.index("What the CPU figures show"):]
    assert "Co-location pays on a GPU server" in explanation
    q = figures["compare"]["requests_per_second"]
    said = "faster even here" if q["colocated"] >= q["remote"] else "slower here, because the remote design splits"
    assert said in explanation, "the comparison it draws is the one measured"
    assert "median of its runs with the range" in explanation


def test_repeated_timings_report_median_and_spread(demo_run):
    figures, text = demo_run
    for precision in ("fp32", "fp16", "int8"):
        runs = figures["kernels"]["fused"][precision]["runs"]
        assert runs["runs"] == 5 and runs["min"] <= runs["median"] <= runs["max"]
        assert runs["median"] == figures["kernels"]["fused"][precision]["ads_per_s"]
    for arch in ("remote", "colocated"):
        runs = figures["compare"]["requests_per_second_runs"][arch]
        assert runs["runs"] == 3 and runs["min"] <= runs["median"] <= runs["max"] > 0
    side = text[text.index("Side by side"):]
    assert side.count("over 3 runs") == 2 and "over 5 runs" in text
    assert "e+" not in text, "rates are written with SI prefixes, never in exponent form"
