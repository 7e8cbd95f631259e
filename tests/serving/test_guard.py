"""Guarded services (issue 15, point 3): tokens through Flight middleware (a reader token to retrieve, an
admin token to update), TLS and mutual TLS, and the refusal to listen beyond loopback without
authentication unless told --insecure; on loopback without tokens everything works as before. Every
server here binds 127.0.0.1."""

from __future__ import annotations

import json

import pyarrow.flight as flight
import pytest
from click.testing import CliRunner

from serving import protocol as fl
from serving.guard import ClientCredentials, GuardError, ServerGuard, is_loopback
from serving.process import ServeError, ServerSettings, listen
from cpu_baseline.index_host import IndexHostServer
from cpu_baseline.scoring_service import ScoringServer

from tests.support.servers import colocated_server, lines_of, make_certificates, saved_corpus, stop, update_stream

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

READER, ADMIN = "reader-secret-0123456789", "admin-secret-0123456789"  # 16 characters at least


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return saved_corpus(tmp_path_factory.mktemp("guard") / "corpus", 41, n_ads=80, n_requests=3)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


def _creds(token=None, **files):
    return ClientCredentials.from_files(token=token, **files)


def test_tokens_a_reader_retrieves_an_admin_updates(corpus):
    _, dataset = corpus
    server = colocated_server(dataset, guard=ServerGuard(reader_token=READER, admin_token=ADMIN))
    loc = f"grpc://127.0.0.1:{server.port}"
    update = lines_of(update_stream(dataset, 1, 1))
    try:
        for creds, error in ((None, "needs a token"), (_creds("wrong"), "unknown token")):
            with pytest.raises(flight.FlightUnauthenticatedError, match=error):
                fl.retrieve_over_flight(loc, dataset.requests, 5, credentials=creds)
            with pytest.raises(flight.FlightUnauthenticatedError):
                fl.flight_action(loc, "update", update, credentials=creds)
        reader = _creds(READER)
        assert len(fl.retrieve_over_flight(loc, dataset.requests, 5, credentials=reader)) == len(dataset.requests)
        assert fl.flight_action(loc, "health", credentials=reader)["guard"] == {"tls": False, "mutual_tls": False,
                                                                               "tokens": True}
        with pytest.raises(flight.FlightUnauthorizedError, match="'update' needs the admin token"):
            fl.flight_action(loc, "update", update, credentials=reader)
        with pytest.raises(flight.FlightUnauthorizedError, match="'compact' needs the admin token"):
            fl.flight_action(loc, "compact", credentials=reader)
        admin = _creds(ADMIN)
        assert fl.flight_action(loc, "update", update, credentials=admin)["applied"] == 1
        assert fl.retrieve_over_flight(loc, dataset.requests, 5, credentials=admin)  # admin may read too
    finally:
        stop(server)


def test_remote_pair_with_tokens_the_scorer_refuses_strangers(corpus):
    _, dataset = corpus
    guard = ServerGuard(reader_token=READER, admin_token=ADMIN)
    scorer = ScoringServer(dataset, "grpc://127.0.0.1:0", guard=guard)
    scorer_loc = f"grpc://127.0.0.1:{scorer.port}"
    try:
        with pytest.raises(flight.FlightUnauthenticatedError):  # a host without the token cannot even start
            IndexHostServer(dataset, scorer_loc, "grpc://127.0.0.1:0", threads=1)
        host = IndexHostServer(dataset, scorer_loc, "grpc://127.0.0.1:0", threads=1, guard=guard,
                               scorer_credentials=_creds(ADMIN))
        try:
            loc = f"grpc://127.0.0.1:{host.port}"
            assert fl.flight_action(loc, "update", lines_of(update_stream(dataset, 3, 2)),
                                    credentials=_creds(ADMIN))["seq"] == 3
            assert fl.retrieve_over_flight(loc, dataset.requests, 5, credentials=_creds(READER))
            record = json.dumps({"seq": 4, "update": {"op": "retire", "ad_id": int(dataset.ad_ids[0])}})
            with pytest.raises(flight.FlightUnauthorizedError, match="needs the admin token"):
                fl.flight_action(scorer_loc, "update", record, credentials=_creds(READER))
        finally:
            host.shutdown()
            host.close_resources()
    finally:
        scorer.shutdown()


