"""scripts/results_manifest.py on a small tree of its own: the provenance it reads from each form of
result file, the files a page names (and where), the manifest it writes, and every problem `--check`
reports, each shown failing on a bad tree and passing on the good one; then the check on this
repository itself, so a page that quotes an unclean result, or a stale manifest, fails here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "results_manifest.py"


@pytest.fixture(scope="module")
def rm():
    spec = importlib.util.spec_from_file_location("results_manifest", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stamped(commit="a" * 40, dirty=False, command="andromeda bench pipeline --out x.json", **fields):
    """A result as `andromeda_nb.provenance.stamp` writes it."""
    host = {"cpu": "AMD EPYC", "cores": 2}
    if commit is not None:
        host.update(git_commit=commit, git_dirty=dirty)
    prov = {"host": host, "created": "2026-12-01T00:00:00Z"}
    if command is not None:
        prov["command"] = command
    return {"kind": "pipeline", **fields, "provenance": prov}


def probe(commit="b" * 40, dirty=False, command="python3 scripts/probe_x.py --out y.json"):
    """A result as a probe script writes it: command and host at the top."""
    return {"command": command, "host": {"cpu": "Intel Xeon", "cores": 16, "git_commit": commit, "git_dirty": dirty}}


def make_tree(root: Path, results: dict, pages: dict) -> Path:
    for rel, doc in results.items():
        path = root / "docs" / "results" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    for rel, text in pages.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# --- provenance -----------------------------------------------------------------------------------------


def test_provenance_of_each_form(rm):
    assert rm.provenance(stamped()) == {"commit": "a" * 40, "dirty": False,
                                        "command": "andromeda bench pipeline --out x.json",
                                        "created": "2026-12-01T00:00:00Z"}
    p = rm.provenance(probe(dirty=True))
    assert (p["commit"], p["dirty"], p["command"]) == ("b" * 40, True, "python3 scripts/probe_x.py --out y.json")
    # no host at all: no commit, dirty unknown
    assert rm.provenance({"command": "x"}) == {"commit": None, "dirty": None, "command": "x", "created": None}
    # a hand-written commit without the tree's state is not a clean record
    hand = rm.provenance({"provenance": {"commit": "a3ec2c7 (v7 in the lab)", "command": "x"}})
    assert hand["commit"] == "a3ec2c7 (v7 in the lab)" and hand["dirty"] is None


def test_provenance_of_parts(rm):
    # before/after at two commits, both clean: both commits, clean
    both = rm.provenance({"command": "c", "before": probe(commit="1" * 40), "after": probe(commit="2" * 40)})
    assert both["commit"] == ["1" * 40, "2" * 40] and both["dirty"] is False and both["command"] == "c"
    # one part dirty makes the file dirty, even where the top records a clean tree
    mixed = {**probe(), "runs": [probe(), probe(dirty=True)]}
    assert rm.provenance(mixed)["dirty"] is True and rm.provenance(mixed)["commit"] == "b" * 40
    # commands only in the runs: each distinct one, in order
    runs = rm.provenance({"host": probe()["host"], "runs": [{"command": "x --a"}, {"command": "x --b"}, {"command": "x --a"}]})
    assert runs["command"] == ["x --a", "x --b"] and runs["dirty"] is False


def test_status_kind_and_device(rm, tmp_path):
    def entry(doc, path="docs/results/r.json"):
        return {"path": path, **rm.provenance(doc)}
    assert rm.status(entry(stamped())) == "clean"
    assert rm.status(entry(stamped(dirty=True))) == "dirty"
    assert rm.status(entry(stamped(commit=None))) == "no commit"
    assert rm.status(entry(stamped(command=None))) == "no command"
    assert rm.status(entry({"provenance": {"commit": "abc", "command": "x"}})) == "tree not recorded"
    assert rm.status({"path": "docs/results/r.log", "commit": None, "dirty": None, "command": None}) == "not JSON"
    assert rm.kind(stamped(), "x.json") == "pipeline"
    assert rm.kind({}, "probes/x.json") == "probe" and rm.kind({}, "score_d64_h200_run1.json") == "score"
    assert rm.kind(None, "a.log") == "log"
    assert rm.device({"env": {"device": "NVIDIA H100 80GB HBM3"}}, "p.json") == "NVIDIA H100 80GB HBM3"
    assert rm.device(probe(), "served_1m_h200.json") == "NVIDIA H200 (from the file name)"
    assert rm.device(probe(), "served_cpu.json") == "CPU: Intel Xeon, 16 cores"


# --- pages ----------------------------------------------------------------------------------------------


PAGE = """# Page

Quoted: [good](results/good.json), `docs/results/probes/p.json`, bare old.json, a command's
`--out /tmp/good.json`, and the logs of docs/results/runs/r.{json,log}.

## Quoted again

probes/p.json

## To be re-run from a commit

| figure | old file |
| --- | --- |
| the dirty one | [dirty.json](results/dirty.json) |

## After it

