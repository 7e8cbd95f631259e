"""Every result file records where it came from (andromeda_nb.provenance): one stamp, `stamp`, with the
command, the commit and whether the tree had changes not committed; every bench command's `--out`
file carries it (the benchmarks faked where they need a GPU or minutes, the writing real), and so
does every script and benchmark module that writes a result file, each through the one function."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

from andromeda_nb import provenance
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _head() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _assert_stamped(doc: dict, command_start: str) -> None:
    prov = doc["provenance"]
    assert prov["command"].startswith(command_start), prov["command"]
    assert prov["commit"] == _head() and prov["commit"] == prov["host"]["git_commit"]
    assert isinstance(prov["dirty"], bool) and prov["dirty"] == prov["host"]["git_dirty"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", prov["created"])


def test_the_stamp_records_the_command_the_commit_and_the_dirty_flag():
    if _head() is None:
        pytest.skip("not a git checkout: there is no commit to record")
    doc = provenance.stamp({"x": 1}, "match", argv=["andromeda", "bench", "match", "--pools", "10"])
    assert doc["kind"] == "match" and doc["x"] == 1
    _assert_stamped(doc, "andromeda bench match --pools 10")
    script = provenance.stamp({}, command=provenance.script_command("probe_x.py", ["--pool", 5, "--out", "a b.json"]))
    assert script["provenance"]["command"] == "PYTHONPATH=. python3 scripts/probe_x.py --pool 5 --out 'a b.json'"
    assert "kind" not in script
    assert provenance.script_command("-m benchmarks.cluster", ["--shards", "1"]) == \
        "PYTHONPATH=. python3 -m benchmarks.cluster --shards 1"


def test_write_result_and_finish_probe_write_the_stamp(tmp_path):
    if _head() is None:
        pytest.skip("not a git checkout: there is no commit to record")
    out = tmp_path / "deep" / "r.json"
    provenance.write_result({"figure": 2.5}, out, "score", command="andromeda bench score --dims 64")
    doc = json.loads(out.read_text())
    assert doc["kind"] == "score" and doc["figure"] == 2.5
    _assert_stamped(doc, "andromeda bench score --dims 64")
    probe = tmp_path / "probe.json"
    provenance.finish_probe({"figure": 1}, "probe_geo_skip.py", ["--pool", "64"], str(probe))
    doc = json.loads(probe.read_text())
    _assert_stamped(doc, "PYTHONPATH=. python3 scripts/probe_geo_skip.py --pool 64")
    assert doc["command"] == doc["provenance"]["command"] and doc["software"]["numpy"]


def test_report_probe_stamps_prints_one_line_and_writes(tmp_path, capsys):
    if _head() is None:
        pytest.skip("not a git checkout: there is no commit to record")
    out = tmp_path / "deep" / "p.json"
    provenance.report_probe({"figure": 3}, "probe_topk_segments.py", ["--versions", "2,3"], str(out))
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and json.loads(printed[0]) == json.loads(out.read_text())
    _assert_stamped(json.loads(out.read_text()), "PYTHONPATH=. python3 scripts/probe_topk_segments.py --versions 2,3")
    provenance.report_probe({"figure": 4}, "probe_tile_occupancy.py", [], None, indent=1)
    assert json.loads(capsys.readouterr().out)["figure"] == 4  # no file: stdout only, indented


def _fake_results(monkeypatch) -> None:
    """The bench commands' library functions replaced by ones returning what their tables read."""
    from benchmarks import cluster as cb
    from benchmarks import cpu, match_both
    from benchmarks import score as bs

    cpu_result = {"machine": {"cpu": "test", "cores": 2}, "scorer": [],
                  "bandwidth": {"ceiling_GBps": 1.0, "numpy_GBps": 1.0, "parallel_GBps": 1.0}, "checks_ok": True,
                  "checks": {}}
    monkeypatch.setattr(cpu, "run_cpu_bench", lambda **kw: dict(cpu_result))
    monkeypatch.setattr(match_both, "bench_match", lambda **kw: {"pools": [], "checks": {}, "checks_ok": True})
    monkeypatch.setattr(bs, "bench_score", lambda **kw: {
        "env": {"device": "test"}, "n_ads": 1, "k": 1, "copy_bandwidth_Bps": 1e12, "arithmetic": "float32",
        "runs": [], "unfused": [], "checks_ok": True, "targets": {}})
    monkeypatch.setattr(bs, "bench_pipeline", lambda *, layout, **kw: {
        "layout": layout, "env": {"device": "test"}, "pool_ads": kw["pool"], "precision": "fp16", "D": 64, "k": 100,
        "checks_ok": True, "latency_ms": {"p50": 1.0, "p99": 2.0}, "throughput": [], "targets": {}})
    monkeypatch.setattr(cb, "measure", lambda *a, **kw: {"kind": "cluster_data_path", "rows": []})
    import cli

    monkeypatch.setattr(cli, "_load_dataset", lambda data, quiet: None)  # the fake measures no corpus
    monkeypatch.setattr(cb, "table", lambda result: "table")


