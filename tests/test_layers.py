"""Dependencies point one way (docs/ARCHITECTURE.md):

    andromeda_nb   the contract and the data: knows no other package
    serving        protocol, servers around an engine, log, guard, client: knows the contract
    cpu_baseline,  the two architectures: know the contract and serving, not each other
    gpu
    migration      needs both architectures at once
    cluster        shards and replicas on Ray, above migration
    benchmarks     benches beside the product: may import everything, nothing shipped imports it
    cli, scripts   on top; nothing imports the tests

Besides the layers, four fences:
* the product never imports a kernel lab (`gpu/lab/`, `cpu_baseline/lab/`): only the lab itself,
  the benchmarks and the scripts do, so the lab can be taken away;
* no module outside the tests imports the test support (`andromeda_nb.testing`);
* the lab and the benchmarks use a shipped module's public names only (no `_private` names of
  another package's modules);
* no circles: among the modules of one package, and between packages, following every import
  (inside functions too).

Every module's imports are read with `ast` (imports inside functions too, relative ones resolved),
and so are modules named as strings (`"cluster.router:ShardedRetriever"`, `python -m MODULE`
arguments): an arrow that runs the wrong way is reported with its file and line. One arrow named
as a string is allowed by name (STRING_ARROWS): the registry of `--arch` naming the optional Ray
layer above it, loaded only when asked for.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("andromeda_nb", "serving", "cpu_baseline", "gpu", "migration", "cluster", "benchmarks")
SCANNED = (*PACKAGES, "scripts")
LIBRARIES = (*PACKAGES, "cli", "scripts")
RANK = {"andromeda_nb": 0, "serving": 1, "cpu_baseline": 2, "gpu": 2, "migration": 3, "cluster": 4,
        "benchmarks": 5, "cli": 6, "scripts": 6, "tests": 7}
# layer -> the layers it must not import: every layer at its own rank (but itself) or above
FORBIDDEN = {layer: tuple(other for other, r in RANK.items() if other != layer and r >= RANK[layer])
             for layer in RANK if layer != "tests"}
LABS = ("gpu.lab", "cpu_baseline.lab")
LAB_CLIENTS = ("gpu.lab", "cpu_baseline.lab", "benchmarks", "scripts")
TEST_SUPPORT = "andromeda_nb.testing"
PUBLIC_ONLY = ("gpu.lab", "cpu_baseline.lab", "benchmarks", "cli")  # importers that keep to public names
STRING_ARROWS = {("migration.architectures", "cluster.router")}
_DOTTED = re.compile(r"^(%s)(\.\w+)+(:\w+)?$" % "|".join(PACKAGES))


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


@dataclass(frozen=True)
class Arrow:
    line: int
    module: str
    names: tuple[str, ...] = ()  # the names a `from` import takes
    as_string: bool = False


def arrows(path: str, source: str) -> list[Arrow]:
    """Every import of the source, anywhere in it, and every module named as a string. `from a import
    b` counts as both `a` and `a.b` (b may be a module); relative imports are resolved against the
    file's package."""
    module = module_name(path)
    package = module if Path(path).name == "__init__.py" else module.rpartition(".")[0]
    found: list[Arrow] = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [Arrow(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: max(0, len(package.split(".")) - (node.level - 1))] if package else []
                base = ".".join([*anchor, *([base] if base else [])])
            names = tuple(alias.name for alias in node.names)
            if base:
                found.append(Arrow(node.lineno, base, names))
            found += [Arrow(node.lineno, f"{base}.{name}" if base else name) for name in names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.match(node.value):
            found.append(Arrow(node.lineno, node.value.partition(":")[0], as_string=True))
    return [a for a in found if a.module]


def imported_modules(path: str, source: str) -> list[tuple[int, str]]:
    """(line, module) of every import and string-named module of the source."""
    return [(a.line, a.module) for a in arrows(path, source)]


def layer_of(module: str) -> str:
    return module.split(".")[0]


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def check_source(path: str, source: str) -> list[Violation]:
    """Every import of one file that runs against the layers (FORBIDDEN) or crosses a fence."""
    importer = module_name(path)
    layer = layer_of(importer)
    out = []
    for a in arrows(path, source):
        target = layer_of(a.module)
        how = " (named as a string)" if a.as_string else ""
        if target in FORBIDDEN.get(layer, ()) and not (a.as_string and (importer, a.module) in STRING_ARROWS):
            out.append(Violation(path, a.line, a.module, f"{layer} -> {target} runs against the layers{how}"))
        for lab in LABS:
            if within(a.module, lab) and not any(within(importer, c) for c in LAB_CLIENTS):
                out.append(Violation(path, a.line, a.module, f"the product ({importer}) -> the kernel lab {lab}{how}"))
        if within(a.module, TEST_SUPPORT) and layer != "tests" and importer != TEST_SUPPORT:
            out.append(Violation(path, a.line, a.module, f"{importer} -> the test support {TEST_SUPPORT}{how}"))
        home = next((p for p in PUBLIC_ONLY if within(importer, p)), None)
        if home and target in PACKAGES and not within(a.module, home):
            private = [n for n in a.names if n.startswith("_") and not n.startswith("__")]
            if private:
                out.append(Violation(path, a.line, a.module, f"{importer} takes private names {private}"))
    return sorted(set(out), key=lambda v: (v.path, v.line, v.imported))


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from a import b` of a name counts as `a`)."""
    modules = {module_name(p) for p in sources}
    graph: dict[str, set[str]] = {}
    for path, source in sources.items():
        me = module_name(path)
        targets = set()
        for a in arrows(path, source):
            if a.as_string:
                continue  # a string names a module loaded later, on request: no import-time circle
            name = a.module
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me and not me.startswith(name + "."):  # a module reaching its own package
                targets.add(name)
        graph[me] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def source_files() -> list[str]:
    files = [str(p.relative_to(ROOT)) for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))]
    return files + ["cli.py"]


def test_every_import_points_the_right_way():
    files = source_files()
    assert len(files) > 60 and {layer_of(module_name(f)) for f in files} >= set(LIBRARIES), files
    violations = [v for f in files for v in check_source(f, (ROOT / f).read_text())]
    assert not violations, "imports against the layers:\n" + "\n".join(map(str, violations))


def test_no_circles_in_or_between_packages():
    sources = {f: (ROOT / f).read_text() for f in source_files() if not f.startswith("scripts/")}
    found = circles(import_graph(sources))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_test_support_is_the_tests_own():
    """The test support exists and only tests use it (a moved helper would leave this empty)."""
    users = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("*.py"))
             if TEST_SUPPORT in {m for _, m in imported_modules(str(p.relative_to(ROOT)), p.read_text())}]
    assert len(users) >= 5, users


def test_the_checker_finds_wrong_arrows():
    """The checker on sources with a wrong arrow each (inside a function, relative, from-import of a
    module, named as a string, the product reaching the lab, a bench or the test support, private
    names of a shipped kernel), and on right ones."""
    bad = {
        "andromeda_nb/example.py": "import numpy\n\n\ndef f():\n    from gpu.index import GpuTargetingIndex\n",
        "cpu_baseline/example.py": "from ..gpu import index\n",
        "gpu/example.py": "from cpu_baseline import scorer\n",
        "migration/example.py": "import cli\n",
        "migration/example2.py": "from cluster import router\n",
        "gpu/kernels/example.py": "from ..lab import match\n",
        "andromeda_nb/sub/example.py": "from ...tests import conftest\n",
        "andromeda_nb/example2.py": "from serving.wal import WriteAheadLog\n",
        "serving/example.py": "from gpu.engine import GpuEngine\n",
        "cluster/example.py": "def f():\n    from benchmarks.tiled import TiledEngine\n",
        "migration/example3.py": "from andromeda_nb.testing import random_ads\n",
        "gpu/example2.py": "MODULE = 'benchmarks.score'\n",
        "migration/example4.py": "ENTRY = 'cluster.replica:ShardReplica'\n",
        "gpu/lab/example.py": "from ..kernels.score import _namespace\n",
        "serving/example2.py": "def f():\n    from cpu_baseline.lab import scorer\n",
    }
    found = {path: check_source(path, source) for path, source in bad.items()}
    assert all(found.values()), {p: v for p, v in found.items() if not v}
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
    assert "andromeda_nb -> serving" in str(found["andromeda_nb/example2.py"][0])
    assert "serving -> gpu" in str(found["serving/example.py"][0])
    assert "cluster -> benchmarks" in str(found["cluster/example.py"][0])
    assert "test support" in str(found["migration/example3.py"][0])
    assert "named as a string" in str(found["gpu/example2.py"][0])
    assert "migration -> cluster" in str(found["migration/example4.py"][0])
    assert "private names ['_namespace']" in str(found["gpu/lab/example.py"][0])
    assert any("kernel lab" in str(v) for v in found["serving/example2.py"])
    good = {
        "migration/example.py": "from cpu_baseline.engine import CpuEngine\nfrom gpu import engine\n",
        "gpu/lab/example.py": "from ..kernels import match\nfrom . import score\n",
        "benchmarks/example.py": "from gpu.lab import score\nfrom andromeda_nb import measure\nfrom cluster import router\n",
        "cli.py": "from benchmarks import demo\n",
        "cluster/example.py": "from migration.architectures import build_engine\n",
        "cpu_baseline/example.py": "from serving.protocol import RetrieveServer\nfrom andromeda_nb.types import Ad\n",
        "migration/architectures.py": "ENTRY = 'cluster.router:ShardedRetriever'\n",
        "andromeda_nb/example.py": "from .targeting import _Checker\n",
    }
    assert not [v for path, source in good.items() for v in check_source(path, source)]


def test_the_checker_finds_circles():
    """A circle inside a package (through an import inside a function too) and one between packages;
    a package's modules importing their package's face is none."""
    sources = {
        "serving/a.py": "from .b import x\n",
        "serving/b.py": "def f():\n    from serving import c\n",
        "serving/c.py": "from . import a\n",
        "gpu/kernels/one.py": "from .two import y\n",
        "gpu/kernels/two.py": "from gpu.kernels import one\n",
        "cluster/__init__.py": "X = 1\n",
        "cluster/router.py": "from cluster import X\n",
    }
    assert circles(import_graph(sources)) == [["gpu.kernels.one", "gpu.kernels.two"],
                                              ["serving.a", "serving.b", "serving.c"]]
    del sources["serving/c.py"], sources["gpu/kernels/two.py"]
    assert circles(import_graph(sources)) == []
