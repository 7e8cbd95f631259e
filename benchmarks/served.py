"""`andromeda bench served`: the served path against the in-process batch. Many plain Flight clients,
one request at a time, against a co-located server started as a process on loopback; the target is
32 concurrent clients served at least 70% of the in-process batch's rate.

0. The in-process engine's answers to the corpus's requests are checked against the float64
   reference (eligibility by the CPU inverted index, itself tested against the oracle) on `checks`
   of them before anything is timed; a target counts only with that check passed.

1. In process: the engine of `--device` over the corpus answers the corpus's requests in batches of
   `--batch` (the median of `--repeat` passes): requests per second; and in batches of `--clients`,
   the largest batch clients with one request each in flight can form.
2. Served: `serve colocated` (same device, `--batch-wait-ms`) as a process; `--clients` threads over
   `--client-processes` processes (`benchmarks.clients`), each its own pyarrow.flight client, send one
   request at a time for `--seconds`, each in its own exchange or as the next batch of an exchange
   the client keeps open (`--exchange call,stream` runs both, each against a fresh server), as JSON
   or columnar request batches (`--request-format json,columns`), with the server decoding a stage
   ahead of the engine or between batches (`--decode-ahead on,off`), with one engine in the server's
   process or several engine worker processes behind one front (`--engines 1,2,4`):
   requests per second, latency p50/p99, the server's batching counters (how many engine batches the
   calls shared), where a batch's time went, and the server's CPU time a request (all its processes,
   and its front's alone). Every answer of the first pass is checked against
   the in-process engine's. The target reads the better way of sending.
3. Then, against the same server, one client alone for half as long: its idle latency. The second
   target reads p99 of a client while the others load the server (the loaded run's p99: every
   client there is one among the others) over its p99 alone: at most 3x.

    andromeda bench served --data DIR --device gpu --out served.json
    python3 -m benchmarks.served --data DIR ...         (the same, with every option of the probes)
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from andromeda_nb.measure import log, software
from andromeda_nb.provenance import script_command, write_result
from serving import protocol as fl
from serving.services import ServiceProcess

CHECKS = 16  # requests of the corpus whose in-process answers are checked against the reference
VIAS = ("front", "workers")  # what the clients reach: the server's front, or its engine workers' own endpoints


def in_process(dataset, device: str, k: int, batches: list[int], repeat: int, layout: str | None = None):
    """The engine's answers to every request, and its requests/s in batches of each size in `batches`
    (the passes alternate between the sizes, so a drift of the machine touches each alike)."""
    from migration.architectures import build_engine

    engine = build_engine(dataset, device, layout=layout)
    try:
        requests = dataset.requests
        want = engine.retrieve(requests, k)
        passes: dict[int, list[float]] = {b: [] for b in batches}
        for _ in range(repeat):
            for batch in batches:
                t = time.perf_counter()
                for lo in range(0, len(requests), batch):
                    engine.retrieve(requests[lo : lo + batch], k)
                passes[batch].append(len(requests) / (time.perf_counter() - t))
        return want, [{"requests_per_s": statistics.median(p), "min": min(p), "max": max(p), "batch": b,
                       "device": engine.device} for b, p in passes.items()]
    finally:
        engine.close()


def check_against_reference(dataset, want, k: int, n: int = CHECKS) -> dict:
    """The in-process answers `want` of the first `n` requests against the float64 reference retriever
    (eligibility by the CPU inverted index): {"requests", "ok", "failures"} (the first few messages)."""
    from andromeda_nb.compare import compare_topk
    from andromeda_nb.reference import ReferenceRetriever
    from cpu_baseline.index import CpuTargetingIndex

    reference = ReferenceRetriever.build(dataset, matcher=CpuTargetingIndex)
    failures = []
    for request, (ids, scores) in zip(dataset.requests[:n], want[:n]):
        ref_ids, result = reference.score_eligible(request)
        verdict = compare_topk(ref_ids, result, ids, scores, k)
        if not verdict.ok:
            failures.append(f"request {request.request_id}: {verdict.message}")
    return {"requests": min(n, len(want)), "ok": not failures, "failures": failures[:5]}


def cluster_specs(spec: str) -> list[tuple[int, int]]:
    """`--cluster 1x4,2x2`: (shards, replicas) pairs; ValueError naming the entry that is not one."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.lower().split("x")
        try:
            shards, replicas = (int(p) for p in parts)
        except ValueError:
            shards = replicas = 0
        if shards < 1 or replicas < 1:
            raise ValueError(f"--cluster {entry!r}: expected SHARDSxREPLICAS, e.g. 1x4")
        out.append((shards, replicas))
    return out


