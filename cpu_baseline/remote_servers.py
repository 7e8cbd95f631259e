"""Run the scoring service or the index host in the foreground (`andromeda serve scorer|remote`, and
`python -m cpu_baseline.remote_servers scorer|remote ...` for the processes `RemoteRetriever` starts).

When a server listens it writes one JSON line to stdout, `{"service": ..., "location":
"grpc://127.0.0.1:PORT"}`, so a parent that asked for port 0 learns the port. SIGTERM or SIGINT
stops it within `--stop-deadline` seconds (batches in flight finish; `serving.process`); with
`--parent-pid` it also stops when that process is gone.

The index host keeps the update log (by default `DIR/updates.log` beside its corpus; `--log PATH`,
or `--log off` for none) and replays it on start; the scoring service keeps none: its index host
re-delivers what it lacks.

The scoring service takes records only from its index host: signed with the pair's secret, which
both read from `$ANDROMEDA_PAIR_SECRET` (a parent starting both puts it there; never in the
arguments) or from `--pair-secret-file` (by default `DIR/pair.secret` beside the corpus, which the
scoring service makes at start when it is absent), or sent with the admin token.
"""

from __future__ import annotations

import argparse
import sys

from serving.protocol import location_of
from pathlib import Path

from serving.guard import PAIR_SECRET_FILE, ClientCredentials, GuardError, pair_secret
from serving.process import (ServeError, ServerSettings, add_server_arguments, listen, preflight, read_token,
                             serve_until_stopped, service_errors, settings_from_args)
from serving.services import announce, load_dataset_for_service, open_corpus

SCORER_TOKEN_ENV = "ANDROMEDA_SCORER_TOKEN"
PAIR_SECRET_HELP = ("File holding the secret the index host signs its records to the scoring service with, or "
                    "$ANDROMEDA_PAIR_SECRET [default: DIR/pair.secret beside the corpus; the scoring service makes it "
                    "when absent].")
SCORER_TOKEN_WARNING = ("warning: --scorer-token on the command line shows in the process list (ps) to every user of "
                        f"this machine; give it in ${SCORER_TOKEN_ENV} or --scorer-token-file instead")


def _announce(service: str, out=None):
    def on_ready(server):
        announce(service, server.announced_location, out)

    return on_ready


def scorer_pair_secret(data_dir, path=None, *, admin_token: str | None = None) -> str | None:
    """The scoring service's pair secret: $ANDROMEDA_PAIR_SECRET, else the file `path` (default
    `DATA_DIR/pair.secret`), made with a new secret when absent. A default file that cannot be made
    is no error when the service has an admin token (the index host then presents that): None."""
    default = path is None
    if default and data_dir is None:
        return pair_secret(None)
    try:
        return pair_secret(Path(data_dir) / PAIR_SECRET_FILE if default else path, create=True)
    except GuardError as exc:
        if default and admin_token:
            return None
        raise ServeError(str(exc)) from None


def host_pair_secret(data_dir, path=None) -> str | None:
    """The index host's pair secret: $ANDROMEDA_PAIR_SECRET, else the file `path` (which must hold
    one), else `DATA_DIR/pair.secret` when it is there (None: the host presents its token alone)."""
    try:
        secret = pair_secret(Path(data_dir) / PAIR_SECRET_FILE if path is None else path)
    except GuardError as exc:
        raise ServeError(str(exc)) from None
    if secret is None and path is not None:
        raise ServeError(f"pair secret {path}: no such file (the scoring service makes it at start: give the path "
                         "it uses)")
    return secret


def run_scorer(dataset, settings: ServerSettings | None = None, *, threads: int | None = None, delay_s: float = 0.0,
               on_ready=None, table=None, pair_secret_file=None) -> None:
    """Serve `dataset`'s embeddings for scoring until stopped (module docstring). `table`: the
    candidate table to score with (default: the CPU's, `cpu_baseline.candidates.CpuCandidateTable`;
    `migration.scorer_server` passes the GPU's). `pair_secret_file`: where the pair's secret is
    (`scorer_pair_secret`)."""
    from .scorer import set_threads
    from .scoring_service import ScoringServer

    settings = settings or ServerSettings()
    preflight(settings.host, settings.port, settings.guard)
    set_threads(threads)
    secret = scorer_pair_secret(getattr(dataset, "source_dir", None), pair_secret_file,
                                admin_token=settings.guard.admin_token)
    server = listen(lambda location: ScoringServer(dataset, location, delay_s=delay_s, limits=settings.limits,
                                                   guard=settings.guard, table=table, pair_secret=secret),
                    settings.host, settings.port, settings.guard)
    server.announced_location = settings.guard.location(settings.host, server.port)
    serve_until_stopped(server, server._stopping, on_ready or _announce("scorer"), deadline_s=settings.stop_deadline_s,
                        parent_pid=settings.parent_pid, busy=lambda: server.busy)


