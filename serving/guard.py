"""Who may call a server: TLS, mutual TLS and bearer tokens, through Flight's own mechanisms.

* **TLS**: the server presents a certificate (`tls_certificates` of `FlightServerBase`) and listens
  on `grpc+tls://`; with a client CA it also requires every client to present a certificate that
  CA signed (mutual TLS: `verify_client`, `root_certificates`).
* **Tokens**: a reader token and an admin token, sent by clients in the `authorization` header
  (`Bearer TOKEN`) by a Flight client middleware, checked by a Flight server middleware before any
  handler runs. Once a token is configured, every call needs one: `retrieve`, `health` and `stats`
  take either token, `update` and `compact` (and the scoring service's sequenced updates) the admin
  token. Tokens are compared in constant time.
* **Token rules**, checked when a guard is made (at a server's start): a token is ASCII (a gRPC
  header carries nothing else, so no client could present another), printable, without spaces, and
  at least `MIN_TOKEN_CHARS` (16) characters; the reader token may not equal the admin token (a
  reader could then update).
* **Exposure**: a server that would listen on anything but loopback without authentication (tokens
  or mutual TLS), or with tokens but without TLS (the tokens would cross the network in clear
  text), refuses to start unless told `insecure`; on loopback without tokens everything works as
  before.

* **The pair's secret**: the scoring service takes its index host's log records only when they
  come with an HMAC-SHA256 made with a secret the pair shares (`sign_records`, `verify_records`), or
  from a caller holding the admin token. The secret never travels: a parent that starts both hands
  it to them in the environment (`$ANDROMEDA_PAIR_SECRET`), a person gives it as a file
  (`--pair-secret-file`, by default `DIR/pair.secret` beside the corpus, which the scoring service
  makes, mode 0600, when it is absent: `pair_secret`).

Server side: `ServerGuard` (from files: `ServerGuard.from_files`) gives the `FlightServerBase`
keyword arguments (`server_kwargs`), the location scheme, and `require(context, role)` for the
handlers. Client side: `ClientCredentials` and `connect(location, credentials)`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import pyarrow.flight as flight

READER, ADMIN = "reader", "admin"
AUTH_MIDDLEWARE = "auth"
AUTHORIZATION = "authorization"
MIN_TOKEN_CHARS = 16  # a server's tokens are at least this long (a client presents whatever it holds)


class GuardError(ValueError):
    """A guard that cannot be set up as asked (unreadable file, exposure without authentication)."""


def _read(path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise GuardError(f"{what} {path}: cannot be read ({exc.strerror})") from None
    if b"-----BEGIN" not in data:
        raise GuardError(f"{what} {path}: not a PEM file")
    return data


def _check_token(token: str | None, what: str, min_chars: int = 1) -> str | None:
    """`token` if it can travel in an `authorization` header and is at least `min_chars` long (the
    message names the rule it breaks, never the token); None stays None."""
    if token is None:
        return None
    if not token:
        raise GuardError(f"{what}: is empty")
    if not token.isascii():
        raise GuardError(f"{what}: holds characters that are not ASCII; a token travels in a gRPC header, which "
                         "carries ASCII only, so no client could present it: use ASCII letters, digits and "
                         "punctuation")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise GuardError(f"{what}: must be printable text without spaces")
    if len(token) < min_chars:
        raise GuardError(f"{what}: is {len(token)} characters long; a server's token needs at least {min_chars} "
                         "(e.g. `python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback address. GuardError when it does not
    resolve at all (an unresolvable --host)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise GuardError(f"host {host!r} does not resolve ({exc})") from None
    addresses = {info[4][0].split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


class _TokenCheck(flight.ServerMiddlewareFactory):
    """Reads `authorization: Bearer TOKEN` before the handler runs; an unknown or missing token ends
    the call as unauthenticated. The middleware instance carries the caller's role."""

    def __init__(self, tokens: dict[str, str], on_refused=None):
        super().__init__()
        self.tokens = tokens  # role -> token
        self.on_refused = on_refused  # called for each call refused here (its body may have been read whole)
        self.refused = 0

    def start_call(self, info, headers):
        try:
            return self._caller(headers)
        except flight.FlightUnauthenticatedError:
            self.refused += 1
            if self.on_refused is not None:
                self.on_refused()
            raise

    def _caller(self, headers):
        values = headers.get(AUTHORIZATION) or headers.get(AUTHORIZATION.title()) or []
        presented = None
        for value in values:
            value = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                presented = token.strip()
        if presented is None:
            raise flight.FlightUnauthenticatedError("this server needs a token (authorization: Bearer TOKEN)")
        role = None
        for name in (ADMIN, READER):  # the admin token may do everything a reader may
            token = self.tokens.get(name)
            if token is not None and hmac.compare_digest(token.encode(), presented.encode()):
                role = role or name
        if role is None:
            raise flight.FlightUnauthenticatedError("unknown token")
        return _Caller(role)