def server_cpus(spec: str | None) -> list[int] | None:
    """`--server-cpus`: a count N (the first N CPUs this process may use) or a comma-separated list."""
    if not spec:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[: int(spec)] if "," not in spec else [int(c) for c in spec.split(",")]
    if not cpus or not set(cpus) <= set(allowed):
        raise SystemExit(f"--server-cpus {spec}: this process may use CPUs {allowed}")
    return cpus


def pin(pid: int, cpus: list[int]) -> int:
    """Confine every thread of process `pid` and of the processes it started (a server's engine
    workers) to `cpus` (Linux: each thread's affinity is its own, so each is set, as `taskset -a -p`
    does); threads they start later inherit it. Returns the count."""
    from serving.services import descendants

    tids = []
    for process in [pid, *descendants(pid)]:
        try:
            tids += [int(t) for t in os.listdir(f"/proc/{process}/task")]
        except FileNotFoundError:  # ended meanwhile
            pass
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return len(tids)


def spy(server_pid: int, seconds: float, out_dir: str, tag: str) -> threading.Thread:
    """Sample with py-spy while the clients send: the whole process tree (the server and the client
    processes, every thread on a CPU) for the first half of `seconds`, then the server's thread that
    holds the interpreter lock for the second half. Raw collapsed stacks, one file each."""
    exe = shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--profile needs py-spy on the PATH (pip install py-spy)")
    half = max(1, int(seconds / 2))
    runs = [(os.getpid(), ["--subprocesses", "--threads"], f"spy_{tag}_all.txt"),
            (server_pid, ["--threads", "--gil"], f"spy_{tag}_server_gil.txt")]

    def record():
        time.sleep(min(3.0, seconds / 4))  # the clients have started
        for pid, extra, name in runs:
            done = subprocess.run([exe, "record", "--pid", str(pid), "--duration", str(half), "--rate", "250",
                                   "--nonblocking", "--format", "raw", "--output", str(Path(out_dir) / name), *extra],
                                  capture_output=True, text=True)
            log(True, f"py-spy {name}: rc {done.returncode} {done.stderr.strip()[-200:]}")

    thread = threading.Thread(target=record, name="py-spy", daemon=True)
    thread.start()
    return thread