def test_tls_and_mutual_tls(corpus, certs):
    _, dataset = corpus
    server = colocated_server(dataset, guard=ServerGuard.from_files(tls_cert=certs["server"], tls_key=certs["server_key"]))
    try:
        loc = f"grpc+tls://127.0.0.1:{server.port}"
        assert fl.retrieve_over_flight(loc, dataset.requests, 5, credentials=_creds(tls_ca=certs["ca"]))
        with pytest.raises(flight.FlightError):  # a client that trusts another CA refuses the server
            fl.flight_action(loc, "health", credentials=_creds(tls_ca=certs["other_ca"]), timeout=5)
        with pytest.raises(flight.FlightError):  # plaintext to a TLS port
            fl.flight_action(f"grpc://127.0.0.1:{server.port}", "health", timeout=5)
    finally:
        stop(server)
    server = colocated_server(dataset, guard=ServerGuard.from_files(
        tls_cert=certs["server"], tls_key=certs["server_key"], tls_client_ca=certs["ca"]))
    try:
        loc = f"grpc+tls://127.0.0.1:{server.port}"
        with pytest.raises(flight.FlightError):  # no client certificate
            fl.flight_action(loc, "health", credentials=_creds(tls_ca=certs["ca"]), timeout=5)
        mutual = _creds(tls_ca=certs["ca"], tls_cert=certs["client"], tls_key=certs["client_key"])
        health = fl.flight_action(loc, "health", credentials=mutual)
        assert health["guard"] == {"tls": True, "mutual_tls": True, "tokens": False}
    finally:
        stop(server)


def test_under_mutual_tls_a_caller_without_a_certificate_never_reaches_the_server(corpus, certs, monkeypatch):
    """gRPC reads a `DoAction` body whole before the token check runs (docs/RELIABILITY.md, section 4):
    with tokens alone, a stranger's large action takes the server's memory while it is received.
    Mutual TLS refuses such a caller at the handshake, before any call exists: the token check never
    runs for it (it runs, and refuses, for a caller whose certificate the CA signed but who has no
    token). The memory itself: scripts/probe_unauthenticated_memory.py --mtls."""
    from serving import hostmem

    refused = []  # the server passes this to the token check as `on_refused` when it is made
    monkeypatch.setattr(hostmem, "request_give_back", lambda: refused.append(1))
    _, dataset = corpus
    server = colocated_server(dataset, guard=ServerGuard.from_files(
        admin_token=ADMIN, tls_cert=certs["server"], tls_key=certs["server_key"], tls_client_ca=certs["ca"]))
    loc = f"grpc+tls://127.0.0.1:{server.port}"
    body = b'{"op":"retire","ad_id":1}\n' * 320_000  # 8 MB
    try:
        stranger = fl.connect(loc, _creds(tls_ca=certs["ca"]))
        try:
            with pytest.raises(flight.FlightUnavailableError):
                list(stranger.do_action(flight.Action("update", body), options=flight.FlightCallOptions(timeout=10)))
        finally:
            stranger.close()
        assert refused == [], "a caller without a certificate reached the token check"
        certified = _creds(tls_ca=certs["ca"], tls_cert=certs["client"], tls_key=certs["client_key"])
        with pytest.raises(flight.FlightUnauthenticatedError):
            fl.flight_action(loc, "update", body, credentials=certified)
        assert refused == [1]
        admin = _creds(ADMIN, tls_ca=certs["ca"], tls_cert=certs["client"], tls_key=certs["client_key"])
        assert fl.flight_action(loc, "health", credentials=admin)["guard"] == {"tls": True, "mutual_tls": True,
                                                                              "tokens": True}
    finally:
        stop(server)


def test_exposure_without_authentication_is_refused_unless_insecure():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    with pytest.raises(GuardError, match="refusing to listen on 0.0.0.0 without authentication"):
        ServerGuard().check_exposure("0.0.0.0")
    ServerGuard(insecure=True).check_exposure("0.0.0.0")
    # tokens without TLS would cross the network in clear text: refused beyond loopback, unless --insecure
    with pytest.raises(GuardError, match="refusing to listen on 0.0.0.0 with tokens but without TLS"):
        ServerGuard(admin_token=ADMIN).check_exposure("0.0.0.0")
    ServerGuard(admin_token=ADMIN, insecure=True).check_exposure("0.0.0.0")
    ServerGuard(admin_token=ADMIN).check_exposure("127.0.0.1")
    ServerGuard(admin_token=ADMIN, tls_cert=b"-----BEGIN CERT", tls_key=b"-----BEGIN KEY").check_exposure("0.0.0.0")
    ServerGuard(tls_cert=b"-----BEGIN CERT", tls_key=b"-----BEGIN KEY",
                client_ca=b"-----BEGIN CA").check_exposure("0.0.0.0")  # mutual TLS: authenticated, encrypted
    with pytest.raises(GuardError, match="without authentication"):  # TLS alone admits anyone
        ServerGuard(tls_cert=b"-----BEGIN CERT", tls_key=b"-----BEGIN KEY").check_exposure("0.0.0.0")
    ServerGuard().check_exposure("127.0.0.1")
    with pytest.raises(GuardError, match="does not resolve"):
        ServerGuard().check_exposure("no-such-host.invalid")
    with pytest.raises(ServeError, match="refusing to listen"):
        listen(lambda location: pytest.fail("must not bind"), "0.0.0.0", 0)
    with pytest.raises(ServeError, match="needs both a certificate and its key"):
        ServerSettings.from_options(tls_cert="cert.pem")


