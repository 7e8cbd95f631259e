"""The process settings of serving processes: freed memory stays with the process where glibc would
hand it back, the environment's own setting rules (serving.hostmem); the thread switch interval."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serving.hostmem import ENV_KEYS

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

PROBE = """
import json, sys
import numpy as np
from serving.hostmem import keep_freed_memory

kept = keep_freed_memory() if sys.argv[1] == "kept" else False
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
before = rss_mb()
a = np.ones(20 * 2**20 // 8)  # 20 MiB, touched
held = rss_mb()
del a
print(json.dumps({"kept": kept, "again": keep_freed_memory() if kept else None, "grew": held - before,
                  "after_free": rss_mb() - before}))
"""


def _run(mode: str, env=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS} | (env or {})
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/statm"),
                    reason="glibc on Linux")
def test_freed_memory_stays_with_the_process_only_when_kept():
    kept, default = _run("kept"), _run("default")
    assert kept["kept"] is True and kept["again"] is True
    assert kept["grew"] > 15 and default["grew"] > 15  # the array was there
    assert kept["after_free"] > 15  # freed, and still the process's: the next batch faults nothing in
    assert default["after_free"] < 5  # glibc's own thresholds hand it back


def test_the_environments_setting_rules():
    assert _run("kept", {"MALLOC_TRIM_THRESHOLD_": "131072"})["kept"] is False


def test_the_switch_interval_is_set_and_nonsense_refused():
    from serving.process import SWITCH_INTERVAL_MS, set_switch_interval

    before = sys.getswitchinterval()
    try:
        set_switch_interval(SWITCH_INTERVAL_MS)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_MS / 1e3)
        set_switch_interval(None)  # left as it is
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_MS / 1e3)
        with pytest.raises(ValueError, match="must be positive"):
            set_switch_interval(0)
    finally:
        sys.setswitchinterval(before)


def test_serving_keeps_the_switch_interval_the_process_was_given():
    """`serve colocated --switch-interval-ms 5` sets the interval before the server starts; the
    serving loop applies the serving default only where none was given, never over it."""
    import gc
    import threading

    from serving import process as serving

    class Stopped:
        def shutdown(self):
            pass

        def wait(self):
            pass

    before, given = sys.getswitchinterval(), list(serving._switch_set)
    try:
        serving.set_switch_interval(3.0)
        stopping = threading.Event()
        stopping.set()
        assert serving.serve_until_stopped(Stopped(), stopping, exit_when_stuck=False)
        assert sys.getswitchinterval() == pytest.approx(0.003)
    finally:
        gc.unfreeze()
        serving._switch_set[:] = given
        sys.setswitchinterval(before)
