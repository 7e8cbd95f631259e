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
| `deadline_s` | 60 s | one call: a batch is not started, an update not logged, after it |
| `update_slice` | 16 | updates applied between two looks at waiting retrievals |
| `update_cpu_share` | 0.25 | share of an update call's time spent working (parsing, logging, applying) while retrievals arrive |
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .constants import MAX_K
from .jsontext import DEFAULT_MAX_DEPTH

OPTION_NAMES = {  # limit -> the `serve` option that sets it (named in error messages)
    "max_request_bytes": "--max-request-bytes",
    "max_batch_requests": "--max-batch-requests",
    "max_k": "--max-k",
    "max_updates": "--max-updates",
    "max_update_bytes": "--max-update-bytes",
    "max_json_depth": "--max-json-depth",
    "deadline_s": "--deadline",
    "update_cpu_share": "--update-cpu-share",
}


class LimitExceeded(ValueError):
    """A call beyond one of the server's limits."""


@dataclass(frozen=True)
class ServiceLimits:
    max_request_bytes: int = 4 << 20
    max_batch_requests: int = 1024
    max_k: int = MAX_K
    max_updates: int = 50_000
    max_update_bytes: int = 128 << 20
    max_json_depth: int = DEFAULT_MAX_DEPTH
    deadline_s: float = 60.0
    update_slice: int = 16
    update_cpu_share: float = 0.25

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

__all__ = ["DEFAULT_LIMITS", "LimitExceeded", "OPTION_NAMES", "ServiceLimits"]
