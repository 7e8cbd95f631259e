"""serving.services: server subprocesses (announce, start failures, stop), dataset arguments,
fingerprints. The real servers are started through it in test_remote.py and test_colocated.py."""

import signal
import textwrap

import os
from pathlib import Path

import numpy as np
import pytest

from andromeda_nb.dataset import fingerprint
from serving.services import (ServedRetriever, ServiceProcess, child_args, dataset_args, load_dataset_for_service,
                              stop_all)

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

LOCATION = "grpc://127.0.0.1:45678"


@pytest.fixture()
def modules(tmp_path, monkeypatch):
    """Small server stand-ins importable by `python -m` (on PYTHONPATH, after the project)."""
    (tmp_path / "svc_announces.py").write_text(textwrap.dedent(f"""
        import time
        from serving.services import announce
        announce("stand-in", "{LOCATION}", device="cpu")
        while True:
            time.sleep(1)
    """))
    (tmp_path / "svc_ignores_term.py").write_text(textwrap.dedent(f"""
        import json, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(json.dumps({{"service": "stand-in", "location": "{LOCATION}"}}), flush=True)
        while True:
            time.sleep(1)
    """))
    (tmp_path / "svc_silent.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "svc_busy_start.py").write_text(textwrap.dedent(f"""
        import time
        from serving.services import announce
        end = time.process_time() + 3.0  # a slow start that works all along (loading, compiling)
        while time.process_time() < end:
            sum(range(1000))
        announce("stand-in", "{LOCATION}")
        while True:
            time.sleep(1)
    """))
    (tmp_path / "svc_fails.py").write_text("raise SystemExit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_start_reads_the_announced_location_and_stop_terminates(modules):
    proc = ServiceProcess("svc_announces", ["--anything"], name="stand-in")
    try:
        assert proc.location == LOCATION and proc.port == 45678
        assert proc.proc.poll() is None and proc.args == ["--anything"]
    finally:
        code = proc.stop()
    assert code == -signal.SIGTERM
    assert proc.stop() == -signal.SIGTERM  # stopping twice is harmless


def test_stop_kills_a_server_that_ignores_sigterm(modules):
    proc = ServiceProcess("svc_ignores_term", [])
    assert proc.stop(timeout_s=0.5) == -signal.SIGKILL


def test_a_server_that_exits_or_stays_silent_is_reported_by_name(modules):
    with pytest.raises(RuntimeError, match="the stand-in exited with code 3 before listening"):
        ServiceProcess("svc_fails", [], name="the stand-in")
    with pytest.raises(RuntimeError, match="svc_silent made no progress \\(used no CPU time\\) within 2 s"):
        ServiceProcess("svc_silent", [], start_timeout_s=2.0)


def test_a_start_is_judged_by_its_progress_not_by_a_fixed_time(modules):
    """A service that works for longer than the stall limit before it listens is waited for."""
    proc = ServiceProcess("svc_busy_start", [], start_timeout_s=1.5)
    try:
        assert proc.location == LOCATION
    finally:
        proc.stop()


def test_dataset_args_directory_or_a_saved_corpus_never_a_pickle(tmp_path):
    from tests.support.servers import small_dataset

    args, tmp = dataset_args({"any": "dataset"}, tmp_path)
    assert args == ["--data", str(tmp_path)] and tmp is None
    dataset = small_dataset(3, n_ads=20, n_requests=2)
    args, tmp = dataset_args(dataset, None, prefix="andromeda-test-")
    try:
        assert args[0] == "--data" and "andromeda-test-" in args[1]
        assert not [p for p in Path(tmp.name).rglob("*") if p.suffix in (".pkl", ".pickle")]
        loaded = load_dataset_for_service(args[1])  # the server's side: the corpus formats only
        assert loaded.ad_ids.tolist() == dataset.ad_ids.tolist()
    finally:
        tmp.cleanup()
    with pytest.raises(ValueError, match="--data DIR"):
        load_dataset_for_service()
    assert child_args() == ["--parent-pid", str(os.getpid()), "--log", "off"]


def test_no_pickle_anywhere():
    """Nothing the project reads can run code: no module imports pickle (multiprocessing's own
    transport between the project's processes aside)."""
    import ast

    root = Path(__file__).resolve().parents[2]
    found = []
    for path in [root / "cli.py", *[p for top in ("andromeda_nb", "cpu_baseline", "gpu", "migration", "scripts")
                                    for p in (root / top).rglob("*.py")]]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(root)}:{node.lineno}" for n in names if n.split(".")[0] in ("pickle", "dill")]
    assert not found, found


def test_fingerprint_depends_on_ids_and_their_order():
    ids = np.array([5, 9, 2], np.int64)
    assert fingerprint(ids) == fingerprint(ids.astype(np.int32).tolist())
    assert fingerprint(ids) != fingerprint(ids[::-1]) and fingerprint(ids) != fingerprint(ids[:2])


def test_traffic_needs_relays():
    class NoRelays(ServedRetriever):
        relays: dict = {}

    with pytest.raises(RuntimeError, match="traffic needs relays"):
        NoRelays().retrieve_traffic([], 1)


def test_stop_all_stops_the_last_started_first_and_cleans_up(tmp_path):
    events = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def stop(self):
            events.append(("stop", self.name))

        def close(self):
            events.append(("close", self.name))

    class Tmp:
        def cleanup(self):
            events.append(("cleanup", None))

    stop_all([Stub("scorer"), Stub("index host")], {"hop": Stub("relay")}, Tmp())
    assert events == [("stop", "index host"), ("stop", "scorer"), ("close", "relay"), ("cleanup", None)]
    stop_all()  # nothing started: nothing to do