def served(data: str, device: str, want, k: int, clients: int, processes: int, seconds: float, wait_ms: float,
           exchange: str = "call", cpus: list[int] | None = None, profile: str | None = None,
           request_format: str = "json", decode_ahead: bool = True, switch_ms: str = "", layout: str | None = None,
           engines: int = 1, cluster: tuple[int, int] | None = None, gpu_turn: bool = False,
           via: str = "front", overlap: bool = False, fronts: int = 0):
    """One served run against a fresh server: `serve colocated`, or with `cluster` (shards, replicas)
    `serve cluster` (Ray, started by the server; its replicas share the machine's GPUs). `via`
    "workers": the server's engine workers serve on endpoints of their own (`--endpoints`) and the
    clients follow them (client i to the (i mod n)-th), so no request passes the front. `overlap`: the
    server's engines prepare each batch on the host while the device answers the one before
    (`--overlap-batches`). `fronts`: that many front processes beside the engines (`--fronts`), and
    the clients follow them (client i to the (i mod n)-th), `via` "front" only."""
    from benchmarks.clients import drive

    if via not in VIAS or (via == "workers" and (engines < 2 or cluster is not None)):
        raise ValueError(f"via {via!r}: the clients reach the front, or (with engines of 2 or more) the workers")
    if fronts and (via != "front" or cluster is not None):
        raise ValueError("fronts: the clients follow the fronts the server lists; not with via workers or a cluster")
    if cluster is None:
        proc = ServiceProcess("migration.colocated_server", ["--data", data, "--device", device, "--log", "off",
                                                  "--batch-wait-ms", str(wait_ms), "--engines", str(engines),
                                                  *(["--decode-ahead"] if decode_ahead else []),
                                                  *(["--gpu-turn"] if gpu_turn else []),
                                                  *(["--overlap-batches"] if overlap else []),
                                                  *(["--endpoints"] if via == "workers" else []),
                                                  *(["--fronts", str(fronts)] if fronts else []),
                                                  *(["--switch-interval-ms", switch_ms] if switch_ms else []),
                                                  *(["--layout", layout] if layout else [])],
                              name="the co-located server")
    else:
        shards, replicas = cluster
        proc = ServiceProcess("cli", ["serve", "cluster", "--data", data, "--shards", str(shards), "--replicas",
                                      str(replicas), "--device", device, "--port", "0", "--log-dir", "off", "-q"],
                              name="serve cluster")
    try:
        if cpus is not None:  # the server alone on these CPUs; the clients keep the rest
            pin(proc.proc.pid, cpus)
        cpu0, front0 = proc.cpu_seconds(), proc.cpu_seconds(started=False)
        tag = (f"{exchange}-{request_format}-{'ahead' if decode_ahead else 'inline'}"
               f"{'-si' + switch_ms if switch_ms else ''}{f'-engines{engines}' if engines > 1 else ''}"
               f"{'' if cluster is None else '-cluster%dx%d' % cluster}{'-turn' if gpu_turn else ''}")
        tag += ("-via-workers" if via == "workers" else "") + ("-overlap" if overlap else "")
        tag += f"-fronts{fronts}" if fronts else ""
        spying = None if profile is None else spy(proc.proc.pid, seconds, profile, tag)
        follow = via == "workers" or fronts
        locations = fl.retrieve_endpoints(proc.location) if follow else [proc.location]
        if len(locations) != (fronts or engines if follow else 1):
            raise RuntimeError(f"the server at {proc.location} lists {locations} for {engines} engine workers and "
                               f"{fronts} fronts")
        before = fl.flight_action(proc.location, "stats")
        result = drive(locations, data, k=k, clients=clients, processes=processes, seconds=seconds, want=want,
                       exchange=exchange, request_format=request_format)
        cpu1, front1 = proc.cpu_seconds(), proc.cpu_seconds(started=False)
        after = fl.flight_action(proc.location, "stats")
        # with engine workers: their processes' CPU a request, and the fronts' (--fronts), apart
        for name, key in (("engine_cpu_ms_per_request", "engine_cpu_s"), ("fronts_cpu_ms_per_request", "front_cpu_s")):
            result[name] = (1e3 * (after[key] - before[key]) / result["requests"]
                            if key in after and key in before and result["requests"] else None)
        # the same server with one client alone: the lone client's idle latency, against which the
        # latency of any one of the clients above, while the others load the server, is read
        idle = drive(locations, data, k=k, clients=1, processes=1, seconds=max(1.0, seconds / 2), want=want,
                     exchange=exchange, request_format=request_format)
        result["idle"] = {"latency_ms": idle["latency_ms"], "requests": idle["requests"], "n_wrong": idle["n_wrong"]}
        result["n_wrong"] += idle["n_wrong"]
        result["p99_loaded_over_idle"] = lone_ratio(result)
        if spying is not None:
            spying.join()
        stats = fl.flight_action(proc.location, "stats")
        result["batching"] = stats.get("batching")
        result["front_batching"] = stats.get("front_batching")  # each front's batches (--fronts)
        result["call_path"] = stats.get("call_path")  # where a call's time went (flight.CallPath)
        # where a batch's time goes in the server: the batcher's own split (batcher.stats), the device's
        # busy time, and the server process's CPU per request (all its threads)
        batches = max(1, (result["batching"] or {}).get("batches", 0))
        device_s = stats.get("device_seconds")
        result["device_ms_per_batch"] = None if device_s is None else 1e3 * device_s / batches
        result["server_cpu_ms_per_request"] = (None if cpu0 is None or cpu1 is None or not result["requests"]
                                               else 1e3 * (cpu1 - cpu0) / result["requests"])
        # with engine workers, the front's own share of it (the Flight server, the hand-over to the workers)
        result["front_cpu_ms_per_request"] = (None if front0 is None or front1 is None or not result["requests"]
                                              else 1e3 * (front1 - front0) / result["requests"])
    finally:
        proc.stop()
    return {**result, "batch_wait_ms": wait_ms, "engines": engines, "gpu_turn": gpu_turn,
            "via": "fronts" if fronts else via, "fronts": fronts, "overlap": overlap,
            "server": "colocated" if cluster is None else "cluster",
            **({} if cluster is None else {"shards": cluster[0], "replicas": cluster[1]})}


