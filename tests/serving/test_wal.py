"""The write-ahead log and compaction (issue 15, point 1): records read back exactly; a write torn at
any byte is dropped and nothing before it; damage before the end, another corpus's log, a gap, a
second owner are refused with the reason; compaction folds the log into a snapshot equal to one built
from the final ads, and a crash at any step of it leaves a directory that recovers to the same state."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import pytest

from andromeda_nb import store

from serving import compaction
from andromeda_nb.compiled import COMPILED_ARRAYS, compile_ads
from andromeda_nb.model import ad_embedding_of, quantize
from andromeda_nb.testing import update_to_json
from andromeda_nb.types import Retire, SetStatus, Upsert
from serving.wal import LOG_FILE, LogError, LogLock, WriteAheadLog, corpus_lineage, decode_line, encode_line

from tests.support.servers import D, saved_corpus, update_stream


def _open(root, dataset=None):
    dataset = dataset or store.load_dataset(root)
    return WriteAheadLog.open(root / LOG_FILE, lineage=corpus_lineage(dataset),
                              snapshot_seq=int(dataset.meta.get("log_seq", 0)))


@pytest.fixture
def corpus(tmp_path):
    root, dataset = saved_corpus(tmp_path / "corpus", 11, n_ads=120, n_requests=4, precision="int8")
    return root, dataset


def test_lines_carry_a_checksum_chained_to_the_line_before():
    line = encode_line({"seq": 3, "update": {"op": "retire", "ad_id": 7}})
    assert json.loads(line)["seq"] == 3 and line.endswith(b'"}\n')
    assert decode_line(line) == {"seq": 3, "update": {"op": "retire", "ad_id": 7}}
    assert decode_line(line.replace(b'"ad_id":7', b'"ad_id":8')) is None  # checksum
    assert decode_line(line[:-1]) is None  # no newline: torn
    chained = encode_line({"seq": 3, "update": {"op": "retire", "ad_id": 7}}, chain=0x1234)
    assert decode_line(chained, chain=0x1234) == {"seq": 3, "update": {"op": "retire", "ad_id": 7}}
    assert decode_line(chained) is None and decode_line(chained, chain=0x1235) is None  # another line before it


def test_records_read_back_in_order_and_continue_after_reopening(corpus):
    root, dataset = corpus
    updates = [update_to_json(u) for u in update_stream(dataset, 30, 1)]
    log = _open(root, dataset)
    assert [r.seq for r in log.append(updates[:10])] == list(range(1, 11))
    assert [r.seq for r in log.append(updates[10:])] == list(range(11, 31))
    log.close()
    log = _open(root, dataset)
    replay = log.replay()
    assert [r.seq for r in replay] == list(range(1, 31)) and [r.update for r in replay] == updates
    assert [r.seq for r in log.records_after(25)] == [26, 27, 28, 29, 30]
    assert log.append([updates[0]])[0].seq == 31
    log.close()


def test_a_write_torn_at_any_byte_is_dropped_and_nothing_before_it(corpus):
    """Four calls of one update each; the last one torn at every byte: the three calls before it stay."""
    root, dataset = corpus
    updates = [update_to_json(u) for u in update_stream(dataset, 4, 2)]
    log = _open(root, dataset)
    for update in updates:
        log.append([update])
    log.close()
    lines = (root / LOG_FILE).read_bytes().splitlines(keepends=True)
    whole, last = b"".join(lines[:4]), lines[4]  # the header, three records; the fourth, as written
    for cut in range(0, len(last)):  # every prefix of the fourth record, as a crash mid-write leaves it
        (root / LOG_FILE).write_bytes(whole + last[:cut])
        log = _open(root, dataset)
        assert [r.seq for r in log.replay()] == [1, 2, 3], f"cut at byte {cut}"
        assert (root / LOG_FILE).read_bytes() == whole  # the torn tail is cut off
        assert log.append([updates[3]])[0].seq == 4
        log.close()
        assert [r.seq for r in _reopened(root, dataset)] == [1, 2, 3, 4]


def _reopened(root, dataset):
    log = _open(root, dataset)
    try:
        return log.replay()
    finally:
        log.close()


def test_damage_before_the_end_another_corpus_and_gaps_are_refused(corpus, tmp_path):
    root, dataset = corpus
    updates = [update_to_json(u) for u in update_stream(dataset, 3, 3)]
    log = _open(root, dataset)
    log.append(updates)
    log.close()
    lines = (root / LOG_FILE).read_bytes().splitlines(keepends=True)
    (root / LOG_FILE).write_bytes(b"".join([lines[0], lines[1].replace(b'"seq":1', b'"seq":7'), *lines[2:]]))
    with pytest.raises(LogError, match=r"line 2, record 1, is damaged \(its checksum, chained from the line before, "
                                       r"differs\), and 2 more lines follow it; no record before it is intact"):
        _open(root, dataset)
    (root / LOG_FILE).write_bytes(b"".join([lines[0], lines[1], lines[3]]))  # a record dropped: the chain breaks
    with pytest.raises(LogError, match=r"line 3, record 2, is damaged \(its checksum, chained from the line before"):
        _open(root, dataset)
    (root / LOG_FILE).write_bytes(b"".join(lines))
    other_root, other = saved_corpus(tmp_path / "other", 12, n_ads=50, n_requests=2)
    (other_root / LOG_FILE).write_bytes(b"".join(lines))
    with pytest.raises(LogError, match="belongs to another corpus"):
        _open(other_root, other)


@pytest.mark.parametrize("damage", ["checksum", "truncated"])
def test_every_damaged_record_before_the_last_is_refused_and_the_log_left_whole(corpus, damage):
    """Only the last line may be a torn write: a damaged record anywhere before it (the one just
    before the last included) is refused with its line number, and the file is not cut, so the
    records after it are not dropped."""
    root, dataset = corpus
    updates = [update_to_json(u) for u in update_stream(dataset, 5, 4)]
    log = _open(root, dataset)
    log.append(updates)
    log.close()
    whole = (root / LOG_FILE).read_bytes()
    lines = whole.splitlines(keepends=True)  # the header, then records 1..5
    assert len(lines) == 6
    for n in range(2, len(lines)):  # line n (1-based) holds record n - 1; the last line is left intact
        broken = lines[n - 1].replace(b'"seq":', b'"seq": ') if damage == "checksum" else lines[n - 1][:-5] + b"\n"
        assert decode_line(broken) is None, f"line {n}: the damage must break the record"
        damaged = b"".join([*lines[:n - 1], broken, *lines[n:]])
        (root / LOG_FILE).write_bytes(damaged)
        with pytest.raises(LogError, match=f"line {n}, record {n - 1}, is damaged .* more lines? follows? it"):
            _open(root, dataset)
        assert (root / LOG_FILE).read_bytes() == damaged, f"line {n} ({damage}): the log was cut"
    (root / LOG_FILE).write_bytes(whole)
    assert [r.update for r in _reopened(root, dataset)] == updates


def test_one_owner_at_a_time(corpus):
    root, dataset = corpus
    log = _open(root, dataset)
    try:
        with pytest.raises(LogError, match="another process holds this update log"):
            _open(root, dataset)
        with pytest.raises(LogError, match="another process holds"):
            compaction.compact_corpus(root)
    finally:
        log.close()
    _open(root, dataset).close()  # released with its owner


def test_one_corpus_has_one_writer_whatever_its_log(corpus, tmp_path):
    """Two servers on one corpus, one with --log elsewhere, then a compaction: the other's acknowledged
    updates were gone and its log rewritten. A server that logs updates holds the corpus's writer
    lock for its life (its pid written in it): a second server is refused whatever its --log, naming
    the holder, and so are `andromeda compact` with another log and the compaction of a server in
    another process; once the holder stops, the corpus can be written again."""
    import subprocess
    import sys

    import pyarrow.flight as flight

    from serving import protocol as fl
    from serving.services import PROJECT_ROOT, ServiceProcess, open_corpus
    from serving.wal import CorpusLock

    from tests.support.servers import colocated_server, lines_of, location, stop

    root, dataset = corpus
    first = ServiceProcess("migration.colocated_server", ["--data", str(root), "--device", "cpu", "--port", "0"],
                           name="first")
    holder = f"another server writes this corpus (pid {first.proc.pid}, log {(root / LOG_FILE).resolve()})"
    stream = update_stream(dataset, 8, 21)
    try:
        assert fl.flight_action(first.location, "update", lines_of(stream))["seq"] == 8
        log_bytes = (root / LOG_FILE).read_bytes()
        assert json.loads((root / CorpusLock.FILE).read_text())["pid"] == first.proc.pid
        second = subprocess.run([sys.executable, "-m", "migration.colocated_server", "--data", str(root), "--device",
                                 "cpu", "--port", "0", "--log", str(tmp_path / "elsewhere.log")], cwd=PROJECT_ROOT,
                                env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}, capture_output=True, text=True,
                                timeout=120, stdin=subprocess.DEVNULL)
        assert second.returncode == 2 and holder in second.stderr and "--log off" in second.stderr, second.stderr
        assert not second.stdout and not (tmp_path / "elsewhere.log").exists()  # never listened, nothing written
        with pytest.raises(LogError, match=re.escape(holder)):
            open_corpus(root, str(tmp_path / "third.log"))
        with pytest.raises(LogError, match=re.escape(holder)):
            compaction.compact_corpus(root, tmp_path / "fourth.log")
        # a server of this process on a log of its own (the library path, no open_corpus): its compaction
        # of the corpus is refused, and the first server's acknowledged updates stay
        own = _log_at(tmp_path / "own.log", dataset)
        server = colocated_server(dataset, log=own, data_dir=root)
        try:
            fl.flight_action(location(server), "update", lines_of(update_stream(dataset, 3, 22)))
            with pytest.raises(flight.FlightInternalError, match=re.escape(holder)):
                fl.flight_action(location(server), "compact", timeout=60)
        finally:
            stop(server)
        assert (root / LOG_FILE).read_bytes() == log_bytes and store.load_dataset(root).meta.get("log_seq", 0) == 0
        assert fl.flight_action(first.location, "health")["seq"] == 8
    finally:
        assert first.stop() == 0
    dataset_again, log = open_corpus(root, str(tmp_path / "third.log"))  # the holder is gone: a new writer may come
    try:
        with pytest.raises(LogError, match="a server in this process already writes this corpus"):
            open_corpus(root)
        assert json.loads((root / CorpusLock.FILE).read_text())["pid"] == os.getpid()
    finally:
        log.close()
    assert (root / CorpusLock.FILE).read_text() == ""  # released with the log, no pid left behind
    open_corpus(root)[1].close()


def _expected_state(dataset, updates):
    live = {a.ad_id: a for a in dataset.ads}
    emb = dict(zip(dataset.ad_ids.tolist(), dataset.embeddings.dequantize()))
    for u in updates:
        if isinstance(u, Upsert):
            live[u.ad.ad_id] = u.ad
            emb[u.ad.ad_id] = quantize(ad_embedding_of(u.ad, dataset.seed, D)[None], dataset.precision).dequantize()[0]
        elif isinstance(u, SetStatus):
            live[u.ad_id] = dataclasses.replace(live[u.ad_id], status=u.status)
        elif isinstance(u, Retire):
            del live[u.ad_id]
    return live, emb


def _assert_snapshot_is(root, dataset, updates, seq):
    got = store.load_dataset(root)
    live, emb = _expected_state(dataset, updates)
    assert got.meta["log_seq"] == seq and got.meta["lineage"] == corpus_lineage(dataset)
    assert sorted(got.ad_ids.tolist()) == sorted(live)
    assert {a.ad_id: a for a in got.ads} == live  # every field but the embedding (compared next)
    stored = got.embeddings.dequantize()
    for row, ad_id in enumerate(got.ad_ids.tolist()):
        assert np.array_equal(stored[row], emb[ad_id]), f"embedding of ad {ad_id}"
    expect = compile_ads([live[i] for i in got.ad_ids.tolist()])
    for name in COMPILED_ARRAYS:
        assert np.array_equal(getattr(expect, name), getattr(got.compiled, name)), name


def test_compaction_folds_the_log_into_a_snapshot_built_from_the_final_ads(corpus):
    root, dataset = corpus
    updates = update_stream(dataset, 120, 4)
    log = _open(root, dataset)
    log.append([update_to_json(u) for u in updates[:80]])
    log.close()
    result = compaction.compact_corpus(root)
    assert (result["compacted"], result["seq"]) == (80, 80)
    _assert_snapshot_is(root, dataset, updates[:80], 80)
    log = _open(root)
    assert (log.base_seq, log.last_seq, log.replay()) == (80, 80, [])
    log.append([update_to_json(u) for u in updates[80:]])  # numbering goes on from the snapshot
    log.close()
    assert compaction.compact_corpus(root)["seq"] == 120
    _assert_snapshot_is(root, dataset, updates, 120)
    assert not list(root.glob(".compact-*"))


@pytest.mark.parametrize("crash_after_renames", [0, 1, 2])
def test_a_crash_during_the_swap_is_finished_on_recovery(corpus, monkeypatch, crash_after_renames):
    root, dataset = corpus
    updates = update_stream(dataset, 40, 5)
    log = _open(root, dataset)
    log.append([update_to_json(u) for u in updates])
    real_replace, calls = os.replace, []

    def crashing_replace(src, dst):
        if os.path.dirname(os.path.abspath(dst)) != os.path.abspath(root):
            return real_replace(src, dst)  # a file written aside inside the decided compaction, not the swap
        if len(calls) == crash_after_renames:
            raise KeyboardInterrupt("crash")
        calls.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(compaction.os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        compaction.compact(root, log.records_after(0), lineage=log.lineage)
    monkeypatch.setattr(compaction.os, "replace", real_replace)
    log.close()
    assert list(root.glob(".compact-*")), "the decided compaction is still on disk"
    assert compaction.recover(root) == ["finished 40"]
    _assert_snapshot_is(root, dataset, updates, 40)
    log = _open(root)  # the old log's records are all in the snapshot: none replays, numbering goes on
    assert log.replay() == [] and log.last_seq == 40 and log.append([update_to_json(updates[0])])[0].seq == 41
    log.close()


def test_a_crash_before_the_decision_leaves_the_old_snapshot_and_log(corpus, monkeypatch):
    root, dataset = corpus
    updates = update_stream(dataset, 30, 6)
    log = _open(root, dataset)
    log.append([update_to_json(u) for u in updates])

    def crash(path):
        raise KeyboardInterrupt("crash")

    monkeypatch.setattr(compaction, "_sync_file", crash)
    with pytest.raises(KeyboardInterrupt):
        compaction.compact(root, log.records_after(0), lineage=log.lineage)
    log.close()
    assert compaction.recover(root) == ["discarded 30"]
    assert store.load_dataset(root).meta.get("log_seq", 0) == 0
    assert [r.seq for r in _reopened(root, dataset)] == list(range(1, 31))


def test_lock_file_sits_beside_the_log(corpus):
    root, _ = corpus
    lock = LogLock(root / LOG_FILE).acquire()
    assert (root / (LOG_FILE + ".lock")).exists()
    lock.release()


def _log_at(path, dataset):
    return WriteAheadLog.open(path, lineage=corpus_lineage(dataset), snapshot_seq=0)


@pytest.mark.parametrize("content", [b"", b"not a log\n", b"not a log", b'{"log":"andromeda-nb update log"}\n',
                                     b"\0" * 4096])
def test_a_file_at_the_log_path_that_is_not_a_log_is_refused_and_left_alone(corpus, content):
    """Issue 37, point 4: one line of anything (or nothing) at the log path was taken for a torn header
    and replaced by a new log. A log is always created whole (written aside, renamed into place), so
    such a file is never one of ours: refused, naming the path, and left as it was."""
    root, dataset = corpus
    path = root / LOG_FILE
    path.write_bytes(content)
    with pytest.raises(LogError, match=f"^{re.escape(str(path))}: (is empty|line 1 is not a valid log header).* left as it is"):
        _log_at(path, dataset)
    assert path.read_bytes() == content
    assert not path.with_name(LOG_FILE + ".new").exists()


def test_a_symbolic_link_at_the_log_path_is_refused_whatever_it_points_to(corpus, tmp_path):
    root, dataset = corpus
    path = root / LOG_FILE
    real = tmp_path / "real.log"
    _log_at(real, dataset).close()  # a valid log of this corpus
    one_line = tmp_path / "notes.txt"
    one_line.write_bytes(b"one line\n")
    for target in (real, one_line, tmp_path / "missing"):
        before = target.read_bytes() if target.exists() else None
        path.symlink_to(target)
        with pytest.raises(LogError, match=f"^{re.escape(str(path))}: is a symbolic link to '{re.escape(str(target))}'; "
                                           "an update log must be a regular file or absent"):
            _log_at(path, dataset)
        assert (target.read_bytes() if target.exists() else None) == before, target  # never written through
        assert path.is_symlink()
        path.unlink()
    path.mkdir()
    with pytest.raises(LogError, match=f"^{re.escape(str(path))}: is not a regular file"):
        _log_at(path, dataset)


def test_a_new_log_is_written_aside_and_never_through_a_link(corpus, tmp_path):
    """The header of a new log goes to PATH.new, synced, then renamed into place: a link (or a file a
    crash left) at PATH.new is replaced, not written through, and a log at PATH always has its header."""
    root, dataset = corpus
    path = root / LOG_FILE
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me\n")
    path.with_name(LOG_FILE + ".new").symlink_to(victim)
    log = _log_at(path, dataset)
    log.append([update_to_json(update_stream(dataset, 1, 7)[0])])
    log.reset(1)  # a compaction's restart of the log goes the same way
    log.close()
    assert victim.read_bytes() == b"keep me\n"
    assert not path.with_name(LOG_FILE + ".new").exists() and not path.is_symlink()
    assert decode_line(path.read_bytes().splitlines(keepends=True)[0])["base_seq"] == 1


def test_the_serve_command_refuses_a_log_path_that_is_not_a_log_in_one_line(corpus, tmp_path):
    """Through the server process (a process with a timeout: a server that took the file would serve
    on instead of failing)."""
    import subprocess
    import sys
    from pathlib import Path

    root, dataset = corpus
    project = Path(__file__).resolve().parent.parent.parent
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"one line\n")
    link = tmp_path / "link.log"
    link.symlink_to(notes)
    for log, expected in ((notes, "line 1 is not a valid log header"), (link, "is a symbolic link")):
        run = subprocess.run([sys.executable, "-m", "migration.colocated_server", "--data", str(root), "--device", "cpu",
                              "--host", "127.0.0.1", "--port", "0", "--log", str(log)], cwd=project,
                             env={**os.environ, "PYTHONPATH": str(project)}, capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        assert run.returncode == 2 and f"colocated: {log}: {expected}" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr and not run.stdout, run.stdout  # never listened
    assert notes.read_bytes() == b"one line\n"


# --- issue 37, the minor three: clean messages, a decided compaction checked before it is moved ---------


def _line_with_checksum(payload: bytes, before: bytes) -> bytes:
    """A log line of `payload` (a JSON object's bytes, not necessarily decodable) with a valid CRC-32,
    chained from the line `before` it."""
    import zlib

    return payload[:-1] + b',"crc":"%08x"}\n' % zlib.crc32(payload, int(before[-11:-3], 16))


@pytest.mark.parametrize("last", [False, True])
def test_a_record_that_passes_its_checksum_but_cannot_be_read_is_refused_in_words(corpus, last):
    """A record nested 3,000 deep (or not JSON) with a valid checksum was refused with the decoder's raw
    `maximum recursion depth exceeded`; it is not a torn write either, so it is never cut off, even last."""
    root, dataset = corpus
    log = _open(root, dataset)
    log.append([update_to_json(u) for u in update_stream(dataset, 2, 8)])
    log.close()
    lines = (root / LOG_FILE).read_bytes().splitlines(keepends=True)
    deep = _line_with_checksum(b'{"seq":2,"update":' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}", lines[1])
    not_json = _line_with_checksum(b'{"seq":2,"update":{"op":"retire",}}', lines[1])
    for bad, reason in ((deep, r"nested 3001 levels deep, deeper than the JSON decoder goes"), (not_json, "not JSON")):
        whole = b"".join(lines[:2] + [bad] + ([] if last else lines[2:]))
        (root / LOG_FILE).write_bytes(whole)
        with pytest.raises(LogError, match=f"line 3 passes its checksum but cannot be read: {reason}.*not torn by a "
                                           "crash"):
            _open(root, dataset)
        assert (root / LOG_FILE).read_bytes() == whole  # nothing cut off


def _decided_garbage(root, seq: int, files: dict) -> "os.PathLike":
    tmp = root / f"{compaction.COMPACT_PREFIX}{seq}"
    tmp.mkdir()
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    return tmp


def _corpus_bytes(root):
    return {name: (root / name).read_bytes() for name in (store.ADS_FILE, store.TARGETING_FILE, store.META_FILE)}


def test_a_decided_compaction_directory_is_checked_before_it_replaces_the_snapshot(corpus):
    """A `.compact-N` holding COMPLETE and garbage was renamed over the snapshot, and the corpus no longer
    loaded. Now the directory is checked first (marker, meta.json, the sha256 of each file) and refused,
    naming it, with the corpus as it was; the server's start and `andromeda compact` say so in one line."""
    from serving.services import open_corpus

    root, dataset = corpus
    before = _corpus_bytes(root)
    meta = json.loads(before[store.META_FILE])
    cases = {
        "garbage": ({compaction.COMPLETE: b"5\n", store.ADS_FILE: b"garbage", store.TARGETING_FILE: b"garbage",
                     store.META_FILE: b"{}"}, r"ends at update None, not 5"),
        "wrong marker": ({compaction.COMPLETE: b"6\n", store.META_FILE: json.dumps({**meta, "log_seq": 5}).encode()},
                         r"the marker says b'6\\n', the directory's name '5'"),
        "meta not JSON": ({compaction.COMPLETE: b"5\n", store.META_FILE: b"{not json"}, "not valid JSON"),
        "files not recorded": ({compaction.COMPLETE: b"5\n", store.ADS_FILE: b"garbage",
                                store.TARGETING_FILE: before[store.TARGETING_FILE],
                                store.META_FILE: json.dumps({**meta, "log_seq": 5}).encode()},
                               r"ads.parquet is not the file its meta.json records"),
        "marker alone": ({compaction.COMPLETE: b"5\n"}, r"meta.json ends at update None, not 5"),
    }
    for case, (files, reason) in cases.items():
        tmp = _decided_garbage(root, 5, files)
        with pytest.raises(compaction.CompactionError, match=f"marked COMPLETE but it does not hold the compacted "
                                                             f"snapshot it decided \\(.*{reason}"):
            compaction.recover(root)
        with pytest.raises(LogError, match=re.escape(str(tmp))):
            open_corpus(root)  # what a server's start runs
        assert _corpus_bytes(root) == before, case
        assert tmp.is_dir(), case  # left for the operator to look at
        import shutil

        shutil.rmtree(tmp)
    assert store.load_dataset(root).n_ads == dataset.n_ads


def test_a_decided_compaction_whose_file_was_damaged_is_refused(corpus, monkeypatch):
    """A real compaction decided, then a crash before its renames, then one of its files damaged: the
    next start refuses it instead of moving a damaged file over the snapshot."""
    root, dataset = corpus
    log = _open(root, dataset)
    log.append([update_to_json(u) for u in update_stream(dataset, 20, 9)])
    monkeypatch.setattr(compaction, "recover", lambda data_dir: [])  # the crash: decided, nothing moved
    compaction.compact(root, log.records_after(0), lineage=log.lineage)
    monkeypatch.undo()
    log.close()
    tmp = root / f"{compaction.COMPACT_PREFIX}20"
    assert (tmp / compaction.COMPLETE).is_file()
    before = _corpus_bytes(root)
    data = bytearray((tmp / store.TARGETING_FILE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp / store.TARGETING_FILE).write_bytes(bytes(data))
    with pytest.raises(compaction.CompactionError, match="targeting.npz is not the file its meta.json records.*"
                                                         "nothing of it was moved"):
        compaction.recover(root)
    assert _corpus_bytes(root) == before


def test_a_compaction_that_cannot_write_fails_in_words_and_changes_nothing(tmp_path, monkeypatch):
    """Compaction on a read-only corpus directory answered `internal error: OSError`. The first write
    into the directory fails as on a read-only file system (tests may run as root, for whom permission
    bits do not stop a write, so the failure is made at that call)."""
    import errno
    import pathlib

    import pyarrow.flight as flight

    from serving import protocol as fl

    from tests.support.servers import assert_equals_reference, colocated_server, lines_of, location, reference_at, stop

    root, dataset = saved_corpus(tmp_path / "corpus", 13, n_ads=80, n_requests=3)
    (tmp_path / "logs").mkdir()
    log = WriteAheadLog.open(tmp_path / "logs" / LOG_FILE, lineage=corpus_lineage(dataset), snapshot_seq=0)
    server = colocated_server(dataset, log=log, data_dir=root)
    real_mkdir = pathlib.Path.mkdir

    def read_only(self, *args, **kw):
        if self.parent == root:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kw)

    stream = update_stream(dataset, 30, 10)
    try:
        loc = location(server)
        fl.flight_action(loc, "update", lines_of(stream[:20]))
        before = _corpus_bytes(root)
        log_before = (tmp_path / "logs" / LOG_FILE).read_bytes()
        monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
        with pytest.raises(flight.FlightInternalError) as err:
            fl.flight_action(loc, "compact", timeout=60)
        message = str(err.value).split(". Detail:")[0]
        assert message == (f"compaction: {root}: cannot write the compacted snapshot (Read-only file system: "
                           f"{root / '.compact-20'}); nothing changed: the snapshot and the log are as they were")
        assert _corpus_bytes(root) == before and not list(root.glob(".compact-*"))
        assert (tmp_path / "logs" / LOG_FILE).read_bytes() == log_before
        monkeypatch.undo()
        assert fl.flight_action(loc, "update", lines_of(stream[20:]))["seq"] == 30  # the server goes on
        assert_equals_reference(reference_at(dataset, stream), dataset.requests,
                                fl.retrieve_over_flight(loc, dataset.requests, 50), 50, "after the refused compaction")
        assert fl.flight_action(loc, "compact", timeout=60)["seq"] == 30  # and compacts once it can write
    finally:
        stop(server)


# --- issue 37, point 3: damage anywhere is refused, naming the record; only a torn write is cut ------


def _log_of(root, dataset, n: int, seed: int = 14):
    """A log of `n` calls of one update each."""
    log = _open(root, dataset)
    for u in update_stream(dataset, n, seed):
        log.append([update_to_json(u)])
    log.close()
    return (root / LOG_FILE).read_bytes()


def _flip(data: bytes, at: int, bit: int = 0x04) -> bytes:
    return data[:at] + bytes([data[at] ^ bit]) + data[at + 1:]


def test_damage_anywhere_is_refused_naming_the_record_and_the_log_is_never_shortened(corpus, tmp_path):
    """The issue's cases after acknowledged records: one bit flipped in the last complete record (the
    server came back one record short), its newline damaged, the last 4 KiB zeroed (four records
    short), a line break put inside a middle record (everything after it cut as a 'torn tail'), a middle
    record replaced by a line valid on its own (from another log of this corpus), and a damaged header.
    Each is refused, naming the line and the record, the file left as it was."""
    root, dataset = corpus
    data = _log_of(root, dataset, 30)
    lines = data.splitlines(keepends=True)
    assert len(data) > 8192, len(data)
    other = tmp_path / "other.log"
    other_log = WriteAheadLog.open(other, lineage=corpus_lineage(dataset), snapshot_seq=0)
    other_log.append([update_to_json(u) for u in update_stream(dataset, 30, 15)])
    other_log.close()
    foreign = other.read_bytes().splitlines(keepends=True)[12]  # record 12 of another log: valid on its own
    assert decode_line(foreign) is None and json.loads(foreign)["seq"] == 12  # chained to its own log's line 11
    last_start = len(data) - len(lines[-1])
    middle = sum(map(len, lines[:12]))  # the start of record 12 (line 13)
    cases = {
        "a bit of the last record": (_flip(data, last_start + len(lines[-1]) // 2), r"line 31, record 30, is damaged "
                                     r"\(its checksum, chained from the line before, differs\); records 1\.\.29"),
        "the last newline": (_flip(data, len(data) - 1), r"line 31, record 30, is damaged \(incomplete, and not a "
                                                          r"beginning of that record"),
        "the last 4 KiB zeroed": (data[:-4096] + b"\0" * 4096, r"record \d+, is damaged"),
        "a line break inside record 12": (data[:middle + 40] + b"\r" + data[middle + 41:],
                                          r"line 13, record 12, is damaged .* and 18 more lines follow it; "
                                          r"records 1\.\.11 before it are intact"),
        "a line break inside the last record": (data[:last_start + 40] + b"\n" + data[last_start + 41:],
                                                r"line 31, record 30, is damaged"),
        "a line of another log": (b"".join(lines[:12] + [foreign] + lines[13:]), r"line 13, record 12, is damaged"),
    }
    for case, (damaged, expected) in cases.items():
        (root / LOG_FILE).write_bytes(damaged)
        with pytest.raises(LogError, match=expected) as err:
            _open(root, dataset)
        assert "never shortened by itself" in str(err.value) and "andromeda truncate-log --log" in str(err.value), case
        assert (root / LOG_FILE).read_bytes() == damaged, case  # left as it is
    (root / LOG_FILE).write_bytes(_flip(data, 20))
    with pytest.raises(LogError, match="line 1 is not a valid log header"):
        _open(root, dataset)
    (root / LOG_FILE).write_bytes(data)
    assert [r.seq for r in _reopened(root, dataset)] == list(range(1, 31))  # the log itself was whole


def test_only_a_torn_last_write_is_cut_without_a_word(corpus):
    """What a crash while writing an unacknowledged call leaves: any beginning of its first record (see
    also test_a_write_torn_at_any_byte_is_dropped_and_nothing_before_it), and the whole record short
    of its newline. Cut off, and the log goes on after the last intact record."""
    root, dataset = corpus
    data = _log_of(root, dataset, 6)
    lines = data.splitlines(keepends=True)
    whole = b"".join(lines[:-1])
    for tail in (lines[-1][:-1], lines[-1][:9], b'{"se', lines[-1][:-12]):
        (root / LOG_FILE).write_bytes(whole + tail)
        log = _open(root, dataset)
        assert [r.seq for r in log.replay()] == [1, 2, 3, 4, 5], tail[:20]
        assert log.append([update_to_json(update_stream(dataset, 1, 16)[0])])[0].seq == 6
        log.close()
        assert [r.seq for r in _reopened(root, dataset)] == [1, 2, 3, 4, 5, 6]
    for tail, why in ((lines[-1][:-1] + b"x", "incomplete"), (lines[-1][:30] + b"\0" * 10, "incomplete"),
                      (lines[-1][:-1].replace(b'"seq":6', b'"seq":7'), "incomplete")):
        (root / LOG_FILE).write_bytes(whole + tail)
        with pytest.raises(LogError, match=f"line 7, record 6, is damaged \\({why}"):
            _open(root, dataset)


def _crc_of(line: bytes) -> int:
    return int(line.rstrip(b"\n")[-10:-2], 16)


def test_a_call_is_committed_as_a_unit_and_replay_never_applies_part_of_it(corpus):
    """A kill while a 12,000-line call was written brought back a prefix of it (196 or 2,156 records).
    Each record names its call's last record (`end`): a log that ends inside its last call, at any
    byte (whole records of it and a torn one, whole records alone, the whole call short of its last
    newline), replays none of that call, and the file is cut back to the call before; a server
    started on it answers as the calls before. A record naming another end than its call's is
    refused; a truncation keeps whole calls only."""
    from serving import protocol as fl
    from tests.support.servers import (assert_equals_reference, colocated_server, lines_of, location, reference_at,
                                       stop)

    root, dataset = corpus
    stream = update_stream(dataset, 8, 23)
    updates = [update_to_json(u) for u in stream]
    log = _open(root, dataset)
    log.append(updates[:3])  # call A: records 1..3
    log.append(updates[3:])  # call B: records 4..8
    log.close()
    data = (root / LOG_FILE).read_bytes()
    lines = data.splitlines(keepends=True)
    assert [json.loads(x)["end"] for x in lines[1:]] == [3, 3, 3, 8, 8, 8, 8, 8]
    call_a = b"".join(lines[:4])
    boundaries = {len(call_a) + sum(map(len, lines[4:4 + i])) for i in range(5)}
    cuts = sorted(set(range(len(call_a), len(data), 5)) | boundaries | {len(data) - 1})
    for cut in cuts:  # every line boundary inside B, and a byte in every five
        (root / LOG_FILE).write_bytes(data[:cut])
        log = _open(root, dataset)
        assert [r.seq for r in log.replay()] == [1, 2, 3], f"cut at byte {cut}"
        assert (root / LOG_FILE).read_bytes() == call_a, f"cut at byte {cut}: the file goes back to call A"
        if cut > len(call_a):
            assert log.describe()["cut_at_open"] == {"records": sum(b <= cut for b in sorted(boundaries)[1:]),
                                                     "bytes": cut - len(call_a)}, cut
        log.close()
    # a server started on a log whose last call is partly written answers as the calls before it
    (root / LOG_FILE).write_bytes(data[:len(call_a) + sum(map(len, lines[4:7])) + 40])  # B: 3 whole records, 1 torn
    from serving.services import open_corpus

    loaded, log = open_corpus(root)
    server = colocated_server(loaded, log=log)
    try:
        assert fl.flight_action(location(server), "health")["seq"] == 3 and server.replayed == 3
        assert_equals_reference(reference_at(dataset, stream[:3]), dataset.requests,
                                fl.retrieve_over_flight(location(server), dataset.requests, 4096), 4096,
                                "a server on a log whose last call is partly written")
        assert fl.flight_action(location(server), "update", lines_of(stream[3:]))["seq"] == 8  # sent again: whole
    finally:
        stop(server)
    assert [r.seq for r in _reopened(root, dataset)] == list(range(1, 9))

    # a record whose `end` is not its call's is written so, not torn: refused, naming it
    (root / LOG_FILE).write_bytes(data)
    obj = json.loads(lines[6])
    del obj["crc"]
    obj["end"] = 9
    forged = encode_line(obj, chain=_crc_of(lines[5]))
    tail = [forged]
    for line in lines[7:]:  # the chain carried on over the changed line, so only `end` is wrong
        o = json.loads(line)
        del o["crc"]
        tail.append(encode_line(o, chain=_crc_of(tail[-1])))
    (root / LOG_FILE).write_bytes(b"".join([*lines[:6], *tail]))
    with pytest.raises(LogError, match=r"line 7, record 6, names 9 as its call's last record, expected 8, as the "
                                       r"records of its call before it; .* --after 3`"):
        _open(root, dataset)
    # damage inside call B: the truncation the refusal names keeps call A, and one inside B is refused
    (root / LOG_FILE).write_bytes(b"".join([*lines[:6], _flip(lines[6], 20), *lines[7:]]))
    with pytest.raises(LogError, match=r"line 7, record 6, is damaged .* records 1\.\.5 before it are intact \(records "
                                       r"4\.\.5 belong to the damaged record's call, .* --after 3`"):
        _open(root, dataset)
    from serving.wal import truncate_log

    with pytest.raises(LogError, match=r"record 5 is inside a call that ends at record 8.* keep through 3 instead"):
        truncate_log(root / LOG_FILE, 5)
    assert truncate_log(root / LOG_FILE, 3)["kept_through"] == 3
    assert (root / LOG_FILE).read_bytes() == call_a


def test_truncate_log_keeps_the_intact_records_on_purpose(corpus, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from click.testing import CliRunner

    from serving.wal import truncate_log
    from cli import main

    root, dataset = corpus
    data = _log_of(root, dataset, 30)
    lines = data.splitlines(keepends=True)
    at = sum(map(len, lines[:20])) + 30  # inside record 20
    damaged = _flip(data, at)
    (root / LOG_FILE).write_bytes(damaged)
    project = Path(__file__).resolve().parent.parent.parent
    run = subprocess.run([sys.executable, "-m", "migration.colocated_server", "--data", str(root), "--device", "cpu", "--host",
                          "127.0.0.1", "--port", "0"], cwd=project, env={**os.environ, "PYTHONPATH": str(project)},
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and "line 21, record 20, is damaged" in run.stderr, run.stderr
    assert f"andromeda truncate-log --log {root / LOG_FILE} --after 19" in run.stderr
    with pytest.raises(LogError, match=r"cannot keep records through 25: the intact records are 1\.\.19"):
        truncate_log(root / LOG_FILE, 25)
    result = CliRunner().invoke(main, ["truncate-log", "--log", str(root / LOG_FILE), "--after", "19", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["kept_through"] == 19 and Path(report["kept_aside"]).read_bytes() == damaged
    assert (root / LOG_FILE).read_bytes() == b"".join(lines[:20])
    log = _open(root, dataset)
    assert [r.seq for r in log.replay()] == list(range(1, 20))
    assert log.append([update_to_json(update_stream(dataset, 1, 17)[0])])[0].seq == 20  # the chain goes on
    log.close()
    assert [r.seq for r in _reopened(root, dataset)] == list(range(1, 21))
    (root / LOG_FILE).write_bytes(damaged)
    lock = LogLock(root / LOG_FILE).acquire()  # a server holding the log
    try:
        refused = CliRunner().invoke(main, ["truncate-log", "--log", str(root / LOG_FILE), "--after", "19"])
        assert refused.exit_code == 1 and "another process holds this update log" in refused.output
    finally:
        lock.release()


def test_a_version_1_log_is_read_as_before_and_restarted_as_version_2_by_a_compaction(corpus):
    """Logs written before the chain (version 1: each line's checksum of itself alone) are still read,
    with the same rule for a torn last write; they take new records as version 1 lines, and become
    version 2 when a compaction restarts them."""
    root, dataset = corpus
    updates = [update_to_json(u) for u in update_stream(dataset, 12, 18)]
    header = encode_line({"log": "andromeda-nb update log", "version": 1, "lineage": corpus_lineage(dataset),
                          "base_seq": 0})
    v1 = [encode_line({"seq": i + 1, "update": u}) for i, u in enumerate(updates[:8])]
    (root / LOG_FILE).write_bytes(header + b"".join(v1) + v1[-1][:10].replace(b'"seq":8', b'"seq":9'))
    log = _open(root, dataset)
    assert log.describe()["version"] == 1 and [r.seq for r in log.replay()] == list(range(1, 9))
    log.append(updates[8:10])
    log.close()
    lines = (root / LOG_FILE).read_bytes().splitlines(keepends=True)
    assert decode_line(lines[-1])["seq"] == 10  # a version 1 line: its checksum of itself alone
    assert [r.seq for r in _reopened(root, dataset)] == list(range(1, 11))
    (root / LOG_FILE).write_bytes(b"".join(lines[:3] + lines[4:]))  # a record dropped: the numbers tell
    with pytest.raises(LogError, match="line 4 holds sequence number 4, expected 3"):
        _open(root, dataset)
    (root / LOG_FILE).write_bytes(b"".join(lines))
    assert compaction.compact_corpus(root)["seq"] == 10
    log = _open(root)
    assert log.describe()["version"] == 2 and log.base_seq == 10
    log.append(updates[10:])
    log.close()
    lines = (root / LOG_FILE).read_bytes().splitlines(keepends=True)
    assert json.loads(lines[0])["version"] == 2 and decode_line(lines[1]) is None  # chained now
    assert [r.seq for r in _reopened(root, store.load_dataset(root))] == [11, 12]
