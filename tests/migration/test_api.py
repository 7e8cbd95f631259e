"""The Python entry point (`from migration import build, load`): a corpus loaded, either architecture
built over it, `retrieve(requests, k)` equal to the float64 reference (DESIGN section 4), request
objects accepted as a requests file holds them, updates applied, README's example run as written."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from andromeda_nb.compare import compare_topk
from andromeda_nb.corpus import generate_corpus
from migration import ARCHS, build, load

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"
SEED, K = 21, 10


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "corpus"
    generate_corpus(out, 800, 5, SEED)
    return out


@pytest.fixture(scope="module")
def reference(corpus_dir):
    with build(load(corpus_dir), arch="reference") as index:
        return index.retrieve(load(corpus_dir).requests, K)


def _assert_equal(want, got, label):
    assert len(want) == len(got)
    for i, ((wi, ws), (gi, gs)) in enumerate(zip(want, got)):
        assert gi.dtype == np.int64 and gs.dtype == np.float32
        verdict = compare_topk(wi, ws, gi, gs, K)
        assert verdict.ok, f"{label}, request {i} (seed {SEED}, k {K}): {verdict.message}"


@pytest.mark.parametrize("arch", ["colocated", "remote"])
def test_each_architecture_answers_as_the_reference(corpus_dir, reference, arch):
    corpus = load(corpus_dir)
    with build(corpus, arch=arch, device="cpu") as index:
        assert index.arch == arch and index.device == "cpu"
        _assert_equal(reference, index.retrieve(corpus.requests, K), arch)
    assert ARCHS == ("reference", "remote", "colocated", "sharded")


def test_request_objects_as_a_requests_file_holds_them(corpus_dir, reference):
    corpus = load(corpus_dir)
    from andromeda_nb.targeting import request_to_json

    objects = [request_to_json(r) for r in corpus.requests]
    without_ids = [{k: v for k, v in o.items() if k != "request_id"} for o in objects]
    with build(corpus, arch="colocated", device="cpu") as index:
        _assert_equal(reference, index.retrieve(objects, K), "objects")
        _assert_equal(reference, index.retrieve(without_ids, K), "objects without ids")
        assert [r.request_id for r in index.requests(without_ids)] == list(range(len(objects)))
        bad = dict(objects[0], user=dict(objects[0]["user"], age=-1))
        with pytest.raises(ValueError, match=rf"requests\[1\]: request {objects[0]['request_id']}: user\.age: "):
            index.retrieve([objects[0], bad], K)
        with pytest.raises(ValueError, match="k"):
            index.retrieve(objects, 0)


def test_updates_carry_over_between_calls(tmp_path):
    from andromeda_nb.store import import_jsonl

    import_jsonl(SAMPLE / "ads.jsonl", SAMPLE / "requests.jsonl", tmp_path / "c", seed=7)
    corpus = load(tmp_path / "c")
    lines = (SAMPLE / "updates.jsonl").read_text().splitlines()
    with build(corpus, arch="colocated", device="cpu") as colocated, build(corpus, arch="reference") as ref:
        for index in (colocated, ref):
            applied, rejected = index.apply_updates(lines[:17])  # line 17 retires ad 1000181
            assert (applied, rejected) == (17, [])
            applied, rejected = index.apply_updates(lines[17:])
            assert applied == 9 and len(rejected) == 4
            assert "1000181" in str(rejected[1]), "its status change is refused: retired in the first call"
        _assert_equal(ref.retrieve(corpus.requests, K), colocated.retrieve(corpus.requests, K), "after updates")


def test_unknown_arch_and_device_are_refused(corpus_dir):
    corpus = load(corpus_dir)
    with pytest.raises(ValueError, match="unknown arch 'gpu'; choose from reference, remote, colocated"):
        build(corpus, arch="gpu")
    with pytest.raises(ValueError, match="unknown device"):
        build(corpus, device="tpu")


def test_the_readme_example_runs_as_written(corpus_dir, reference):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## From Python"):]
    code = section[section.index("```python\n") + 10:section.index("```\n", section.index("```python\n") + 10)]
    assert "from migration import build, load" in code and '"/tmp/corpus"' in code
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(code.replace("/tmp/corpus", str(corpus_dir)), "README.md", "exec"), {})
    printed = out.getvalue().splitlines()
    corpus = load(corpus_dir)
    assert len(printed) == 3 and printed[0].startswith(f"{corpus.requests[0].request_id} [")
    assert str(reference[0][0][:5].tolist()[0]) in printed[0]