def client_bound(srv: dict, clients: int) -> float | None:
    """The most requests a second `clients` clients with one request each in flight can be served: each
    waits for its answer, so at best clients / the idle p50 latency (None without an idle run)."""
    idle = srv.get("idle", {}).get("latency_ms", {}).get("p50")
    return None if not idle else clients / (idle * 1e-3)


def lone_ratio(srv: dict) -> float | None:
    """p99 of one client's requests while the others load the server, over its p99 alone (None when
    either is missing)."""
    loaded, idle = srv.get("latency_ms", {}).get("p99"), srv.get("idle", {}).get("latency_ms", {}).get("p99")
    return None if not loaded or not idle else loaded / idle


def run(data: str, *, device: str = "auto", k: int = 100, layout: str | None = None, batch: int = 64,
        repeat: int = 3, clients: int = 32, client_processes: int = 1, seconds: float = 20.0,
        batch_wait_ms: float = 0.2, exchanges=("call",), request_formats=("json",), decode_aheads=(False,),
        switch_intervals=("",), engines=(1,), gpu_turns=(False,), vias=("front",), overlaps=(False,), clusters=(),
        cpus: list[int] | None = None, profile: str | None = None, checks: int = CHECKS, progress=True,
        fronts=(0,)) -> dict:
    """The whole measurement (the module docstring): the in-process engine checked against the
    reference, timed in batches of `batch` and of `clients`; then one served run per combination of
    `exchanges`, `request_formats`, `decode_aheads`, `switch_intervals`, `engines` (engine
    processes behind the server's front; 1: the engine in its process), `gpu_turns` (the engines
    taking turns on the device or not; a turn only where there are several) and `vias` (the clients
    reach the front, or the engine workers' own endpoints: only where there are several) and `overlaps`
    (the engines preparing each batch while the device answers the one before, or not; never with a
    turn) and `fronts` (front processes beside the engines, which the clients then follow: with the
    clients reaching the front only), each against its own
    server, every answer of its first pass checked against the in-process engine's; then one run
    against `serve cluster` for each (shards, replicas) of `clusters`, its clients as the first way of
    sending (`served_cluster`, each beside the in-process rate; the targets read `serve colocated`).
    Returns the JSON-ready result; `target.met` only when every check passed."""
    from andromeda_nb.devices import resolve
    from andromeda_nb.store import load_dataset
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()  # as the servers do (serving.hostmem)
    if profile:
        Path(profile).mkdir(parents=True, exist_ok=True)
    device = resolve(device)
    dataset = load_dataset(data)
    log(progress, f"{dataset.n_ads:,} ads, {len(dataset.requests)} requests, device {device}")
    sizes = [batch] + ([clients] if clients != batch else [])
    want, runs = in_process(dataset, device, k, sizes, repeat, layout)
    checked = check_against_reference(dataset, want, k, checks)
    log(progress, f"in-process answers against the float64 reference: {'ok' if checked['ok'] else 'FAILED'} "
                  f"({checked['requests']} requests)")
    inproc = runs[0]
    for r in runs:
        log(progress, f"in process, batches of {r['batch']}: {r['requests_per_s']:.1f} requests/s")
    engines = list(engines)
    if not engines or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in engines):
        raise ValueError(f"engines: expected whole numbers of at least 1, got {engines}")
    by_exchange = {}
    if any(v not in VIAS for v in vias):
        raise ValueError(f"vias: expected some of {', '.join(VIAS)}, got {list(vias)}")
    fronts = list(fronts)
    if not fronts or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in fronts):
        raise ValueError(f"fronts: expected whole numbers of at least 0, got {fronts}")
    for exchange, request_format, ahead, switch, n_engines, turn, via, overlap, n_fronts in itertools.product(
            exchanges, request_formats, decode_aheads, switch_intervals, engines, gpu_turns, vias, overlaps, fronts):
        if (turn or via == "workers") and n_engines == 1 or turn and overlap or n_fronts and via == "workers":
            continue  # one engine has nobody to take turns with, and no workers; a turn overlaps nothing; the
            # clients of a server with fronts follow the fronts
        srv = served(data, device, want, k, clients, client_processes, seconds, batch_wait_ms, exchange, cpus,
                     profile, request_format, ahead, switch, layout, n_engines, gpu_turn=turn, via=via,
                     overlap=overlap, fronts=n_fronts)
        srv["server_cpus"] = cpus
        srv["decode_ahead"] = ahead
        srv["switch_interval_ms"] = float(switch) if switch else None
        # one key per way of serving: the exchange alone when it is the only thing varied
        key = "/".join([exchange] + ([request_format] if len(request_formats) > 1 else [])
                       + ([f"decode-ahead-{'on' if ahead else 'off'}"] if len(decode_aheads) > 1 else [])
                       + ([f"switch-{switch or 'default'}ms"] if len(switch_intervals) > 1 else [])
                       + ([f"engines-{n_engines}"] if len(engines) > 1 else [])
                       + ([f"turn-{'on' if turn else 'off'}"] if len(gpu_turns) > 1 else [])
                       + ([f"via-{via}"] if len(vias) > 1 else [])
                       + ([f"overlap-{'on' if overlap else 'off'}"] if len(overlaps) > 1 else [])
                       + ([f"fronts-{n_fronts}"] if len(fronts) > 1 else []))
        by_exchange[key] = srv
        ratio = srv["requests_per_s"] / inproc["requests_per_s"]
        log(progress, f"served, {clients} clients in {client_processes} processes, {key}: "
                      f"{srv['requests_per_s']:.1f} requests/s ({ratio:.0%} of in process), "
                      f"p50 {srv['latency_ms']['p50']:.2f} ms, p99 {srv['latency_ms']['p99']:.2f} ms, "
                      f"batching {srv['batching']}, device ms a batch {srv['device_ms_per_batch']}, "
                      f"server CPU ms a request {srv['server_cpu_ms_per_request']} (the front's process "
                      f"{srv.get('front_cpu_ms_per_request')}, the engine workers' {srv.get('engine_cpu_ms_per_request')}"
                      f", the fronts' {srv.get('fronts_cpu_ms_per_request')}), front batching "
                      f"{srv.get('front_batching')}, wrong answers {srv['n_wrong']}")
    clusters = [tuple(c) for c in clusters]
    if any(len(c) != 2 or min(c) < 1 for c in clusters):
        raise ValueError(f"clusters: expected (shards, replicas) pairs of whole numbers of at least 1, got {clusters}")
    by_cluster = {}
    for shards, replicas in clusters:
        srv = served(data, device, want, k, clients, client_processes, seconds, batch_wait_ms, exchanges[0], cpus,
                     profile, request_formats[0], False, "", layout, cluster=(shards, replicas))
        key = f"cluster-{shards}x{replicas}"
        by_cluster[key] = srv
        log(progress, f"served by `serve cluster` ({shards} shard(s) x {replicas} replica(s) on Ray), {clients} "
                      f"clients in {client_processes} processes: {srv['requests_per_s']:.1f} requests/s "
                      f"({srv['requests_per_s'] / inproc['requests_per_s']:.0%} of in process), "
                      f"p50 {srv['latency_ms']['p50']:.2f} ms, p99 {srv['latency_ms']['p99']:.2f} ms, "
                      f"batching {srv['batching']}, wrong answers {srv['n_wrong']}")
    srv = max(by_exchange.values(), key=lambda x: x["requests_per_s"])  # the target reads the best way
    ratio = srv["requests_per_s"] / inproc["requests_per_s"]
    checks_ok = checked["ok"] and all(not s["n_wrong"] for s in [*by_exchange.values(), *by_cluster.values()])
    met = checks_ok and ratio >= 0.70
    lone = lone_ratio(srv)
    bound = client_bound(srv, clients)
    # the target reads the in-process batch of `batch`; the batch as large as the clients can make it
    # (one request each in flight) is beside it, for what the batch size alone explains
    return {"kind": "served", "ads": dataset.n_ads, "requests": len(dataset.requests), "k": k, "layout": layout,
            "precision": dataset.precision, "dim": dataset.model.D, "device": device, "clients": clients,
            "client_processes": client_processes, "seconds": seconds, "engines": engines,
            "reference_check": checked, "checks_ok": checks_ok,
            "in_process": inproc,
            "in_process_at_clients": runs[-1] if len(runs) > 1 else inproc,
            "served_over_in_process_at_clients": srv["requests_per_s"] / runs[-1]["requests_per_s"],
            "served": srv, "served_by_exchange": by_exchange, "served_over_in_process": ratio,
            "served_cluster": by_cluster,
            # what the clients allow whatever the server (clients / idle p50), and that over the in-process rate
            "client_bound": None if bound is None else {"requests_per_s": bound,
                                                        "over_in_process": bound / inproc["requests_per_s"]},
            "target": {"value": ratio, "target": ">= 0.70", "met": met,
                       **({} if checks_ok else {"reason": "checks failed"})},
            # one client among `clients`: its p99 while the others load the server, over its p99 alone
            "lone_target": {"value": lone, "target": "<= 3", "met": bool(checks_ok and lone is not None and lone <= 3),
                            **({} if checks_ok else {"reason": "checks failed"})},
            "software": software()}


