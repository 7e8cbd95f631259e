"""Where a measured figure came from: the command that made it, the commit it was made from and
whether the tree had changes not committed, when, on which host, with which package versions. Every
writer of a result JSON (`bench ...`, `compare --json`, `quality --out`, the scripts' `--out`)
stamps it through one function, `stamp`, under the key "provenance" (the CLI's commands also set
an explicit "kind"), so that `andromeda bench report` and `scripts/results_manifest.py` can show
every figure with the command and the source that produced it, and refuse one made from a tree
nobody can check out again.

    {"kind": "match" | "score" | "pipeline" | "cpu" | "compare" | "quality",
     "provenance": {"command": "andromeda bench match --ads 10000000 ...",
                    "commit": "5de0fb7...",  (None outside a git checkout)
                    "dirty": false,  (tracked files changed since the commit; None outside a checkout)
                    "options": {every parsed option of the command, defaults included},
                    "created": "2026-01-01T12:00:00Z",
                    "host": {"python", "platform", "cpu", "cores", package versions, "git_commit", "git_dirty"}}}

A script's command reads as it is run from the repository root (`script_command`):
`PYTHONPATH=. python3 scripts/probe_x.py --pool 1000000`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from .measure import package_version, software, write_json

KINDS = ("match", "score", "pipeline", "cpu", "compare", "quality")
PACKAGES = ("numpy", "numba", "numba-cuda", "pyarrow", "cupy-cuda12x", "cupy-cuda13x", "click")
CLI_NAMES = ("andromeda", "cli.py")
_ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> dict:
    """The source revision of the working tree, when it is a git checkout (else empty)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return {}
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=5)
        return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {}


def host_info() -> dict:
    """Python, platform, CPU, core count, the versions of the packages that matter, the git revision."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_model(),
            "cores": os.cpu_count()}
    for name in PACKAGES:
        version = package_version(name)
        if version is not None:
            info[name.replace("-", "_")] = version
    info.update(_git_commit())
    return info


def command_line(command_path: str, params: dict | None = None, argv: list[str] | None = None) -> str:
    """The command as typed when this process is the CLI itself (`andromeda ...` or `python3 cli.py
    ...`); otherwise (the CLI called as a library, e.g. in tests) rebuilt from the parsed options."""
    argv = sys.argv if argv is None else argv
    if argv and os.path.basename(argv[0]) in CLI_NAMES:
        prefix = ["python3", "cli.py"] if argv[0].endswith(".py") else ["andromeda"]
        return shlex.join(prefix + list(argv[1:]))
    words = ["andromeda", *command_path.split()[1:]]
    for name, value in (params or {}).items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                words += [flag, str(v)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def script_command(script: str, argv) -> str:
    """The command line of a script run from the repository root: `PYTHONPATH=. python3 scripts/SCRIPT
    ARGS` (`script`: its file name, or a module run with -m as "-m benchmarks.cluster")."""
    words = ["python3", *script.split()] if script.startswith("-m ") else ["python3", f"scripts/{script}"]
    return "PYTHONPATH=. " + shlex.join([*words, *(str(a) for a in argv)])


def stamp(result: dict, kind: str | None = None, *, command: str | None = None, command_path: str = "andromeda",
          params: dict | None = None, argv: list[str] | None = None) -> dict:
    """The one stamp of a result file: "provenance" (the command, the commit and whether the tree was
    dirty, the options, the time, the host) and, with `kind`, "kind", added to `result` in place
    (returned for chaining). `command`: the command line as run (a script's, `script_command`);
    without it, the CLI's, from `argv` or rebuilt from `command_path` and `params`. `kind` None:
    the result keeps its own "kind" (one `bench report` does not read)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown result kind {kind!r}; expected one of {', '.join(KINDS)}")
    created = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    if kind is not None:
        result["kind"] = kind
    host = host_info()
    result["provenance"] = {
        "command": command if command is not None else command_line(command_path, params, argv),
        "commit": host.get("git_commit"),
        "dirty": host.get("git_dirty"),
        "options": {k: _jsonable(v) for k, v in (params or {}).items()},
        "created": created,
        "host": host,
    }
    return result


def stamp_from_click(result: dict, kind: str | None) -> dict:
    """`stamp` with the command path and options of the click command now running (outside one: the
    command rebuilt from this process's arguments where it is the CLI, else "andromeda")."""
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return stamp(result, kind)
    return stamp(result, kind, command_path=ctx.command_path, params=_by_flag(ctx))


def _by_flag(ctx) -> dict:
    """The command's parsed options keyed by their long flag's name ("--kernel-version" ->
    "kernel_version", whatever the keyword the command takes), so a rebuilt command line names the
    options a user types."""
    import click

    flags = {}
    for param in ctx.command.params:
        longs = [o for o in param.opts if o.startswith("--")] if isinstance(param, click.Option) else []
        flags[param.name] = longs[0][2:].replace("-", "_") if longs else param.name
    return {flags.get(name, name): value for name, value in ctx.params.items()}


def write_result(result: dict, path, kind: str | None = None, *, command: str | None = None) -> None:
    """A result JSON written as every writer writes one: stamped (`stamp`, from the click command now
    running unless `command` is given), then `measure.write_json`. A benchmark's partial files, written
    after every measurement, carry the stamp too."""
    if command is not None:
        stamp(result, kind, command=command)
    else:
        stamp_from_click(result, kind)
    write_json(result, path)


def finish_probe(result: dict, script: str, argv, out) -> None:
    """A script's last step: the software versions and the stamp (`stamp`, with `script_command`) into
    `result`, then the JSON into `out`, or onto stdout without one."""
    result["software"] = software()
    stamp(result, command=script_command(script, argv))
    result["command"] = result["provenance"]["command"]  # where older readers look for it
    if out:
        write_json(result, out)
    else:
        print(json.dumps(result, indent=1, default=float))


def report_probe(result: dict, script: str, argv, out, indent: int | None = None) -> None:
    """A measuring script's tail: `result` stamped with the script's command line (`stamp`,
    `script_command`), printed on stdout as JSON (one line unless `indent`), and written into `out` when
    given (`measure.write_json`)."""
    stamp(result, command=script_command(script, argv))
    print(json.dumps(result, indent=indent, default=float))
    if out:
        write_json(result, out)


__all__ = ["KINDS", "command_line", "cpu_model", "finish_probe", "host_info", "report_probe", "script_command", "stamp",
           "stamp_from_click", "write_result"]
