"""The mutation runner's list (scripts/mutants.py) stays plantable: every mutant's text occurs exactly
once in its file and its test files exist, so none is reported stale instead of run; a text that no
longer occurs is named."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _runner():
    spec = importlib.util.spec_from_file_location("mutants_runner", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutant_can_be_planted_as_written():
    runner = _runner()
    assert len(runner.MUTANTS) >= 100
    assert runner.problems() == []
    assert runner.main(["--check"]) == 0


def test_a_mutant_whose_text_is_gone_is_named(monkeypatch):
    runner = _runner()
    gone = runner.Mutant("gone", "test", "andromeda_nb/oracle.py", "no such text", "x",
                         ("tests/core/test_oracle.py", "tests/core/test_nothing.py"), "nothing")
    monkeypatch.setattr(runner, "MUTANTS", [*runner.MUTANTS, gone])
    assert runner.problems() == ["gone: its text occurs 0 times in andromeda_nb/oracle.py",
                                 "gone: no test file tests/core/test_nothing.py"]
    assert runner.main(["--check"]) == 1


def test_a_mutant_caught_only_by_the_end_to_end_tests_is_a_gap_that_fails_the_run(monkeypatch, capsys):
    import json
    import subprocess

    runner = _runner()
    failed = {"file": runner.END_TO_END}

    def fake_pytest(cmd, **kw):  # pytest's summary line, as -x leaves it
        out = f"FAILED {failed['file']}::test_x - AssertionError\n1 failed in 1.0s\n"
        return subprocess.CompletedProcess(cmd, 1, stdout=out, stderr="")

    monkeypatch.setattr(runner, "make_copy", lambda dest: None)
    monkeypatch.setattr(runner, "apply", lambda mutant, tree: None)
    monkeypatch.setattr(runner.subprocess, "run", fake_pytest)
    assert runner.main(["--only", "age-min-exclusive", "--json"]) == 1
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["result"] == "caught" and row["caught_by"] == runner.END_TO_END and "gap" in row
    failed["file"] = "tests/core/test_oracle.py"  # caught by its module's own test file: no gap
    assert runner.main(["--only", "age-min-exclusive", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["caught_by"] == "tests/core/test_oracle.py" and "gap" not in row