def scorer_credentials(settings: ServerSettings, *, token=None, token_file=None, ca=None, cert=None,
                       key=None) -> ClientCredentials:
    """How the index host presents itself to its scoring service: `token` (or the file `token_file`,
    else $ANDROMEDA_SCORER_TOKEN, else this host's own admin token: it sends updates), the CA of the
    service's certificate, and a client certificate for mutual TLS. A `token` given on the command
    line is warned about by the caller (it shows in the process list)."""
    try:
        token = read_token(token, token_file, SCORER_TOKEN_ENV, "--scorer-token") or settings.guard.admin_token
    except GuardError as exc:
        raise ServeError(str(exc)) from None
    return ClientCredentials.from_files(token=token, tls_ca=ca, tls_cert=cert, tls_key=key)


def run_index_host(data, scorer: str, settings: ServerSettings | None = None, *, threads: int | None = None,
                   scorer_timeout_s: float = 10.0, credentials: ClientCredentials | None = None,
                   on_ready=None, pair_secret_file=None) -> None:
    """Serve the `["retrieve"]` exchange over the corpus directory `data` (its update log as
    `settings.log` says), scoring on the service at `scorer`, until stopped; its records signed with
    the pair's secret (`host_pair_secret`)."""
    from .index_host import IndexHostServer

    settings = settings or ServerSettings()
    preflight(settings.host, settings.port, settings.guard)
    secret = host_pair_secret(data, pair_secret_file)
    dataset, log = open_corpus(data, settings.log)
    try:
        server = listen(lambda location: IndexHostServer(
            dataset, location_of(scorer), location, scorer_timeout_s=scorer_timeout_s, threads=threads, log=log,
            limits=settings.limits, guard=settings.guard, scorer_credentials=credentials, scorer_secret=secret),
            settings.host, settings.port, settings.guard)
    except BaseException:
        if log is not None:
            log.close()
        raise
    server.announced_location = settings.guard.location(settings.host, server.port)
    server.serve_until_stopped(on_ready or _announce("remote"), deadline_s=settings.stop_deadline_s,
                               parent_pid=settings.parent_pid)


def main(argv=None) -> int:
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (serving.hostmem)
    parser = argparse.ArgumentParser(prog="python -m cpu_baseline.remote_servers", description=__doc__.split("\n")[0])
    parser.add_argument("service", choices=("scorer", "remote"))
    parser.add_argument("--data", help="corpus directory")
    add_server_arguments(parser)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--scorer", help="scoring service address (remote only)")
    parser.add_argument("--scorer-timeout", type=float, default=10.0)
    parser.add_argument("--scorer-token", default=None, help="prefer $ANDROMEDA_SCORER_TOKEN or --scorer-token-file")
    parser.add_argument("--scorer-token-file", default=None)
    parser.add_argument("--scorer-ca", default=None)
    parser.add_argument("--scorer-cert", default=None)
    parser.add_argument("--scorer-key", default=None)
    parser.add_argument("--pair-secret-file", default=None, help=PAIR_SECRET_HELP)
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)  # test hook: slow scorer
    args = parser.parse_args(argv)
    if args.service == "remote" and not args.scorer:
        parser.error("remote needs --scorer ADDRESS")
    with service_errors(f"{args.service}"):
        settings = settings_from_args(args)
        if args.service == "scorer":
            run_scorer(load_dataset_for_service(args.data), settings, threads=args.threads, delay_s=args.delay,
                       pair_secret_file=args.pair_secret_file)
        else:
            if args.scorer_token is not None:
                print(SCORER_TOKEN_WARNING, file=sys.stderr, flush=True)
            credentials = scorer_credentials(settings, token=args.scorer_token, token_file=args.scorer_token_file,
                                             ca=args.scorer_ca, cert=args.scorer_cert, key=args.scorer_key)
            run_index_host(args.data, args.scorer, settings, threads=args.threads,
                           scorer_timeout_s=args.scorer_timeout, credentials=credentials,
                           pair_secret_file=args.pair_secret_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
