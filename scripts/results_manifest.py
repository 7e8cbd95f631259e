"""The manifest of docs/results: every result file with its kind, device, commit, dirty flag and command,
and the pages that name it (README.md and docs/*.md).

    python3 scripts/results_manifest.py            # (re)writes docs/results/MANIFEST.jsonl
    python3 scripts/results_manifest.py --check    # exit 1 on a problem below, or a stale manifest

A JSON result records where it came from in one of the forms the project's commands write
(`andromeda_nb.provenance.stamp`: "provenance" with "command" and "host" {"git_commit", "git_dirty"};
a probe script: "command" and "host" at the top), or per part of a before/after or repeated run
("before", "after", "runs", "rounds", each with its own "host" and "command"). A file is clean when it
records a commit and a command and every part says `git_dirty: false`.

What `--check` refuses:
* a page naming a file under docs/results (a path with `results/` in it) that does not exist;
* a page quoting a JSON result that is not clean: no commit, no command, or made from an
  uncommitted tree (`git_dirty` true or not recorded). A file named only inside a section whose
  heading starts with "To be re-run" is listed there to be measured again, not quoted: it must exist,
  it may be unclean;
* a MANIFEST.jsonl that differs from what this script writes now.
Other files (logs, text, notes) carry no provenance of their own and are only checked to exist.

Standard library only; the output is sorted by path and has no timestamp, so running it twice
writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path("docs") / "results"
MANIFEST = RESULTS / "MANIFEST.jsonl"
RERUN_HEADING = re.compile(r"^(#+)\s+To be re-run", re.IGNORECASE)
HEADING = re.compile(r"^(#+)\s")
BRACES = re.compile(r"([\w.\-/]+)\.\{([\w.,\-]+)\}")
TOKEN = re.compile(r"[\w.\-/*]+")
PART_KEYS = ("before", "after")
LIST_KEYS = ("runs", "rounds")
SUFFIX_KINDS = {".log": "log", ".txt": "text", ".md": "notes", ".jsonl": "json lines", ".tgz": "archive"}
NAME_KINDS = (("bench_match", "match"), ("bench_cpu", "cpu"), ("score_", "score"), ("pipeline_", "pipeline"),
              ("compare_", "compare"), ("demo_", "demo"), ("quality", "quality"))
GPU_IN_NAME = re.compile(r"(?:^|_)(gh200|h200|h100|a100)(?:_|$)")


# --- provenance of one JSON result ---------------------------------------------------------------------


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _own(doc: dict) -> dict:
    """The provenance one record states at its own level: commit, dirty flag, command, creation time."""
    prov = _dict(doc.get("provenance"))
    host = _dict(prov.get("host")) or _dict(doc.get("host"))
    commit = host.get("git_commit") or prov.get("git_commit") or prov.get("commit")
    dirty = host.get("git_dirty") if "git_dirty" in host else prov.get("git_dirty")
    command = prov.get("command") or doc.get("command")
    created = prov.get("created") or doc.get("created")
    return {"commit": commit if isinstance(commit, str) and commit else None,
            "dirty": dirty if isinstance(dirty, bool) else None,
            "command": command if isinstance(command, str) and command.strip() else None,
            "created": created if isinstance(created, str) else None}


def _parts(doc: dict) -> list[dict]:
    """The sub-records of a before/after or repeated run, in file order."""
    parts = [doc[k] for k in PART_KEYS if isinstance(doc.get(k), dict)]
    for key in LIST_KEYS:
        if isinstance(doc.get(key), list):
            parts += [r for r in doc[key] if isinstance(r, dict)]
    return parts


def _one_or_many(values: list):
    unique = list(dict.fromkeys(v for v in values if v is not None))
    if not unique:
        return None
    return unique[0] if len(unique) == 1 else unique


def provenance(doc) -> dict:
    """commit (str, a list for a file made at several commits, or None), dirty (True when any part was
    made from an uncommitted tree, False when every part that records a commit says clean, else None),
    command (str, a list, or None), created."""
    if not isinstance(doc, dict):
        return {"commit": None, "dirty": None, "command": None, "created": None}
    own = _own(doc)
    parts = [_own(p) for p in _parts(doc)]
    records = [own, *parts]
    commit = own["commit"] if own["commit"] else _one_or_many([p["commit"] for p in parts])
    command = own["command"] if own["command"] else _one_or_many([p["command"] for p in parts])
    if any(r["dirty"] is True for r in records):
        dirty = True
    else:
        with_commit = [r for r in records if r["commit"]]
        dirty = False if with_commit and all(r["dirty"] is False for r in with_commit) else None
    created = own["created"] or _one_or_many([p["created"] for p in parts])
    return {"commit": commit, "dirty": dirty, "command": command, "created": created}


def status(entry: dict) -> str:
    """clean | dirty | no commit | no command | tree not recorded | not JSON (a manifest entry's verdict)."""
    if not entry["path"].endswith(".json"):
        return "not JSON"
    if entry["dirty"] is True:
        return "dirty"
    if not entry["commit"]:
        return "no commit"
    if not entry["command"]:
        return "no command"
    if entry["dirty"] is not False:
        return "tree not recorded"  # a commit without git_dirty: false may have had local changes
    return "clean"


def _find_gpu(value, depth: int = 0) -> str | None:
    """The first string naming an NVIDIA device anywhere in the document (depth-first, file order)."""
    if depth > 6:
        return None
    if isinstance(value, str):
        return value if value.startswith("NVIDIA") else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        found = _find_gpu(item, depth + 1)
        if found:
            return found
    return None


def device(doc, name: str) -> str | None:
    """The GPU a result names, else the GPU its file name names, else its host CPU, else None."""
    gpu = _find_gpu(doc) if isinstance(doc, (dict, list)) else None
    if gpu:
        return gpu
    named = GPU_IN_NAME.search(Path(name).stem.lower())
    if named:
        return f"NVIDIA {named.group(1).upper()} (from the file name)"
    if not isinstance(doc, dict):
        return None
    prov = _dict(doc.get("provenance"))
    for host in (_dict(prov.get("host")), _dict(doc.get("host")), _dict(doc.get("machine")),
                 *(_dict(p.get("host")) for p in _parts(doc))):
        if host.get("cpu"):
            cores = f", {host['cores']} cores" if host.get("cores") else ""
            return f"CPU: {host['cpu']}{cores}"
    return None


def kind(doc, rel: str) -> str:
    """The result's own "kind", else one read from its folder or name, else its file type."""
    suffix = Path(rel).suffix
    if suffix != ".json":
        return SUFFIX_KINDS.get(suffix, suffix.lstrip(".") or "file")
    if isinstance(doc, dict) and isinstance(doc.get("kind"), str):
        return doc["kind"]
    if rel.startswith("probes/"):
        return "probe"
    name = Path(rel).name
    for prefix, found in NAME_KINDS:
        if name.startswith(prefix):
            return found
    return "json"


# --- pages and the files they name ---------------------------------------------------------------------


def result_files(root: Path) -> list[str]:
    """Every file under docs/results (the manifest excepted), as paths relative to it, sorted."""
    base = root / RESULTS
    if not base.is_dir():
        return []
    manifest = (root / MANIFEST).resolve()
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*")
                  if p.is_file() and p.resolve() != manifest)


