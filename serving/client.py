"""The client side of a running server, for a person (`andromeda query`, `andromeda health`): requests
read from JSON Lines or a corpus directory, top-K asked over the `["retrieve"]` exchange of either
architecture, and the server's `health`.

    requests, rejected = read_requests("requests.jsonl")          # or a corpus directory
    result = query("grpc://127.0.0.1:8815", requests, k=10)         # QueryResult
    health("grpc://127.0.0.1:8815")                                 # {"status": "ok", ...}

A server that asks for a token or TLS (`serving.guard`) is given `credentials`
(`ClientCredentials`: a reader token, the CA of its certificate, a client certificate).

The server validates every request (DESIGN section 2, the same parser as `import`); a batch it
refuses as invalid is sent again one request at a time, so each bad request is reported with the
server's reason and every valid one is still answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from andromeda_nb import jsontext
from andromeda_nb.batching import in_batches

from .guard import ClientCredentials, connect
from .protocol import DEFAULT_CLIENT_BATCH, flight_action, location_of, retrieve_endpoints, retrieve_over_flight


class ServerUnreachable(RuntimeError):
    """No server answers at the address (not started, another port, another host)."""


@dataclass
class QueryResult:
    request_ids: list[int] = field(default_factory=list)  # the answered requests, in the order asked
    answers: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (ad ids, scores) each
    rejected: list[str] = field(default_factory=list)  # "request R: why", from the server


def read_requests(source) -> tuple[list[dict], list[str]]:
    """Request objects (each with an int `request_id`) from a JSON Lines file, or from a corpus
    directory's requests; and the lines that cannot be sent ("line N: why": not UTF-8, not JSON,
    nested too deep, a repeated key, not an object, no int request_id, a request id seen before; read
    by `andromeda_nb.jsontext`). What the server checks is left to it."""
    path = Path(source)
    if path.is_dir():
        return _corpus_requests(path), []
    objects, rejected, seen = [], [], set()
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ValueError(f"{source}: cannot be read ({exc.strerror})") from None
    with fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                obj = jsontext.loads(raw)
            except ValueError as exc:
                rejected.append(f"line {line_no}: {exc}")
                continue
            rid = obj.get("request_id") if isinstance(obj, dict) else None
            if not isinstance(obj, dict):
                rejected.append(f"line {line_no}: a request must be a JSON object")
            elif not isinstance(rid, int) or isinstance(rid, bool):
                rejected.append(f"line {line_no}: request_id: is required (an int)")
            elif rid in seen:
                rejected.append(f"line {line_no}: request {rid}: request_id: repeats an earlier request")
            else:
                seen.add(rid)
                objects.append(obj)
    return objects, rejected


def _corpus_requests(root: Path) -> list[dict]:
    from andromeda_nb.store import REQUESTS_FILE, REQUESTS_SCHEMA, StoreError, _read_parquet, read_meta

    read_meta(root)
    try:
        table = _read_parquet(root / REQUESTS_FILE, REQUESTS_SCHEMA)
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    ids = table.column("request_id").to_pylist()
    texts = table.column("request").to_pylist()
    return [{**jsontext.loads(text), "request_id": int(rid)} for rid, text in zip(ids, texts)]


def _unreachable(location: str, exc: Exception) -> ServerUnreachable:
    return ServerUnreachable(f"no server answers at {location} ({type(exc).__name__}); is it running? "
                             "`andromeda serve ...` prints its address")


def _invalid(exc: Exception) -> str | None:
    """The server's reason when `exc` is its refusal of invalid input, else None."""
    text = str(exc)
    marker = "invalid request: "
    if marker not in text:
        return None
    return text[text.index(marker) + len(marker):].splitlines()[0].split(". Detail:")[0].strip()


