"""The command line through click's CliRunner: help everywhere, --json shapes of DESIGN section 8,
match / retrieve answers equal to the library computed directly, user errors without tracebacks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
import numpy as np
import pytest

from andromeda_nb import store
from andromeda_nb.oracle import OracleIndex
from andromeda_nb.reference import ReferenceRetriever
from andromeda_nb.updates import apply_update_file
from cli import main
from migration import architectures
from tests.support.cli import run_cli as _run
from tests.support.cli import runner as _runner

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

SEED = 3
SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "corpus"
    result = _run("generate", "--ads", 600, "--requests", 7, "--seed", SEED, "--out", out, "--json", "--quiet")
    report = json.loads(result.stdout)
    assert report["ads"] == 600 and report["requests"] == 7 and report["seed"] == SEED
    assert set(report["eligible_fraction"]) == {"min", "p10", "median", "p90", "max"}
    assert 0 < report["eligible_fraction"]["median"] < 0.3
    return out


def _commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


def test_every_command_has_help_text():
    seen = []
    for path, cmd in _commands(main):
        assert (cmd.help or "").strip(), f"andromeda {' '.join(path)} has no help text"
        result = _run(*path, "--help")
        assert "Usage:" in result.stdout
        seen.append(" ".join(path))
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert (param.help or "").strip(), f"andromeda {' '.join(path)} {param.opts[0]} has no help"
    assert {"generate", "import", "match", "retrieve", "demo"} <= set(seen)


def test_generate_prints_the_eligible_distribution(tmp_path):
    result = _run("generate", "--ads", 300, "--requests", 4, "--seed", 1, "--out", tmp_path / "c", "--quiet")
    assert "eligible fraction per request" in result.stdout
    for key in ("min", "p10", "median", "p90", "max"):
        assert key in result.stdout
    assert result.stderr == ""  # --quiet


def test_generate_writes_an_update_stream_that_match_applies_whole(tmp_path):
    out = tmp_path / "c"
    _run("generate", "--ads", 400, "--requests", 6, "--seed", 3, "--out", out, "--updates", 60, "--quiet")
    lines = (out / "updates.jsonl").read_text().splitlines()
    assert len(lines) == 60 and {json.loads(x)["op"] for x in lines} == {"upsert", "status", "retire"}
    before = [json.loads(x)["eligible"] for x in _run("match", "--data", out, "--arch", "oracle", "--json",
                                                      "--quiet").stdout.splitlines()]
    after = _run("match", "--data", out, "--arch", "cpu", "--updates-file", out / "updates.jsonl", "--json", "--quiet")
    oracle = _run("match", "--data", out, "--arch", "oracle", "--updates-file", out / "updates.jsonl", "--json", "--quiet")
    assert "rejected" not in after.stderr
    after_sets = [json.loads(x)["eligible"] for x in after.stdout.splitlines()]
    assert after_sets == [json.loads(x)["eligible"] for x in oracle.stdout.splitlines()]
    assert after_sets != before  # the stream changes what requests find


def test_match_json_equals_the_oracle(corpus_dir):
    result = _run("match", "--data", corpus_dir, "--arch", "oracle", "--json", "--quiet")
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    dataset = store.load_dataset(corpus_dir)
    expect = OracleIndex.build(dataset.ads).match(dataset.requests)
    assert [x["request_id"] for x in lines] == [r.request_id for r in dataset.requests]
    assert sum(len(x["eligible"]) for x in lines) > 0
    for line, ids in zip(lines, expect):
        assert set(line) == {"request_id", "eligible"}
        assert line["eligible"] == sorted(line["eligible"]) == ids.tolist()


def test_match_table_without_json(corpus_dir):
    result = _run("match", "--data", corpus_dir, "--quiet")
    assert result.stdout.splitlines()[0].split()[:2] == ["request_id", "eligible"]
    assert len(result.stdout.splitlines()) == 1 + 7


def test_retrieve_json_equals_the_reference(corpus_dir):
    result = _run("retrieve", "--data", corpus_dir, "--arch", "reference", "--k", 7, "--json", "--quiet")
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    dataset = store.load_dataset(corpus_dir)
    expect = ReferenceRetriever.build(dataset).retrieve(dataset.requests, 7)
    assert len(lines) == len(dataset.requests)
    for line, req, (ids, scores) in zip(lines, dataset.requests, expect):
        assert set(line) == {"request_id", "ads", "scores"} and line["request_id"] == req.request_id
        assert line["ads"] == ids.tolist()
        assert np.array_equal(np.asarray(line["scores"], np.float32), scores), "scores read back to the same float32"
        assert all(a >= b for a, b in zip(line["scores"], line["scores"][1:]))
    assert any(len(x["ads"]) == 7 for x in lines)


def test_retrieve_k_is_validated(corpus_dir):
    for bad in (0, 4097):
        result = _runner().invoke(main, ["retrieve", "--data", str(corpus_dir), "--k", str(bad)])
        assert result.exit_code == 2 and "--k" in result.stderr and "Traceback" not in result.stderr


def test_updates_are_applied_and_rejections_reported(tmp_path):
    out = tmp_path / "sample"
    _run("import", "--ads-file", SAMPLE / "ads.jsonl", "--requests-file", SAMPLE / "requests.jsonl", "--seed", 7, "--out", out,
         "--quiet")
    result = _run("match", "--data", out, "--updates-file", SAMPLE / "updates.jsonl", "--json", "--quiet")
    dataset = store.load_dataset(out)
    index = OracleIndex.build(dataset.ads)
    applied, rejections = apply_update_file(SAMPLE / "updates.jsonl", [index], dataset.ad_ids.tolist(), seed=7,
                                            dim=64)
    assert applied == 26 and [r.line_no for r in rejections] == [27, 28, 29, 30]
    expect = index.match(dataset.requests)
    assert [json.loads(x)["eligible"] for x in result.stdout.splitlines()] == [e.tolist() for e in expect]
    for line in (27, 28, 29, 30):
        assert f"line {line}:" in result.stderr, "rejections are reported even with --quiet"
    before = _run("match", "--data", out, "--json", "--quiet")
    assert before.stdout != result.stdout, "the updates change some answer"
    ranked = _run("retrieve", "--data", out, "--updates-file", SAMPLE / "updates.jsonl", "--k", 3, "--json", "--quiet")
    for line, ids in zip(ranked.stdout.splitlines(), expect):
        assert set(json.loads(line)["ads"]) <= set(ids.tolist())


def test_import_counts_rejections_and_strict_fails(tmp_path):
    args = ["import", "--ads-file", SAMPLE / "ads.jsonl", "--requests-file", SAMPLE / "requests.jsonl", "--seed", 7]
    result = _run(*args, "--out", tmp_path / "a", "--json")
    summary = json.loads(result.stdout)
    assert (summary["ads"], summary["rejected_ads"], summary["requests"]) == (190, 10, 20)
    assert "rejected 10 ad(s)" in result.stderr and "targeting.genders[0]" in result.stderr
    assert len((tmp_path / "a" / "rejected.jsonl").read_text().splitlines()) == 10
    strict = _runner().invoke(main, [str(a) for a in args] + ["--out", str(tmp_path / "b"), "--strict"])
    assert strict.exit_code == 1 and "--strict" in strict.stderr and "Traceback" not in strict.stderr
    assert "nothing was written" in strict.stderr and not (tmp_path / "b").exists(), "--strict writes nothing"
    assert strict.stdout == ""


def test_import_of_swapped_files_loads_nothing_and_says_why(tmp_path):
    result = _runner().invoke(main, ["import", "--ads-file", str(SAMPLE / "requests.jsonl"), "--requests-file",
                                     str(SAMPLE / "ads.jsonl"), "--out", str(tmp_path / "c"), "--quiet"])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "no valid ad in" in result.stderr and "swapped?" in result.stderr
    assert "rejected 20 ad(s)" in result.stderr and not (tmp_path / "c").exists()


def test_import_of_requests_that_are_all_rejected_fails(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": 1, "user": {"age": "old"}}\n{"request_id": 2}\n')
    result = _runner().invoke(main, ["import", "--ads-file", str(SAMPLE / "ads.jsonl"), "--requests-file", str(bad),
                                     "--out", str(tmp_path / "c"), "--quiet"])
    assert result.exit_code == 1 and "no valid request in" in result.stderr and "2 line(s) rejected" in result.stderr
    assert not (tmp_path / "c").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = _runner().invoke(main, ["import", "--ads-file", str(empty), "--requests-file", str(SAMPLE / "requests.jsonl"),
                                     "--out", str(tmp_path / "d"), "--quiet"])
    assert result.exit_code == 1 and "it holds no ad" in result.stderr


def test_an_existing_corpus_is_replaced_only_with_force(tmp_path):
    out = tmp_path / "c"
    _run("generate", "--ads", 50, "--requests", 2, "--seed", 1, "--out", out, "--quiet")
    before = (out / "ads.parquet").read_bytes()
    for command in (["generate", "--ads", 60, "--requests", 2, "--seed", 2],
                    ["import", "--ads-file", SAMPLE / "ads.jsonl", "--requests-file", SAMPLE / "requests.jsonl", "--seed", 7]):
        result = _runner().invoke(main, [str(a) for a in command] + ["--out", str(out), "--quiet"])
        assert result.exit_code == 1 and "already holds a corpus" in result.stderr and "--force" in result.stderr
        assert (out / "ads.parquet").read_bytes() == before, "nothing of the corpus changed"
    _run("generate", "--ads", 60, "--requests", 2, "--seed", 2, "--out", out, "--quiet", "--force")
    assert store.load_dataset(out).n_ads == 60
    _run("import", "--ads-file", SAMPLE / "ads.jsonl", "--requests-file", SAMPLE / "requests.jsonl", "--seed", 7,
         "--out", out, "--quiet", "--force")
    assert store.load_dataset(out).n_ads == 190


def test_an_update_stream_of_which_nothing_applies_fails(corpus_dir, tmp_path):
    rejected = tmp_path / "rejected.jsonl"
    rejected.write_text("".join(f'{{"op": "retire", "ad_id": {900000 + i}}}\n' for i in range(200)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for command in (["match"], ["retrieve", "--k", 3]):
        result = _runner().invoke(main, [*command, "--data", str(corpus_dir), "--updates-file", str(rejected), "--quiet"])
        assert result.exit_code == 1 and "no update of" in result.stderr and "all 200 were rejected" in result.stderr
        assert result.stdout == "" and "Traceback" not in result.stderr
        result = _runner().invoke(main, [*command, "--data", str(corpus_dir), "--updates-file", str(empty), "--quiet"])
        assert result.exit_code == 1 and "holds no update" in result.stderr


def test_user_errors_are_clean(tmp_path, corpus_dir, monkeypatch):
    (tmp_path / "empty").mkdir()
    result = _runner().invoke(main, ["match", "--data", str(tmp_path / "empty")])
    assert result.exit_code == 1 and "meta.json" in result.stderr and "Traceback" not in result.stderr
    monkeypatch.setitem(architectures.MATCHERS, "gpu", "no_such_module.index:Index")
    result = _runner().invoke(main, ["match", "--data", str(corpus_dir), "--arch", "gpu", "--quiet"])
    assert result.exit_code == 1 and "not available" in result.stderr and "Traceback" not in result.stderr
    monkeypatch.setitem(architectures.RETRIEVERS, "colocated", "no_such_module.colocated:Retriever")
    result = _runner().invoke(main, ["retrieve", "--data", str(corpus_dir), "--arch", "colocated", "--quiet"])
    assert result.exit_code == 1 and "not available" in result.stderr


def test_export_then_import_gives_the_same_answers(corpus_dir, tmp_path):
    _run("export", "--data", corpus_dir, "--out", tmp_path / "jsonl", "--quiet")
    _run("import", "--ads-file", tmp_path / "jsonl" / "ads.jsonl", "--requests-file", tmp_path / "jsonl" / "requests.jsonl",
         "--model", corpus_dir / "model.npz", "--seed", SEED, "--out", tmp_path / "back", "--strict", "--quiet")
    for command in (("match", "--json"), ("retrieve", "--k", 5, "--json")):
        a = _run(*command, "--data", corpus_dir, "--quiet").stdout
        b = _run(*command, "--data", tmp_path / "back", "--quiet").stdout
        assert a == b and a.strip()


def test_a_service_failing_mid_run_ends_the_command_with_its_message(corpus_dir, monkeypatch):
    """A Flight error from a service the command started (a scoring service refusing a batch, say)
    ends the command with exit 1 and the service's own words, without gRPC's debug context or a
    traceback."""
    import pyarrow.flight as flight

    class Failing:
        def retrieve_traffic(self, requests, k):
            raise flight.FlightInternalError(
                "scoring service at grpc://127.0.0.1:9 failed: invalid request: candidate batch of bytes (5) is over "
                "the server's limit of 4 (--max-request-bytes). Detail: Failed. gRPC client debug context: UNKNOWN")

        retrieve = retrieve_traffic

        def close(self):
            pass

    monkeypatch.setattr(architectures, "build_retriever", lambda *a, **kw: Failing())
    result = _runner().invoke(main, ["retrieve", "--data", str(corpus_dir), "--arch", "colocated", "--quiet"])
    assert result.exit_code == 1, result.output
    assert "a service failed: scoring service at grpc://127.0.0.1:9 failed" in result.stderr
    assert "--max-request-bytes)" in result.stderr
    assert "Traceback" not in result.stderr and "debug context" not in result.stderr
    # anything else still surfaces as itself
    monkeypatch.setattr(architectures, "build_retriever", lambda *a, **kw: 1 / 0)
    result = _runner().invoke(main, ["retrieve", "--data", str(corpus_dir), "--arch", "colocated", "--quiet"])
    assert isinstance(result.exception, ZeroDivisionError)


def test_bench_pipeline_runs_each_layout_in_turn_in_one_process(monkeypatch):
    from benchmarks import score as bs

    calls = []

    def fake(*, layout, **options):  # the GPU benchmark's result, as far as the table reads it
        calls.append((layout, options["pool"]))
        return {"layout": layout, "env": {"device": "test"}, "pool_ads": options["pool"], "precision": "fp16",
                "D": 64, "k": 100, "checks_ok": True, "latency_ms": {"p50": 1.0 + len(calls), "p99": 2.0},
                "throughput": [], "targets": {}}

    monkeypatch.setattr(bs, "bench_pipeline", fake)
    result = _run("bench", "pipeline", "--ads", 4096, "--layouts", "geo,format", "--json")
    doc = json.loads(result.stdout.splitlines()[-1])
    assert calls == [("geo", 4096), ("format", 4096)]
    assert doc["layout"] == "geo" and list(doc["other_layouts"]) == ["format"]
    assert doc["other_layouts"]["format"]["latency_ms"]["p50"] == 3.0
    table = _run("bench", "pipeline", "--ads", 4096, "--layouts", "format,geo").stdout
    assert "layout format:" in table and "layout geo:" in table
    bad = _runner().invoke(main, ["bench", "pipeline", "--layouts", "geo,spiral"])
    assert bad.exit_code == 2 and "'geo,spiral': a comma-separated list of format, geo, each once" in bad.stderr


def test_bench_pipeline_passes_its_launch_modes_and_refuses_unknown_ones(monkeypatch):
    from benchmarks import score as bs

    seen = []

    def fake(*, layout, launches, **options):
        seen.append(launches)
        return {"layout": layout, "env": {"device": "test"}, "pool_ads": options["pool"], "precision": "fp16",
                "D": 64, "k": 100, "checks_ok": True, "launch": launches[0],
                "latency_ms": {"p50": 1.0, "p99": 2.0}, "throughput": [], "targets": {},
                "launch_modes": {m: {"latency_ms": {"p50": 1.5, "p99": 2.5},
                                     "throughput": [{"batch": 64, "pool_ads_per_s": 3e10}]} for m in launches}}

    monkeypatch.setattr(bs, "bench_pipeline", fake)
    table = _run("bench", "pipeline", "--ads", 4096).stdout
    assert seen == [("graph", "direct")]  # both, graph first: the engine's way is the result
    assert "latency per request (batch 1, graph)" in table and "launched direct: latency p50 1.50 ms" in table
    _run("bench", "pipeline", "--ads", 4096, "--launches", "direct")
    assert seen[-1] == ("direct",)
    bad = _runner().invoke(main, ["bench", "pipeline", "--launches", "graph,warp"])
    assert bad.exit_code == 2 and "'graph,warp': a comma-separated list of graph, direct, each once" in bad.stderr


def _refused(args, option: str, *names: str):
    """`andromeda ARGS` stops with a usage error naming `option` and each of `names`, without a traceback."""
    result = _runner().invoke(main, [str(a) for a in args])
    said = result.stderr
    assert result.exit_code not in (0, 1) and isinstance(result.exception, (SystemExit, type(None))), \
        f"andromeda {' '.join(map(str, args))}: exit {result.exit_code}, {result.exception!r}\n{said}"
    assert option in said and all(str(n) in said for n in names) and "Traceback" not in said + result.stdout, said
    return said


def _unmakeable_folders(tmp_path):
    """(why, path) pairs of --out folders that cannot be made: under a file (NotADirectoryError), and
    under /proc (FileNotFoundError: a virtual file system; root may write anywhere else)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    places = [("under a file", a_file / "corpus")]
    if Path("/proc/self").is_dir():
        places.append(("under /proc", Path("/proc/no-such-place/corpus")))
    return places


