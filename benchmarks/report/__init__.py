"""`andromeda bench report`: benchmark JSON -> the generated part of docs/BENCHMARKS.md and PNG charts.

Inputs are the JSON files the measuring commands write, of both architectures (`sources` recognises
each file's kind). Output: markdown tables of every figure, each with its device, versions, sizes and
the command that made it (or a note that the JSON does not record it) (`markdown`), and with
matplotlib (the optional extra `plots`) four charts under OUT/benchmarks/ (`charts`); the figures
they show are derived in `figures`.

OUT/BENCHMARKS.md keeps any hand-written text: the generated part lives between the BEGIN and END
markers and only that part is replaced (appended at the end the first time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..report.charts import CHART_DIR, PLOTS_MISSING, write_charts
from ..report.figures import kernel_flops_per_ad
from ..report.markdown import ANCHORS, BEGIN, END, merge_into, render_markdown
from ..report.sources import (
    KINDS,
    ReportError,
    Source,
    detect_kind,
    load_source,
    load_sources,
    parse_commands,
)


# --- the whole report ----------------------------------------------------------------------------------


@dataclass
class ReportResult:
    markdown: str  # path of BENCHMARKS.md
    sources: list[Source]
    charts: dict[str, str] = field(default_factory=dict)  # name -> path
    skipped: str | None = None  # why charts were not drawn

    def to_json(self) -> dict:
        return {"markdown": self.markdown, "sources": [{"path": s.path, "kind": s.kind} for s in self.sources],
                "charts": self.charts, "charts_skipped": self.skipped}


def build_report(paths: Iterable, out_dir, *, charts: bool = True, markdown_name: str = "BENCHMARKS.md",
                 commands: dict[str, str] | None = None) -> ReportResult:
    """Read the result files, draw the charts into OUT/benchmarks/ and write (or update) OUT/BENCHMARKS.md.
    `commands`: {file name: command} for files whose JSON does not record the command that made them."""
    sources = load_sources(paths)
    commands = dict(commands or {})
    for s in sources:
        s.given_command = commands.pop(s.name, None)
        rel = os.path.relpath(Path(s.path).resolve(), Path(out_dir).resolve())
        s.link = None if rel.startswith("..") else Path(rel).as_posix()
    if commands:
        raise ReportError(f"--command given for {', '.join(sorted(commands))}, which is not among the input files")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path = out / markdown_name
    existing = md_path.read_text() if md_path.exists() else None
    if existing is not None:
        merge_into(existing, "")  # fail on broken markers before anything is drawn
    if charts:
        written, skipped = write_charts(sources, out / CHART_DIR)
    else:
        written, skipped = {}, "--no-charts was given"
    block = render_markdown(sources, written, skipped)
    md_path.write_text(merge_into(existing, block))
    return ReportResult(str(md_path), sources, {k: str(out / CHART_DIR / v) for k, v in written.items()}, skipped)


def format_summary(result: ReportResult) -> str:
    lines = [f"{s.path}: {s.kind}" for s in result.sources]
    lines.append(f"wrote {result.markdown}")
    if result.skipped:
        lines.append(f"charts skipped: {result.skipped}")
    for name, path in result.charts.items():
        lines.append(f"chart {name}: {path}")
    return "\n".join(lines)


__all__ = ["ANCHORS", "BEGIN", "CHART_DIR", "END", "KINDS", "PLOTS_MISSING", "ReportError", "ReportResult", "Source",
           "build_report", "detect_kind", "format_summary", "kernel_flops_per_ad", "load_source", "load_sources",
           "merge_into", "parse_commands", "render_markdown", "write_charts"]
