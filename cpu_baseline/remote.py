"""`RemoteRetriever` (`--arch remote`): the remote-scoring architecture as real processes on loopback.

`build(dataset)` starts the scoring service and the index host as subprocesses on 127.0.0.1 (free
ports), or connects to running ones (`scorer=`, `host=` addresses). With `traffic=True` a counting
relay (`andromeda_nb.relay`) sits in front of each server it starts, so `retrieve_traffic` reports
the real bytes per request on both hops: client -> index host, and index host -> scoring service.

Updates go to the index host (`DoAction("update")`), which checks them, applies them and forwards
the accepted ones to the scoring service: both hold the same live ads afterwards.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow.flight as flight

from andromeda_nb.flight import flight_action, location_of, retrieve_over_flight, wait_until_healthy
from andromeda_nb.relay import Relay, Traffic
from andromeda_nb.types import Request, Update

START_TIMEOUT_S = 120.0  # a cold start compiles the numba kernels once
STOP_TIMEOUT_S = 10.0
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class ServiceProcess:
    """One server subprocess (`python -m cpu_baseline.serve ...`) and the location it announced."""

    def __init__(self, args: list[str], *, start_timeout_s: float = START_TIMEOUT_S):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", "cpu_baseline.serve", *args], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, env=env, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=start_timeout_s)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"{args[0]} did not start within {start_timeout_s:.0f} s") from None
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"{args[0]} exited with code {code} before listening (see its stderr)")
        self.location = json.loads(line)["location"]

    @property
    def port(self) -> int:
        return int(self.location.rsplit(":", 1)[1])

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode


def _check_same_corpus(location: str, dataset, data_dir) -> None:
    """The index host loaded `data_dir`: it must hold the dataset's ads, row for row."""
    from .scoring_service import fingerprint

    got = flight_action(location, "health").get("fingerprint")
    if got != fingerprint(dataset.ad_ids):
        raise RuntimeError(f"the services loaded {data_dir}, whose ads differ from the dataset's "
                           f"(fingerprint {got}, expected {fingerprint(dataset.ad_ids)})")


class RemoteRetriever:
    """interfaces.Retriever over the index host's `["retrieve"]` exchange."""

    def __init__(self, location: str, *, processes=(), relays: dict[str, Relay] | None = None,
                 tmpdir: tempfile.TemporaryDirectory | None = None, timeout_s: float = 60.0):
        self.location = location
        self.processes = list(processes)
        self.relays = relays or {}
        self._tmpdir = tmpdir
        self.timeout_s = timeout_s
        self.client = flight.connect(location)

    @classmethod
    def build(cls, dataset=None, device=None, scorer: str | None = None, host: str | None = None, *,
              traffic: bool = False, data_dir: str | None = None, scorer_timeout_s: float = 10.0,
              threads: int | None = None, start_timeout_s: float = START_TIMEOUT_S, **options) -> "RemoteRetriever":
        """Start (or connect to) the scoring service and the index host. `device` is accepted for
        interface symmetry and ignored: this architecture runs on the CPU. The services load the
        corpus directory `data_dir`, or the one `dataset` was read from (`dataset.source_dir`: the
        fast load, nothing parsed), and are checked to hold the dataset's ads; a dataset made in
        memory travels to them as a pickle."""
        processes: list[ServiceProcess] = []
        relays: dict[str, Relay] = {}
        tmp = None
        if data_dir is None and dataset is not None:
            data_dir = getattr(dataset, "source_dir", None)
        try:
            if host is None:
                if data_dir:
                    source = ["--data", str(data_dir)]
                else:
                    tmp = tempfile.TemporaryDirectory(prefix="andromeda-remote-")
                    path = Path(tmp.name) / "dataset.pkl"
                    with open(path, "wb") as f:
                        pickle.dump(dataset, f, protocol=pickle.HIGHEST_PROTOCOL)
                    source = ["--dataset-pickle", str(path)]
                extra = ["--threads", str(threads)] if threads else []
                if scorer is None:
                    proc = ServiceProcess(["scorer", *source, *extra], start_timeout_s=start_timeout_s)
                    processes.append(proc)
                    scorer = proc.location
                scorer_address = location_of(scorer)
                if traffic:
                    h, p = scorer_address.split("://", 1)[1].rsplit(":", 1)
                    relays["index host->scorer"] = Relay(h, int(p)).start()
                    scorer_address = relays["index host->scorer"].location
                proc = ServiceProcess(["remote", *source, *extra, "--scorer", scorer_address,
                                       "--scorer-timeout", str(scorer_timeout_s)], start_timeout_s=start_timeout_s)
                processes.append(proc)
                host = proc.location
            location = location_of(host)
            wait_until_healthy(location, timeout=30.0)
            if processes and data_dir and dataset is not None:
                _check_same_corpus(location, dataset, data_dir)
            if traffic:
                h, p = location.split("://", 1)[1].rsplit(":", 1)
                relays["client->index host"] = Relay(h, int(p)).start()
                location = relays["client->index host"].location
            hops = ("client->index host", "index host->scorer")  # in the order a request travels
            relays = {hop: relays[hop] for hop in hops if hop in relays}
            return cls(location, processes=processes, relays=relays, tmpdir=tmp)
        except BaseException:
            for proc in reversed(processes):
                proc.stop()
            for relay in relays.values():
                relay.close()
            if tmp is not None:
                tmp.cleanup()
            raise

    # --- retrieval ---------------------------------------------------------------------------------
    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return retrieve_over_flight(self.location, requests, k, timeout=self.timeout_s, client=self.client)

    def retrieve_traffic(self, requests: Sequence[Request], k: int) -> tuple[list, list[dict]]:
        """Answers plus, per request, the bytes each relayed hop carried for it (one request per
        exchange, counters read after the relay has gone quiet)."""
        if not self.relays:
            raise RuntimeError("traffic needs relays: build(..., traffic=True)")
        answers, per_request = [], []
        for request in requests:
            before = {hop: relay.snapshot() for hop, relay in self.relays.items()}
            answers.extend(self.retrieve([request], k))
            for relay in self.relays.values():
                relay.wait_idle()
            per_request.append({hop: (relay.snapshot() - before[hop]).to_json() for hop, relay in self.relays.items()})
        return answers, per_request

    def traffic(self) -> dict[str, Traffic]:
        return {hop: relay.snapshot() for hop, relay in self.relays.items()}

    # --- updates -----------------------------------------------------------------------------------
    def apply(self, update: Update) -> None:
        from andromeda_nb.testing import update_to_json

        ack = self.apply_lines([json.dumps(update_to_json(update))])
        if ack["rejected"]:
            raise ValueError(f"update rejected by the index host: {ack['rejected'][0]}")

    def apply_lines(self, lines: Sequence[str]) -> dict:
        """Send JSON Lines updates; returns the index host's acknowledgement
        `{"applied": n, "rejected": [{"line", "ad_id", "error"}, ...]}`."""
        return flight_action(self.location, "update", "\n".join(lines), timeout=self.timeout_s, client=self.client)

    def action(self, name: str) -> dict:
        return flight_action(self.location, name, timeout=self.timeout_s, client=self.client)

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass
        for proc in reversed(self.processes):  # the index host first, then the scorer
            proc.stop()
        self.processes = []
        for relay in self.relays.values():
            relay.close()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> "RemoteRetriever":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RemoteRetriever", "ServiceProcess"]
