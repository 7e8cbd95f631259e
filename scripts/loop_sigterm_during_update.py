"""SIGTERM during a large update call, again and again (docs/RELIABILITY.md, section 6): the scenario of
`tests/serving/test_lifecycle.py::test_sigterm_during_a_large_update_call_acknowledges_it_or_applies_none_of_it`
as a loop, for a loaded machine or a cold compile cache, printing one JSON line per run.

Each run saves a corpus of 300 ads, starts the co-located server (CPU), sends one `update` call of
3,000 upserts, sends SIGTERM `--delays` seconds into it, and records the exit code, the seconds from
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

from andromeda_nb import store  # noqa: E402
from andromeda_nb.dataset import Dataset  # noqa: E402
from andromeda_nb.model import MoeModel, quantize  # noqa: E402
from andromeda_nb.testing import random_ads, random_requests, random_updates, update_to_json  # noqa: E402
from serving import protocol as fl  # noqa: E402
from serving.services import ServiceProcess  # noqa: E402

D, F = 16, 8  # the test's corpus: 300 ads of 16-wide embeddings, 8 formats


def corpus_and_body(path: Path, n_ads: int = 300, n_updates: int = 3000) -> tuple[Path, str]:
    """The test's corpus (seed 64) saved at `path`, and its call of valid updates (seed 9) as JSON Lines."""
    rng = np.random.default_rng(64)
    ads = random_ads(rng, n_ads, dim=D, formats=F)
    dataset = Dataset(ads=ads, embeddings=quantize(np.stack([a.embedding for a in ads]), "fp32"),
                      requests=random_requests(rng, 3), model=MoeModel.init(64, D=D, F=F), seed=0, precision="fp32")
    store.save_dataset(dataset, path)
    updates = random_updates(np.random.default_rng(9), store.load_dataset(path).ads, n_updates, dim=D, formats=F)
    return path, "\n".join(json.dumps(update_to_json(u)) for u in updates)


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