def test_serve_commands_say_what_is_wrong_without_a_traceback(corpus, tmp_path):
    from cli import main

    root, dataset = corpus
    runner = CliRunner()
    busy = colocated_server(dataset)
    try:
        cases = {
            "refusing to listen on 0.0.0.0 without authentication": ["--host", "0.0.0.0"],
            "refusing to listen on 0.0.0.0 with tokens but without TLS": ["--host", "0.0.0.0"],
            "reader token: is 5 characters long": [],
            "host 'no-such-host.invalid' does not resolve": ["--host", "no-such-host.invalid"],
            f"port {busy.port} on 127.0.0.1 is not free": ["--port", str(busy.port)],
            "TLS certificate": ["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "k.pem")],
        }
        envs = {"refusing to listen on 0.0.0.0 with tokens but without TLS": {"ANDROMEDA_ADMIN_TOKEN": ADMIN},
                "reader token: is 5 characters long": {"ANDROMEDA_TOKEN": "short"}}
        for expected, extra in cases.items():
            for command in (["serve", "colocated", "--device", "cpu"], ["serve", "scorer"]):
                result = runner.invoke(main, [*command, "--data", str(root), *extra], env=envs.get(expected, {}))
                assert result.exit_code == 1, (command, extra, result.output)
                assert expected in result.output and "Traceback" not in result.output, result.output
    finally:
        stop(busy)
    assert not (root / "updates.log").exists()  # refused before the corpus's log was touched


def test_query_and_health_present_a_token_and_say_when_refused(corpus, tmp_path):
    """The client commands of a person (`andromeda query`, `andromeda health`) take --token (or
    $ANDROMEDA_TOKEN); without it a guarded server's refusal is one line, exit code 1."""
    from cli import main

    root, dataset = corpus
    server = colocated_server(dataset, guard=ServerGuard(reader_token=READER, admin_token=ADMIN))
    loc = f"grpc://127.0.0.1:{server.port}"
    runner = CliRunner()
    try:
        for command in (["health", "--server", loc], ["query", "--server", loc, "--data", str(root), "--k", "3"]):
            refused = runner.invoke(main, [*command, "--quiet"])
            assert refused.exit_code == 1 and "refused" in refused.output and "needs a token" in refused.output
            assert "Traceback" not in refused.output
            answered = runner.invoke(main, [*command, "--json", "--quiet", "--token", READER])
            assert answered.exit_code == 0, answered.output
            from_env = runner.invoke(main, [*command, "--json", "--quiet"], env={"ANDROMEDA_TOKEN": READER})
            assert from_env.exit_code == 0 and from_env.output == answered.output
        lines = runner.invoke(main, ["query", "--server", loc, "--data", str(root), "--k", "3", "--json",
                                     "--quiet", "--token", READER]).output.splitlines()
        assert [json.loads(x)["request_id"] for x in lines] == [int(r.request_id) for r in dataset.requests]
    finally:
        stop(server)


def test_tokens_that_cannot_work_are_refused_at_start(corpus, tmp_path):
    """A token no client could present (not ASCII), a short one, a reader token equal to the admin
    token, a token given twice or an empty token file: refused when the guard is made, naming the
    rule and never the token; through a serve command, one line and exit code 1."""
    from cli import main

    root, _ = corpus
    cases = {
        "not ASCII": dict(reader_token="\u00e9" * 20),
        "is 15 characters long; a server's token needs at least 16": dict(admin_token="x" * 15),
        "reader token equals the admin token": dict(reader_token=ADMIN, admin_token=ADMIN),
        "printable text without spaces": dict(admin_token="a b" * 8),
    }
    for expected, tokens in cases.items():
        with pytest.raises(GuardError, match=expected):
            ServerGuard(**tokens)
        with pytest.raises(ServeError, match=expected):
            ServerSettings.from_options(token=tokens.get("reader_token"), admin_token=tokens.get("admin_token"))
    ServerGuard(reader_token=READER, admin_token=ADMIN)  # 16 or more ASCII characters, two different ones
    token_file = tmp_path / "reader.token"
    token_file.write_text(READER + "\n")
    with pytest.raises(ServeError, match="--token and --token-file both give the token"):
        ServerSettings.from_options(token=READER, token_file=str(token_file))
    (tmp_path / "empty.token").write_text("\n")
    with pytest.raises(ServeError, match="--admin-token-file .*empty.token: is empty"):
        ServerSettings.from_options(admin_token_file=str(tmp_path / "empty.token"))
    with pytest.raises(ServeError, match="--token-file .*missing: cannot be read"):
        ServerSettings.from_options(token_file=str(tmp_path / "missing"))
    runner = CliRunner()
    for env in ({"ANDROMEDA_TOKEN": "\u00e9" * 20}, {"ANDROMEDA_TOKEN": READER, "ANDROMEDA_ADMIN_TOKEN": READER}):
        result = runner.invoke(main, ["serve", "colocated", "--device", "cpu", "--data", str(root)], env=env)
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert READER not in result.output  # the message names the rule, never the token
    assert not (root / "updates.log").exists()  # refused before the corpus's log was touched


def test_tokens_come_from_a_file_or_the_environment_and_a_command_line_token_is_warned_about(corpus, tmp_path,
                                                                                              monkeypatch):
    """Tokens are read from --token-file / --admin-token-file or $ANDROMEDA_TOKEN /
    $ANDROMEDA_ADMIN_TOKEN, so none needs the command line; a token given there still works, with a
    one-line warning on stderr that it shows in the process list (a serve command and a server
    process alike)."""
    import subprocess
    import sys

    from cli import main
    from serving.process import command_line_secret_warnings
    from serving.services import PROJECT_ROOT, ServiceProcess

    root, dataset = corpus
    (tmp_path / "reader.token").write_text(READER + "\n")
    (tmp_path / "admin.token").write_text(ADMIN)
    settings = ServerSettings.from_options(token_file=str(tmp_path / "reader.token"),
                                           admin_token_file=str(tmp_path / "admin.token"))
    assert (settings.guard.reader_token, settings.guard.admin_token) == (READER, ADMIN)
    monkeypatch.setenv("ANDROMEDA_TOKEN", READER)
    monkeypatch.setenv("ANDROMEDA_ADMIN_TOKEN", ADMIN)
    assert (ServerSettings.from_options().guard.reader_token, ServerSettings.from_options().guard.admin_token) == \
        (READER, ADMIN)
    monkeypatch.delenv("ANDROMEDA_TOKEN")
    monkeypatch.delenv("ANDROMEDA_ADMIN_TOKEN")
    assert command_line_secret_warnings({"token_file": "f", "admin_token_file": "g"}) == []
    warned = command_line_secret_warnings({"token": READER, "admin_token": ADMIN})
    assert len(warned) == 2 and all("process list" in line and READER not in line and ADMIN not in line
                                    for line in warned)

    # a serve command: the warning is one line on stderr (the refusal that follows ends the command here)
    runner = CliRunner()
    result = runner.invoke(main, ["serve", "colocated", "--device", "cpu", "--data", str(root), "--host", "0.0.0.0",
                                  "--token", READER, "--admin-token-file", str(tmp_path / "admin.token")])
    assert result.exit_code == 1
    assert [line for line in result.stderr.splitlines() if line.startswith("warning:")] == [
        "warning: --token on the command line shows in the process list (ps) to every user of this machine; "
        "give it in $ANDROMEDA_TOKEN or --token-file instead"]
    # the server process: tokens from a file and the environment, no warning, the tokens in force
    env = {"ANDROMEDA_ADMIN_TOKEN": ADMIN}
    proc = ServiceProcess("migration.colocated_server", ["--data", str(root), "--device", "cpu", "--port", "0",
                                                         "--log", "off", "--token-file", str(tmp_path / "reader.token")],
                          env=env)
    try:
        with pytest.raises(flight.FlightUnauthenticatedError):
            fl.flight_action(proc.location, "health")
        assert fl.flight_action(proc.location, "health", credentials=_creds(READER))["guard"]["tokens"] is True
        update = lines_of(update_stream(dataset, 1, 3))
        with pytest.raises(flight.FlightUnauthorizedError):
            fl.flight_action(proc.location, "update", update, credentials=_creds(READER))
        assert fl.flight_action(proc.location, "update", update, credentials=_creds(ADMIN))["applied"] == 1
    finally:
        assert proc.stop() == 0
    # ... and given on its command line, it says so on stderr
    child = subprocess.run([sys.executable, "-m", "migration.colocated_server", "--data", str(root), "--device", "cpu",
                            "--host", "0.0.0.0", "--admin-token", ADMIN], cwd=PROJECT_ROOT, capture_output=True,
                           text=True, timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert child.returncode == 2, child.stderr
    lines = child.stderr.splitlines()
    assert lines[0].startswith("warning: --admin-token on the command line shows in the process list")
    assert "with tokens but without TLS" in lines[1] and len(lines) == 2
