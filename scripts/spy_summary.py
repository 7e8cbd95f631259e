"""Summarize py-spy's raw (collapsed) stacks, as `scripts/bench_served.py --profile` writes them:
samples by process and thread, then the heaviest functions of each thread, inclusive (a function
counted once per sample it is on the stack) and self (the innermost frame).

    python3 scripts/spy_summary.py spy_stream_all.txt [--top 12] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

_PROCESS = re.compile(r'^process (\d+):"(.*)"$')
_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\):? ?(.*)$")


def parse(lines):
    """Yield (process, thread, frames, count) from raw collapsed stacks."""
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        process, thread = "", ""
        while frames:
            if frames[0].startswith("process ") and not frames[0].endswith('"') and len(frames) > 1:
                frames[:2] = [frames[0] + ";" + frames[1]]  # a command line with ';' in it
            elif m := _PROCESS.match(frames[0]):
                cmd = m.group(2)
                process = f"{m.group(1)} {cmd.split(' --')[0][-60:]}"
                frames = frames[1:]
            elif m := _THREAD.match(frames[0]):
                thread = m.group(1) or frames[0]
                frames = frames[1:]
            else:
                break
        yield process, thread, frames, int(count)


def summarize(lines, top: int = 12) -> dict:
    by_thread: dict = collections.defaultdict(lambda: {"samples": 0, "inclusive": collections.Counter(),
                                                       "self": collections.Counter()})
    for process, thread, frames, count in parse(lines):
        entry = by_thread[(process, re.sub(r"[-_ ]?\d+\b", "", thread).strip())]  # threads of one role together
        entry["samples"] += count
        for name in set(re.sub(r" \(.*:\d+\)$", "", f) for f in frames):
            entry["inclusive"][name] += count
        if frames:
            entry["self"][frames[-1]] += count
    total = sum(e["samples"] for e in by_thread.values()) or 1
    out = []
    for (process, thread), e in sorted(by_thread.items(), key=lambda kv: -kv[1]["samples"]):
        out.append({"process": process, "thread": thread, "samples": e["samples"], "share": e["samples"] / total,
                    "inclusive": e["inclusive"].most_common(top), "self": e["self"].most_common(top)})
    return {"samples": total, "threads": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with open(args.path) as f:
        result = summarize(f, args.top)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['samples']} samples")
    for t in result["threads"]:
        print(f"\n{t['share']:6.1%} {t['samples']:6d}  {t['process']} | {t['thread']}")
        for name, n in t["self"]:
            print(f"    self {n / t['samples']:6.1%}  {name[:140]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
