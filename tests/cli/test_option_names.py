"""One meaning per option name: every renamed option still works under its old name for one release
(read as the new one, with one deprecation line on stderr) and its new name works without one; counts,
files, devices and --json mean one thing in every command."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from cli import main
from tests.support.cli import runner as _runner

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample"

# (command, old name, new name, value, other options the command needs): every rename cli.py declares
RENAMES = [
    ("import", "--ads", "--ads-file", SAMPLE / "ads.jsonl",
     ["--requests-file", SAMPLE / "requests.jsonl", "--out", "{tmp}/corpus"]),
    ("import", "--requests", "--requests-file", SAMPLE / "requests.jsonl",
     ["--ads-file", SAMPLE / "ads.jsonl", "--out", "{tmp}/corpus"]),
    ("match", "--updates", "--updates-file", SAMPLE / "updates.jsonl", ["--data", SAMPLE]),
    ("retrieve", "--updates", "--updates-file", SAMPLE / "updates.jsonl", ["--data", SAMPLE]),
    ("compare", "--updates", "--updates-file", SAMPLE / "updates.jsonl", ["--data", SAMPLE]),
    ("query", "--requests", "--requests-file", SAMPLE / "requests.jsonl", ["--server", "grpc://127.0.0.1:1"]),
    ("query", "--requests", "--data", SAMPLE, ["--server", "grpc://127.0.0.1:1"]),
    ("serve cluster", "--log", "--log-dir", "off", ["--data", SAMPLE, "--shards", 2]),
    ("bench cpu", "--out", "--out-file", "{tmp}/r.json", []),
    ("bench match", "--pools", "--ads", "4096,8192", []),
    ("bench match", "--versions", "--kernel-versions", "6,8", []),
    ("bench match", "--updates", "--measure-updates", None, []),
    ("bench match", "--no-updates", "--no-measure-updates", None, []),
    ("bench match", "--cpu-pool", "--cpu-ads", 0, []),
    ("bench match", "--out", "--out-file", "{tmp}/r.json", []),
    ("bench score", "--versions", "--kernel-versions", "4,6", []),
    ("bench score", "--out", "--out-file", "{tmp}/r.json", []),
    ("bench pipeline", "--pool", "--ads", 4096, []),
    ("bench pipeline", "--score-version", "--kernel-version", 7, []),
    ("bench pipeline", "--layout", "--layouts", "format,geo", []),
    ("bench pipeline", "--launch", "--launches", "direct", []),
    ("bench pipeline", "--out", "--out-file", "{tmp}/r.json", []),
    ("bench cluster", "--out", "--out-file", "{tmp}/r.json", ["--data", SAMPLE]),
]


def _commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))
        else:
            yield " ".join(prefix + (name,)), cmd


COMMANDS = dict(_commands(main))


def _options(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}


def _parsed(monkeypatch, command: str, args: list, tmp_path) -> tuple[dict, str]:
    """The keywords `andromeda COMMAND ARGS` hands its function (which is not run), and its stderr."""
    cmd = COMMANDS[command]
    seen = {}
    monkeypatch.setattr(cmd, "callback", lambda **kwargs: seen.update(kwargs))
    words = [str(a).replace("{tmp}", str(tmp_path)) for a in [*command.split(), *args]]
    result = _runner().invoke(main, words, catch_exceptions=False)
    assert result.exit_code == 0, f"andromeda {' '.join(words)}: exit {result.exit_code}\n{result.stderr}"
    return seen, result.stderr


def test_the_table_here_holds_every_rename_cli_declares():
    declared = {(name, old) for name, cmd in COMMANDS.items() for old in getattr(cmd, "renamed", {})}
    assert declared == {(c, old) for c, old, *_ in RENAMES}


@pytest.mark.parametrize("command, old, new, value, needs", RENAMES,
                         ids=[f"{c} {old}->{new}" for c, old, new, *_ in RENAMES])
def test_an_old_name_is_read_as_its_new_one_and_says_so_once(monkeypatch, tmp_path, command, old, new, value, needs):
    cmd = COMMANDS[command]
    assert new in _options(cmd), f"{command}: {new} is not an option"
    assert old not in {o for p in cmd.params if isinstance(p, click.Option) and not p.hidden for o in p.opts}
    given = [] if value is None else [value]
    with_new, said_new = _parsed(monkeypatch, command, [*needs, new, *given], tmp_path)
    with_old, said_old = _parsed(monkeypatch, command, [*needs, old, *given], tmp_path)
    assert with_old == with_new
    assert "deprecated" not in said_new
    notice = [line for line in said_old.splitlines() if "deprecated" in line]
    assert len(notice) == 1 and new in notice[0], said_old
    assert notice[0].startswith(f"andromeda {command}: {old} is deprecated (it goes in the next release): use ")
    if value is not None:  # also as --old=VALUE, and said once however often it is given
        with_eq, said_eq = _parsed(monkeypatch, command, [*needs, f"{old}={str(value).replace('{tmp}', str(tmp_path))}"],
                                   tmp_path)
        assert with_eq == with_new and said_eq.count("deprecated") == 1


def test_old_names_are_listed_in_help_and_nothing_after_a_double_dash_is_renamed(capsys):
    import cli

    text = _runner().invoke(main, ["bench", "pipeline", "--help"]).stdout
    assert "Old option names (accepted until the next release)" in text and "--pool" in text.split("Old option")[1]
    renames = {"--pool": cli._Rename("--ads")}
    assert cli._renamed_args("andromeda x", ["--pool", "1", "--", "--pool"], renames) == ["--ads", "1", "--", "--pool"]
    assert capsys.readouterr().err.count("deprecated") == 1


def test_query_takes_a_requests_file_or_a_corpus_directory_one_of_them(tmp_path):
    for args in ([], ["--requests-file", SAMPLE / "requests.jsonl", "--data", SAMPLE]):
        result = _runner().invoke(main, ["query", "--server", "grpc://127.0.0.1:1", *map(str, args)])
        assert result.exit_code == 2 and "--requests-file FILE or --data DIR" in result.stderr, result.stderr
    result = _runner().invoke(main, ["query", "--server", "grpc://127.0.0.1:1", "--requests-file", str(SAMPLE)])
    assert result.exit_code == 2 and "is a directory" in result.stderr


def test_a_count_a_file_and_a_list_are_named_apart_in_every_command():
    """--ads, --requests and --updates are counts wherever they appear, at least 1 for --ads; a file
    is --X-file; a list of kernel versions is --kernel-versions, one is --kernel-version; --out is a
    directory, a bench's result file --out-file; --log a file, --log-dir a directory."""
    kinds: dict[str, set] = {}
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            if isinstance(p, click.Option):
                kinds.setdefault(p.opts[0], set()).add((name, type(p.type).__name__))
                if p.opts[0] == "--ads":
                    assert getattr(p.type, "min", 1) == 1, (name, p.type)
    for option in ("--ads", "--requests", "--updates"):
        assert {k for _, k in kinds[option]} <= {"IntRange", "IntList"}, (option, kinds[option])
    for option in ("--ads-file", "--requests-file", "--updates-file", "--out-file", "--log"):
        assert {k for _, k in kinds[option]} == {"Path"}, (option, kinds[option])
    for name, cmd in COMMANDS.items():
        out = next((p for p in cmd.params if "--out" in getattr(p, "opts", [])), None)
        if out is not None:
            assert out.type.dir_okay and not out.type.file_okay, f"{name} --out is not a directory"
    assert {k for _, k in kinds["--kernel-version"]} == {"IntRange"}
    assert {k for _, k in kinds["--kernel-versions"]} == {"IntList"}
    assert "--versions" not in kinds and "--pool" not in kinds and "--pools" not in kinds