def test_an_out_folder_that_cannot_be_made_is_refused_naming_it_before_any_work(tmp_path, corpus_dir):
    ads, requests = SAMPLE / "ads.jsonl", SAMPLE / "requests.jsonl"
    for why, out in _unmakeable_folders(tmp_path):
        for command in (["generate", "--ads", 10, "--requests", 2], ["import", "--ads-file", ads, "--requests-file", requests],
                        ["export", "--data", corpus_dir]):
            said = _refused([*command, "--out", out, "--quiet"], "'--out'", out)
            assert ("is a file" if why == "under a file" else "cannot create the folder") in said, (why, said)
    with_file = tmp_path / "a-file" / "result.json"
    _refused(["bench", "cpu", "--out-file", with_file], "'--out-file'", with_file, "is a file")
    _refused(["bench", "report", SAMPLE, "--out", tmp_path / "a-file" / "docs"], "'--out'", "is a file")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write into a read-only folder")
def test_an_out_folder_under_a_read_only_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        _refused(["generate", "--ads", 10, "--requests", 2, "--out", locked / "corpus"], "'--out'", "Permission denied")
    finally:
        locked.chmod(0o700)


def test_the_out_check_leaves_nothing_behind(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    store.check_output_dir(deep)
    assert list(tmp_path.iterdir()) == []  # the folders it made to prove it can were removed
    (tmp_path / "kept").mkdir()
    store.check_output_dir(tmp_path / "kept")
    assert list((tmp_path / "kept").iterdir()) == []
    (tmp_path / "f").write_text("")
    with pytest.raises(store.StoreError, match="cannot be a folder: it is a file"):
        store.check_output_dir(tmp_path / "f")


def test_counts_out_of_range_are_refused_naming_the_option():
    _refused(["bench", "cpu", "--ads", -5], "'--ads'", "-5")
    _refused(["bench", "match", "--base-ads", 0], "'--base-ads'")
    _refused(["bench", "pipeline", "--ads", -1], "'--ads'")
    _refused(["generate", "--seed", -1, "--out", "unused"], "'--seed'", "-1")


def test_an_unknown_match_version_is_refused_before_the_corpus_loads(tmp_path):
    """`bench pipeline --match-version` names a kernel of the lab; another number is refused with the
    lab's numbers, before any corpus is read (the folder here holds none)."""
    result = _runner().invoke(main, ["bench", "pipeline", "--data", str(tmp_path), "--device", "sim",
                                     "--match-version", "99"])
    said = result.stderr
    assert result.exit_code == 1 and "no match kernel v99; the lab has [1, 2, 3" in said, said
    assert "Traceback" not in said and "meta.json" not in said


def test_every_numeric_option_has_a_range():
    """A count, size, seed or time outside what the work can take is a usage error naming the option,
    never a traceback from deep inside: every int or float option of every command is a range."""
    loose = []
    for path, cmd in _commands(main):
        for param in cmd.params:
            numeric = isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType))
            if numeric and not isinstance(param.type, (click.IntRange, click.FloatRange)):
                loose.append(f"andromeda {' '.join(path)} {param.opts[0]}")
    assert not loose, f"numeric options without a range: {loose}"


