"""Retrieval latency while one large `update` call is applied (issue 15, point 6; docs/RELIABILITY.md).

For each server (the co-located server on the engine of `--device`, the CPU by default, and the remote pair: index host and scoring
service), started as processes on loopback over a generated corpus with its update log on disk:

1. a probe thread sends one request per exchange (k = 100), back to back, and times each answer;
2. `--idle-s` seconds of that alone give the idle latency (p50, p99, max);
3. then one `update` call of `--upserts` upserts (every field of existing ads replaced, embeddings
   included, as a catalogue refresh sends them) goes in from another thread, and the probe's
   latencies while that call is in flight give the latency during the call.

The target: p99 during the call within 2x of the idle p99. `--calls N` sends N such calls at once, from
N threads (issue 37, point 8: three concurrent calls of about 100 MB each, `--upserts 60000 --calls 3`);
"during" is then from the first call's start to the last one's end. `--slice N` sets how many updates the
server applies between two looks at waiting retrievals (`ServiceLimits.update_slice`); `--slice
1000000` applies the whole call in one piece, as the servers did before slicing, for comparison.
`--cpu-shares 1,0.5,0.25` runs each server once per share of the call's time it may spend applying
while retrievals arrive (`ServiceLimits.update_cpu_share`; 1: no pause). `--baseline-tree DIR` (a
checkout of an earlier commit, `--baseline-commit` naming it) runs each measurement first with that
tree's servers and then with this one's, so a result holds before and after from one machine and one run.

    PYTHONPATH=. python3 scripts/bench_update_stall.py --out docs/results/reliability/update_stall.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving import protocol as fl  # noqa: E402
from andromeda_nb.measure import log, software, write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402
from serving.services import ServiceProcess  # noqa: E402


def percentiles(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    if not len(ms):
        return {"n": 0}
    return {"n": int(len(ms)), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p90_ms": round(float(np.percentile(ms, 90)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2)}


class Probe:
    """Back-to-back single-request retrievals; each latency recorded with its start and end."""

    def __init__(self, location: str, requests, k: int = 100):
        import pyarrow.flight as flight

        self.client = flight.connect(location)
        self.location, self.requests, self.k = location, requests, k
        self.samples: list[tuple[float, float]] = []  # (start, end), time.monotonic()
        self.stop = threading.Event()
        self.errors = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        i = 0
        while not self.stop.is_set():
            request = self.requests[i % len(self.requests)]
            i += 1
            t = time.monotonic()
            try:
                fl.retrieve_over_flight(self.location, [request], self.k, client=self.client, timeout=60)
            except Exception:
                self.errors += 1
                continue
            self.samples.append((t, time.monotonic()))

    def between(self, lo: float, hi: float) -> list[float]:
        return [end - start for start, end in self.samples if start >= lo and end <= hi]


def upsert_body(dataset, n: int, seed: int) -> bytes:
    from andromeda_nb.targeting import ad_to_json

    rng = np.random.default_rng(seed)
    ads = dataset.ads
    lines = []
    for i in range(n):
        ad = ad_to_json(ads[i % len(ads)])
        ad["embedding"] = np.round(rng.standard_normal(dataset.model.D) / 8, 6).tolist()
        lines.append(json.dumps({"op": "upsert", "ad": ad}, separators=(",", ":")))
    return "\n".join(lines).encode()


def measure(name: str, location: str, dataset, body: bytes, idle_s: float, progress: bool, calls: int = 1,
            call_timeout_s: float = 600.0) -> dict:
    import gc

    gc.collect()
    gc.freeze()  # the probe's process holds the corpus: a full collection over it paused the probe itself
    probe = Probe(location, dataset.requests)
    probe.thread.start()
    time.sleep(2.0)  # warm: kernels loaded, connections up
    t_idle = time.monotonic()
    time.sleep(idle_s)
    t_call = time.monotonic()
    acks: list = [None] * calls

    def send(i):
        try:
            acks[i] = fl.send_updates(location, body, timeout=call_timeout_s)
        except Exception as exc:  # reported in the result, never hidden
            acks[i] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}", "applied": 0}

    senders = [threading.Thread(target=send, args=(i,)) for i in range(calls)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    t_done = time.monotonic()
    ack = acks[0] if calls == 1 else {"applied": sum(a.get("applied", 0) for a in acks)}
    time.sleep(0.5)
    probe.stop.set()
    probe.thread.join(60)
    probe.client.close()
    idle = percentiles(probe.between(t_idle, t_call))
    during = percentiles(probe.between(t_call, t_done))
    # the call's phases as the server timed them, laid back from the call's end: the probe's latencies
    # within each (parse also holds the body's transfer before it)
    seconds = ack.get("seconds") or {}
    phases = {}
    if seconds:
        apply_from = t_done - seconds["apply"]
        log_from = apply_from - seconds["log"]
        for phase, lo, hi in (("parse", t_call, log_from), ("log", log_from, apply_from), ("apply", apply_from, t_done)):
            phases[phase] = {"seconds": seconds[phase], **percentiles(probe.between(lo, hi))}
    result = {"server": name, "idle": idle, "during_update": during, "update_call_s": round(t_done - t_call, 2),
              "updates_per_s": round(ack["applied"] / (t_done - t_call)), "applied": ack["applied"],
              "probe_errors": probe.errors, "phases": phases, "calls": calls,
              "call_errors": [a["error"] for a in acks if "error" in a],
              "call_seconds": [a.get("seconds") for a in acks],  # each call's parse, log and apply, as the server timed them
              "p99_ratio": round(during["p99_ms"] / idle["p99_ms"], 2) if during.get("n") else None}
    log(progress, f"{name}: idle p99 {idle['p99_ms']} ms, during the call p99 {during.get('p99_ms')} ms "
                  f"(x{result['p99_ratio']}), max {during.get('max_ms')} ms; the call took {result['update_call_s']} s "
                  f"({result['updates_per_s']} updates/s)")
    for phase_name, phase in phases.items():
        log(progress, f"  {phase_name}: {phase['seconds']:.2f} s, p99 {phase.get('p99_ms')} ms over {phase['n']} requests")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ads", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--upserts", type=int, default=20_000)
    parser.add_argument("--idle-s", type=float, default=8.0)
    parser.add_argument("--calls", type=int, default=1, help="update calls sent at once, each of --upserts upserts")
    parser.add_argument("--server-args", default="", help="more options for the servers, e.g. '--max-updates 100000' "
                        "(the default limit is 50,000 lines a call)")
    parser.add_argument("--slice", type=int, default=None, help="updates applied between looks at retrieval")
    parser.add_argument("--servers", default="colocated,remote")
    parser.add_argument("--cpu-shares", default=None,
                        help="update CPU shares to run each server with, comma-separated (default: the server's)")
    parser.add_argument("--device", default="cpu", help="the co-located server's device (cpu, gpu, auto)")
    parser.add_argument("--baseline-tree", default=None,
                        help="a checkout of another commit of the project (e.g. `git archive C | tar -x -C DIR`): each "
                             "run goes first with its servers, then with this tree's, both in the result")
    parser.add_argument("--baseline-commit", default=None, help="the commit of --baseline-tree, recorded with its runs")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each measurement this many times (with --baseline-tree, the trees alternating)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--call-timeout-s", type=float, default=600.0,
                        help="the client's timeout for each update call (three 100 MB calls take longer than 600 s)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from andromeda_nb.corpus import generate_corpus
    from andromeda_nb.store import load_dataset

    with tempfile.TemporaryDirectory(prefix="andromeda-stall-") as tmp:
        results = []
        shares = [float(x) for x in args.cpu_shares.split(",")] if args.cpu_shares else [None]
        for name in args.servers.split(","):
            root = Path(tmp) / name
            generate_corpus(root, args.ads, args.requests, args.seed)
            dataset = load_dataset(root)
            body = upsert_body(dataset, args.upserts, args.seed)
            for share in shares * args.repeat:
                log(True, f"{name}: {args.ads} ads, one call of {args.upserts} upserts ({len(body) / 1e6:.1f} MB)"
                          + (f", update CPU share {share}" if share else ""))
                extra = (["--update-slice", str(args.slice)] if args.slice else []) + \
                    (["--update-cpu-share", str(share)] if share else []) + args.server_args.split()
                label = name if name == "remote" else f"colocated ({args.device})"
                trees = ([("baseline", args.baseline_tree, args.baseline_commit)] if args.baseline_tree else []) + \
                    [("this tree", None, None)]
                for tree, tree_root, tree_commit in trees:
                    for leftover in root.glob("updates.log*"):  # each run starts from the corpus alone
                        leftover.unlink()
                    procs = []
                    try:
                        if name == "colocated":
                            procs.append(ServiceProcess("migration.colocated_server", ["--data", str(root), "--device",
                                                        args.device, *extra], start_timeout_s=600, root=tree_root))
                        else:
                            procs.append(ServiceProcess("cpu_baseline.remote_servers", ["scorer", "--data", str(root),
                                                        *extra], root=tree_root))
                            procs.append(ServiceProcess("cpu_baseline.remote_servers", ["remote", "--data", str(root),
                                                        "--scorer", procs[0].location, *extra], root=tree_root))
                        if args.baseline_tree:
                            log(True, f"  servers of {tree}" + (f" (commit {tree_commit})" if tree_commit else ""))
                        result = measure(label, procs[-1].location, dataset, body, args.idle_s, True, args.calls,
                                         args.call_timeout_s)
                        results.append({**result, "update_cpu_share": share or "default",
                                        **({"tree": tree, "tree_commit": tree_commit} if args.baseline_tree else {})})
                    finally:
                        for proc in reversed(procs):
                            proc.stop()
    doc = {"kind": "update_stall", "ads": args.ads, "upserts": args.upserts, "calls": args.calls,
           "call_mb": round(len(body) / 1e6, 1), "idle_s": args.idle_s,
           "baseline_commit": args.baseline_commit,
           "update_slice": args.slice or "default", "repeat": args.repeat, "results": results,
           "target": "p99 during the call within 2x of the idle p99", "software": software()}
    stamp(doc, command=script_command("bench_update_stall.py", argv if argv is not None else sys.argv[1:]))
    if args.out:
        write_json(doc, args.out)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
