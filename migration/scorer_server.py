"""The remote scoring service on any device (`andromeda serve scorer --device gpu|cpu|sim`, and
`python -m migration.scorer_server ...` for the process a remote retriever with `--scorer-device` starts).

The published 2024 design matched targeting on CPU index hosts and shipped every eligible candidate
to remote GPUs for scoring. This is that service: `cpu_baseline.scoring_service.ScoringServer` (the
same protocol, sequence numbers, limits and guard) holding the candidate table of its device: the
CPU's (`cpu_baseline.candidates.CpuCandidateTable`) or the GPU's (`gpu.candidates.GpuCandidateScorer`:
candidate ids resolved to rows and scored by gathering, on the device). Keeping the scoring service
and the co-located server apart on the same GPU separates what the GPU buys from what co-location
buys (`andromeda compare`'s three columns).
"""

from __future__ import annotations

import argparse
import sys

from andromeda_nb.devices import DEVICES, resolve
from cpu_baseline.remote_servers import PAIR_SECRET_HELP
from serving.process import ServerSettings, add_server_arguments, service_errors, settings_from_args
from serving.services import announce, load_dataset_for_service


def candidate_table(dataset, device: str):
    """The scoring service's table for `device` (resolved: 'cpu', 'gpu' or 'sim')."""
    if device == "cpu":
        from cpu_baseline.candidates import CpuCandidateTable

        return CpuCandidateTable.for_dataset(dataset)
    from gpu.candidates import GpuCandidateScorer

    return GpuCandidateScorer.for_dataset(dataset)


def run_scorer_on(dataset, settings: ServerSettings | None = None, *, device: str = "auto", threads=None,
                  on_ready=None, out=None, pair_secret_file=None) -> None:
    """Serve `dataset`'s embeddings for scoring on `device` ('auto': the GPU when usable, else the
    CPU) until SIGTERM or SIGINT."""
    from cpu_baseline.remote_servers import run_scorer

    where = resolve(device)
    table = candidate_table(dataset, where)

    def on_listening(server):
        announce("scorer", server.announced_location, out, device=where)

    run_scorer(dataset, settings, threads=threads, table=table, on_ready=on_ready or on_listening,
               pair_secret_file=pair_secret_file)


def main(argv=None) -> int:
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (serving.hostmem)
    parser = argparse.ArgumentParser(prog="python -m migration.scorer_server", description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="corpus directory")
    add_server_arguments(parser)  # --log is taken and unused: the index host keeps the log
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--pair-secret-file", default=None, help=PAIR_SECRET_HELP)
    args = parser.parse_args(argv)
    with service_errors("scorer"):
        settings = settings_from_args(args)
        resolve(args.device)  # before anything imports numba.cuda
        run_scorer_on(load_dataset_for_service(args.data), settings, device=args.device, threads=args.threads,
                      pair_secret_file=args.pair_secret_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
