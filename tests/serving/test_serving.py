"""Serving a person can use: `andromeda serve` on a fixed default port with a banner on stderr beside
the machine line on stdout, `andromeda query` and `andromeda health` as its client (answers from
each architecture, printed as `retrieve` prints them), and README's pyarrow.flight example run as
written. Every server here is started on 127.0.0.1 with --port 0 and stopped by the test."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from andromeda_nb import store
from andromeda_nb.compare import compare_topk
from andromeda_nb.devices import child_environment
from andromeda_nb.reference import ReferenceRetriever
from serving.services import DEFAULT_PORTS
from tests.support.cli import run_cli as _run

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"
K = 7


class Served:
    """`andromeda serve ARGS --port 0` as a subprocess: its announced line, its stderr so far."""

    def __init__(self, *args):
        env = child_environment()
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", *map(str, args), "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True, env=env, cwd=ROOT)
        self.err: list[str] = []
        reader = threading.Thread(target=lambda: self.err.extend(iter(self.proc.stderr.readline, "")), daemon=True)
        reader.start()
        line = self._first_line(timeout=180)
        assert line, f"andromeda serve {' '.join(map(str, args))} did not start: {''.join(self.err)}"
        self.announced = json.loads(line)
        self.location = self.announced["location"]

    def _first_line(self, timeout: float) -> str:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return box[0] if box else ""

    def stderr_text(self, until: str | None = None, timeout: float = 10.0) -> str:
        """stderr so far; with `until`, once it holds that text (or after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while until is not None and until not in "".join(self.err) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "".join(self.err)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving") / "corpus"
    _run("import", "--ads-file", SAMPLE / "ads.jsonl", "--requests-file", SAMPLE / "requests.jsonl", "--seed", 7,
         "--out", out, "--quiet")
    return out


@pytest.fixture(scope="module")
def servers(corpus_dir):
    """Both architectures served from the corpus: the co-located server (on the CPU) and the index host
    in front of its scoring service. One corpus has one writer: the index host keeps the corpus's
    log, and the co-located server beside it on the same corpus keeps its updates in memory."""
    started = []
    try:
        colocated = Served("colocated", "--data", corpus_dir, "--device", "cpu", "--log", "off")
        started.append(colocated)
        scorer = Served("scorer", "--data", corpus_dir, "--quiet")
        started.append(scorer)
        remote = Served("remote", "--data", corpus_dir, "--scorer", scorer.location)
        started.append(remote)
        yield {"colocated": colocated, "remote": remote, "scorer": scorer}
    finally:
        for server in reversed(started):
            assert server.stop() == 0, "SIGTERM stops a server cleanly"


@pytest.fixture(scope="module")
def reference(corpus_dir):
    dataset = store.load_dataset(corpus_dir)
    answers = ReferenceRetriever.build(dataset).retrieve(dataset.requests, K)
    return dataset, {int(r.request_id): a for r, a in zip(dataset.requests, answers)}


def test_the_default_ports_are_fixed_and_documented():
    assert DEFAULT_PORTS == {"colocated": 8815, "remote": 8816, "scorer": 8817, "cluster": 8818}
    readme, protocol = (ROOT / "README.md").read_text(), (ROOT / "docs" / "PROTOCOL.md").read_text()
    for service, port in DEFAULT_PORTS.items():
        assert f"[default: {port};" in _run("serve", service, "--help").stdout.replace("\n", " ").replace("  ", " ")
        assert str(port) in readme and f"| {port} |" in protocol, (service, port)


def test_a_banner_on_stderr_beside_the_machine_line(servers):
    colocated = servers["colocated"]
    assert colocated.announced == {"service": "colocated", "location": colocated.location, "device": "cpu"}
    assert re.fullmatch(r"grpc://127\.0\.0\.1:\d+", colocated.location)
    text = colocated.stderr_text(until="stop it")
    assert "serving the co-located server" in text and f"at       {colocated.location}" in text
    assert f"andromeda query --server {colocated.location} --requests" in text
    assert f"andromeda health --server {colocated.location}" in text and "stop it" in text
    assert "190 ads of" in text, "what it holds"
    assert "serving the remote-scoring index host" in servers["remote"].stderr_text(until="stop it")
    assert "serving" not in servers["scorer"].stderr_text(until="stop it", timeout=1), "--quiet leaves it out"


@pytest.mark.parametrize("arch", ["colocated", "remote"])
def test_query_gets_the_answers_of_each_served_architecture(servers, reference, corpus_dir, arch):
    dataset, want = reference
    location = servers[arch].location
    lines = _run("query", "--server", location, "--requests-file", SAMPLE / "requests.jsonl", "--k", K, "--json",
                 "--quiet").stdout.splitlines()
    assert [json.loads(x)["request_id"] for x in lines] == [int(r.request_id) for r in dataset.requests]
    for line in lines:
        got = json.loads(line)
        assert set(got) == {"request_id", "ads", "scores"}, "the JSON Lines of `retrieve`"
        ids, scores = want[got["request_id"]]
        verdict = compare_topk(ids, scores, got["ads"], got["scores"], K)
        assert verdict.ok, f"{arch}, request {got['request_id']}: {verdict.message}"
    table = _run("query", "--server", location, "--data", corpus_dir, "--k", K, "--quiet").stdout
    retrieve = _run("retrieve", "--data", corpus_dir, "--k", K, "--quiet").stdout
    assert table.splitlines()[0] == retrieve.splitlines()[0] and len(table.splitlines()) == len(retrieve.splitlines())


def test_query_reports_each_refused_request_and_answers_the_others(servers, tmp_path):
    good = [json.loads(x) for x in (SAMPLE / "requests.jsonl").read_text().splitlines()[:3]]
    bad_age = dict(good[1], request_id=99, user=dict(good[1]["user"], age="old"))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([json.dumps(good[0]), json.dumps(bad_age), "{not json", json.dumps(good[2]),
                               json.dumps(good[0])]) + "\n")
    result = _run("query", "--server", servers["colocated"].location, "--requests-file", path, "--k", 3, "--json")
    assert [json.loads(x)["request_id"] for x in result.stdout.splitlines()] == [good[0]["request_id"],
                                                                                 good[2]["request_id"]]
    assert "request 99: user.age" in result.stderr
    assert "line 3: not valid JSON" in result.stderr and "line 5: request 1: request_id: repeats" in result.stderr
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text(json.dumps(bad_age) + "\n")
    failed = _run("query", "--server", servers["colocated"].location, "--requests-file", only_bad, "--quiet", code=1)
    assert "no request of" in failed.stderr and "Traceback" not in failed.stderr


