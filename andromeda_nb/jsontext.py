"""JSON text from outside the process, read one safe way: every place that decodes JSON a person or a
client wrote (`import`, `--updates-file`, the Flight request column and update body, meta.json, the
request texts of a corpus) goes through `loads`, so none of them can end in a traceback.

* Nesting deeper than `max_depth` (default 64; a targeting spec needs about 6) is an error that says
  so, found before decoding: Python's decoder would otherwise raise `RecursionError` near depth 1000.
* A key repeated in one object is an error naming its path (`targeting.geo_locations.countries`):
  the standard decoder keeps the last value silently, so two readers could disagree on one line.
* A leading byte-order mark is skipped (editors on some systems write one).
* Bytes that are not UTF-8 are an error naming the first bad byte's offset.

Errors are `JsonInputError` (a ValueError) with `path` ("" when the problem is not at one key) and a
message that starts with what is wrong; callers prefix the line or request they were reading.
"""

from __future__ import annotations

import json
import re

import numpy as np

from .quoting import clip

DEFAULT_MAX_DEPTH = 64
BOM = "\ufeff"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal (linear: no nested repetition)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class JsonInputError(ValueError):
    """JSON input that cannot be used: not UTF-8, not JSON, nested too deep, or a duplicate key."""

    def __init__(self, message: str, path: str = ""):
        path = clip(path)  # a path holds keys from the input (a repeated key names itself)
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def decode_utf8(data: bytes) -> str:
    """`data` as text; a leading byte-order mark is dropped. JsonInputError at the first bad byte."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonInputError(f"not valid UTF-8 (byte {exc.start + 1} is {data[exc.start]:#04x})") from None
    return text[1:] if text.startswith(BOM) else text


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in `text` (brackets inside strings do not count)."""
    if text.count("[") + text.count("{") == 0:
        return 0
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def check_depth(text: str, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    # cheap first: a text with at most max_depth opening brackets cannot nest deeper
    if text.count("[") + text.count("{") <= max_depth:
        return
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JsonInputError(f"nested {depth} levels deep; at most {max_depth} are allowed")


class _Duplicated(dict):
    """An object in which `key` appeared more than once (found again by `_duplicate_path`)."""

    key: str


def _object_hook(marked: list):
    """An `object_pairs_hook` that builds plain dicts and marks (in `marked`) an object with a
    repeated key, as a `_Duplicated` naming the key."""

    def build(pairs: list) -> dict:
        out = dict(pairs)
        if len(out) == len(pairs):
            return out
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                break
            seen.add(key)
        out = _Duplicated(out)
        out.key = key
        marked.append(key)
        return out

    return build


def _join(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _duplicate_path(value, path: str = "") -> str | None:
    """Path of the first repeated key (depth first, in document order), or None."""
    if isinstance(value, _Duplicated):
        inner = _find_in(value.items(), path)
        return inner if inner is not None else _join(path, value.key)
    if isinstance(value, dict):
        return _find_in(value.items(), path)
    if isinstance(value, list):
        return _find_in(enumerate(value), path)
    return None


def _find_in(items, path: str) -> str | None:
    for key, item in items:
        if isinstance(item, (dict, list)):
            found = _duplicate_path(item, _join(path, key))
            if found is not None:
                return found
    return None


def _position(text: str, pos: int) -> str:
    """Where decoding stopped, in the terms of the text a person wrote: "at column C", or "at line L,
    column C" in a text of several lines. A text that ends too early (a line of JSON Lines cut short,
    read with its newline) stops at its last character, not at the start of an empty next line."""
    content = len(text.rstrip())
    ended = pos >= content
    pos = min(pos, content)
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    where = f"at line {line}, column {column}" if "\n" in text[:content] else f"at column {column}"
    return where + (", where the text ends" if ended else "")


def _too_long_number(exc: ValueError) -> str:
    """Python's refusal of a long integer literal, said without its advice to the programmer."""
    digits = re.search(r"value has (\d+) digits", str(exc))
    limit = re.search(r"limit \((\d+) digits\)", str(exc))
    if digits is None or limit is None:
        return f"not valid JSON ({exc})"
    return (f"a number of {int(digits.group(1)):,} digits is longer than the {int(limit.group(1)):,} digits "
            "accepted; no id, count or value here needs more than 20")


def loads(text: str | bytes, *, max_depth: int = DEFAULT_MAX_DEPTH):
    """Decode one JSON value from text or UTF-8 bytes, as the module docstring says. Raises
    `JsonInputError` for every problem with the input."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = decode_utf8(bytes(text))
    elif text.startswith(BOM):
        text = text[1:]
    check_depth(text, max_depth)
    marked: list = []
    try:
        value = json.loads(text, object_pairs_hook=_object_hook(marked))
    except json.JSONDecodeError as exc:
        raise JsonInputError(f"not valid JSON ({exc.msg} {_position(text, exc.pos)})") from None
    except RecursionError:  # not reachable after check_depth; kept so no input can raise it
        raise JsonInputError(f"nested too deep; at most {max_depth} levels are allowed") from None
    except ValueError as exc:  # an integer literal too long to convert (sys.get_int_max_str_digits)
        raise JsonInputError(_too_long_number(exc)) from None
    if marked:
        raise JsonInputError("key appears more than once in its object", _duplicate_path(value) or marked[0])
    return value


def last_json_document(text: str, *, max_depth: int = DEFAULT_MAX_DEPTH):
    """The JSON document a command's output ends with: the whole text when it is one document, else
    its last non-empty line (JSON Lines, or a log whose last line is the result). JsonInputError when
    neither is JSON: the last line's fault when the text has several lines, else the whole text's."""
    try:
        return loads(text, max_depth=max_depth)
    except JsonInputError as whole:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) < 2:
            raise whole from None
    return loads(lines[-1], max_depth=max_depth)


__all__ = ["BOM", "DEFAULT_MAX_DEPTH", "JsonInputError", "check_depth", "decode_utf8", "last_json_document", "loads",
           "nesting_depth"]