def test_commands_without_a_device_option_say_what_they_need_not_which_device_to_give():
    """bench score and bench pipeline run on a CUDA GPU only and have no --device: without one they
    say so (here the simulator is on, as in every test run), never `--device gpu: ...`."""
    for command, what in ((["bench", "score", "--ads", 1024], "the fused scoring benchmark"),
                          (["bench", "pipeline", "--ads", 4096], "the co-located pipeline benchmark")):
        result = _runner().invoke(main, [str(a) for a in command] + ["--quiet"])
        assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
        said = result.stderr
        assert f"{' '.join(command[:2])}: {what} needs a CUDA GPU" in said and "--device" not in said, said
        assert "no CPU or simulator form" in said and "cu12" in said


def test_bench_match_without_a_gpu_names_itself_once(monkeypatch):
    from andromeda_nb import devices

    monkeypatch.setattr(devices, "simulator_enabled", lambda: False)
    monkeypatch.setattr(devices, "gpu_usable", lambda: False)
    result = _runner().invoke(main, ["bench", "match", "--ads", "4096", "--quiet"])
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("Error: bench match: the GPU index runs only as CUDA kernels"), result.stderr
    assert result.stderr.count("bench match") == 1 and "--device sim" in result.stderr


def test_import_with_a_model_that_is_not_one_says_what_the_file_is(tmp_path):
    result = _runner().invoke(main, ["import", "--ads-file", str(SAMPLE / "ads.jsonl"), "--requests-file",
                                     str(SAMPLE / "requests.jsonl"), "--model", str(SAMPLE / "ads.jsonl"),
                                     "--out", str(tmp_path / "c"), "--quiet"])
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert "ads.jsonl: not a model: it is JSON text" in result.stderr and "allow_pickle" not in result.stderr
    assert not (tmp_path / "c").exists()


