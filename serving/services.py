"""Server processes and the client plumbing both architectures' retrievers share.

* `ServiceProcess`: one server started as `python -m MODULE ARGS...` (`cpu_baseline.remote_servers`,
  `migration.colocated_server`) with the project on `PYTHONPATH` and without the CUDA simulator switch in its
  environment (a server that needs a device is given it as an argument). A server announces itself
  with one JSON line on stdout once it listens (`announce`: `{"service": ..., "location":
  "grpc://HOST:PORT", ...}`), so a parent that asked for port 0 learns the port. `stop()` sends
  SIGTERM, waits, then kills.
* `DEFAULT_PORTS`, `banner`: what a server a person starts (`andromeda serve`) listens on and says on
  stderr (a taken port is refused before the corpus loads: `serving.process.preflight`).
* `dataset_args`: how a started server gets the corpus: the directory it was read from, or an
  in-memory dataset saved as a corpus directory in a temporary directory (never a pickle: a server
  reads only the corpus formats, which carry no code); `open_corpus` is the server's side of it,
  with the corpus's update log (`serving.wal`) when the server keeps one.
* `check_same_corpus`: by `andromeda_nb.dataset.fingerprint`, a hash of the ad id in each row, so a
  started server (or another service) can be checked to hold the dataset's ads, row for row.
* `relay_in_front`: a counting relay (`serving.relay`) that forwards to a server, for real
  bytes on the wire; `stop_all` stops started processes, closes relays, removes a temporary directory.
* `ServedRetriever`: the client half of a retriever answered by a server over Flight
  (`cpu_baseline.remote.RemoteRetriever`, `migration.colocated.ColocatedRetriever` when served): retrieve,
  traffic per hop, updates, actions, release.
"""

from __future__ import annotations

import json
import os
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

from andromeda_nb.devices import child_environment

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HOST = "127.0.0.1"  # servers listen on loopback unless told otherwise
# the port each service listens on when a person starts it (`andromeda serve`); --port 0 asks for a free
# one, and servers a command starts for itself always take a free one (docs/PROTOCOL.md)
DEFAULT_PORTS = {"colocated": 8815, "remote": 8816, "scorer": 8817, "cluster": 8818}
SERVICE_NAMES = {"colocated": "the co-located server (match, fused scoring and top-K in one process)",
                 "remote": "the remote-scoring index host (CPU match here, scoring on the scoring service)",
                 "scorer": "the scoring service (scores candidate lists for the index host)",
                 "cluster": "the front of co-located shards on Ray (fan-out to every shard, exact merge)"}
START_TIMEOUT_S = 120.0  # seconds a starting service may use no CPU time (a cold start compiles kernels)
STOP_TIMEOUT_S = 10.0


def announce(service: str, location: str, out=None, **extra) -> None:
    """The line a server writes to stdout once it listens; `ServiceProcess` reads it."""
    print(json.dumps({"service": service, "location": location, **extra}), file=out or sys.stdout, flush=True)


def banner(service: str, location: str, serving: str) -> str:
    """What a person starting a server reads on stderr: what is served, where, how to ask it, how to
    stop it (the machine line, `announce`, goes to stdout)."""
    lines = [f"serving {SERVICE_NAMES.get(service, service)}", f"  holds    {serving}", f"  at       {location}"]
    if service == "scorer":
        lines.append(f"  used by  andromeda serve remote --data DIR --scorer {location}")
    else:
        lines += [f"  ask it   andromeda query --server {location} --requests-file REQUESTS.jsonl --k 10",
                  "           or from Python with pyarrow.flight (README, \"Asking a server\")"]
    lines += [f"  health   andromeda health --server {location}", "  stop it  Ctrl-C or SIGTERM"]
    return "\n".join(lines)


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # from the state on: fields[1] is the parent's pid


