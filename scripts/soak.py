"""Soak: many clients against a server for minutes while updates stream and a service restarts (issue 15,
point 7; docs/RELIABILITY.md has the results).

For each server (`colocated`: the co-located server on the CPU engine; `remote`: the index host and the
scoring service), started as processes on loopback over a generated corpus, their update log on disk:

The co-located server runs on `--device` (the CPU engine by default).

* `--clients` threads (32) each send batches of 1-8 requests (k = 10 or 100) back to back; every answer
  batch carries the update sequence number it reflects (`answer_seq`). Each answer must reflect at
  least every update acknowledged before its request was sent (visibility), and a sample of them
  (`--check-every`) is compared afterwards with the float64 reference at exactly that sequence number:
  eligible ads from the oracle, top K within the comparison rules (`andromeda_nb.compare.compare_topk`);
* `--updaters` threads (3) stream updates at once (calls of 1-40 lines, a steady mix that keeps the
  number of live ads flat: replacements with new embeddings and formats, status changes, retirements
  and re-creations), each over its own share of the ads (ad id modulo the number of updaters), so
  every call applies whatever the order the server puts them in. The server's log says that order:
  the answers are checked against the reference built from the log's records, and every
  acknowledged call must be in the log, whole, at the sequence numbers its acknowledgement gave;
* halfway through, one service is killed with SIGKILL and started again on the same port (the
  co-located server; the scoring service of the remote pair, the issue's first case). Calls that fail
  meanwhile are counted as unavailable, never as wrong; the update stream resumes from what the
  server holds, and that must include every acknowledged update;
* the servers' resident memory is sampled every 5 s: it must stay flat once warm.

    PYTHONPATH=. python3 scripts/soak.py --minutes 10 --out docs/results/reliability/soak.json
"""

from __future__ import annotations

import argparse
import json
import random
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


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class UpdateStream:
    """A deterministic, endless stream of valid updates that keeps the live set's size flat; over the
    ads `owns(ad_id)` says are this stream's (several streams over disjoint shares of the ads apply in
    any interleaving)."""

    def __init__(self, dataset, seed: int, owns=lambda ad_id: True):
        from andromeda_nb.targeting import ad_to_json

        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.D, self.F = dataset.model.D, dataset.model.F
        self.json_of = {a.ad_id: ad_to_json(a) for a in dataset.ads if owns(a.ad_id)}
        for obj in self.json_of.values():
            obj.pop("embedding", None)
        self.live = sorted(self.json_of)
        self.live_set = set(self.live)
        self.retired: list[int] = []
        self.lines: list[str] = []  # every update made so far, in order

    def _next(self) -> str:
        r = self.rng.random()
        if r < 0.1 and len(self.live) > 10:
            ad_id = self.live.pop(self.rng.randrange(len(self.live)))
            self.live_set.discard(ad_id)
            self.retired.append(ad_id)
            return json.dumps({"op": "retire", "ad_id": ad_id})
        if r < 0.4:
            return json.dumps({"op": "status", "ad_id": self.rng.choice(self.live),
                               "status": self.rng.choice(["ACTIVE", "ACTIVE", "PAUSED"])})
        if r < 0.5 and self.retired:
            ad_id = self.retired.pop(self.rng.randrange(len(self.retired)))
            self.live.append(ad_id)
            self.live_set.add(ad_id)
        else:
            ad_id = self.rng.choice(self.live)
        ad = dict(self.json_of[ad_id], status="ACTIVE", format=self.rng.randrange(self.F),
                  embedding=np.round(self.np_rng.standard_normal(self.D) / 8, 5).tolist())
        return json.dumps({"op": "upsert", "ad": ad}, separators=(",", ":"))

    def upto(self, n: int) -> list[str]:
        while len(self.lines) < n:
            self.lines.append(self._next())
        return self.lines[:n]