def query(location, requests: Sequence[dict], k: int, *, batch_size: int = DEFAULT_CLIENT_BATCH,
          timeout: float | None = 60.0, credentials: ClientCredentials | None = None,
          follow_endpoints: bool = True) -> QueryResult:
    """Top-K of each request from the server at `location` (either architecture). A batch refused as
    invalid is asked again one request at a time: each refused request goes to `rejected` with the
    server's reason, the others are answered. With `follow_endpoints`, when the server lists other
    locations for its retrieve exchange (`serve colocated --engines N --endpoints`: its engine workers'
    own servers), one of them is asked instead (chosen by this process's id, so many clients spread
    over them), and the server itself once that one is gone."""
    import pyarrow.flight as flight

    location = location_of(location)
    result = QueryResult()
    try:
        client = connect(location, credentials)
    except flight.FlightError as exc:
        raise _unreachable(location, exc) from None
    try:
        asked = _endpoint_client(location, client, credentials, timeout) if follow_endpoints else None
    except flight.FlightUnavailableError as exc:
        client.close()
        raise _unreachable(location, exc) from None
    except BaseException:  # refused (no token, a wrong one): the caller says so
        client.close()
        raise

    def ask(part: Sequence[dict]) -> list:
        nonlocal asked
        if asked is not None:
            try:
                return retrieve_over_flight(asked[0], part, k, timeout=timeout, batch_size=len(part), client=asked[1])
            except flight.FlightUnavailableError:  # the worker behind the endpoint ended: the server answers
                asked[1].close()
                asked = None
        return retrieve_over_flight(location, part, k, timeout=timeout, batch_size=len(part), client=client)

    try:
        for part in in_batches(list(requests), batch_size):
            try:
                answers = ask(part)
            except flight.FlightUnavailableError as exc:
                raise _unreachable(location, exc) from None
            except flight.FlightServerError as exc:
                if _invalid(exc) is None:
                    raise
                answers = None
            if answers is not None:
                result.request_ids += [int(r["request_id"]) for r in part]
                result.answers += answers
                continue
            for request in part:  # one at a time: which ones are invalid, and the others answered
                try:
                    answer = ask([request])[0]
                except flight.FlightServerError as exc:
                    reason = _invalid(exc)
                    if reason is None:
                        raise
                    result.rejected.append(reason)
                    continue
                result.request_ids.append(int(request["request_id"]))
                result.answers.append(answer)
    finally:
        client.close()
        if asked is not None:
            asked[1].close()
    return result


def _endpoint_client(location: str, client, credentials, timeout):
    """(endpoint, its client) for `query` when the server at `location` lists endpoints of its retrieve
    exchange, else None (one picked by this process's id; one that does not connect: the server)."""
    import os

    import pyarrow.flight as flight

    endpoints = retrieve_endpoints(location, client=client, timeout=timeout)
    if not endpoints:
        return None
    endpoint = endpoints[os.getpid() % len(endpoints)]
    try:
        return endpoint, connect(endpoint, credentials)
    except flight.FlightError:
        return None


def health(location, timeout: float = 10.0, credentials: ClientCredentials | None = None) -> dict:
    """The server's `health` answer ({"status": "ok" | "degraded", "server": ..., ...})."""
    import pyarrow.flight as flight

    location = location_of(location)
    try:
        return flight_action(location, "health", timeout=timeout, credentials=credentials)
    except (flight.FlightUnavailableError, flight.FlightTimedOutError) as exc:
        raise _unreachable(location, exc) from None


def health_lines(answer: dict) -> list[str]:
    """A `health` answer as lines of "key: value" a person reads: nested objects flattened to dotted
    keys ("log.path: ..."), lists and other values as JSON (null, true, [1, 2]), text as it is."""
    import json

    lines: list[str] = []

    def add(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            lines.append(f"{prefix}: {value if isinstance(value, str) else json.dumps(value, default=str)}")

    add("", answer)
    return lines


__all__ = ["QueryResult", "ServerUnreachable", "health", "health_lines", "query", "read_requests"]
