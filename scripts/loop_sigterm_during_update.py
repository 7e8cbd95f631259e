"""SIGTERM during a large update call, again and again (docs/RELIABILITY.md, section 6): the scenario of
`tests/serving/test_lifecycle.py::test_sigterm_during_a_large_update_call_acknowledges_it_or_applies_none_of_it`
as a loop, for a loaded machine or a cold compile cache, printing one JSON line per run.

Each run generates a corpus of 300 ads, starts the co-located server (CPU), sends one `update` call
of 3,000 upserts, sends SIGTERM `--delays` seconds into it, and records the exit code, the seconds from
SIGTERM to exit, and what the client got (the acknowledgement's phases and whether it says `stopped`,
or the error). `--cold` gives every server a new, empty NUMBA_CACHE_DIR (the compile cache of a new
environment). A server that has not ended `--wait-s` seconds after SIGTERM is reported as `"hang"`
and killed; its stderr (where a stuck server prints its threads' stacks, serving.process) is kept.

    PYTHONPATH=. python3 scripts/loop_sigterm_during_update.py --rounds 5 --delays 0.05,0.3,0.7,1.2,2.0
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow.flight as flight  # noqa: E402

from andromeda_nb.corpus import generate_corpus  # noqa: E402
from andromeda_nb.store import load_dataset  # noqa: E402
from andromeda_nb.targeting import ad_to_json  # noqa: E402
from serving import protocol as fl  # noqa: E402
from serving.services import ServiceProcess  # noqa: E402


def corpus_and_body(path: Path, n_ads: int = 300, n_upserts: int = 3000, seed: int = 9) -> tuple[Path, str]:
    """A generated corpus of `n_ads` at `path`, and one call of `n_upserts` upserts of its ads (every
    field replaced, a new embedding each) as JSON Lines."""
    generate_corpus(path, n_ads, 3, seed)
    dataset = load_dataset(path)
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n_upserts):
        ad = ad_to_json(dataset.ads[i % len(dataset.ads)])
        ad["embedding"] = np.round(rng.standard_normal(dataset.model.D) / 8, 6).tolist()
        lines.append(json.dumps({"op": "upsert", "ad": ad}, separators=(",", ":")))
    return path, "\n".join(lines)


def one_run(delay_s: float, cold: bool, wait_s: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="sigterm-loop-"))
    root, body = corpus_and_body(tmp / "corpus")
    env = {"NUMBA_CACHE_DIR": str(tmp / "numba-cache")} if cold else {}
    server = ServiceProcess("migration.colocated_server", ["--data", str(root), "--device", "cpu", "--port", "0"],
                            env=env, start_timeout_s=600)
    outcome: dict = {}

    def call():
        t = time.monotonic()
        try:
            outcome["ack"] = fl.flight_action(server.location, "update", body, timeout=120)
        except flight.FlightError as exc:
            outcome["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        outcome["call_s"] = round(time.monotonic() - t, 2)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(delay_s)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code, exit_s = server.proc.wait(wait_s), round(time.monotonic() - t0, 2)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        code, exit_s = "hang", None
    thread.join(60)
    ack = outcome.get("ack") or {}
    return {"delay_s": delay_s, "cold": cold, "code": code, "exit_s": exit_s, "call_s": outcome.get("call_s"),
            "seq": ack.get("seq"), "seconds": ack.get("seconds"), "stopped": "stopped" in ack,
            "error": outcome.get("error")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--delays", default="0.05,0.3,0.7,1.2,2.0", help="seconds into the call, comma-separated")
    parser.add_argument("--cold", action="store_true", help="a new, empty compile cache for every server")
    parser.add_argument("--wait-s", type=float, default=60.0, help="how long a server may take to end")
    args = parser.parse_args(argv)
    delays = [float(d) for d in args.delays.split(",")]
    hangs = 0
    for _ in range(args.rounds):
        for delay in delays:
            row = one_run(delay, args.cold, args.wait_s)
            hangs += row["code"] == "hang"
            print(json.dumps(row), flush=True)
    print(f"{hangs} of {args.rounds * len(delays)} servers did not end within {args.wait_s:g} s", file=sys.stderr)
    return 1 if hangs else 0


if __name__ == "__main__":
    sys.exit(main())