class Soak:
    def __init__(self, name: str, root: Path, dataset, args):
        self.name, self.root, self.dataset, self.args = name, root, dataset, args
        n = args.updaters
        self.streams = [UpdateStream(dataset, args.seed + i, owns=lambda ad_id, i=i: ad_id % n == i) for i in range(n)]
        self.procs: dict[str, ServiceProcess] = {}
        self.ports: dict[str, int] = {}
        self.acked = 0  # the highest sequence number acknowledged: every update up to it is applied
        self.acked_updates = 0  # updates acknowledged (each call's applied)
        self.calls: list[tuple[list[str], dict]] = []  # every acknowledged call: its lines, its acknowledgement
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.samples: list[tuple[int, list[int], int, list]] = []  # (seq, request indexes, k, answers)
        self.counts = {"batches": 0, "requests": 0, "unavailable": 0, "other_errors": 0,
                       "visibility_violations": 0, "update_calls": 0, "update_calls_failed": 0,
                       "update_calls_resent": 0}
        self.latencies: list[float] = []
        self.rss: dict[str, list[tuple[float, float]]] = {}
        self.events: list[str] = []
        self.restart_check: dict = {}

    # --- processes -------------------------------------------------------------------------------------
    def start(self, which: str) -> None:
        port = ["--port", str(self.ports[which])] if which in self.ports else []
        if which == "colocated":
            proc = ServiceProcess("migration.colocated_server", ["--data", str(self.root), "--device", self.args.device, *port],
                                  start_timeout_s=600)
        elif which == "scorer":
            proc = ServiceProcess("cpu_baseline.remote_servers", ["scorer", "--data", str(self.root), *port], name="scorer")
        else:
            proc = ServiceProcess("cpu_baseline.remote_servers", ["remote", "--data", str(self.root), "--scorer",
                                                         self.procs["scorer"].location, *port], name="index host")
        self.procs[which] = proc
        self.ports[which] = proc.port

    @property
    def front(self) -> str:
        return self.procs["colocated" if self.name == "colocated" else "remote"].location

    # --- the threads ------------------------------------------------------------------------------------
    def client(self, index: int) -> None:
        import pyarrow.flight as flight

        rng = random.Random(self.args.seed * 1000 + index)
        requests = self.dataset.requests
        client = flight.connect(self.front)
        n = 0
        while not self.stop.is_set():
            picks = rng.sample(range(len(requests)), rng.randint(1, 8))
            k = rng.choice([10, 100])
            acked_before = self.acked
            seqs: list = []
            t = time.monotonic()
            try:
                batch = fl.request_batch([requests[i] for i in picks], k)
                (out,) = fl.exchange_batches(client, [batch], timeout=30, seqs=seqs)
            except flight.FlightUnavailableError:
                self.counts["unavailable"] += 1
                client.close()
                time.sleep(0.2)
                client = flight.connect(self.front)
                continue
            except flight.FlightError as exc:
                self.counts["other_errors"] += 1
                self.events.append(f"client {index}: {type(exc).__name__}: {str(exc)[:200]}")
                client.close()
                time.sleep(0.2)
                client = flight.connect(self.front)
                continue
            self.latencies.append(time.monotonic() - t)
            seq = seqs[0]
            with self.lock:
                self.counts["batches"] += 1
                self.counts["requests"] += len(picks)
                if seq is None or seq < acked_before:
                    self.counts["visibility_violations"] += 1
                    self.events.append(f"answer at seq {seq}, {acked_before} acknowledged before it was sent")
            n += 1
            if n % self.args.check_every == 0:
                answers = fl.split_answers(out, [requests[i].request_id for i in picks])
                with self.lock:
                    self.samples.append((seq, picks, k, [(a.tolist(), s.tolist()) for a, s in answers]))
        client.close()

    def updater(self, index: int) -> None:
        """One of the concurrent updaters: calls of 1-40 lines of its own stream, back to back. A
        call that fails (the server was killed) may or may not have been logged: once the server is
        back it is sent again, which its own share of the ads makes harmless (an upsert or status
        again changes nothing; a retire again is rejected)."""
        rng = random.Random(self.args.seed * 7 + index)
        stream, sent = self.streams[index], 0
        while not self.stop.is_set():
            n = rng.randint(1, 40)
            lines = stream.upto(sent + n)[sent:]
            resend = False
            while not self.stop.is_set():
                try:
                    ack = fl.send_updates(self.front, "\n".join(lines), timeout=60)
                except Exception:
                    self.counts["update_calls_failed"] += 1
                    if self.held_updates() is None:  # waits until the server is back and steady
                        return
                    resend = True
                    continue
                with self.lock:
                    self.counts["update_calls"] += 1
                    self.counts["update_calls_resent"] += resend
                    if ack["rejected"] and not resend:
                        self.events.append(f"unexpected rejection {ack['rejected'][:3]}")
                        self.counts["other_errors"] += 1
                    self.acked = max(self.acked, ack["seq"])
                    self.acked_updates += ack["applied"]
                    self.calls.append((lines, ack))
                break
            sent += len(lines)
            time.sleep(rng.uniform(0.02, 0.1))

    def held_updates(self) -> int | None:
        """The number of updates the server holds once it answers and that number is steady (a call
        that failed on this side may have been logged, and be applied still): nothing is sent before
        that, or the stream would send some lines twice. None once the soak is over."""
        last = None
        while not self.stop.is_set():
            time.sleep(0.5)
            try:
                held = fl.flight_action(self.front, "health", timeout=5)["seq"]
            except Exception:
                last = None
                continue
            if held == last:
                return held
            last = held
        return None

    def sampler(self, started: float) -> None:
        while not self.stop.wait(5.0):
            for which, proc in list(self.procs.items()):
                value = rss_mb(proc.proc.pid)
                if value is not None:
                    self.rss.setdefault(which, []).append((round(time.monotonic() - started, 1), round(value, 1)))

    def restart(self) -> None:
        which = "colocated" if self.name == "colocated" else "scorer"
        acked = self.acked
        self.events.append(f"SIGKILL {which} with {acked} updates acknowledged")
        self.procs[which].proc.kill()
        self.procs[which].stop()
        time.sleep(1.0)
        self.start(which)
        held = fl.flight_action(self.front, "health", timeout=30)
        self.restart_check.update({"service": which, "acknowledged_at_kill": acked, "server_seq_after": held["seq"],
                                   "status_after": held["status"]})
        self.events.append(f"{which} back: the server reports update {held['seq']} ({held['status']})")

    # --- the run ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        if self.name == "colocated":
            self.start("colocated")
        else:
            self.start("scorer")
            self.start("remote")
        started = time.monotonic()
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.args.clients)]
        threads += [threading.Thread(target=self.updater, args=(i,), daemon=True) for i in range(self.args.updaters)]
        threads += [threading.Thread(target=self.sampler, args=(started,), daemon=True)]
        for t in threads:
            t.start()
        duration = self.args.minutes * 60
        time.sleep(duration / 2)
        if self.args.restart:
            self.restart()
        time.sleep(max(0.0, duration - (time.monotonic() - started)))
        self.stop.set()
        for t in threads:
            t.join(60)
        final_health = fl.flight_action(self.front, "health", timeout=30)
        final = fl.retrieve_over_flight(self.front, self.dataset.requests, 100, timeout=60, seqs=(final_seqs := []))
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        log(True, f"{self.name}: {self.counts['batches']} batches, {self.acked_updates} updates acknowledged in "
                  f"{len(self.calls)} calls from {self.args.updaters} updaters; checking {len(self.samples)} sampled "
                  "answers against the reference built from the log")
        records = self.logged_records()
        lost = self.lost_calls(records)
        wrong, checked = self.check(records, final, final_seqs[0] if final_seqs else None)
        lat = np.asarray(self.latencies) * 1e3
        rss = {which: summarize_rss(series) for which, series in self.rss.items()}
        return {"server": self.name, **({"device": self.args.device} if self.name == "colocated" else {}),
                "minutes": self.args.minutes, "clients": self.args.clients, "updaters": self.args.updaters,
                **self.counts, "updates_acknowledged": self.acked_updates, "final_seq": final_health["seq"],
                "final_status": final_health["status"], "logged_updates": len(records),
                "lost_acknowledged_updates": lost + max(0, self.acked - final_health["seq"]),
                "answers_checked": checked, "wrong_answers": wrong, "restart": self.restart_check,
                "latency_ms": {"p50": round(float(np.percentile(lat, 50)), 2),
                               "p99": round(float(np.percentile(lat, 99)), 2)} if len(lat) else {},
                "rss_mb": rss, "rss_series_mb": {which: series for which, series in self.rss.items()},
                "events": self.events[:50]}

    def logged_records(self) -> list:
        """The server's log after the run (its processes stopped): the order the server gave the
        concurrent calls, which the checks follow."""
        from serving.wal import LOG_FILE, WriteAheadLog, corpus_lineage, snapshot_seq

        log_ = WriteAheadLog.open(self.root / LOG_FILE, lineage=corpus_lineage(self.dataset),
                                  snapshot_seq=snapshot_seq(self.dataset))
        try:
            return log_.replay()
        finally:
            log_.close()

    def lost_calls(self, records) -> int:
        """Acknowledged updates not in the log where their acknowledgement put them: a call's
        accepted lines are its records `seq - applied + 1 .. seq`, in order."""
        base = snapshot_seq_of(self.dataset)
        lost = 0
        for lines, ack in self.calls:
            rejected = {r["line"] for r in ack["rejected"]}
            accepted = [json.loads(line) for n, line in enumerate(lines, start=1) if n not in rejected]
            first = ack["seq"] - ack["applied"]
            got = [r.update for r in records[first - base : ack["seq"] - base]]
            if got != accepted:
                lost += ack["applied"]
                self.events.append(f"LOST: the call acknowledged at {ack['seq']} is not in the log as acknowledged")
        return lost

    def check(self, records, final, final_seq) -> tuple[int, int]:
        from andromeda_nb.compare import compare_topk
        from andromeda_nb.reference import ReferenceRetriever
        from andromeda_nb.updates import read_updates

        reference = ReferenceRetriever.build(self.dataset)
        updates, bad = read_updates([json.dumps(r.update) for r in records], seed=self.dataset.seed,
                                    dim=self.dataset.model.D, formats=self.dataset.model.F)
        assert not bad, bad[:3]
        samples = sorted(self.samples, key=lambda s: s[0])
        if final_seq is not None:
            samples.append((final_seq, list(range(len(self.dataset.requests))), 100,
                            [(a.tolist(), s.tolist()) for a, s in final]))
        at, wrong, checked = 0, 0, 0
        for seq, picks, k, answers in samples:
            while at < seq:
                reference.apply(updates[at][1])
                at += 1
            for i, (ids, scores) in zip(picks, answers):
                request = self.dataset.requests[i]
                ref_ids, result = reference.score_eligible(request)
                cmp = compare_topk(ref_ids, result, np.asarray(ids, np.int64), np.asarray(scores, np.float32), k)
                checked += 1
                if not cmp.ok:
                    wrong += 1
                    self.events.append(f"WRONG at seq {seq}, request {request.request_id}, k {k}: {cmp.message}")
        return wrong, checked


