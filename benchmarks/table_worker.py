"""An engine worker process (`migration.engine_worker`) whose engine is an answer table
(`benchmarks.clients.AnswerTable`, computed by the CPU engine when the worker starts): behind the
co-located front (`serving.engine_front`) it serves at the front's and the workers' own ceiling, with
no engine time (`scripts/probe_served_ceiling.py --engines N`). Its configuration takes three keys of
its own: `table_k` (the answers' length), `engine_ms` (a wait a batch without the interpreter lock,
as a device's) and `engine_host_ms` (host work a batch holding it, as an engine's host share). The
table looks requests up by what they hold, so it answers the batches of fronts too (`--fronts`),
which number their requests afresh."""

from __future__ import annotations

import sys


def build_table(dataset, config: dict, say=None):
    from benchmarks.clients import AnswerTable

    table = AnswerTable.computed(dataset, int(config.get("table_k", 100)), float(config.get("engine_ms", 0.0)) / 1e3,
                                 host_s=float(config.get("engine_host_ms", 0.0)) / 1e3)
    if say is not None:
        say(f"answer table of {len(table.answers)} requests")
    return table


if __name__ == "__main__":
    from migration.engine_worker import main

    sys.exit(main(build=build_table))
