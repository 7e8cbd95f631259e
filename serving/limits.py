"""What one call to a server may ask, each limit configurable (`andromeda serve ... --max-...`).

A call beyond a limit fails with a Flight error whose message names the limit and its value (and
loses nothing: a request batch over a limit is refused whole before any of it is parsed, an update
call over a limit before any line is applied). Defaults sit well above what the project's clients
send (64 requests per batch, about 1.5 kB per request) and well below what hurt the servers.

| limit | default | what it bounds |
| --- | --- | --- |
| `max_request_bytes` | 4 MiB | Arrow payload bytes of one request batch |
| `max_batch_requests` | 1024 | requests in one batch |
| `max_k` | 4096 (MAX_K) | answers per request |
| `max_updates` | 50,000 | update lines in one `update` call |
| `max_update_bytes` | 128 MiB | bytes of one `update` call's body |
| `max_json_depth` | 64 | nesting of any JSON text (a targeting spec needs about 6) |
| `deadline_s` | 60 s | one call: a batch is not started after it; an update call waits at most this long for its turn (its parse not counted) |
| `update_slice` | 16 | updates applied between two looks at waiting retrievals |
| `update_cpu_share` | 0.25 | share of an update call's time spent working (parsing, logging, applying) while retrievals arrive |
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from andromeda_nb.constants import MAX_K
from andromeda_nb.jsontext import DEFAULT_MAX_DEPTH


class LimitExceeded(ValueError):
    """A call beyond one of the server's limits."""


def _limit(default, option: str, help: str, *, at_most=None, hidden: bool = False):
    """A limit's field: its default, the `serve` option that sets it (named in error messages), its help
    and its upper bound; `serving.process.SERVER_OPTIONS` makes the options of every server from these."""
    return field(default=default, metadata={"option": option, "help": help, "at_most": at_most, "hidden": hidden})


@dataclass(frozen=True)
class ServiceLimits:
    max_request_bytes: int = _limit(4 << 20, "--max-request-bytes", "Bytes of one request batch")
    max_batch_requests: int = _limit(1024, "--max-batch-requests", "Requests in one batch")
    max_k: int = _limit(MAX_K, "--max-k", "Answers per request", at_most=MAX_K)
    max_updates: int = _limit(50_000, "--max-updates", "Update lines in one call")
    max_update_bytes: int = _limit(128 << 20, "--max-update-bytes", "Bytes of one update call")
    max_json_depth: int = _limit(DEFAULT_MAX_DEPTH, "--max-json-depth", "Nesting of any JSON text")
    deadline_s: float = _limit(60.0, "--deadline", "Seconds one call may take (an update call: may wait for its "
                                                  "turn, its parse not counted)")
    update_slice: int = _limit(16, "--update-slice", "Updates applied between two looks at waiting retrievals",
                               hidden=True)
    update_cpu_share: float = _limit(0.25, "--update-cpu-share",
                                     "Share of an update call's time spent working (parsing, logging, applying) "
                                     "while retrievals arrive; the rest is left to them", at_most=1)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"limit {f.name}: expected a positive number, got {value!r}")
        if not self.update_cpu_share <= 1:
            raise ValueError(f"limit update_cpu_share: expected a share in (0, 1], got {self.update_cpu_share}")
        if not 1 <= self.max_k <= MAX_K:
            raise ValueError(f"limit max_k: expected 1..{MAX_K}, got {self.max_k}")

    def over(self, name: str, got, what: str) -> LimitExceeded:
        """The error for `got` beyond limit `name`: '<what> (got): over the server's limit of N (--option)'."""
        return LimitExceeded(f"{what} ({got}) is over the server's limit of {getattr(self, name)} "
                             f"({OPTION_NAMES.get(name, name)})")

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


DEFAULT_LIMITS = ServiceLimits()
OPTION_NAMES = {f.name: f.metadata["option"] for f in fields(ServiceLimits)}  # limit -> its `serve` option

__all__ = ["DEFAULT_LIMITS", "LimitExceeded", "OPTION_NAMES", "ServiceLimits"]