def snapshot_seq_of(dataset) -> int:
    from serving.wal import snapshot_seq

    return snapshot_seq(dataset)


def summarize_rss(series: list[tuple[float, float]]) -> dict:
    if not series:
        return {}
    values = [v for _, v in series]
    warm = [v for t, v in series if t >= 60] or values  # after the first minute
    return {"first_mb": values[0], "after_1_min_mb": warm[0], "last_mb": values[-1], "max_mb": max(values),
            "growth_after_1_min_pct": round(100 * (warm[-1] - warm[0]) / warm[0], 1), "samples": len(series)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="colocated,remote")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--updaters", type=int, default=3, help="threads sending update calls at once")
    parser.add_argument("--ads", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--check-every", type=int, default=8, help="compare every Nth answer of each client")
    parser.add_argument("--device", default="cpu", help="the co-located server's device (cpu, gpu, auto)")
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                        help="SIGKILL one service halfway and start it again (--no-restart: one process "
                             "throughout, to tell state growth from a leak in the memory series)")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from andromeda_nb.corpus import generate_corpus
    from andromeda_nb.store import load_dataset

    results = []
    with tempfile.TemporaryDirectory(prefix="andromeda-soak-") as tmp:
        for name in args.servers.split(","):
            root = Path(tmp) / name
            generate_corpus(root, args.ads, args.requests, args.seed)
            dataset = load_dataset(root)
            log(True, f"{name}: {args.clients} clients and {args.updaters} updaters for {args.minutes:g} min on "
                      f"{args.ads} ads")
            result = Soak(name, root, dataset, args).run()
            log(True, json.dumps({k: v for k, v in result.items() if k != "events"}))
            results.append(result)
    doc = {"kind": "soak", "results": results, "software": software()}
    stamp(doc, command=script_command("soak.py", argv if argv is not None else sys.argv[1:]))
    if args.out:
        write_json(doc, args.out)
    ok = all(r["wrong_answers"] == 0 and r["lost_acknowledged_updates"] == 0 and r["visibility_violations"] == 0
             and r["other_errors"] == 0 for r in results)
    print(json.dumps([{k: v for k, v in r.items() if k != "events"} for r in results], indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
