"""What a decode costs a server whose other threads want the interpreter lock: the one-request calls
of many clients decoded together (`flight.decode_request_batches`), as JSON and as columnar batches,
alone and beside threads that keep the lock busy, at several thread switch intervals
(`sys.setswitchinterval`, Python's default 5 ms). Code that lets go of the lock often (Arrow calls;
a CUDA driver call through ctypes) waits for it to come back each time: up to a switch interval when
another thread holds it.

    PYTHONPATH=. python3 scripts/probe_gil_release.py --data DIR --out gil.json
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import median_ms, write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory (its requests are decoded)")
    ap.add_argument("--calls", type=int, default=16, help="one-request calls decoded together")
    ap.add_argument("--busy-threads", type=int, default=2, help="threads that keep the lock busy")
    ap.add_argument("--intervals-ms", default="5,1,0.2", help="switch intervals to try, comma-separated")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from serving import protocol as fl
    from andromeda_nb.store import load_requests, request_settings

    kw = request_settings(args.data)
    requests = load_requests(args.data)
    calls = {kind: [fl.encode_requests_for_exchange([requests[i % len(requests)]], 100, request_format=kind)[0][0]
                    for i in range(args.calls)] for kind in ("json", "columns")}
    for kind, batches in calls.items():  # both decode to the same requests before anything is timed
        got = [list(reqs)[0] for reqs, _ in fl.decode_request_batches(batches, **kw)]
        assert got == [requests[i % len(requests)] for i in range(args.calls)], kind
    default = sys.getswitchinterval()
    rows = []
    for interval in (float(x) for x in args.intervals_ms.split(",")):
        sys.setswitchinterval(interval / 1e3)
        row = {"switch_interval_ms": interval}
        row["quiet"] = {kind: median_ms(lambda b=b: fl.decode_request_batches(b, **kw), args.repeat)
                        for kind, b in calls.items()}
        stop = threading.Event()

        def busy():
            x = 0
            while not stop.is_set():
                x += 1

        threads = [threading.Thread(target=busy, daemon=True) for _ in range(args.busy_threads)]
        for t in threads:
            t.start()
        try:
            row["busy"] = {kind: median_ms(lambda b=b: fl.decode_request_batches(b, **kw), args.repeat)
                           for kind, b in calls.items()}
        finally:
            stop.set()
            for t in threads:
                t.join()
        rows.append(row)
        print(f"switch interval {interval:g} ms: quiet JSON {row['quiet']['json']:.2f} ms, columns "
              f"{row['quiet']['columns']:.2f} ms; beside {args.busy_threads} busy threads JSON "
              f"{row['busy']['json']:.2f} ms, columns {row['busy']['columns']:.2f} ms")
    sys.setswitchinterval(default)
    out = {"what": f"{args.calls} one-request calls decoded together, medians of {args.repeat}", "rows": rows,
           "busy_threads": args.busy_threads}
    stamp(out, command=script_command("probe_gil_release.py", argv if argv is not None else sys.argv[1:]))
    if args.out:
        write_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