def test_quiet_holds_back_the_library_notices_too(monkeypatch):
    """`compare -q` printed the device fallback ("no usable CUDA GPU: --device auto runs on the CPU")
    all the same: --quiet holds back `devices.notice` for the command's run, and only for it."""
    from andromeda_nb import devices
    from andromeda_nb.progress import to_stderr
    from migration import budget

    monkeypatch.setattr(budget, "build_budget", lambda *a, **k: devices.notice("a device notice") or {})
    monkeypatch.setattr(budget, "format_budget", lambda report: "the budget")
    for args, said in ((["budget"], "a device notice\n"), (["budget", "--quiet"], ""), (["budget", "-q"], "")):
        monkeypatch.setattr(devices, "_said", set())  # each notice is said once per process
        result = _runner().invoke(main, args)
        assert result.exit_code == 0 and result.stdout == "the budget\n" and result.stderr == said, (args, result.stderr)
        assert devices.notice_sink is to_stderr, "the notices are back on after the command"


def test_health_prints_nested_fields_as_dotted_keys_not_python_dicts(monkeypatch):
    from serving import client

    answer = {"status": "ok", "ads": 190, "log": {"path": "/c/updates.log", "durable": True, "seq": [3, 4]},
              "guard": {"tls": False}, "gpu": None}
    monkeypatch.setattr(client, "health", lambda server, credentials=None: answer)
    text = _run("health", "--server", "grpc://127.0.0.1:1").stdout
    assert text.splitlines() == ["status: ok", "ads: 190", "log.path: /c/updates.log", "log.durable: true",
                                 "log.seq: [3, 4]", "guard.tls: false", "gpu: null"]
    assert "{" not in text and "True" not in text and "None" not in text
    assert json.loads(_run("health", "--server", "grpc://127.0.0.1:1", "--json").stdout) == answer