def table(result: dict) -> str:
    """The result as a person reads it: the in-process rate, each way of serving, the target."""
    inproc = result["in_process"]
    lines = [f"{result['ads']:,} ads, {result['requests']} requests, k = {result['k']}, device {result['device']}, "
             f"{result['clients']} clients in {result['client_processes']} process(es)",
             f"in-process answers against the float64 reference: "
             f"{'ok' if result['reference_check']['ok'] else 'FAILED'} ({result['reference_check']['requests']} requests)",
             f"in process, batches of {inproc['batch']}: {inproc['requests_per_s']:,.1f} requests/s",
             f"{'served':<28} {'requests/s':>12} {'of in process':>14} {'p50 ms':>8} {'p99 ms':>8} {'wrong':>6}"]
    for key, srv in result["served_by_exchange"].items():
        lines.append(f"{key:<28} {srv['requests_per_s']:>12,.1f} "
                     f"{srv['requests_per_s'] / inproc['requests_per_s']:>14.0%} {srv['latency_ms']['p50']:>8.2f} "
                     f"{srv['latency_ms']['p99']:>8.2f} {srv['n_wrong']:>6}")
    for key, srv in result.get("served_cluster", {}).items():
        lines.append(f"{key + ' (serve cluster)':<28} {srv['requests_per_s']:>12,.1f} "
                     f"{srv['requests_per_s'] / inproc['requests_per_s']:>14.0%} {srv['latency_ms']['p50']:>8.2f} "
                     f"{srv['latency_ms']['p99']:>8.2f} {srv['n_wrong']:>6}")
    t = result["target"]
    lines.append(f"target served / in process {t['target']}: {t['value']:.0%}, "
                 f"{'met' if t['met'] else 'NOT met'}{' (' + t['reason'] + ')' if 'reason' in t else ''}")
    bound = result.get("client_bound")
    if bound:
        lines.append(f"at most {bound['requests_per_s']:,.0f} requests/s ({bound['over_in_process']:.0%} of in process) "
                     f"from {result['clients']} clients with one request each in flight: their number over the "
                     f"idle p50 ({result['served']['idle']['latency_ms']['p50']:.2f} ms)")
    lone = result.get("lone_target")
    if lone and lone["value"] is not None:
        idle = result["served"]["idle"]["latency_ms"]["p99"]
        lines.append(f"target p99 of a client among {result['clients']} over its p99 alone ({idle:.2f} ms) "
                     f"{lone['target']}: {lone['value']:.1f}x, {'met' if lone['met'] else 'NOT met'}"
                     f"{' (' + lone['reason'] + ')' if 'reason' in lone else ''}")
    return "\n".join(lines)


