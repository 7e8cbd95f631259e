"""The CPU time one large `update` call costs a co-located server, by phase: parsing and checking, the
log (encoded, written and synced) and applying (issue 37, point 8; docs/RELIABILITY.md).

`scripts/bench_update_stall.py` measures retrieval while calls run, in wall-clock time, which the
other work of a shared machine moves by tens of percent from run to run; this measures the work
itself. A co-located server over the CPU engine (`serving.engine_server.EngineServer`, its log on
disk) takes one call of `--upserts` upserts (every field of existing ads replaced, embeddings
included, as the stall bench sends them) with no retrieval running, so nothing paces it, its journal
timing the phases on the thread's CPU clock (`time.thread_time`): the seconds of CPU each phase
took, whatever else the machine runs. `--trees this,DIR` runs it in the servers of another checkout
too (e.g. `git archive C | tar -x -C DIR`, `--tree-commits` naming them), each in a process of its
own, `--repeat` times alternating, so before and after come from one run on one machine.

    PYTHONPATH=. python3 scripts/time_update_call.py --trees DIR,this --tree-commits 324708e,this \\
        --out docs/results/reliability/update_call_cpu_before_after.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # put on sys.path by the outer run only: an inner run imports its tree's


def inner(data: str, body_path: str) -> dict:
    """One call on this process's tree ($PYTHONPATH, set by the outer run): CPU seconds by phase."""
    from andromeda_nb.store import load_dataset
    from cpu_baseline.engine import CpuEngine
    from serving.engine_server import EngineServer
    from serving.wal import WriteAheadLog, corpus_lineage

    dataset = load_dataset(data)
    body = Path(body_path).read_bytes()
    log_path = Path(tempfile.mkdtemp(prefix="andromeda-call-")) / "updates.log"
    server = EngineServer(CpuEngine(dataset), dataset, log=WriteAheadLog.open(log_path, lineage=corpus_lineage(dataset),
                                                                                snapshot_seq=0))
    try:
        server.journal._clock = time.thread_time  # the phases in this thread's CPU seconds (no pacing: no retrieval)
        wall = time.perf_counter()
        ack = server.apply_updates(body, time.monotonic())
        wall = time.perf_counter() - wall
    finally:
        server.shutdown()  # the Flight server (pyarrow's), then what it holds
        server.close_resources()
    return {"applied": ack["applied"], "rejected": len(ack["rejected"]), "cpu_s": ack["seconds"],
            "wall_s": round(wall, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ads", type=int, default=20_000)
    ap.add_argument("--upserts", type=int, default=5_000)
    ap.add_argument("--trees", default="this", help="comma-separated: `this`, or a directory holding another checkout")
    ap.add_argument("--tree-commits", default=None, help="comma-separated, one per tree: what each tree is, recorded")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--inner", nargs=2, metavar=("DATA", "BODY"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        print(json.dumps(inner(*args.inner)))
        return 0
    sys.path.insert(0, str(ROOT))
    from andromeda_nb.corpus import generate_corpus
    from andromeda_nb.measure import software
    from andromeda_nb.provenance import report_probe
    from andromeda_nb.store import load_dataset
    from scripts.bench_update_stall import upsert_body

    trees = args.trees.split(",")
    commits = args.tree_commits.split(",") if args.tree_commits else trees
    if len(commits) != len(trees):
        ap.error("--tree-commits names one commit per tree")
    runs = []
    with tempfile.TemporaryDirectory(prefix="andromeda-call-") as tmp:
        data = Path(tmp) / "corpus"
        generate_corpus(data, args.ads, 16, args.seed)
        body = upsert_body(load_dataset(data), args.upserts, args.seed)
        body_path = Path(tmp) / "body.jsonl"
        body_path.write_bytes(body)
        for round_no in range(args.repeat):
            for tree, commit in zip(trees, commits):
                root = ROOT if tree == "this" else Path(tree).resolve()
                env = {**os.environ, "PYTHONPATH": str(root)}
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--inner", str(data), str(body_path)],
                                     cwd=root, env=env, capture_output=True, text=True, check=False)
                if out.returncode:
                    raise SystemExit(f"{tree}: exited with {out.returncode}: {out.stderr[-2000:]}")
                run = json.loads(out.stdout.strip().splitlines()[-1])
                per = {phase: round(1e6 * s / max(1, run["applied"]), 1) for phase, s in run["cpu_s"].items()}
                total = sum(run["cpu_s"].values())
                run.update(tree=tree, tree_commit=commit, round=round_no, cpu_us_per_upsert=per,
                           upserts_per_cpu_s=round(run["applied"] / total) if total else None)
                runs.append(run)
                print(f"{commit}: {run['applied']} upserts, CPU us per upsert {per} "
                      f"({run['upserts_per_cpu_s']} upserts per CPU second; wall {run['wall_s']} s)", file=sys.stderr)
    doc = {"kind": "update_call_cpu", "ads": args.ads, "upserts": args.upserts, "call_mb": round(len(body) / 1e6, 1),
           "runs": runs, "software": software()}
    report_probe(doc, "time_update_call.py", argv if argv is not None else sys.argv[1:], args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
