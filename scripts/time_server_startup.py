"""How long `serve colocated` takes to be ready on a corpus: from the process's start to its announcement
(it listens only once the corpus is loaded, its log replayed and every kernel compiled or loaded from
the cache). The first run may fill the compile cache; the runs after it read it.

    PYTHONPATH=. python3 scripts/time_server_startup.py --data DIR --device cpu --runs 3 --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402
from serving.services import ServiceProcess  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory")
    ap.add_argument("--device", default="cpu", help="the engine's device (cpu, gpu, sim, auto)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    seconds = []
    for i in range(args.runs):
        t = time.monotonic()
        proc = ServiceProcess("migration.colocated_server", ["--data", args.data, "--device", args.device, "--steps"], start_timeout_s=900)
        seconds.append(round(time.monotonic() - t, 2))
        proc.stop()
        print(f"run {i + 1}: ready in {seconds[-1]:.1f} s", file=sys.stderr, flush=True)
    meta = json.loads((Path(args.data) / "meta.json").read_text())
    out = {"kind": "server_startup", "ads": meta.get("counts", {}).get("ads"), "device": args.device,
           "ready_s": seconds}
    stamp(out, command=script_command("time_server_startup.py", argv if argv is not None else sys.argv[1:]))
    print(json.dumps(out))
    if args.out:
        write_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