[gone](results/probes/gone.json)
"""


def test_mentions_name_quote_and_list(rm):
    files = ["dirty.json", "good.json", "old.json", "probes/p.json", "runs/r.json", "runs/r.log", "unnamed.json"]
    found = rm.mentions(PAGE, files)
    quoted = {rel for rel, exists, rerun in found if exists and not rerun}
    listed = {rel for rel, exists, rerun in found if exists and rerun}
    missing = {rel for rel, exists, _ in found if not exists}
    assert quoted == {"good.json", "probes/p.json", "old.json", "runs/r.json", "runs/r.log"}
    assert listed == {"dirty.json"}
    assert missing == {"probes/gone.json"}
    # a path under another folder names nothing; neither does a folder or a glob
    assert rm.mentions("see /tmp/good.json and docs/results/probes/ and docs/results/*.json", files) == []
    # a name inside a longer name is not a mention
    assert rm.mentions("xgood.json good.json.bak", files) == []


def test_rerun_section_ends_at_a_heading_of_its_level(rm):
    text = "# A\n## To be re-run\nx\n### sub\ny\n## Next\nz\n"
    (start, end), = rm.rerun_spans(text)
    assert text[start:end] == "## To be re-run\nx\n### sub\ny\n"
    assert rm.rerun_spans("# A\n```\n## To be re-run\n```\n") == []


# --- the manifest and the check -------------------------------------------------------------------------


def good_tree(root):
    return make_tree(root, {"good.json": stamped(), "probes/p.json": probe(), "dirty.json": stamped(dirty=True),
                            "unnamed.json": stamped(commit=None), "runs/r.log": "log\n"},
                     {"README.md": "[good](docs/results/good.json)\n",
                      "docs/PAGE.md": "probes/p.json and results/runs/r.log\n\n## To be re-run from a commit\n\n"
                                      "results/dirty.json\n"})


def test_a_good_tree_checks_clean_and_the_manifest_is_stable(rm, tmp_path):
    root = good_tree(tmp_path)
    assert rm.check(root) == ["docs/results/MANIFEST.jsonl is missing: run python3 scripts/results_manifest.py"]
    first = rm.write(root)
    text = (root / rm.MANIFEST).read_text()
    assert rm.check(root) == []
    assert rm.write(root) == first and (root / rm.MANIFEST).read_text() == text  # same bytes again
    assert rm.main(["--root", str(root), "--check"]) == 0
    entries = {e["path"]: e for e in map(json.loads, text.splitlines())}
    assert list(entries) == sorted(entries)
    assert "docs/results/MANIFEST.jsonl" not in entries
    assert entries["docs/results/good.json"]["named_by"] == ["README.md"]
    assert entries["docs/results/good.json"]["status"] == "clean"
    assert entries["docs/results/dirty.json"]["to_rerun_on"] == ["docs/PAGE.md"]
    assert entries["docs/results/dirty.json"]["named_by"] == [] and entries["docs/results/dirty.json"]["dirty"] is True
    assert entries["docs/results/unnamed.json"]["named_by"] == [] == entries["docs/results/unnamed.json"]["to_rerun_on"]
    assert entries["docs/results/runs/r.log"]["kind"] == "log"
    assert entries["docs/results/probes/p.json"]["device"] == "CPU: Intel Xeon, 16 cores"


@pytest.mark.parametrize("page, expected", [
    ("[d](results/dirty.json)", "docs/PAGE.md: quotes docs/results/dirty.json (dirty)"),
    ("results/unnamed.json", "docs/PAGE.md: quotes docs/results/unnamed.json (no commit)"),
    ("`docs/results/probes/gone.json`", "docs/PAGE.md: names docs/results/probes/gone.json, which does not exist"),
    ("## To be re-run from a commit\n\nresults/gone.json\n", "docs/PAGE.md: names docs/results/gone.json, which does not exist"),
])
def test_the_check_fails_on_each_problem(rm, tmp_path, page, expected):
    root = good_tree(tmp_path)
    rm.write(root)
    assert rm.check(root) == []
    (root / "docs" / "PAGE.md").write_text(page)
    rm.write(root)  # a current manifest: only the page's problem is left
    problems = rm.check(root)
    assert len(problems) == 1 and problems[0].startswith(expected), problems
    assert rm.main(["--root", str(root), "--check"]) == 1


def test_the_check_fails_on_a_stale_manifest(rm, tmp_path):
    root = good_tree(tmp_path)
    rm.write(root)
    (root / "docs" / "results" / "new.json").write_text(json.dumps(stamped()))
    assert rm.check(root) == ["docs/results/MANIFEST.jsonl is stale: run python3 scripts/results_manifest.py"]
    rm.write(root)
    assert rm.check(root) == []
    # a file quoted and also listed for re-run is a quote: checked as one
    (root / "README.md").write_text("results/dirty.json\n")
    rm.write(root)
    assert rm.check(root) == ["README.md: quotes docs/results/dirty.json (dirty); re-run it from a commit or list "
                              "it under \"To be re-run\""]


# --- this repository ------------------------------------------------------------------------------------


def test_this_repository_quotes_only_clean_results_and_its_manifest_is_current(rm):
    """README.md and docs/*.md name only existing result files, quote only clean ones (an unclean file
    is named only under "To be re-run"), and docs/results/MANIFEST.jsonl is what the script writes."""
    problems = rm.check(ROOT)
    assert problems == [], "python3 scripts/results_manifest.py --check:\n" + "\n".join(problems)