def _counts(ap, option: str, text: str, least: int, example: str) -> list[int]:
    """An option's comma-separated whole numbers of at least `least`; the parser's error otherwise."""
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        ap.error(f"{option} {text}: expected comma-separated whole numbers of at least {least}, e.g. {example}")
    return values


def main(argv=None) -> int:
    """`python -m benchmarks.served`: every option of the measurement, the probes' way."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.served", description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory (made by `andromeda generate`)")
    ap.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--layout", default=None, choices=("format", "geo"),
                    help="the GPU engine's slot order, in process and served alike (default: the engine's)")
    ap.add_argument("--batch", type=int, default=64, help="requests per in-process batch")
    ap.add_argument("--repeat", type=int, default=3, help="in-process passes (the median is reported)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--client-processes", type=int, default=1,
                    help="processes the client threads are spread over (1: one interpreter for all clients)")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the clients send")
    ap.add_argument("--batch-wait-ms", type=float, default=0.2)
    ap.add_argument("--exchange", default="call",
                    help="how clients send, comma-separated to run each against its own server in turn: 'call' "
                         "(an exchange per request), 'stream' (one exchange per client, a batch per request)")
    ap.add_argument("--request-format", default="json",
                    help="the clients' request batches, comma-separated to run each in turn: 'json' (the request "
                         "column) or 'columns' (the columnar batch)")
    ap.add_argument("--decode-ahead", default="off",
                    help="'off' (requests decoded between engine batches), 'on' (on a thread of their own, a stage "
                         "ahead of the engine), or 'on,off' to run both in turn")
    ap.add_argument("--switch-interval-ms", default="",
                    help="the server's thread switch interval in ms, comma-separated to run each in turn "
                         "(empty: the server's default, serving.process.SWITCH_INTERVAL_MS; Python's is 5)")
    ap.add_argument("--engines", default="1",
                    help="engine processes behind the server's front, comma-separated to run each in turn against "
                         "a fresh server (1: the engine in the server's process)")
    ap.add_argument("--cluster", default="", metavar="SxR[,SxR...]",
                    help="also `serve cluster` (Ray) with S shards of R replicas each, e.g. 1x4; comma-separated "
                         "to run each in turn (the cluster extra must be installed)")
    ap.add_argument("--gpu-turn", default="off",
                    help="with several engines: 'on' (they take turns on the device), 'off' (time slices), or "
                         "'off,on' to run both in turn")
    ap.add_argument("--via", default="front",
                    help="with several engines: 'front' (every request through the server's front), 'workers' (the "
                         "engine workers serve on endpoints of their own, --endpoints, and the clients follow them), "
                         "or 'front,workers' to run both in turn")
    ap.add_argument("--overlap", default="off",
                    help="'on' (the engines prepare each batch while the device answers the one before: "
                         "--overlap-batches), 'off', or 'off,on' to run both in turn")
    ap.add_argument("--fronts", default="0",
                    help="front processes beside the engines (--fronts), which the clients follow, comma-separated "
                         "to run each in turn against a fresh server (0: none)")
    ap.add_argument("--server-cpus", default=None,
                    help="confine the server to this many CPUs (the first it may use) or to a comma-separated list; "
                         "the clients are not confined (Linux)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="sample the server and the clients with py-spy while they run; raw stacks under DIR")
    ap.add_argument("--checks", type=int, default=CHECKS, help="in-process answers checked against the reference")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    formats, aheads, turns = args.request_format.split(","), args.decode_ahead.split(","), args.gpu_turn.split(",")
    vias, overlaps = args.via.split(","), args.overlap.split(",")
    if not set(overlaps) <= {"on", "off"}:
        ap.error("--overlap takes on and off")
    if not set(formats) <= {"json", "columns"} or not set(aheads) <= {"on", "off"} or not set(turns) <= {"on", "off"}:
        ap.error("--request-format takes json and columns, --decode-ahead and --gpu-turn on and off")
    if not set(vias) <= set(VIAS):
        ap.error(f"--via {args.via}: takes {' and '.join(VIAS)}")
    engines = _counts(ap, "--engines", args.engines, 1, "1,2,4")
    fronts = _counts(ap, "--fronts", args.fronts, 0, "0,4")
    try:
        clusters = cluster_specs(args.cluster)
    except ValueError as exc:
        ap.error(str(exc))
    result = run(args.data, device=args.device, k=args.k, layout=args.layout, batch=args.batch, repeat=args.repeat,
                 clients=args.clients, client_processes=args.client_processes, seconds=args.seconds,
                 batch_wait_ms=args.batch_wait_ms, exchanges=args.exchange.split(","), request_formats=formats,
                 decode_aheads=[a == "on" for a in aheads], switch_intervals=args.switch_interval_ms.split(","),
                 engines=engines, gpu_turns=[t == "on" for t in turns], vias=vias,
                 overlaps=[o == "on" for o in overlaps], clusters=clusters,
                 cpus=server_cpus(args.server_cpus), profile=args.profile,
                 checks=args.checks, fronts=fronts)
    print(table(result))
    if args.out:
        write_result(result, args.out, command=script_command("-m benchmarks.served",
                                                              sys.argv[1:] if argv is None else argv))
    return 0 if result["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