class _Caller(flight.ServerMiddleware):
    def __init__(self, role: str):
        super().__init__()
        self.role = role


@dataclass(frozen=True)
class ServerGuard:
    """How a server admits callers. All fields empty: as before (no TLS, no tokens)."""

    reader_token: str | None = None
    admin_token: str | None = None
    tls_cert: bytes | None = None  # PEM
    tls_key: bytes | None = None
    client_ca: bytes | None = None  # PEM: mutual TLS, clients need a certificate this CA signed
    insecure: bool = False

    def __post_init__(self):
        _check_token(self.reader_token, "reader token", MIN_TOKEN_CHARS)
        _check_token(self.admin_token, "admin token", MIN_TOKEN_CHARS)
        if self.reader_token is not None and self.reader_token == self.admin_token:
            raise GuardError("the reader token equals the admin token: every reader could update; give two "
                             "different tokens (or the admin token alone)")

    @classmethod
    def from_files(cls, *, token: str | None = None, admin_token: str | None = None, tls_cert=None,
                   tls_key=None, tls_client_ca=None, insecure: bool = False) -> "ServerGuard":
        """From the `serve` options: tokens as text, certificates and keys as PEM file paths."""
        if (tls_cert is None) != (tls_key is None):
            raise GuardError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if tls_client_ca is not None and tls_cert is None:
            raise GuardError("mutual TLS (--tls-client-ca) needs the server's own certificate (--tls-cert, --tls-key)")
        return cls(reader_token=token, admin_token=admin_token,
                   tls_cert=None if tls_cert is None else _read(tls_cert, "TLS certificate"),
                   tls_key=None if tls_key is None else _read(tls_key, "TLS key"),
                   client_ca=None if tls_client_ca is None else _read(tls_client_ca, "client CA"),
                   insecure=insecure)

    def to_json(self) -> dict:
        """Every field, JSON-ready (PEM as text): how a front hands its guard to its engine workers'
        own servers (`from_json`), over their private channel."""
        return {name: value.decode() if isinstance(value, bytes) else value for name, value in vars(self).items()}

    @classmethod
    def from_json(cls, fields: dict) -> "ServerGuard":
        pem = ("tls_cert", "tls_key", "client_ca")
        return cls(**{name: value.encode() if name in pem and value is not None else value
                      for name, value in fields.items()})

    @property
    def tokens(self) -> bool:
        return self.reader_token is not None or self.admin_token is not None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def authenticated(self) -> bool:
        """Callers prove who they are: a token or a client certificate."""
        return self.tokens or self.client_ca is not None

    @property
    def scheme(self) -> str:
        return "grpc+tls" if self.tls else "grpc"

    def location(self, host: str, port: int) -> str:
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{self.scheme}://{host}:{port}"

    def describe(self) -> dict:
        """For `health`: what is configured (never the secrets)."""
        return {"tls": self.tls, "mutual_tls": self.client_ca is not None, "tokens": self.tokens}

    def check_exposure(self, host: str) -> None:
        """Refuse to listen beyond loopback without authentication, or with tokens but without TLS
        (they would cross the network in clear text), unless `insecure` was given."""
        if is_loopback(host) or self.insecure:
            return
        if not self.authenticated:
            raise GuardError(f"refusing to listen on {host} without authentication: anyone who reaches the port "
                             "could send updates. Give tokens ($ANDROMEDA_TOKEN, $ANDROMEDA_ADMIN_TOKEN or "
                             "--token-file, --admin-token-file) with TLS (--tls-cert, --tls-key), or mutual TLS "
                             "(--tls-client-ca), or --insecure to accept the risk")
        if self.tokens and not self.tls:
            raise GuardError(f"refusing to listen on {host} with tokens but without TLS: every call would carry "
                             "its token in clear text to anyone on the network. Give --tls-cert and --tls-key, "
                             "or --insecure to accept the risk")

    def server_location(self, location: str) -> str:
        """`location` with the scheme this guard serves (`grpc+tls://` once there is a certificate)."""
        if self.tls and location.startswith("grpc://"):
            return "grpc+tls://" + location[len("grpc://"):]
        return location

    def server_kwargs(self, on_refused=None) -> dict:
        """Keyword arguments of `FlightServerBase` for this guard; `on_refused()`: called for each call
        refused for its token (a server gives the memory of its body back)."""
        kwargs: dict = {}
        if self.tokens:
            tokens = {role: t for role, t in ((READER, self.reader_token), (ADMIN, self.admin_token)) if t}
            kwargs["middleware"] = {AUTH_MIDDLEWARE: _TokenCheck(tokens, on_refused)}
        if self.tls:
            kwargs["tls_certificates"] = [flight.CertKeyPair(self.tls_cert, self.tls_key)]
        if self.client_ca is not None:
            kwargs["verify_client"] = True
            kwargs["root_certificates"] = self.client_ca
        return kwargs

    def caller_is_admin(self, context) -> bool:
        """Whether the caller presented the admin token (False on a server without tokens: there,
        nobody proved anything)."""
        if not self.tokens or context is None:
            return False
        return getattr(context.get_middleware(AUTH_MIDDLEWARE), "role", None) == ADMIN

    def require(self, context, role: str, what: str) -> None:
        """In a handler: the caller must hold `role` (READER: either token; ADMIN: the admin token).
        Nothing to check when no token is configured."""
        if not self.tokens or context is None:
            return
        caller = context.get_middleware(AUTH_MIDDLEWARE)
        held = getattr(caller, "role", None)
        if held == ADMIN or (role == READER and held == READER):
            return
        raise flight.FlightUnauthorizedError(f"{what} needs the {role} token")


