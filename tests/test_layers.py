"""Dependencies point one way (docs/ARCHITECTURE.md): the shared contract `andromeda_nb` knows neither
architecture; `cpu_baseline` and `gpu` know the contract and not each other; `migration`, above both,
knows all three; `cluster` (shards and replicas on Ray) sits above `migration`; `cli.py` and `scripts/`
sit on top; nothing imports the tests. Besides, the product
of each architecture never imports its kernel lab (`gpu/lab/`, `cpu_baseline/lab/`): only the lab
itself and the benchmarks do, so the lab can be taken away.

Every module's imports are read with `ast` (imports inside functions too, relative ones resolved),
and each arrow that runs the wrong way is reported with its file and line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("andromeda_nb", "cpu_baseline", "gpu", "migration", "cluster")
SCANNED = (*PACKAGES, "scripts")
LIBRARIES = ("andromeda_nb", "cpu_baseline", "gpu", "migration", "cluster", "cli", "scripts")
# layer -> the layers it must not import
FORBIDDEN = {
    "andromeda_nb": ("cpu_baseline", "gpu", "migration", "cluster", "cli", "tests"),
    "cpu_baseline": ("gpu", "migration", "cluster", "cli", "tests"),
    "gpu": ("cpu_baseline", "migration", "cluster", "cli", "tests"),
    "migration": ("cluster", "cli", "tests"),
    "cluster": ("cli", "tests"),
    "scripts": ("cli", "tests"),
    "cli": ("tests",),
}
LABS = {"gpu": "gpu.lab", "cpu_baseline": "cpu_baseline.lab"}
LAB_CLIENTS = ("gpu.lab", "gpu.bench_match", "gpu.bench_score", "cpu_baseline.lab", "cpu_baseline.bench")


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.imported} ({self.rule})"


def module_name(path: str) -> str:
    """Dotted module name of a repository-relative .py path ('cli.py' -> 'cli')."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: str, source: str) -> list[tuple[int, str]]:
    """(line, module) for every import of the source, anywhere in it. `from a import b` counts as both
    `a` and `a.b` (b may be a module); relative imports are resolved against the file's package."""
    module = module_name(path)
    package = module if Path(path).name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: max(0, len(package.split(".")) - (node.level - 1))] if package else []
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}" if base else alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name]


def layer_of(module: str) -> str:
    return module.split(".")[0]


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def check_source(path: str, source: str) -> list[Violation]:
    """Every import of one file that runs against the layers (FORBIDDEN) or reaches a kernel lab from
    outside the lab and the benchmarks."""
    importer = module_name(path)
    layer = layer_of(importer)
    out = []
    for line, imported in imported_modules(path, source):
        target = layer_of(imported)
        if target in FORBIDDEN.get(layer, ()):
            out.append(Violation(path, line, imported, f"{layer} -> {target} runs against the layers"))
        lab = LABS.get(layer)
        if lab and within(imported, lab) and not any(within(importer, c) for c in LAB_CLIENTS):
            out.append(Violation(path, line, imported, f"the product ({importer}) -> the kernel lab {lab}"))
    return sorted(set(out), key=lambda v: (v.path, v.line, v.imported))


def source_files() -> list[str]:
    files = [str(p.relative_to(ROOT)) for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))]
    return files + ["cli.py"]


def test_every_import_points_the_right_way():
    files = source_files()
    assert len(files) > 60 and {layer_of(module_name(f)) for f in files} >= set(LIBRARIES), files
    violations = [v for f in files for v in check_source(f, (ROOT / f).read_text())]
    assert not violations, "imports against the layers:\n" + "\n".join(map(str, violations))


def test_the_checker_finds_wrong_arrows():
    """The checker on sources with a wrong arrow each (inside a function, relative, from-import of a
    module, the product reaching the lab), and on right ones."""
    bad = {
        "andromeda_nb/example.py": "import numpy\n\n\ndef f():\n    from gpu.index import GpuTargetingIndex\n",
        "cpu_baseline/example.py": "from ..gpu import index\n",
        "gpu/example.py": "from cpu_baseline import scorer\n",
        "migration/example.py": "import cli\n",
        "migration/example2.py": "from cluster import router\n",
        "gpu/kernels/example.py": "from ..lab import match\n",
        "andromeda_nb/sub/example.py": "from ...tests import conftest\n",
    }
    found = {path: check_source(path, source) for path, source in bad.items()}
    assert [(v.line, v.imported) for v in found["andromeda_nb/example.py"]] == [(5, "gpu.index"),
                                                                               (5, "gpu.index.GpuTargetingIndex")]
    assert "andromeda_nb -> gpu" in str(found["andromeda_nb/example.py"][0])
    assert "andromeda_nb/example.py:5" in str(found["andromeda_nb/example.py"][0])
    assert {v.imported for v in found["cpu_baseline/example.py"]} == {"gpu", "gpu.index"}
    assert {v.imported for v in found["gpu/example.py"]} == {"cpu_baseline", "cpu_baseline.scorer"}
    assert [v.imported for v in found["migration/example.py"]] == ["cli"]
    assert {v.imported for v in found["migration/example2.py"]} == {"cluster", "cluster.router"}
    assert "kernel lab" in str(found["gpu/kernels/example.py"][0])
    assert found["andromeda_nb/sub/example.py"][0].imported.startswith("tests")
    good = {
        "migration/example.py": "from cpu_baseline.engine import CpuEngine\nfrom gpu import engine\n",
        "gpu/lab/example.py": "from ..kernels import match\nfrom . import score\n",
        "gpu/bench_example.py": "from andromeda_nb import bench\n",
        "cli.py": "from migration import demo\n",
        "cluster/example.py": "from migration.architectures import build_engine\n",
    }
    assert not [v for path, source in good.items() for v in check_source(path, source)]
