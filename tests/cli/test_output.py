"""Output a person and a program can rely on, the same in every command: `-q/--quiet` everywhere,
`--json` as JSON Lines everywhere (a `serve` always prints its one JSON line), rates written with SI
prefixes in every table, `retrieve`'s table showing the answers it has or counting the ones it
hides, and no timing that is not above zero turned into a figure."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from andromeda_nb import answers, numbers

from andromeda_nb import measure as bench
from cli import main
from tests.support.cli import run_cli as _run
from tests.support.cli import runner as _runner

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"


def _leaves(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _leaves(cmd, prefix + (name,))
        else:
            yield prefix + (name,), cmd


def _json_lines(text: str) -> list:
    lines = text.splitlines()
    assert lines, "no output"
    return [json.loads(line) for line in lines]  # each line one JSON value: JSON Lines


def test_every_command_has_quiet_and_json():
    for path, cmd in _leaves(main):
        opts = {o for p in cmd.params for o in getattr(p, "opts", ())}
        assert {"-q", "--quiet"} <= opts, f"andromeda {' '.join(path)} lacks -q/--quiet"
        if path[0] == "serve":  # what a server prints on stdout is always its one JSON line
            assert "--json" not in opts and '{"service"' in cmd.help
        else:
            assert "--json" in opts, f"andromeda {' '.join(path)} lacks --json"


def test_no_command_prints_indented_json():
    source = (ROOT / "cli.py").read_text()
    assert "indent=" not in source, "--json prints one line per object; indented JSON is for the --out files"
    assert json.loads(bench.json_line({"a": [1, 2], "b": 1.5})) == {"a": [1, 2], "b": 1.5}
    assert "\n" not in bench.json_line({"nested": {"x": [1, {"y": 2}]}})


def test_corpus_commands_print_json_lines(tmp_path):
    data = tmp_path / "corpus"
    assert _json_lines(_run("generate", "--ads", 200, "--requests", 4, "--out", data, "--json", "-q").stdout)[0]["ads"] == 200
    summary = _json_lines(_run("import", "--ads-file", SAMPLE / "ads.jsonl", "--requests-file", SAMPLE / "requests.jsonl",
                               "--seed", 7, "--out", tmp_path / "sample", "--json", "-q").stdout)
    assert summary[0]["ads"] == 190
    exported = _json_lines(_run("export", "--data", data, "--out", tmp_path / "jsonl", "--json", "-q").stdout)
    assert exported == [{"ads": 200, "requests": 4, "ads_path": str(tmp_path / "jsonl" / "ads.jsonl"),
                         "requests_path": str(tmp_path / "jsonl" / "requests.jsonl")}]
    assert _json_lines(_run("reindex", "--data", data, "--json", "-q").stdout)[0]["ads"] == 200
    assert len(_json_lines(_run("match", "--data", data, "--json", "-q").stdout)) == 4
    assert len(_json_lines(_run("retrieve", "--data", data, "--k", 3, "--json", "-q").stdout)) == 4
    assert "network" in _json_lines(_run("budget", "--data", data, "--json", "-q").stdout)[0]


def test_the_retrieve_table_shows_every_answer_or_counts_the_hidden_ones(tmp_path):
    data = tmp_path / "corpus"
    _run("import", "--ads-file", SAMPLE / "ads.jsonl", "--requests-file", SAMPLE / "requests.jsonl", "--seed", 7, "--out",
         data, "-q")
    five = _run("retrieve", "--data", data, "--k", 5, "-q").stdout.splitlines()
    rows = five[1:-1]
    counts = [int(row.split()[1]) for row in rows]
    assert max(counts) == 5
    for row, n in zip(rows, counts):
        assert row.count(" (") == n and "more" not in row, row
    twenty = _run("retrieve", "--data", data, "--k", 20, "-q").stdout.splitlines()
    full = [row for row in twenty[1:-2] if int(row.split()[1]) == 20]
    assert full and all(row.count(" (") == 10 and row.endswith("... 10 more") for row in full)
    assert twenty[-2] == "(the first 10 answers of each request are shown; --json prints them all)"
    assert five[-1] == twenty[-1] == answers.AGREEMENT_NOTE  # 0.8365 and 0.8366 can be the same answer
    assert "same ads in the same order" in five[-1] and "within 0.0001 of that reference" in five[-1]


def test_serve_has_kernel_version_and_the_top_level_keeps_version():
    assert "--kernel-version" in _run("serve", "colocated", "--help").stdout
    result = _runner().invoke(main, ["serve", "colocated", "--version", "3"])
    assert result.exit_code == 2 and "No such option" in result.stderr
    assert "version" in _run("--version").stdout


def test_rates_read_the_same_everywhere():
    assert numbers.rate(9.24e6, "pool ads/s") == "9.24 M pool ads/s"
    assert numbers.rate(7390.0) == "7.39 k" and numbers.rate(185.4) == "185" and numbers.rate(0.5) == "0.500"
    assert numbers.rate(1.03e10, "ads/s") == "10.3 G ads/s"
    for x in (1.0, 12.0, 999.0, 1e3, 5e5, 1e6, 3.3e9, 7e12):
        assert "e" not in numbers.rate(x), x
    assert numbers.spread([3.0, 1.0, 2.0]) == "2.00 (1.00 to 3.00 over 3 runs)"
    assert numbers.spread_summary({"median": 5.0, "min": 5.0, "max": 5.0, "runs": 1}) == "5.00 (one run)"


def test_compare_table_writes_rates_with_prefixes():
    from migration.harness import format_report

    ok = {"ok": True, "checked": 1, "failures": []}
    arch = {"scores": ok, "topk": ok, "device": "cpu"}
    report = {"ads": 100_000, "requests": 30, "k": 20, "precision": "fp32",
              "updates": {"applied": 0, "rejected": []},
              "eligibility": {"eligible_mean": 6201.0, "eligible_fraction_mean": 0.062, "cpu_vs_oracle": ok,
                              "gpu_vs_oracle": ok, "cpu_vs_gpu": ok, "oracle_requests": 16, "gpu_index": "skipped"},
              "reference_eligibility": {"oracle": 30, "cpu index (under test)": 0}, "remote": arch, "colocated": arch,
              "bytes_per_request": {"remote": 87282.0, "colocated": 3929.0},
              "bytes_per_hop": {"remote": {"client->index host": 3928.0}, "colocated": {"client->server": 3929.0}},
              "latency_ms": {"remote": {}, "colocated": {}}, "traffic_reduction": 22.2,
              "requests_per_second": {"remote": 76.6, "colocated": 108.2},
              "requests_per_second_runs": {"remote": {"median": 76.6, "min": 70.1, "max": 80.0, "runs": 3},
                                           "colocated": {"median": 108.2, "min": 99.0, "max": 111.0, "runs": 3}},
              "pool_ads_per_second": {"remote": 7.66e6, "colocated": 1.08e7}}
    text = format_report(report)
    assert "e+" not in text and "7.66 M" in text and "10.8 M" in text
    assert "range over 3 runs" in text and "70.1 to 80.0" in text
    rows = [line.strip().split("  ")[0] for line in text.splitlines()]
    assert rows[rows.index("requests / second") + 1] == "range over 3 runs", \
        "the range of requests per second sits right under requests per second, not under pool ads per second"


def test_a_timer_that_cannot_resolve_makes_no_figure():
    with pytest.raises(bench.UnresolvedTiming, match="read -1.000 ms"):
        bench.repeat_timed(lambda: -1e-3, min_reps=3, max_reps=5, budget_s=0.1)  # the simulator's events
    with pytest.raises(bench.UnresolvedTiming, match="read 0.000 ms"):
        bench.repeat_timed(lambda: 0.0, min_reps=1, max_reps=1, budget_s=0.0)
    frozen = iter([5.0, 5.0])
    with pytest.raises(bench.UnresolvedTiming):
        bench.timed_runs(lambda: None, 1, clock=lambda: next(frozen))
    timing = bench.repeat_timed(lambda: 2e-3, min_reps=3, max_reps=3, budget_s=0.0)
    assert timing == {"median_s": 2e-3, "min_s": 2e-3, "reps": 3}
    assert numbers.duration(0) == numbers.duration(-1e-3) == numbers.duration(None) == numbers.UNRESOLVED
    assert numbers.duration(0.0037) == "3.70 ms" and numbers.duration(2.5e-5) == "25.0 µs"


@pytest.mark.slow
def test_bench_cpu_prints_one_json_line_of_positive_figures():
    result = _run("bench", "cpu", "--ads", 3000, "--requests", 4, "--k", 5, "--precision", "int8",
                  "--score-rows", 20_000, "--repeat", 1, "--json", "-q")
    [figures] = _json_lines(result.stdout)
    assert result.stderr == ""
    assert figures["kind"] == "cpu" and figures["scorer"][0]["ads_per_s"] > 0
    assert figures["match"]["pool_ads_per_s"] > 0 and figures["end_to_end"]["batched_requests_per_s"] > 0


def test_the_readme_and_ci_run_the_same_commands():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("```bash\n") + 8:readme.index("```", readme.index("```bash\n") + 8)]
    venv, install, tests = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert venv == "python3 -m venv .venv && . .venv/bin/activate" and "python3 -m venv" in "\n".join(ci)
    assert install == 'pip install -e ".[test,cluster]" && andromeda demo'
    assert 'python -m pip install -q -e ".[test,cluster]"' in ci
    assert tests == "python -m pytest -q -n auto" and ci[-1] == tests