def test_every_device_option_defaults_to_auto_and_every_json_is_json_lines():
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            if isinstance(p, click.Option) and p.opts[0] == "--device":
                assert p.default == "auto", f"{name} --device defaults to {p.default}"
            if isinstance(p, click.Option) and p.opts[0] == "--json":
                assert p.help.startswith("JSON Lines on stdout"), f"{name} --json: {p.help}"


def test_the_readme_names_the_scheme_and_every_old_name():
    text = (ROOT / "README.md").read_text()
    section = text.split("### Option names", 1)[1].split("\n## ", 1)[0]
    def named(option: str) -> bool:
        return re.search(r"(?<![\w-])" + re.escape(option) + r"(?![\w-])", section) is not None

    for command, old, new, *_ in RENAMES:
        assert named(old) and named(new), (command, old, new)


def test_a_result_records_its_command_with_the_option_names_a_user_types(monkeypatch):
    """Called as a library (as here), a bench's provenance rebuilds its command from the parsed
    options: under their flags (--ads, --kernel-version), not the keywords the function takes."""
    import json

    from benchmarks import score as bs

    def fake(layouts, **options):
        return {"layout": layouts[0], "env": {"device": "test"}, "pool_ads": options["pool"], "precision": "fp16",
                "D": 64, "k": 100, "checks_ok": True, "latency_ms": {"p50": 1.0, "p99": 2.0}, "throughput": [],
                "targets": {}}

    monkeypatch.setattr(bs, "bench_pipeline_layouts", fake)
    result = _runner().invoke(main, ["bench", "pipeline", "--pool", "4096", "--kernel-version", "7", "--json"])
    assert result.exit_code == 0, result.stderr
    command = json.loads(result.stdout.splitlines()[-1])["provenance"]["command"]
    assert "--ads 4096" in command and "--kernel-version 7" in command and "--json" in command, command
    assert "--pool " not in command and "--score-version" not in command and "--as-json" not in command, command


