"""The one progress callback (`andromeda_nb.progress`), the one batching helper (`andromeda_nb.batching`)
and the one reader of a command's last JSON document (`andromeda_nb.jsontext.last_json_document`)."""

import pytest

from andromeda_nb.batching import BATCH_REQUESTS, in_batches
from andromeda_nb.jsontext import JsonInputError, last_json_document
from andromeda_nb.measure import log
from andromeda_nb.progress import nowhere, say_of, to_stderr


def test_say_of_turns_what_a_caller_gave_into_a_say(capsys):
    lines = []
    assert say_of(lines.append) == lines.append
    assert say_of(True) is to_stderr and say_of(False) is nowhere and say_of(None) is nowhere
    log(True, "pool", 3, "ads")
    log(False, "never shown")
    log(lines.append, "to", "the", "caller")
    captured = capsys.readouterr()
    assert captured.err == "pool 3 ads\n" and captured.out == ""
    assert lines == ["to the caller"]


def test_batches_cover_every_item_once_in_order():
    items = list(range(2 * BATCH_REQUESTS + 5))
    parts = list(in_batches(items))
    assert [len(p) for p in parts] == [BATCH_REQUESTS, BATCH_REQUESTS, 5]
    assert [x for p in parts for x in p] == items
    assert list(in_batches([], 3)) == [] and list(in_batches([1, 2, 3], 3)) == [[1, 2, 3]]
    with pytest.raises(ValueError, match="at least 1"):
        list(in_batches(items, 0))


def test_the_last_json_document_of_a_text():
    assert last_json_document('{"a": 1}') == {"a": 1}
    assert last_json_document('{"a":\n 1}') == {"a": 1}, "one document over several lines"
    assert last_json_document('progress...\n{"x": 1}\n{"x": 2}\n\n') == {"x": 2}, "JSON Lines: the last"
    with pytest.raises(JsonInputError):
        last_json_document("not json\nnor this")
    with pytest.raises(JsonInputError, match="more than once"):
        last_json_document('line\n{"k": 1, "k": 2}')
