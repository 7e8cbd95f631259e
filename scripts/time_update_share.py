"""How closely an update call keeps to its CPU share on this machine's real clock (`ServiceLimits.
update_cpu_share`, `serving.durable.UpdateJournal._keep_share`).

tests/serving/test_limits.py checks the pacing exactly on a simulated clock; this measures what the same
journal does with time.monotonic and time.sleep, where the machine's load stretches both the work and
the pauses. One call of `--lines` retire updates is applied in slices of `--slice` lines, each slice
`--slice-ms` of busy work, with a retrieval arriving before every slice (so the share applies), once
per share in `--shares`, `--repeat` times each. Printed per share: the working share measured (work /
the call's time, the last slice left out: no pause follows it), the pauses taken against the pauses
that leave exactly the share, and the call's time. On an idle machine the measured share is within a
few percent of the asked one; on a loaded one it falls below it (the pauses are sleeps, and the
scheduler wakes the thread late), never above it by more than a pause's rounding.

    PYTHONPATH=. python3 scripts/time_update_share.py --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.provenance import finish_probe  # noqa: E402


def busy(seconds: float) -> None:
    """Work on the CPU for `seconds` (a slice's applying; a sleep would leave the core idle)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def one_call(share: float, lines: int, slice_lines: int, slice_s: float) -> dict:
    from serving.durable import ReadGate, UpdateJournal
    from serving.limits import ServiceLimits
    from serving.wal import WriteAheadLog

    gate = ReadGate()
    journal = UpdateJournal(WriteAheadLog.memory("share"), seed=1, dim=8, formats=2, gate=gate,
                            limits=ServiceLimits(update_slice=slice_lines, update_cpu_share=share))
    work: list[float] = []
    ends: list[float] = []

    def apply(items):
        with gate.reading():  # a retrieval batch arrives between the slices
            pass
        t0 = time.perf_counter()
        busy(slice_s)
        work.append(time.perf_counter() - t0)
        ends.append(time.perf_counter())
        return None

    body = "\n".join(json.dumps({"op": "retire", "ad_id": i}) for i in range(1, lines + 1)).encode()
    journal.submit(body, live=lambda ad_id: True, apply=apply)
    span = ends[-2] - (ends[0] - work[0])  # first slice's start to the end of the last slice a pause follows
    worked = sum(work[:-1])
    return {"working_share": worked / span, "paused_s": journal.paused_s,
            "pause_for_exact_share_s": worked * (1 / share - 1) if share < 1 else 0.0, "call_s": ends[-1] - ends[0]
            + work[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shares", default="1,0.5,0.25,0.1", help="update CPU shares, comma-separated")
    ap.add_argument("--lines", type=int, default=400, help="update lines in the call")
    ap.add_argument("--slice", type=int, default=4, help="lines per slice (ServiceLimits.update_slice)")
    ap.add_argument("--slice-ms", type=float, default=3.0, help="busy work per slice, milliseconds")
    ap.add_argument("--repeat", type=int, default=5, help="calls per share (medians reported)")
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    args = ap.parse_args(argv)
    if min(args.lines, args.slice, args.repeat) < 1 or args.slice_ms <= 0 or args.lines < 2 * args.slice:
        ap.error("--lines, --slice and --repeat must be positive, --lines at least two slices, --slice-ms > 0")

    rows = []
    for share in (float(x) for x in args.shares.split(",")):
        calls = [one_call(share, args.lines, args.slice, args.slice_ms / 1e3) for _ in range(args.repeat)]
        row = {"share": share, **{key: statistics.median(c[key] for c in calls) for key in calls[0]},
               "working_share_range": [min(c["working_share"] for c in calls), max(c["working_share"] for c in calls)]}
        rows.append(row)
        print(f"share {share:<5g} working {row['working_share']:.3f} ({row['working_share_range'][0]:.3f} to "
              f"{row['working_share_range'][1]:.3f} over {args.repeat} calls); paused {row['paused_s'] * 1e3:.1f} ms "
              f"of the {row['pause_for_exact_share_s'] * 1e3:.1f} ms that leave exactly the share; call "
              f"{row['call_s'] * 1e3:.1f} ms", file=sys.stderr)
    result = {"lines": args.lines, "slice": args.slice, "slice_ms": args.slice_ms, "repeat": args.repeat,
              "rows": rows}
    finish_probe(result, "time_update_share.py", argv if argv is not None else sys.argv[1:], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
