"""Compile caches that cannot outlive a change to any source they inline.

numba's on-disk cache (`njit(cache=True)`, `cuda.jit(cache=True)`) is keyed by the source file of
the compiled function alone. A function that inlines code from another module (the CPU scorer
inlining `andromeda_nb.scoring.moe_score`; the CPU index and the match kernels inlining
`andromeda_nb.geo.haversine_km`) then keeps running stale machine code after only that other module
changed: a wrong formula can pass the tests on a machine with a warm cache and fail on a clean one.

`install()` puts a cache locator in front of numba's own for every function defined in the
project's packages: the same cache directories, but a source stamp that also carries a digest of
every Python file of those packages, so any change to any of them makes every cached function
compile again. CPU caches are covered by `install()`; CUDA caches by `install(cuda=True)`, which
`gpu.runtime` calls once the device is chosen (numba.cuda must not be imported before that).

numba names a function's cached entries `<function>.1.nbc`, `.2.nbc`, ... by counting the entries of
its index, and writes the index before the entry (numba issue #4807, "Cache causes Segmentation
Faults when generated in parallel"): two processes compiling at once (pytest's workers on a clean
checkout, the engine processes of a server) can give two entries one file, or point a fresh index at
an entry a stale one left, and a process then loads machine code compiled for another signature or
another version of the sources, and crashes. `install()` also replaces numba's `save` with one that
names each entry by a digest of its source stamp and key (so no two entries, and no stale and fresh
entry, share a file), writes the entry before the index, and updates the index under an exclusive
lock (`fcntl.flock` on a file beside it), so that concurrent writers keep each other's entries.

Kernels written as source at run time (the scoring kernels) have no file for numba to key a cache
by. `generated_function` writes such source to a file of its own, named by a digest of the source
and of the project (`project_digest`), in a cache directory, and defines the function from that file:
numba's cache then finds the code an earlier process compiled, and a change to the generator or to
anything the kernel calls gives a new file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

PACKAGES = ("andromeda_nb", "serving", "cpu_baseline", "gpu", "migration", "cluster", "benchmarks")

_roots: list[Path] = []
_digest: str | None = None
_installed: set[str] = set()


def project_roots() -> list[Path]:
    """The directories of the project's packages (siblings of this package) and any added ones."""
    if not _roots:
        base = Path(__file__).resolve().parent.parent
        _roots.extend(p for p in (base / name for name in PACKAGES) if p.is_dir())
    return _roots


def project_digest() -> str:
    """sha256 over the path and content of every .py file under the project roots (computed once per
    process: a process sees one version of its sources)."""
    global _digest
    if _digest is None:
        h = hashlib.sha256()
        for root in project_roots():
            for path in sorted(root.rglob("*.py")):
                if "__pycache__" in path.parts:
                    continue
                h.update(str(path.relative_to(root.parent)).encode())
                h.update(path.read_bytes())
        _digest = h.hexdigest()
    return _digest


def _in_project(py_file: str) -> bool:
    try:
        path = Path(py_file).resolve()
    except OSError:
        return False
    return any(root in path.parents for root in project_roots())


def _stamped(base: type) -> type:
    """A subclass of numba locator class `base` that serves project functions only, with the project
    digest in the source stamp."""

    class ProjectLocator(base):
        def get_source_stamp(self):
            return (super().get_source_stamp(), project_digest())

        @classmethod
        def from_function(cls, py_func, py_file):
            if not _in_project(py_file):
                return None
            return super().from_function(py_func, py_file)

    ProjectLocator.__name__ = ProjectLocator.__qualname__ = f"Project{base.__name__.lstrip('_')}"
    return ProjectLocator


