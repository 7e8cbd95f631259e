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


if __name__ == "__main__":
    main()
