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

READER, ADMIN = "reader-secret-1", "admin-secret-2"


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


def test_exposure_without_authentication_is_refused_unless_insecure():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    with pytest.raises(GuardError, match="refusing to listen on 0.0.0.0 without authentication"):
        ServerGuard().check_exposure("0.0.0.0")
    ServerGuard(insecure=True).check_exposure("0.0.0.0")
    ServerGuard(admin_token=ADMIN).check_exposure("0.0.0.0")
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
            "host 'no-such-host.invalid' does not resolve": ["--host", "no-such-host.invalid"],
            f"port {busy.port} on 127.0.0.1 is not free": ["--port", str(busy.port)],
            "TLS certificate": ["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "k.pem")],
        }
        for expected, extra in cases.items():
            for command in (["serve", "colocated", "--device", "cpu"], ["serve", "scorer"]):
                result = runner.invoke(main, [*command, "--data", str(root), *extra])
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
