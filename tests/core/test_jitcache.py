"""Compile caches cannot outlive a change to a source they inline (andromeda_nb/jitcache.py).

Two modules in a temporary directory: `a.f`, and `b.g`, cached with `njit(cache=True)`, which inlines
`a.f`. After a first run fills the cache, only `a.py` changes. With numba's own locator the second run
loads the stale machine code of `g` (which the test also shows, so that it proves a real effect);
with the project locator installed the second run compiles again and sees the change."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

ROOT = Path(__file__).resolve().parents[2]

B_SOURCE = textwrap.dedent("""
    from numba import njit
    from a import f

    f_jit = njit(f)


    @njit(cache=True)
    def g(x):
        return f_jit(x)
""")

RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tmp!r})
    if {install}:
        from andromeda_nb import jitcache
        jitcache.install(extra_roots=[{tmp!r}])
    import b
    print(b.g(1))
""")


def _run(tmp: Path, install: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_DISABLE_JIT")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", RUN.format(tmp=str(tmp), install=install)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("install", [False, True])
def test_a_change_to_an_inlined_module_is_seen(tmp_path, install):
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n")
    (tmp_path / "b.py").write_text(B_SOURCE)
    assert _run(tmp_path, install) == 2
    assert list((tmp_path / "__pycache__").glob("b.g-*.nbi")), "the first run wrote no cache"
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 2\n")
    got = _run(tmp_path, install)
    if install:
        assert got == 3, "the project locator served stale code after a.py changed"
    else:
        assert got == 2, "numba's own cache no longer goes stale here: this test shows nothing"


def test_project_functions_get_the_project_locator():
    from numba.core import caching

    from andromeda_nb import jitcache

    jitcache.install()
    first = caching.CacheImpl._locator_classes[0]
    assert first.__name__.startswith("Project")
    import cpu_baseline.index as index

    impl = caching.CompileResultCacheImpl(index.match_one.py_func)
    assert type(impl.locator).__name__.startswith("Project")
    assert impl.locator.get_source_stamp()[1] == jitcache.project_digest()
    impl = caching.CompileResultCacheImpl(textwrap.dedent)  # a function outside the project
    assert not type(impl.locator).__name__.startswith("Project")