def pages(root: Path) -> list[str]:
    """README.md and docs/*.md, relative to the root."""
    found = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    return [p.relative_to(root).as_posix() for p in found if p.is_file()]


def expand_braces(text: str) -> str:
    """`dir/name.{json,log}` -> `dir/name.json dir/name.log`."""
    return BRACES.sub(lambda m: " ".join(f"{m.group(1)}.{ext}" for ext in m.group(2).split(",")), text)


def rerun_spans(text: str) -> list[tuple[int, int]]:
    """Character ranges of the sections whose heading starts with "To be re-run" (to the next heading
    of the same level or above)."""
    spans, start, level, offset, in_code = [], None, 0, 0, False
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        heading = None if in_code else HEADING.match(line)
        if heading:
            depth = len(heading.group(1))
            if start is not None and depth <= level:
                spans.append((start, offset))
                start = None
            if start is None and RERUN_HEADING.match(line):
                start, level = offset, depth
        offset += len(line)
    if start is not None:
        spans.append((start, offset))
    return spans


def mentions(text: str, files: list[str]) -> list[tuple[str, bool, bool]]:
    """(path relative to docs/results, exists, inside a "To be re-run" section) for every naming of a
    result file: a path with `results/` in it (`docs/results/x.json`, a link `results/probes/x.json`),
    or a known file's name, bare or under the folders it lies in (`probes/x.json`). A path under
    another folder (`/tmp/x.json`) names nothing."""
    text = expand_braces(text)
    spans = rerun_spans(text)
    known = set(files)
    by_name: dict[str, list[str]] = {}
    for rel in files:
        by_name.setdefault(rel.rsplit("/", 1)[-1], []).append(rel)
    found = []
    for m in TOKEN.finditer(text):
        token = m.group(0).rstrip(".").removeprefix("./")
        if not token or "*" in token:
            continue
        in_rerun = any(a <= m.start() < b for a, b in spans)
        if "results/" in token:
            rel = token.rsplit("results/", 1)[1]
            if not rel or "." not in rel.rsplit("/", 1)[-1]:
                continue  # a folder
            found.append((rel, rel in known, in_rerun))
            continue
        name = token.rsplit("/", 1)[-1]
        for rel in by_name.get(name, ()):
            if "/" not in token or ("/" + rel).endswith("/" + token):
                found.append((rel, True, in_rerun))
    return found


