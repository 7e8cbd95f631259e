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


GENERATED_RUN = textwrap.dedent("""
    from numba import njit
    from andromeda_nb import jitcache
    src = "def add_{k}(x):\\n    return x + offset\\n"
    fn, in_file = jitcache.generated_function("add_{k}", src, {{"offset": {k}}})
    jit = njit(cache=True)(fn)
    print(jit(1), in_file, sum(jit.stats.cache_hits.values()))
""")


def _generated(tmp: Path, k: int) -> tuple[int, bool, int]:
    env = {k_: v for k_, v in os.environ.items() if k_ not in ("NUMBA_CACHE_DIR", "NUMBA_DISABLE_JIT")}
    env["PYTHONPATH"] = str(ROOT)
    env["ANDROMEDA_GENERATED_DIR"] = str(tmp / "generated")
    out = subprocess.run([sys.executable, "-c", GENERATED_RUN.format(k=k)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    value, in_file, hits = out.stdout.split()
    return int(value), in_file == "True", int(hits)


def test_generated_source_is_compiled_once_across_processes(tmp_path):
    assert _generated(tmp_path, 3) == (4, True, 0)  # compiled, written to the cache
    assert _generated(tmp_path, 3) == (4, True, 1)  # the second process loads the compiled code
    assert _generated(tmp_path, 5) == (6, True, 0)  # other source: another file, compiled anew
    files = sorted(p.name for p in (tmp_path / "generated").glob("add_*.py"))
    assert len(files) == 2 and files[0].startswith("add_3_") and files[1].startswith("add_5_")


def test_generated_source_without_a_writable_cache_is_compiled_in_memory(tmp_path, monkeypatch):
    from andromeda_nb import jitcache

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ANDROMEDA_GENERATED_DIR", str(blocker / "generated"))
    fn, in_file = jitcache.generated_function("twice", "def twice(x):\n    return 2 * x + bias\n", {"bias": 1})
    assert (fn(4), in_file) == (9, False)
    fn, in_file = jitcache.generated_function("twice", "def twice(x):\n    return 2 * x\n", {}, cache=False)
    assert (fn(4), in_file) == (8, False)


def _write_entries(path: str, stamp: str, writer: int, n: int, installed: bool) -> None:
    """`n` entries of one cache index, each its own key and data, as a process compiling `n`
    signatures of one function saves them: with the project's `save` or numba's own."""
    from numba.core import caching

    from andromeda_nb import jitcache

    if installed:
        jitcache.install()
    else:
        caching.IndexDataCacheFile.save = jitcache.numba_save(caching.IndexDataCacheFile)
    cache = caching.IndexDataCacheFile(path, "fn-1", stamp)
    for i in range(n):
        cache.save((writer, i), f"code of writer {writer} entry {i}".encode() * 64)


@pytest.mark.parametrize("installed", [True, False])
def test_concurrent_writers_of_one_index_keep_every_entry_and_share_no_file(tmp_path, installed):
    """Four processes save 40 entries each into one index at once (numba issue #4807's race): with
    the project's `save`, every entry loads as its own data afterwards and each has a file of its
    own. numba's own `save` (run as the control, so that the test shows a real race) loses entries
    or points two keys at one file."""
    import multiprocessing

    from numba.core import caching

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_entries, args=(str(tmp_path), "stamp", w, 40, installed)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    cache = caching.IndexDataCacheFile(str(tmp_path), "fn-1", "stamp")
    index = cache._load_index()
    intact = [index.get((w, i)) is not None and cache.load((w, i)) == f"code of writer {w} entry {i}".encode() * 64
              for w in range(4) for i in range(40)]
    if installed:
        assert all(intact) and len(set(index.values())) == len(index) == 160
    else:
        assert not all(intact), "numba's own save kept every entry: the race this test guards did not occur"


def test_an_index_for_other_sources_gives_way_with_its_entries(tmp_path):
    """An entry saved for new sources never reuses the file of an entry of the old ones (a process
    that read the new index could otherwise load the old machine code), and the old entries' files go
    when the new index replaces the old."""
    from numba.core import caching

    from andromeda_nb import jitcache

    jitcache.install()
    old = caching.IndexDataCacheFile(str(tmp_path), "fn-1", "old sources")
    old.save("key", b"old code")
    [old_file] = [p.name for p in tmp_path.glob("*.nbc")]
    new = caching.IndexDataCacheFile(str(tmp_path), "fn-1", "new sources")
    assert new.load("key") is None
    new.save("key", b"new code")
    assert new.load("key") == b"new code" and old.load("key") is None
    assert [p.name for p in tmp_path.glob("*.nbc")] != [old_file] and not (tmp_path / old_file).exists()