OPEN = ServerGuard()  # loopback, no TLS, no tokens: the default


# --- the pair's secret (index host and scoring service) -----------------------------------------------

PAIR_SECRET_ENV = "ANDROMEDA_PAIR_SECRET"
PAIR_SECRET_FILE = "pair.secret"  # beside the corpus, by default
_MAC_KEY = b'{"pair_mac":"'


def new_pair_secret() -> str:
    """A fresh secret for a pair: 64 hex characters (256 bits)."""
    return secrets.token_hex(32)


def pair_secret(path=None, *, create: bool = False) -> str | None:
    """The pair's secret: $ANDROMEDA_PAIR_SECRET, else the text of the file `path`; None when neither
    holds one. With `create`, a file that is absent is made (mode 0600, never through a link) with a
    new secret: the scoring service makes the pair's secret at start. GuardError when the file
    cannot be read or made, or is empty."""
    env = os.environ.get(PAIR_SECRET_ENV)
    if env:
        return env
    if path is None:
        return None
    path = Path(path)
    if create and not path.exists() and not path.is_symlink():
        secret = new_pair_secret()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secret + "\n")
        except FileExistsError:
            pass  # made meanwhile by the other of the pair: read below
        except OSError as exc:
            raise GuardError(f"pair secret {path}: cannot be made ({exc.strerror}); give ${PAIR_SECRET_ENV} or "
                             "--pair-secret-file PATH in a writable place") from None
        else:
            return secret
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise GuardError(f"pair secret {path}: cannot be read ({exc.strerror})") from None
    if not text:
        raise GuardError(f"pair secret {path}: is empty")
    return text


