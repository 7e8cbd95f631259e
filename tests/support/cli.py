"""The `andromeda` command run in-process for the tests (click's CliRunner), stderr kept apart."""

from __future__ import annotations

from click.testing import CliRunner

from cli import main


def runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2 keeps stderr apart already
        return CliRunner()


def run_cli(*args, code: int = 0):
    """`andromeda ARGS...`, asserting its exit code (with its output in the message when it differs)."""
    result = runner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, f"andromeda {' '.join(map(str, args))}: exit {result.exit_code}\n" \
                                     f"stdout: {result.stdout}\nstderr: {result.stderr}"
    return result