def _save_entry(self, key, data) -> None:
    """numba's `IndexDataCacheFile.save` (entry `key` -> `data`), safe between processes (above). An
    entry's file is `<function>.<stamp digest>-<key digest>.nbc`; the files of other stamps go when
    an index of this one replaces theirs."""
    prefix = self._data_name_pattern.split("{number:d}")[0]
    stamp = hashlib.sha256(repr(self._source_stamp).encode()).hexdigest()[:12]
    name = f"{prefix}{stamp}-{hashlib.sha256(self._dump(key)).hexdigest()[:16]}.nbc"
    self._save_data(name, data)  # the entry is complete before any index names it
    with open(self._index_path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        overloads = self._load_index()  # another writer's entries, read under the lock
        if not overloads:  # no index yet, or one of other sources: their entries' files go
            folder = os.path.dirname(self._index_path)
            for other in os.listdir(folder):
                if other.startswith(prefix) and other.endswith(".nbc") and not other.startswith(prefix + stamp):
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(folder, other))
        overloads[key] = name
        self._save_index(overloads)


_numba_saves: dict[type, Callable] = {}


def _patch_save(cache_file_class: type) -> None:
    if cache_file_class.save is not _save_entry:
        _numba_saves[cache_file_class] = cache_file_class.save
        cache_file_class.save = _save_entry


def numba_save(cache_file_class: type) -> Callable:
    """numba's own `save` of an `IndexDataCacheFile` class, whether or not `install()` replaced it."""
    return _numba_saves.get(cache_file_class, cache_file_class.save)


def _install_into(impl_class: type, bases: Iterable[type]) -> None:
    ours = [_stamped(b) for b in bases]
    impl_class._locator_classes = ours + [c for c in impl_class._locator_classes
                                          if not c.__name__.startswith("Project")]


def install(*, cuda: bool = False, extra_roots: Iterable[os.PathLike] = ()) -> None:
    """Put the project locator in front of numba's (CPU; with `cuda`, the CUDA target's too).
    `extra_roots` adds directories whose files count as project sources (tests use it)."""
    global _digest
    for root in extra_roots:
        path = Path(root).resolve()
        if path not in project_roots():
            project_roots().append(path)
            _digest = None
    from numba.core import caching

    if "cpu" not in _installed:
        _install_into(caching.CacheImpl, (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                                          caching.UserWideCacheLocator))
        _installed.add("cpu")
    _patch_save(caching.IndexDataCacheFile)
    if cuda:
        from numba.cuda.core import caching as cuda_caching

        if "cuda" not in _installed:
            _install_into(cuda_caching.CacheImpl, (cuda_caching._UserProvidedCacheLocator,
                                                   cuda_caching._InTreeCacheLocator,
                                                   cuda_caching._UserWideCacheLocator))
            _installed.add("cuda")
        _patch_save(cuda_caching.IndexDataCacheFile)


GENERATED_ENV = "ANDROMEDA_GENERATED_DIR"


def generated_dir() -> Path:
    """Where generated kernel source is kept: $ANDROMEDA_GENERATED_DIR, else beside numba's own cache
    when NUMBA_CACHE_DIR is set, else the user's cache directory ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get(GENERATED_ENV):
        return Path(os.environ[GENERATED_ENV])
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / "andromeda-generated"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "andromeda-nb" / "generated"


def _source_file(name: str, src: str) -> Path | None:
    """The file holding `src`, written once (aside, then renamed) if it is not there; None where the
    cache directory cannot be written."""
    digest = hashlib.sha256(f"{project_digest()}\n{src}".encode()).hexdigest()[:24]
    path = generated_dir() / f"{name}_{digest}.py"
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        aside.write_text(src)
        os.replace(aside, path)
    except OSError:
        return None
    return path


def generated_function(name: str, src: str, namespace: dict, *, cache: bool = True) -> tuple[Callable, bool]:
    """The function `name` that `src` defines, with `namespace` among its globals, and whether it
    lives in a file (so that `cuda.jit(cache=True)` can keep its compiled code). With `cache` off, or
    where no file can be written, the source is compiled in memory (`linecache` keeps tracebacks
    readable either way)."""
    path = _source_file(name, src) if cache else None
    if path is None:
        import linecache

        filename = f"<andromeda generated {name}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        ns = dict(namespace)
        exec(compile(src, filename, "exec"), ns)
        return ns[name], False
    module_name = f"andromeda_generated.{path.stem}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        module.__dict__.update(namespace)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    return getattr(module, name), True


__all__ = ["generated_dir", "generated_function", "install", "numba_save", "project_digest", "project_roots"]
