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
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

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
    if "cpu" not in _installed:
        from numba.core import caching

        _install_into(caching.CacheImpl, (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                                          caching.UserWideCacheLocator))
        _installed.add("cpu")
    if cuda and "cuda" not in _installed:
        from numba.cuda.core import caching as cuda_caching

        _install_into(cuda_caching.CacheImpl, (cuda_caching._UserProvidedCacheLocator,
                                               cuda_caching._InTreeCacheLocator,
                                               cuda_caching._UserWideCacheLocator))
        _installed.add("cuda")


__all__ = ["install", "project_digest", "project_roots"]