COMMON = {"--json", "--quiet", "-q", "--help", "-h"}  # on every command, said once under the table


def _readme_commands() -> list[tuple[list[str], set[str]]]:
    """(command names, options) of every `andromeda ...` in the first column of README's commands
    table; `serve colocated|remote|scorer` names three commands."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Commands"):].split("\n\n", 2)[1]
    found = []
    for row in table.splitlines()[2:]:
        first = re.split(r"(?<!\\)\|", row)[1]
        for span in re.findall(r"`(andromeda [^`]*)`", first):
            words = span.replace("\\|", "|").split()[1:]
            names = [""]
            group = main
            while words and isinstance(group, click.Group) and all(w in group.commands for w in words[0].split("|")):
                subs = words.pop(0).split("|")
                names = [f"{n} {s}".strip() for n in names for s in subs]
                group = group.commands[subs[0]]
            options = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", " ".join(words)))
            found.append((names, options))
    return found


def test_the_readme_commands_table_matches_every_commands_options():
    """Every option the table names is one of its command's; every command is in the table; and
    where the table gives a command's whole line (all but serve and bench, whose --help lists the
    server and bench options), every option of the command is on it."""
    listed: dict[str, set] = {}
    for names, options in _readme_commands():
        for name in names:
            assert name in COMMANDS, f"README names `andromeda {name}`, which is no command"
            cmd = COMMANDS[name]
            unknown = options - _options(cmd)
            assert not unknown, f"README: `andromeda {name}` has no option {sorted(unknown)}"
            listed.setdefault(name, set()).update(options)
    assert set(COMMANDS) == set(listed), f"commands missing from README's table: {set(COMMANDS) - set(listed)}"
    for name, cmd in COMMANDS.items():
        required = [p.opts[0] for p in cmd.params if isinstance(p, click.Option) and p.required]
        assert set(required) <= listed[name], f"README: `andromeda {name}` lacks its required {required}"
        if name.split()[0] in ("serve", "bench"):
            continue
        missing = [p.opts[0] for p in cmd.params if isinstance(p, click.Option) and not p.hidden
                   and not set(p.opts + p.secondary_opts) & (listed[name] | COMMON)]
        assert not missing, f"README: `andromeda {name}` lacks {missing} (andromeda {name} --help)"
