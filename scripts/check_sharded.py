"""The sharded cluster against one engine over the whole pool: both get the same update stream, then
every request of the corpus; the answers (ad ids and scores, in rank order) must be equal. On a
machine with several GPUs each shard's replica is a Ray actor on its own GPU (`Cluster.start` asks
`num_gpus` = min(1, GPUs / replicas)); the result says where each replica ran.

    PYTHONPATH=. python3 scripts/check_sharded.py --data DIR --shards 2 --device gpu \
        --updates DIR/updates.jsonl --out FILE

Exits 1 when an answer differs (the first differences are printed), 0 when all are equal.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.bench import software, write_json  # noqa: E402
from andromeda_nb.provenance import host_info  # noqa: E402


def differences(got, want, requests, limit: int = 5) -> list[str]:
    """What differs between two lists of answers [(ad ids, scores)], request by request."""
    import numpy as np

    out = []
    for request, (ids, scores), (want_ids, want_scores) in zip(requests, got, want):
        if not (np.array_equal(ids, want_ids) and np.array_equal(scores, want_scores)):
            out.append(f"request {request.request_id}: {len(ids)} answers, ids {list(ids[:5])}..., want "
                       f"{len(want_ids)}, ids {list(want_ids[:5])}...")
            if len(out) == limit:
                break
    return out


def main(argv=None) -> int:
    from andromeda_nb.hostmem import keep_freed_memory

    keep_freed_memory()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--device", default="gpu", choices=("cpu", "gpu"))
    ap.add_argument("--updates", default=None, help="a JSON Lines update stream applied to both first")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from andromeda_nb.answers import apply_updates_file
    from andromeda_nb.devices import resolve
    from andromeda_nb.store import load_dataset
    from cluster import require_ray
    from migration.architectures import build_retriever

    ray = require_ray()
    resolve(args.device)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    dataset = load_dataset(args.data)
    seconds = {}
    t = time.monotonic()
    one = build_retriever(dataset, "colocated", args.device)
    seconds["one_engine_start"] = time.monotonic() - t
    t = time.monotonic()
    sharded = build_retriever(dataset, "sharded", args.device, shards=args.shards, progress=say)
    seconds["cluster_start"] = time.monotonic() - t
    try:
        applied = None
        if args.updates:
            t = time.monotonic()
            applied = [apply_updates_file(args.updates, [target], dataset)[0] for target in (one, sharded)]
            seconds["updates"] = time.monotonic() - t
            say(f"updates applied: {applied[0]} to the one engine, {applied[1]} to the cluster")
        requests = list(dataset.requests)
        t = time.monotonic()
        want = one.retrieve(requests, args.k)
        seconds["one_engine_answers"] = time.monotonic() - t
        t = time.monotonic()
        got = sharded.retrieve(requests, args.k)
        seconds["cluster_answers"] = time.monotonic() - t
        placed = []
        for row in sharded.cluster.router.replicas:
            for handle in row:
                d = ray.get(handle.actor.describe.remote())
                placed.append({key: d.get(key) for key in ("shard", "replica", "pid", "gpu", "ads", "seq")})
        diff = differences(got, want, requests)
    finally:
        sharded.close()
        one.close()
    equal = not diff and applied in (None, [applied[0], applied[0]])
    result = {"kind": "sharded_against_one_engine", "ads": dataset.n_ads, "requests": len(requests), "k": args.k,
              "shards": args.shards, "device": args.device, "updates_applied": applied, "equal": equal,
              "differences": diff, "replicas": placed, "seconds": {k: round(v, 2) for k, v in seconds.items()},
              "software": {**software(), "ray": ray.__version__}, "host": host_info(),
              "command": shlex.join(["python3", "scripts/check_sharded.py", *(argv if argv is not None else sys.argv[1:])])}
    say(f"{args.shards} shards on {args.device} against one engine, {len(requests)} requests, k = {args.k}: "
        f"{'equal' if equal else 'DIFFERENT'}; replicas on GPU(s) {[p['gpu'] for p in placed]}")
    for line in diff:
        say("  " + line)
    if args.out:
        write_json(result, args.out)
    print(json.dumps({"equal": equal, "replicas": placed}))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