def test_health_of_each_server(servers):
    for name, server in servers.items():
        answer = json.loads(_run("health", "--server", server.location, "--json").stdout)
        assert answer["status"] == "ok", (name, answer)
    text = _run("health", "--server", servers["colocated"].location).stdout
    assert "status: ok" in text and "device: cpu" in text


def test_the_client_says_when_no_server_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    for command in (["health"], ["query", "--requests-file", SAMPLE / "requests.jsonl"]):
        result = _run(*command, "--server", f"grpc://127.0.0.1:{port}", "--quiet", code=1)
        assert "no server answers at" in result.stderr and "Traceback" not in result.stderr


def test_a_port_in_use_is_refused_before_the_corpus_loads(corpus_dir):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = _run("serve", "colocated", "--data", corpus_dir, "--device", "cpu", "--port", port, code=1)
    assert f"port {port} on 127.0.0.1 is not free" in result.stderr and "--port 0" in result.stderr
    assert "loading" not in result.stderr


def _readme_python_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Asking a server"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n\n", section.index("```python"))]


def test_the_readme_python_example_runs_as_written(servers):
    from serving.protocol import retrieve_over_flight

    code = _readme_python_example()
    assert 12 <= len([x for x in code.splitlines() if x.strip()]) <= 22, "about fifteen lines"
    assert 'flight.connect("grpc://127.0.0.1:8815")' in code, "the example asks the default port"
    location = servers["colocated"].location
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(code.replace("grpc://127.0.0.1:8815", location), "README.md", "exec"), {})
    printed = out.getvalue().splitlines()
    assert ast.literal_eval(printed[0])["status"] == "ok"  # the dict it printed
    rows = [eval(x) for x in printed[1:]]  # the dicts it printed
    request = re.search(r"request = (\{.*?\n.*?\})\n", code, re.S).group(1)
    ids, scores = retrieve_over_flight(location, [{"request_id": 1, **eval(request)}], 10)[0]
    assert [r["ad_id"] for r in rows] == ids.tolist() and len(rows) > 0
    assert [r["score"] for r in rows] == scores.tolist()