@pytest.mark.parametrize("args, kind", [
    (["bench", "cpu", "--ads", "100"], "cpu"),
    (["bench", "match", "--ads", "100", "--device", "sim"], "match"),
    (["bench", "score", "--ads", "4096"], "score"),
    (["bench", "pipeline", "--ads", "4096"], "pipeline"),
    (["bench", "cluster", "--data", "{data}", "--device", "cpu"], "cluster_data_path"),
], ids=["cpu", "match", "score", "pipeline", "cluster"])
def test_every_bench_command_writes_its_provenance_into_its_out_file(args, kind, tmp_path, monkeypatch):
    if _head() is None:
        pytest.skip("not a git checkout: there is no commit to record")
    _fake_results(monkeypatch)
    data = tmp_path / "corpus"
    data.mkdir()
    out = tmp_path / "result.json"
    run_cli(*[a.replace("{data}", str(data)) for a in args], "--out-file", out, "-q")
    doc = json.loads(out.read_text())
    assert doc["kind"] == kind
    _assert_stamped(doc, "andromeda " + " ".join(args[:2]))
    assert doc["provenance"]["options"]["out_file"] == str(out)


def test_the_cluster_bench_run_as_a_module_stamps_its_partial_and_final_files(tmp_path, monkeypatch):
    if _head() is None:
        pytest.skip("not a git checkout: there is no commit to record")
    from andromeda_nb import store
    from benchmarks import cluster as cb

    out = tmp_path / "cluster.json"
    seen = []

    def fake_measure(dataset, counts, *, partial, **kw):
        partial({"kind": "cluster_data_path", "rows": [], "complete": False})
        seen.append(json.loads(out.read_text()))  # the partial file, as a run cut short would leave it
        return {"kind": "cluster_data_path", "rows": [], "complete": True}

    monkeypatch.setattr(cb, "measure", fake_measure)
    monkeypatch.setattr(cb, "table", lambda result: "table")
    monkeypatch.setattr(store, "load_dataset", lambda path: None)
    assert cb.main(["--data", str(tmp_path), "--placement", "processes", "--device", "cpu", "--out", str(out)]) == 0
    for doc in (seen[0], json.loads(out.read_text())):
        _assert_stamped(doc, "PYTHONPATH=. python3 -m benchmarks.cluster --data ")
    assert seen[0]["complete"] is False and json.loads(out.read_text())["complete"] is True


# --- every writer of a result file goes through the stamp --------------------------------------------------


def _writers() -> list[Path]:
    """Scripts and benchmark modules that take --out (or write a result file as they go)."""
    files = sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    marks = ('"--out"', "write_json(", "write_result(", "json.dump(")
    return [f for f in files if any(mark in f.read_text() for mark in marks)]


NOT_RESULTS = {"mutants.py": "prints JSON Lines of mutants, no result file",
               "results_manifest.py": "writes the manifest of the result files, not a result"}


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_every_script_and_benchmark_that_writes_a_result_stamps_it_through_provenance():
    writers = [f for f in _writers() if f.name not in NOT_RESULTS]
    assert len(writers) >= 20, [f.name for f in writers]
    unstamped = [f.relative_to(ROOT).as_posix() for f in writers
                 if not _calls(f) & {"stamp", "write_result", "finish_probe", "report_probe"}]
    assert not unstamped, f"these write result JSON without andromeda_nb.provenance's stamp: {unstamped}"
    # and none writes one by hand beside it
    by_hand = [f.relative_to(ROOT).as_posix() for f in writers if "json.dump(" in f.read_text()]
    assert not by_hand, by_hand