def _mac(secret: str, body: bytes) -> str:
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def sign_records(secret: str | None, body: bytes) -> bytes:
    """`body` (the index host's log records) preceded by a line holding its HMAC-SHA256 under the
    pair's `secret` (unchanged without one)."""
    if not secret:
        return body
    return _MAC_KEY + _mac(secret, body).encode() + b'"}\n' + body


def verify_records(secret: str | None, body: bytes) -> tuple[bool, bytes]:
    """(whether `body` carries a valid HMAC under `secret`, the records without the MAC line)."""
    if not body.startswith(_MAC_KEY):
        return False, body
    head, _, rest = body.partition(b"\n")
    try:
        mac = json.loads(head)["pair_mac"]
    except (ValueError, KeyError, TypeError):
        return False, rest
    ok = bool(secret) and isinstance(mac, str) and hmac.compare_digest(mac.encode(), _mac(secret, rest).encode())
    return ok, rest


# --- client side --------------------------------------------------------------------------------------


class _Bearer(flight.ClientMiddlewareFactory):
    def __init__(self, token: str):
        super().__init__()
        self.header = {AUTHORIZATION: f"Bearer {token}"}

    def start_call(self, info):
        return _BearerCall(self.header)


class _BearerCall(flight.ClientMiddleware):
    def __init__(self, header: dict):
        super().__init__()
        self.header = header

    def sending_headers(self):
        return self.header


@dataclass(frozen=True)
class ClientCredentials:
    """What a client presents: a token (sent as `authorization: Bearer`), the CA that signed the
    server's certificate (TLS), and a certificate and key of its own (mutual TLS). PEM bytes."""

    token: str | None = None
    tls_root_certs: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    override_hostname: str | None = None

    @classmethod
    def from_files(cls, *, token: str | None = None, tls_ca=None, tls_cert=None, tls_key=None,
                   override_hostname: str | None = None) -> "ClientCredentials":
        if (tls_cert is None) != (tls_key is None):
            raise GuardError("a client certificate needs its key, and a key its certificate")
        return cls(token=_check_token(token, "token"),
                   tls_root_certs=None if tls_ca is None else _read(tls_ca, "CA certificate"),
                   cert_chain=None if tls_cert is None else _read(tls_cert, "client certificate"),
                   private_key=None if tls_key is None else _read(tls_key, "client key"),
                   override_hostname=override_hostname)

    @property
    def tls(self) -> bool:
        return self.tls_root_certs is not None or self.cert_chain is not None


NO_CREDENTIALS = ClientCredentials()


def connect(location: str, credentials: ClientCredentials | None = None) -> flight.FlightClient:
    """A Flight client for `location` presenting `credentials`; a `grpc://` location is upgraded to
    `grpc+tls://` when the credentials carry TLS material."""
    creds = credentials or NO_CREDENTIALS
    if creds.tls and location.startswith("grpc://"):
        location = "grpc+tls://" + location[len("grpc://"):]
    kwargs: dict = {}
    if creds.tls_root_certs is not None:
        kwargs["tls_root_certs"] = creds.tls_root_certs
    if creds.cert_chain is not None:
        kwargs["cert_chain"] = creds.cert_chain
        kwargs["private_key"] = creds.private_key
    if creds.override_hostname:
        kwargs["override_hostname"] = creds.override_hostname
    if creds.token:
        kwargs["middleware"] = [_Bearer(creds.token)]
    return flight.connect(location, **kwargs)


__all__ = ["ADMIN", "MIN_TOKEN_CHARS", "NO_CREDENTIALS", "OPEN", "PAIR_SECRET_ENV", "PAIR_SECRET_FILE", "READER",
           "ClientCredentials", "GuardError", "ServerGuard", "connect", "is_loopback", "new_pair_secret", "pair_secret",
           "sign_records", "verify_records"]
