"""`andromeda`: the command line of andromeda-nb. It parses options and prints; the work is in the
library (`andromeda_nb`, `cpu_baseline`, `gpu`). Data goes to stdout, progress and logs to stderr."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="andromeda-nb")
def main():
    """GPU ads retrieval by model-system co-design: run, compare and measure a remote-scoring CPU
    architecture and a co-located GPU one on the same corpus."""


@main.group()
def serve():
    """Run one service in the foreground on 127.0.0.1."""


@main.group()
def bench():
    """Benchmarks (DESIGN section 7): print a table and write JSON."""

# --- remote-scoring services and CPU benchmark (cpu_baseline) ------------------------------------------


def _service_dataset(data: str):
    from andromeda_nb.store import StoreError
    from cpu_baseline.serve import load_dataset_for_service

    try:
        return load_dataset_for_service(data)
    except (StoreError, OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load corpus {data}: {exc}") from None


@serve.command("scorer")
@click.option("--data", required=True, type=click.Path(exists=True, file_okay=False), help="Corpus directory.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=0, show_default=True, help="Port (0: a free one, printed on stdout).")
@click.option("--threads", type=int, default=None, help="Scoring threads (default: all cores).")
def serve_scorer(data, host, port, threads):
    """The remote scoring service: holds the ad embeddings, scores candidate lists (Arrow Flight).

    Prints {"service": "scorer", "location": ...} on stdout once listening; SIGTERM stops it."""
    from cpu_baseline.serve import run_scorer

    run_scorer(_service_dataset(data), host=host, port=port, threads=threads)


@serve.command("remote")
@click.option("--data", required=True, type=click.Path(exists=True, file_okay=False), help="Corpus directory.")
@click.option("--scorer", "scorer_address", required=True, help="Scoring service address (host:port).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=0, show_default=True, help="Port (0: a free one, printed on stdout).")
@click.option("--threads", type=int, default=None, help="Matching threads (default: all cores).")
@click.option("--scorer-timeout", default=10.0, show_default=True, help="Seconds to wait for the scorer.")
def serve_remote(data, scorer_address, host, port, threads, scorer_timeout):
    """The index host: serves the ["retrieve"] exchange, matching on the CPU and scoring remotely.

    Prints {"service": "remote", "location": ...} on stdout once listening; SIGTERM stops it."""
    import pyarrow.flight as flight

    from cpu_baseline.serve import run_index_host

    dataset = _service_dataset(data)
    try:
        run_index_host(dataset, scorer_address, host=host, port=port, threads=threads,
                       scorer_timeout_s=scorer_timeout)
    except (RuntimeError, flight.FlightError) as exc:
        raise click.ClickException(str(exc)) from None


@bench.command("cpu")
@click.option("--ads", "n_ads", default=200_000, show_default=True, help="Pool size (ads).")
@click.option("--requests", "n_requests", default=64, show_default=True, help="Requests for match and end-to-end.")
@click.option("--k", default=100, show_default=True, help="Top-K of the end-to-end runs.")
@click.option("--seed", default=1, show_default=True, help="Corpus seed.")
@click.option("--precision", "precisions", multiple=True, default=("fp32", "fp16", "int8"), show_default=True,
              type=click.Choice(["fp32", "fp16", "int8"]), help="Storage precisions to score.")
@click.option("--e2e-precision", default="int8", show_default=True, type=click.Choice(["fp32", "fp16", "int8"]),
              help="Storage precision of the end-to-end run.")
@click.option("--repeat", default=5, show_default=True, help="Repetitions per timing (median reported).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here.")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def bench_cpu(n_ads, n_requests, k, seed, precisions, e2e_precision, repeat, out, quiet):
    """Remote-scoring baseline: CPU match (pool ads/s), CPU scorer (ads/s, GB/s against this machine's
    measured copy bandwidth) and end-to-end requests/s with p50/p99 latency over Flight."""
    import json

    from cpu_baseline.bench import format_table, run_cpu_bench

    log = (lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True))
    result = run_cpu_bench(n_ads=n_ads, n_requests=n_requests, k=k, seed=seed, precisions=precisions,
                           e2e_precision=e2e_precision, repeat=repeat, log=log)
    click.echo(format_table(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        log(f"wrote {out}")


if __name__ == "__main__":
    main()
