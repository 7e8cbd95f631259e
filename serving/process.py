"""A server process's life: listening (with clear errors), stopping within a bounded time, and
ending with the process that started it.

* `listen(make, host, port, guard)`: refuses an exposed address without authentication
  (`ServerGuard.check_exposure`), says so plainly when the host does not resolve or the port is
  taken, and builds the server with `make(location)`.
* `serve_until_stopped(server, stopping, ...)`: serves until SIGTERM or SIGINT (or `stopping` is
  set, e.g. because the parent process is gone); then no new calls or batches are taken, the batches
  and updates in flight finish, and the process ends within `deadline_s` (default 5 s) whatever its
  clients do: gRPC waits for every open call to end, and a client holding an idle exchange would keep
  it waiting for ever, so once nothing is being worked on (or at the deadline) the process exits
  anyway; its update log is already on disk. An update call in flight counts as busy until its
  acknowledgement is handed to gRPC, and the process ends only once nothing has been busy for
  `SETTLE_S`, so it is either acknowledged or (ended by the journal before it was logged) not applied.
  The signal handlers take no lock (`StopSignals`: one that set `stopping` could wait for ever on
  the event's own lock, held by the main thread it interrupted). A serving process hands the interpreter between threads
  every `SWITCH_INTERVAL_MS` (0.2 ms) rather than Python's 5 ms unless it was given another
  interval (`set_switch_interval`, `--switch-interval-ms`), so a request never queues long behind a
  thread parsing a large update call; and what was built before serving (corpus, index, compiled
  kernels) is moved out of the garbage collector's sight (`gc.freeze`), so a full collection no
  longer walks it while requests wait.
* `watch_parent(pid, stopping)`: a server started for one command (`retrieve --arch remote`) stops
  when the process that started it is gone, even if that process was killed.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .guard import MIN_TOKEN_CHARS, OPEN, GuardError, ServerGuard

DEFAULT_STOP_DEADLINE_S = 5.0
PARENT_POLL_S = 0.25
IDLE_GRACE_S = 0.5  # after SIGTERM, how long clients with no batch in flight get to close their calls
STUCK_AFTER_S = 30.0  # past the stop deadline: a process still alive then prints every thread's stack and exits
SETTLE_S = 0.25  # how long nothing must be in flight before the process ends with calls still open: an
# answer handed to gRPC (an update's acknowledgement) still has to leave the process


class ServeError(RuntimeError):
    """A server that cannot start as asked; the message says why and what to change."""


def _port_in_use(host: str, port: int) -> bool:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def preflight(host: str, port: int, guard: ServerGuard = OPEN) -> None:
    """The checks `listen` makes, early: before a server loads its corpus or opens its log."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ServeError(f"port {port!r}: expected 0..65535 (0: a free one)")
    try:
        guard.check_exposure(host)  # resolves the host first
    except GuardError as exc:
        raise ServeError(str(exc)) from None
    if port and _port_in_use(host, port):
        raise ServeError(f"port {port} on {host} is not free (already in use: another server?); give --port N, "
                         "or --port 0 for a free one")


# The interpreter's thread switch interval of a serving process. A thread that lets go of the
# interpreter lock (every CUDA driver call through ctypes, every Arrow call) waits to take it back up
# to this long while another thread holds it; a GPU batch makes dozens of such calls, and the
# exchange threads hold the lock between them. Python's default is 5 ms (docs/BENCHMARKS.md, "The
# served path": a stand-in engine of 60 foreign calls a batch served 13% and 26% more at 0.2 ms).
SWITCH_INTERVAL_MS = 0.2


_switch_set: list[float] = []  # the interval this process was given, once given


def set_switch_interval(ms: float | None) -> None:
    """The process's thread switch interval in milliseconds (None: leave it)."""
    if ms is not None:
        if not ms > 0:
            raise ValueError(f"a switch interval must be positive, got {ms} ms")
        sys.setswitchinterval(ms / 1e3)
        _switch_set[:] = [ms]