# --- the manifest and the check -------------------------------------------------------------------------


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def build(root: Path) -> tuple[list[dict], list[str]]:
    """The manifest's entries (sorted by path) and the problems `--check` reports."""
    root = Path(root)
    files = result_files(root)
    manifest_rel = MANIFEST.relative_to(RESULTS).as_posix()
    quoted: dict[str, set[str]] = {rel: set() for rel in files}
    listed: dict[str, set[str]] = {rel: set() for rel in files}
    problems = []
    for page in pages(root):
        for rel, exists, in_rerun in mentions((root / page).read_text(), files):
            if rel == manifest_rel:
                continue
            if not exists:
                problems.append(f"{page}: names docs/results/{rel}, which does not exist")
                continue
            (listed if in_rerun else quoted)[rel].add(page)
    entries = []
    for rel in files:
        path = root / RESULTS / rel
        doc = _load(path) if rel.endswith(".json") else None
        prov = provenance(doc)
        entry = {"path": (RESULTS / rel).as_posix(), "kind": kind(doc, rel), "device": device(doc, rel),
                 "commit": prov["commit"], "dirty": prov["dirty"], "command": prov["command"],
                 "created": prov["created"], "named_by": sorted(quoted[rel]),
                 "to_rerun_on": sorted(listed[rel] - quoted[rel])}
        entry["status"] = status(entry)
        if rel.endswith(".json") and doc is None:
            entry["status"] = "unreadable"
        entries.append(entry)
        if entry["named_by"] and rel.endswith(".json") and entry["status"] != "clean":
            for page in entry["named_by"]:
                problems.append(f"{page}: quotes docs/results/{rel} ({entry['status']}); re-run it from a "
                                f"commit or list it under \"To be re-run\"")
    return entries, sorted(set(problems))


def render(entries: list[dict]) -> str:
    return "".join(json.dumps(e) + "\n" for e in entries)


def check(root: Path) -> list[str]:
    """Every problem of the pages and result files, and a stale manifest."""
    root = Path(root)
    entries, problems = build(root)
    path = root / MANIFEST
    current = path.read_text() if path.is_file() else None
    if current != render(entries):
        problems.append(f"{MANIFEST.as_posix()} is {'missing' if current is None else 'stale'}: "
                        f"run python3 scripts/results_manifest.py")
    return problems


def write(root: Path) -> list[dict]:
    root = Path(root)
    entries, _ = build(root)
    (root / MANIFEST).write_text(render(entries))
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository's root (default: the checkout this script is in)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a page names a missing result, quotes an unclean one, "
                             "or the manifest is stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.root)
        for line in problems:
            print(line)
        print(f"{len(problems)} problem(s)" if problems else "results manifest: ok", file=sys.stderr)
        return 1 if problems else 0
    entries = write(args.root)
    counts: dict[str, int] = {}
    for e in entries:
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    print(f"{MANIFEST.as_posix()}: {len(entries)} files (" +
          ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ")", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