def descendants(pid: int) -> list[int]:
    """The live processes started by `pid`, and by them, and so on (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry))[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cpu_seconds(pid: int, started: bool = True) -> float | None:
    """User + system CPU seconds process `pid` and (`started`) the processes it started (a co-located
    server's engine workers) have used (Linux /proc), or None where unknown."""
    try:
        fields = _stat_fields(pid)
        ticks = int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None
    try:
        children = descendants(pid) if started else []
    except OSError:
        children = []
    for child in children:
        try:
            fields = _stat_fields(child)
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    return ticks / os.sysconf("SC_CLK_TCK")


class ServiceProcess:
    """`python -m module *args` as a subprocess; `location` is what it announced. `name` says which
    server it is in errors; `env`: further environment variables (tokens travel there, not in the
    arguments every user of the machine can list); `root`: the checkout of the project whose server
    runs (this one by default; a benchmark compares another commit's server with this one's)."""

    def __init__(self, module: str, args: Sequence[str], *, name: str | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, env: dict | None = None, root=None):
        env = {**child_environment(), **(env or {})}  # no simulator switch: a server is told its device
        root = PROJECT_ROOT if root is None else Path(root)
        paths = [str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env["PYTHONPATH"] = os.pathsep.join(paths)  # the project first, whatever the caller's directory
        self.module = module
        self.args = list(args)
        self.name = name or module
        # `python -m` looks in its working directory first: another checkout's server starts in that checkout
        self.proc = subprocess.Popen([sys.executable, "-m", module, *self.args], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, env=env, text=True,
                                     cwd=None if root == PROJECT_ROOT else str(root))
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        line = self._wait_for_announcement(lines, start_timeout_s)
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"{self.name} exited with code {code} before listening (see its stderr)")
        self.announced = json.loads(line)  # the whole line: location, and what else the server said
        self.location = self.announced["location"]

    def _wait_for_announcement(self, lines: queue.Queue, stall_s: float) -> str:
        """The server's first stdout line. A start is judged by its progress, not by a fixed time: a
        busy machine may take minutes to load and compile, so the wait goes on while the process
        uses CPU time (Linux: /proc/PID/stat) and ends with an error after `stall_s` seconds in which
        it used none. Where the process's CPU time cannot be read, `stall_s` bounds the whole start."""
        last_cpu, last_progress = _cpu_seconds(self.proc.pid), time.monotonic()
        while True:
            try:
                return lines.get(timeout=1.0)
            except queue.Empty:
                pass
            if self.proc.poll() is not None:
                try:
                    return lines.get(timeout=5.0)
                except queue.Empty:
                    return ""
            cpu = _cpu_seconds(self.proc.pid)
            if cpu is not None and last_cpu is not None and cpu > last_cpu + 0.05:
                last_cpu, last_progress = cpu, time.monotonic()
            if time.monotonic() - last_progress > stall_s:
                self.stop()
                what = "made no progress (used no CPU time)" if cpu is not None else "did not start"
                raise RuntimeError(f"{self.name} {what} within {stall_s:.0f} s")

    @property
    def port(self) -> int:
        return int(self.location.rsplit(":", 1)[1])

    def cpu_seconds(self, started: bool = True) -> float | None:
        """User + system CPU seconds the process and (`started`) the processes it started have used so
        far (Linux /proc; None where unknown)."""
        return _cpu_seconds(self.proc.pid, started)

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


def dataset_args(dataset, data_dir=None, *, prefix: str = "andromeda-"
                 ) -> tuple[list[str], tempfile.TemporaryDirectory | None]:
    """Server arguments that load the corpus: `--data DIR` when there is a directory, else
    `--data TMP/corpus` with the dataset saved there (`andromeda_nb.store.save_dataset`) in a new
    temporary directory, returned for the caller to clean up (None otherwise)."""
    if data_dir is not None:
        return ["--data", str(data_dir)], None
    from andromeda_nb.store import save_dataset

    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    try:
        path = save_dataset(dataset, Path(tmp.name) / "corpus", source={"kind": "saved for a service"})
    except BaseException:
        tmp.cleanup()
        raise
    return ["--data", str(path)], tmp


def child_args(log: str = "off") -> list[str]:
    """Arguments every server started for one command gets: it ends with this process
    (`--parent-pid`), and keeps its updates where the command says (`--log`; off by default: a
    command's own servers never write into the corpus directory it reads)."""
    return ["--parent-pid", str(os.getpid()), "--log", log]


def load_dataset_for_service(data: str | None = None):
    """A server's corpus: a `Dataset` from a corpus directory (`andromeda_nb.store`)."""
    if not data:
        raise ValueError("give a corpus directory (--data DIR)")
    from andromeda_nb.store import load_dataset

    return load_dataset(data)


def open_corpus(data, log: str | None = None, say=None):
    """A server's corpus and its update log: (dataset, WriteAheadLog or None).

    `log`: None for the default, `DIR/updates.log`; "off" for none (updates in memory only); else a
    path. The corpus's writer lock (`serving.wal.CorpusLock`: one server writes a corpus, whatever
    its --log) and the log's lock are taken first, so that a second server on the same corpus or
    log is refused before it loads anything; then an interrupted compaction is finished
    (`serving.compaction.recover`), the snapshot loaded and the log opened (its torn tail cut, its
    records kept for replay). Both locks are released when the log is closed. `say`
    (`andromeda_nb.progress.Say`): told each step of the corpus's loading as it ends."""
    if not data:
        raise ValueError("give a corpus directory (--data DIR)")
    from andromeda_nb.store import load_dataset

    if log == "off":
        return load_dataset(data, say=say), None
    from .compaction import recover
    from .wal import LOG_FILE, CorpusLock, LogLock, WriteAheadLog, corpus_lineage, snapshot_seq

    path = Path(data) / LOG_FILE if log is None else Path(log)
    writer = CorpusLock(data).acquire(log=path.resolve())
    lock = None
    try:
        lock = LogLock(path).acquire()
        recover(data)
        dataset = load_dataset(data, say=say)
        wal = WriteAheadLog.open(path, lineage=corpus_lineage(dataset), snapshot_seq=snapshot_seq(dataset), lock=lock)
    except BaseException:
        if lock is not None:
            lock.release()
        writer.release()
        raise
    wal.hold(writer)
    return dataset, wal


def check_same_corpus(location: str, dataset, data_dir, who: str, credentials=None) -> None:
    """The server at `location` (`who`, for the error) loaded `data_dir`: its `health` fingerprint
    must be the dataset's."""
    from andromeda_nb.dataset import fingerprint

    from .protocol import flight_action

    got = flight_action(location, "health", credentials=credentials).get("fingerprint")
    if got != fingerprint(dataset.ad_ids):
        raise RuntimeError(f"{who} loaded {data_dir}, whose ads differ from the dataset's "
                           f"(fingerprint {got}, expected {fingerprint(dataset.ad_ids)})")


def relay_in_front(location: str, link=None):
    """A started counting `Relay` to the server at `location` (`grpc://HOST:PORT`); with a shaped
    `relay.Link`, delaying the bytes as that network would."""
    from .relay import Link, Relay

    host, port = location.split("://", 1)[1].rsplit(":", 1)
    return Relay(host, int(port), link=link or Link()).start()


def start_side_by_side(starters, close=lambda started: started.close()) -> list:
    """Call every starter at once, on threads (each starts services that load a corpus: minutes at 10M
    ads); what they started, in order. If one fails, what the others started is closed (`close`) and
    its error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(starters))) as pool:
        futures = [pool.submit(start) for start in starters]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                close(f.result())
        raise failed[0]
    return [f.result() for f in futures]


def stop_all(processes: Sequence[ServiceProcess] = (), relays: dict | None = None,
             tmpdir: tempfile.TemporaryDirectory | None = None) -> None:
    """Stop the processes (the last started first: a front server before the one it calls), close
    the relays, remove the temporary directory."""
    for proc in reversed(list(processes)):
        proc.stop()
    for relay in (relays or {}).values():
        relay.close()
    if tmpdir is not None:
        tmpdir.cleanup()


class ServedRetriever:
    """The client half of a retriever whose answers come from a server's `["retrieve"]` exchange.
    The class sets `location`, `client` (a `pyarrow.flight` client of it), `timeout_s`, `relays`
    ({hop: Relay}, in the order a request travels), and `server_name` (for errors)."""

    server_name = "the server"
    location: str
    client: object
    timeout_s: float
    relays: dict

    def retrieve(self, requests: Sequence, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        from .protocol import retrieve_over_flight

        return retrieve_over_flight(self.location, requests, k, timeout=self.timeout_s, client=self.client)

    def services(self) -> dict:
        """{role: ServiceProcess} of the services this retriever started (none when it joined running
        ones): what `cpu_seconds` reads."""
        return {}

    def cpu_seconds(self) -> dict[str, float | None]:
        """User + system CPU seconds each started service has used so far, by role (Linux /proc;
        None where unknown)."""
        return {role: proc.cpu_seconds() for role, proc in self.services().items()}

    def device_seconds(self) -> dict[str, float | None]:
        """Device seconds each started service has spent in its GPU launches so far, by role, from its
        `stats` (None: a CPU service, the simulator, or no answer)."""
        from .protocol import flight_action

        out = {}
        for role, proc in self.services().items():
            try:
                stats = flight_action(proc.location, "stats", timeout=self.timeout_s,
                                      credentials=getattr(self, "credentials", None))
            except Exception:  # a service that cannot say has no figure, and the run goes on
                stats = None
            out[role] = (stats or {}).get("device_seconds")
        return out

    def retrieve_traffic(self, requests: Sequence, k: int) -> tuple[list, list[dict]]:
        """Answers plus, per request, the bytes each relayed hop carried for it (one request per
        exchange, counters read after the relays have gone quiet)."""
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

    def traffic(self) -> dict:
        """Bytes so far per hop (`serving.relay.Traffic`)."""
        return {hop: relay.snapshot() for hop, relay in self.relays.items()}

    def apply(self, update) -> None:
        """Send one update; a rejection raises ValueError with the server's reason."""
        from andromeda_nb.updates import update_to_json

        ack = self.apply_lines([json.dumps(update_to_json(update))])
        if ack["rejected"]:
            raise ValueError(f"update rejected by {self.server_name}: {ack['rejected'][0]}")

    def apply_lines(self, lines: Sequence[str]) -> dict:
        """Send JSON Lines updates, streamed (`serving.protocol.send_update_stream`); returns the
        server's acknowledgement `{"applied": n, "rejected": [{"line", "ad_id", "error"}, ...]}`."""
        from .protocol import send_update_stream

        return send_update_stream(self.client, "\n".join(lines), timeout=self.timeout_s)

    def action(self, name: str, body: bytes | str = b"") -> dict:
        from .protocol import flight_action

        return flight_action(self.location, name, body, timeout=self.timeout_s, client=self.client)

    def close_client(self) -> None:
        """Close the Flight client (a server already gone is no error)."""
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "DEFAULT_HOST", "DEFAULT_PORTS", "PROJECT_ROOT", "SERVICE_NAMES", "banner",
    "START_TIMEOUT_S", "STOP_TIMEOUT_S", "ServedRetriever", "ServiceProcess", "announce", "check_same_corpus",
    "child_args", "dataset_args", "descendants", "load_dataset_for_service", "open_corpus", "relay_in_front",
    "start_side_by_side", "stop_all",
]