def _serving_switch_interval() -> None:
    """The serving default, unless this process was given an interval."""
    if not _switch_set:
        set_switch_interval(SWITCH_INTERVAL_MS)


def listen(make: Callable[[str], object], host: str, port: int, guard: ServerGuard = OPEN):
    """`make(location)` for `host:port` under `guard`, or ServeError saying what is wrong. Every
    server runs with the same process settings: the memory its batches free kept
    (`serving.hostmem`), and the switch interval of `SWITCH_INTERVAL_MS` unless one was set."""
    from .hostmem import keep_freed_memory

    keep_freed_memory()
    _serving_switch_interval()
    preflight(host, port, guard)
    try:
        return make(guard.location(host, port))
    except Exception as exc:
        if type(exc).__name__ in ("ArrowException", "FlightInternalError", "FlightUnavailableError") \
                and "start" in str(exc):
            if port and _port_in_use(host, port):
                raise ServeError(f"port {port} on {host} is not free (already in use: another server?)") from None
            raise ServeError(f"cannot listen on {host}:{port} ({exc})") from None
        raise


def watch_parent(parent_pid: int, stopping: threading.Event, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Set `stopping` once this process's parent is no longer `parent_pid` (it exited or was killed:
    the process was handed to another parent)."""

    def watch():
        while not stopping.is_set():
            if os.getppid() != parent_pid:
                print(f"parent process {parent_pid} is gone: stopping", file=sys.stderr, flush=True)
                stopping.set()
                return
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


STOP_POLL_S = 0.05  # how often the main thread looks for a stop signal or `stopping`


class StopSignals:
    """SIGTERM and SIGINT, noted by handlers that take no lock, for the main thread to act on.

    Python runs a signal's handler in the main thread between two of its bytecodes, wherever that
    thread is, also inside a `threading.Event`'s own lock, which `Event.wait` holds for a moment
    each time it looks (and longer when it hands the interpreter to a busy thread there). A handler
    that called `stopping.set()` then waited for that lock, held by the thread it runs in: for ever,
    so a server sent SIGTERM while its main thread was inside `stopping.wait(...)` never ended. The
    handlers here only note the signal; `wait(stopping)` (main thread) looks every `STOP_POLL_S`
    and sets `stopping` itself, outside any lock. Installed on construction; `restore()` puts the
    previous handlers back."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: list[int] = []  # appended to by the handler (no lock: a list's append is atomic)
        self._previous = {s: signal.signal(s, self._note) for s in self.SIGNALS}

    def _note(self, signum, frame) -> None:
        self.received.append(signum)

    def wait(self, stopping: threading.Event, poll_s: float = STOP_POLL_S) -> None:
        """Return once a signal came or `stopping` is set (by another thread), with `stopping` set."""
        while not self.received and not stopping.is_set():
            time.sleep(poll_s)
        stopping.set()

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def serve_until_stopped(server, stopping: threading.Event, on_ready=None, *,
                        deadline_s: float = DEFAULT_STOP_DEADLINE_S, parent_pid: int | None = None,
                        busy: Callable[[], bool] | None = None, before_exit: Callable[[], None] | None = None,
                        exit_when_stuck: bool = True) -> bool:
    """Run `server` (already listening) until SIGTERM/SIGINT, `stopping`, or the parent's end; then
    shut it down within `deadline_s`. `busy()`: whether batches or updates are still being worked
    on (they get the deadline to finish). Returns True after a clean shutdown. When calls are still
    open at the deadline: `before_exit()` runs, then the process exits with code 0
    (`exit_when_stuck`), or False is returned. With `exit_when_stuck`, a process that has not ended
    `STUCK_AFTER_S` after the deadline (a thread that never lets the interpreter go, an exit that
    hangs) prints every thread's stack on stderr and exits with code 1 (`faulthandler`'s own thread,
    which needs no interpreter lock). Call from the main thread (signal handlers)."""

    signals = StopSignals()
    _serving_switch_interval()  # never over an interval the process was given
    gc.collect()
    gc.freeze()  # what was built to serve lives as long as the process: no collection walks it again
    try:
        if parent_pid is not None:
            watch_parent(parent_pid, stopping)
        if on_ready is not None:
            on_ready(server)
        signals.wait(stopping)
        if exit_when_stuck:  # a backstop, and a diagnosis on stderr, should the exit itself never come
            faulthandler.dump_traceback_later(deadline_s + STUCK_AFTER_S, exit=True)
        started = time.monotonic()
        closer = threading.Thread(target=server.shutdown, name="shutdown", daemon=True)
        closer.start()
        last_busy = started
        while True:  # the shutdown ends, or only idle calls are left, or the deadline comes
            closer.join(0.02)
            if not closer.is_alive():
                server.wait()
                return True
            now = time.monotonic()
            if busy and busy():
                last_busy = now
            elapsed = now - started
            if elapsed >= deadline_s or (elapsed >= min(IDLE_GRACE_S, deadline_s) and now - last_busy >= SETTLE_S):
                break
        print("stopping: calls still open with no batch in flight (idle clients); exiting without them",
              file=sys.stderr, flush=True)
        if before_exit is not None:
            before_exit()
        if exit_when_stuck:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return False
    finally:
        signals.restore()


