"""How error messages show what came from outside: at most `QUOTE_LIMIT` (200) characters of any one
value, and at most `MESSAGE_LIMIT` characters of a whole message sent to a client.

A message names the offending value so that its sender can find it, and must stay small whatever the
value: a 1 MB `country` quoted whole made the error larger than gRPC's limit on its metadata, so the
client saw `RESOURCE_EXHAUSTED` instead of the error, and an update call's acknowledgement repeated
each rejected value (a 124 MB body got a 126 MB acknowledgement). Every message built from input
goes through `quote` (a value, as its repr) or `clip` (text that holds input, such as a JSON path
with a key in it); a server caps what it finally sends with `clip(message, MESSAGE_LIMIT)`.
"""

from __future__ import annotations

QUOTE_LIMIT = 200  # characters of one offending value shown in a message
MESSAGE_LIMIT = 2000  # characters of one error message sent to a client


def quote(value, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)`, its first `limit` characters when longer, then how long it was: `'XX...' (1048576
    characters)`. A long string is cut before its repr is made."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value)) if len(value) <= limit else f"{bytes(value[:limit])!r}... ({len(value)} bytes)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def clip(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` itself when at most `limit` characters, else its first `limit` and how long it was."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


__all__ = ["MESSAGE_LIMIT", "QUOTE_LIMIT", "clip", "quote"]
