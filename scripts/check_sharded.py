"""`andromeda serve cluster` against one engine over the whole pool: the front is started as a process
(its own local Ray), both get the same update stream (the front through its `update` action), then
every request of the corpus (the front through a plain Flight exchange); the answers (ad ids and
scores, in rank order) must be equal. On a machine with several GPUs each shard's replica is a Ray
actor on its own GPU (`Cluster.start` asks `num_gpus` = min(1, GPUs / replicas)); the front's
`health` says where each shard runs, and the result records it.

    PYTHONPATH=. python3 scripts/check_sharded.py --data DIR --shards 2 --device gpu \
        --updates DIR/updates.jsonl --out FILE

Exits 1 when an answer differs (the first differences are printed), 0 when all are equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import software, write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402

BATCH = 256  # requests per request batch to the front


def differences(got, want, requests, limit: int = 5) -> list[str]:
    """What differs between two lists of answers [(ad ids, scores)], request by request."""
    import numpy as np

    out = []
    if len(got) != len(want):
        out.append(f"{len(got)} answers for {len(want)} requests")
    for request, (ids, scores), (want_ids, want_scores) in zip(requests, got, want):
        if not (np.array_equal(ids, want_ids) and np.array_equal(scores, want_scores)):
            out.append(f"request {request.request_id}: {len(ids)} answers, ids {list(ids[:5])}..., want "
                       f"{len(want_ids)}, ids {list(want_ids[:5])}...")
            if len(out) == limit:
                break
    return out


def main(argv=None) -> int:
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--device", default="gpu", choices=("cpu", "gpu"))
    ap.add_argument("--updates", default=None, help="a JSON Lines update stream applied to both first")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from serving import protocol as fl
    from andromeda_nb.answers import apply_updates_file
    from andromeda_nb.devices import resolve
    from serving.services import ServiceProcess
    from andromeda_nb.store import load_dataset
    from cluster import require_ray
    from migration.architectures import build_retriever

    ray = require_ray()
    resolve(args.device)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    dataset = load_dataset(args.data)
    requests = list(dataset.requests)
    seconds = {}
    t = time.monotonic()
    say(f"starting `serve cluster` with {args.shards} shard(s) on {args.device}")
    front = ServiceProcess("cli", ["serve", "cluster", "--data", args.data, "--shards", str(args.shards), "--device",
                                   args.device, "--port", "0", "--log-dir", "off", "-q"], name="serve cluster",
                           start_timeout_s=600)
    seconds["front_start"] = time.monotonic() - t
    one = None
    try:
        t = time.monotonic()
        one = build_retriever(dataset, "colocated", args.device)
        seconds["one_engine_start"] = time.monotonic() - t
        applied = None
        if args.updates:
            t = time.monotonic()
            ack = fl.send_updates(front.location, Path(args.updates).read_bytes(), timeout=600)
            applied = [apply_updates_file(args.updates, [one], dataset)[0], ack["applied"]]
            seconds["updates"] = time.monotonic() - t
            say(f"updates applied: {applied[0]} to the one engine, {applied[1]} by the front")
        t = time.monotonic()
        want = one.retrieve(requests, args.k)
        seconds["one_engine_answers"] = time.monotonic() - t
        t = time.monotonic()
        got = []
        for lo in range(0, len(requests), BATCH):
            got += fl.retrieve_over_flight(front.location, requests[lo : lo + BATCH], args.k, timeout=600)
        seconds["front_answers"] = time.monotonic() - t
        health = fl.flight_action(front.location, "health")
        placed = [{key: s.get(key) for key in ("shard", "gpu", "ads", "log_seq")} for s in health["shard_state"]]
        diff = differences(got, want, requests)
    finally:
        if one is not None:
            one.close()
        front.stop()
    equal = not diff and (applied is None or applied[0] == applied[1])
    result = {"kind": "serve_cluster_against_one_engine", "ads": dataset.n_ads, "requests": len(requests),
              "k": args.k, "shards": args.shards, "device": args.device, "updates_applied": applied, "equal": equal,
              "differences": diff, "shard_state": placed, "seconds": {k: round(v, 2) for k, v in seconds.items()},
              "software": {**software(), "ray": ray.__version__}}
    stamp(result, command=script_command("check_sharded.py", argv if argv is not None else sys.argv[1:]))
    say(f"serve cluster, {args.shards} shards on {args.device}, against one engine, {len(requests)} requests, "
        f"k = {args.k}: {'equal' if equal else 'DIFFERENT'}; shards on GPU(s) {[p['gpu'] for p in placed]}")
    for line in diff:
        say("  " + line)
    if args.out:
        write_json(result, args.out)
    print(json.dumps({"equal": equal, "shard_state": placed}))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
