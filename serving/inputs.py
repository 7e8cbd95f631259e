"""What one request of a batch may be, written once for both request forms (JSON text and the
columnar batch of `serving.request_columns`): the error a malformed request becomes, the check of
its k against the server's limit, and the parse of one JSON request sent with an id."""

from __future__ import annotations

from andromeda_nb import answers
from andromeda_nb.constants import MAX_K
from andromeda_nb.types import Request, TargetingError

from .limits import LimitExceeded


class InvalidInput(ValueError):
    """A malformed request, batch or update: becomes a Flight error starting 'invalid request:'."""


def check_k(k: int, request_id=None, max_k: int = MAX_K) -> int:
    """`andromeda_nb.answers.check_k` as an `InvalidInput` that names the request; `max_k`: a
    server's own lower limit."""
    try:
        k = answers.check_k(int(k))
    except ValueError:
        raise InvalidInput(f"request {request_id}: k = {k} is outside 1..{MAX_K}") from None
    if k > max_k:
        raise LimitExceeded(f"request {request_id}: k = {k} is over the server's limit of {max_k} (--max-k)")
    return k


def parse_batch_request(obj, rid: int, *, seed: int, experts: int, width: int) -> Request:
    """`targeting.parse_request` of one request of a client batch, sent with id `rid`: a fault is an
    `InvalidInput` that names the request once, then the JSON path."""
    from andromeda_nb.targeting import parse_request

    try:
        return parse_request(obj, seed=seed, experts=experts, width=width, request_id=rid)
    except TargetingError as exc:  # named by the id it was sent with, then the JSON path
        raise InvalidInput(f"request {rid}: {exc.path}: {exc.message}" if exc.path
                           else f"request {rid}: {exc.message}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInput(f"request {rid}: {exc}") from None


__all__ = ["InvalidInput", "check_k", "parse_batch_request"]