# --- the options every server takes ---------------------------------------------------------------

TOKEN_ENV, ADMIN_TOKEN_ENV = "ANDROMEDA_TOKEN", "ANDROMEDA_ADMIN_TOKEN"


class ServerSettings:
    """Where and how a server listens, whom it admits, its limits, its log and its life: what the
    `serve` commands' options and `python -m ... serve`'s arguments say (`from_options`)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, guard: ServerGuard = OPEN, limits=None,
                 log: str | None = None, stop_deadline_s: float = DEFAULT_STOP_DEADLINE_S,
                 parent_pid: int | None = None):
        from .limits import DEFAULT_LIMITS

        self.host, self.port, self.guard = host, port, guard
        self.limits = limits or DEFAULT_LIMITS
        self.log, self.stop_deadline_s, self.parent_pid = log, stop_deadline_s, parent_pid

    @classmethod
    def from_options(cls, *, host: str = "127.0.0.1", port: int = 0, token=None, admin_token=None, token_file=None,
                     admin_token_file=None, tls_cert=None, tls_key=None, tls_client_ca=None, insecure: bool = False,
                     log=None, stop_deadline: float = DEFAULT_STOP_DEADLINE_S, parent_pid=None,
                     **limits) -> "ServerSettings":
        """From option values (None: the default). Each token comes from its option, its file
        (`token_file`, `admin_token_file`) or, when neither is given, $ANDROMEDA_TOKEN and
        $ANDROMEDA_ADMIN_TOKEN (`read_token`). Limits by their `ServiceLimits` names, deadline as
        `deadline_s`. ServeError for anything that cannot be used."""
        from .limits import ServiceLimits

        try:
            token = read_token(token, token_file, TOKEN_ENV, "--token")
            admin_token = read_token(admin_token, admin_token_file, ADMIN_TOKEN_ENV, "--admin-token")
            guard = ServerGuard.from_files(token=token, admin_token=admin_token, tls_cert=tls_cert, tls_key=tls_key,
                                           tls_client_ca=tls_client_ca, insecure=insecure)
            chosen = ServiceLimits(**{k: v for k, v in limits.items() if v is not None})
        except (GuardError, ValueError, TypeError) as exc:
            raise ServeError(str(exc)) from None
        if not stop_deadline or stop_deadline <= 0:
            raise ServeError(f"--stop-deadline must be a positive number of seconds, got {stop_deadline!r}")
        return cls(host=host, port=port, guard=guard, limits=chosen, log=log, stop_deadline_s=stop_deadline,
                   parent_pid=parent_pid)


def read_token(given: str | None, path=None, env: str | None = None, flag: str = "--token") -> str | None:
    """A token from the command line (`given`), else from the file `path` (its text, the line end
    and surrounding spaces taken off), else from the environment variable `env`; None when none
    holds one. GuardError when the file cannot be read or is empty, or when both `given` and `path`
    are (two sources for one secret are a mistake, not a choice)."""
    if given is not None and path is not None:
        raise GuardError(f"{flag} and {flag}-file both give the token: give one (the file, or ${env})")
    if given is not None:
        return given
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="surrogateescape").strip()
        except OSError as exc:
            raise GuardError(f"{flag}-file {path}: cannot be read ({exc.strerror})") from None
        if not text:
            raise GuardError(f"{flag}-file {path}: is empty")
        return text
    return (os.environ.get(env) or None) if env else None


def command_line_secret_warnings(given: dict) -> list[str]:
    """One line for each secret option given on a command line (`given`: option values by their
    `ServerOption.dest`, None when not given): it shows in the process list (`ps`) to every user
    of the machine. What `warn_command_line_secrets` prints."""
    out = []
    for o in server_options():
        if o.secret and given.get(o.dest) is not None:
            out.append(f"warning: {o.flag} on the command line shows in the process list (ps) to every user of "
                       f"this machine; give it in ${o.env} or {o.flag}-file instead")
    return out


def warn_command_line_secrets(given: dict, err=None) -> None:
    """Print `command_line_secret_warnings(given)` on stderr."""
    for line in command_line_secret_warnings(given):
        print(line, file=err or sys.stderr, flush=True)


@dataclass(frozen=True)
class ServerOption:
    """One option every server takes, declared once: `add_server_arguments` puts it on a server
    process's argparse parser, cli.py's `serve` commands make a click option of it."""

    flag: str  # "--max-k"
    dest: str  # the `ServerSettings.from_options` keyword
    kind: type  # int, float, str or bool (a flag)
    help: str
    default: object = None
    at_least: float | None = None
    at_most: float | None = None
    above: bool = False  # at_least is open: the value must be greater
    env: str | None = None  # the environment variable read when neither the option nor its file is given
    path: bool = False
    hidden: bool = False
    cli: bool = True  # False: only a parent process passes it to a child
    secret: bool = False  # given on a command line, it shows in the process list: a warning says so


def _limit_options() -> list[ServerOption]:
    from dataclasses import fields

    from .limits import DEFAULT_LIMITS, ServiceLimits

    out = []
    for f in fields(ServiceLimits):
        kind = int if f.type in (int, "int") else float
        default = getattr(DEFAULT_LIMITS, f.name)
        shown = f"{default:,}" if kind is int else f"{default:g}"
        out.append(ServerOption(f.metadata["option"], f.name, kind, f"{f.metadata['help']} [default: {shown}].",
                                at_least=1 if kind is int else 0, above=kind is float,
                                at_most=f.metadata["at_most"], hidden=f.metadata["hidden"]))
    return out


def server_options(*, log: bool = True) -> list[ServerOption]:
    """Every option of a server (`ServerSettings.from_options`' keywords), in the order `--help` shows."""
    return [
        ServerOption("--host", "host", str, "Address to listen on; anything but loopback needs tokens or mutual TLS, "
                     "or --insecure.", default="127.0.0.1"),
        ServerOption("--port", "port", int, "Port to listen on (0: a free one; the address is printed on stdout).",
                     default=0, at_least=0, at_most=65535),
        ServerOption("--token-file", "token_file", str, f"File holding the reader token: once a token is set, "
                     f"retrieve, health and stats need one. Or ${TOKEN_ENV}. At least {MIN_TOKEN_CHARS} ASCII "
                     "characters.", path=True),
        ServerOption("--admin-token-file", "admin_token_file", str, f"File holding the admin token: update and "
                     f"compact need it. Or ${ADMIN_TOKEN_ENV}. Not the reader token.", path=True),
        ServerOption("--token", "token", str, f"Reader token as text: it shows in the process list; prefer "
                     f"${TOKEN_ENV} or --token-file.", env=TOKEN_ENV, secret=True),
        ServerOption("--admin-token", "admin_token", str, f"Admin token as text: it shows in the process list; "
                     f"prefer ${ADMIN_TOKEN_ENV} or --admin-token-file.", env=ADMIN_TOKEN_ENV, secret=True),
        ServerOption("--tls-cert", "tls_cert", str, "Server certificate (PEM): TLS.", path=True),
        ServerOption("--tls-key", "tls_key", str, "Its private key (PEM).", path=True),
        ServerOption("--tls-client-ca", "tls_client_ca", str, "Mutual TLS: clients need a certificate this CA (PEM) "
                     "signed; a caller without one is refused at the handshake, before any of its bytes "
                     "are received.", path=True),
        ServerOption("--insecure", "insecure", bool, "Allow a non-loopback --host without authentication, or "
                     "with tokens but without TLS.", default=False),
        *_limit_options(),
        ServerOption("--stop-deadline", "stop_deadline", float, "Seconds from SIGTERM to exit, whatever clients do "
                     "(batches in flight finish).", default=DEFAULT_STOP_DEADLINE_S, at_least=0, above=True),
        ServerOption("--parent-pid", "parent_pid", int, "Stop when this process is gone.", cli=False),
        *([ServerOption("--log", "log", str, "Update log file, or 'off' for none (updates in memory only) "
                        "[default: DIR/updates.log].", path=True)] if log else []),
    ]


def add_server_arguments(parser, *, log: bool = True) -> None:
    """The `ServerSettings` options on an argparse parser (`python -m cpu_baseline.remote_servers`,
    `python -m migration.colocated_server`): `server_options`, as cli.py's `serve` commands take them."""
    for o in server_options(log=log):
        if o.kind is bool:
            parser.add_argument(o.flag, dest=o.dest, action="store_true", help=o.help)
        else:
            parser.add_argument(o.flag, dest=o.dest, type=o.kind, default=o.default,
                                help=argparse.SUPPRESS if o.hidden else o.help)


def settings_from_args(args, *, log: bool = True) -> ServerSettings:
    """`ServerSettings` from the namespace `add_server_arguments` filled (a token given as an
    argument is warned about on stderr: it shows in the process list)."""
    values = {o.dest: getattr(args, o.dest, None) for o in server_options(log=log)}
    warn_command_line_secrets(values)
    return ServerSettings.from_options(**values)


# errors a server's start can end with that are the user's to fix: a message, never a traceback
def startup_errors() -> tuple[type, ...]:
    import pyarrow.flight as flight

    from andromeda_nb.jsontext import JsonInputError
    from andromeda_nb.store import StoreError

    from .wal import LogError

    return (ServeError, GuardError, StoreError, LogError, JsonInputError, RuntimeError, ValueError, OSError,
            flight.FlightError)


class service_errors:
    """`with service_errors("scorer"):` around a `python -m ... serve` main: a known error is one line
    on stderr and exit code 2."""

    def __init__(self, who: str):
        self.who = who

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and isinstance(exc, startup_errors()):
            print(f"{self.who}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        return False


__all__ = ["ADMIN_TOKEN_ENV", "DEFAULT_STOP_DEADLINE_S", "TOKEN_ENV", "ServeError", "ServerOption", "ServerSettings", "StopSignals",
           "command_line_secret_warnings", "read_token", "server_options", "warn_command_line_secrets",
           "add_server_arguments", "listen", "preflight", "serve_until_stopped", "service_errors", "settings_from_args",
           "startup_errors", "watch_parent"]
