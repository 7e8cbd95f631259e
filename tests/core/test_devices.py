"""One meaning for every device word (andromeda_nb.devices): 'auto' is the GPU when usable, else
compiled CPU code; the simulator runs only when asked for; a fallback is said once on stderr; work
that exists only as CUDA kernels stops and says so; and the services a command starts are told their
device, with the simulator switch kept out of their environment.

The suite itself runs with NUMBA_ENABLE_CUDASIM=1 (tests/conftest.py), so what a user without a GPU
sees is checked in fresh processes whose environment lacks it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from andromeda_nb import devices

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = pytest.mark.skipif(devices._driver_present(),
                            reason="a CUDA driver is installed here: what a machine without a GPU does is not "
                                   "what runs")


def _user_env() -> dict:
    """The environment of a user who set nothing: no simulator switch, the project importable."""
    env = devices.child_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=_user_env(), cwd=ROOT, timeout=timeout)


def _cli(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], capture_output=True, text=True,
                          env=_user_env(), cwd=ROOT, timeout=timeout)


def test_child_environment_drops_the_simulator_switch(monkeypatch):
    monkeypatch.setenv(devices.SIM_ENV, "1")
    monkeypatch.setenv("ANDROMEDA_SOMETHING", "kept")
    env = devices.child_environment()
    assert devices.SIM_ENV not in env and env["ANDROMEDA_SOMETHING"] == "kept"
    assert os.environ[devices.SIM_ENV] == "1", "this process keeps its own"


def test_unknown_device_and_cpu_for_kernels_are_refused():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        devices.resolve("tpu")
    with pytest.raises(devices.NoKernelDevice, match="the GPU index runs only as CUDA kernels.*--device cpu.*"
                                                      "--device sim"):
        devices.resolve("cpu", kernels=True, what="the GPU index")
    assert devices.resolve("cpu") == "cpu"


def test_a_notice_is_said_once(monkeypatch):
    said = []
    monkeypatch.setattr(devices, "notice_sink", said.append)
    monkeypatch.setattr(devices, "_said", set())
    for _ in range(3):
        devices.notice("falling back")
    devices.notice("another")
    assert said == ["falling back", "another"]


def test_the_simulator_switch_set_before_start_is_what_auto_means_here():
    # the suite set NUMBA_ENABLE_CUDASIM=1 before anything started: that is asking for the simulator
    assert devices.simulator_enabled()
    assert devices.resolve("auto") == "sim" and devices.resolve("auto", kernels=True) == "sim"
    assert devices.resolve("sim") == "sim"


@NO_GPU
def test_without_a_gpu_auto_is_the_cpu_said_once_and_kernels_stop():
    proc = _python("""
        import sys
        from andromeda_nb import devices
        print(devices.resolve("auto"), devices.resolve("auto"), "numba.cuda" in sys.modules)
        try:
            devices.resolve("auto", kernels=True, what="the GPU index")
        except devices.NoKernelDevice as exc:
            print("stopped:", exc)
        print(devices.resolve("sim"), devices.simulator_enabled())
    """)
    assert proc.returncode == 0, proc.stderr
    first, stopped, sim = proc.stdout.splitlines()
    assert first == "cpu cpu False", "without a driver, auto decides without importing numba.cuda"
    assert stopped.startswith("stopped: the GPU index runs only as CUDA kernels, and no usable CUDA GPU here")
    assert "--device sim" in stopped
    assert sim == "sim True", "the simulator when asked for"
    assert proc.stderr.count(devices.CPU_FALLBACK) == 1, proc.stderr


@NO_GPU
def test_match_arch_gpu_without_a_gpu_says_so_and_stops(tmp_path):
    data = tmp_path / "corpus"
    gen = _cli("generate", "--ads", 300, "--requests", 3, "--out", data, "--quiet")
    assert gen.returncode == 0, gen.stderr
    for extra, also in (((), "no usable CUDA GPU here"), (("--device", "cpu"), "--arch cpu")):
        proc = _cli("match", "--data", data, "--arch", "gpu", *extra, "--quiet", timeout=120)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "runs only as CUDA kernels" in proc.stderr and "--device sim" in proc.stderr and also in proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""
    sim = _cli("match", "--data", data, "--arch", "gpu", "--device", "sim", "--json", timeout=300)
    assert sim.returncode == 0, sim.stderr
    assert "the CUDA simulator runs each kernel thread in Python" in sim.stderr, "the cost is said before it starts"
    assert len(sim.stdout.splitlines()) == 3


@NO_GPU
@pytest.mark.slow
def test_compare_without_a_gpu_on_a_generated_corpus_of_100000_ads(tmp_path):
    """The newcomer's path: `generate` at its default size, then `compare`, no GPU and no setting. The
    co-located server must be told --device cpu (it once inherited the simulator switch and timed out)."""
    data = tmp_path / "corpus"
    gen = _cli("generate", "--out", data, "--requests", 30, "--quiet")
    assert gen.returncode == 0, gen.stderr
    assert json.loads((data / "meta.json").read_text())["counts"]["ads"] == 100_000, "the default size"
    proc = _cli("compare", "--data", data, "--k", 20, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["ads"] == 100_000 and report["eligible_equal"] and report["scores_equal"] and report["topk_equal"]
    assert report["colocated"]["device"] == "cpu"
    assert report["eligibility"]["gpu_index"].startswith("the GPU index runs only as CUDA kernels")
    assert proc.stderr.count(devices.CPU_FALLBACK) == 1, "the fallback is said, once"
    assert "GPU index skipped" in proc.stderr


def test_a_started_server_gets_no_simulator_switch(tmp_path, monkeypatch):
    from serving.services import ServiceProcess

    (tmp_path / "svc_env.py").write_text(textwrap.dedent("""
        import os, time
        from serving.services import announce
        announce("stand-in", "grpc://127.0.0.1:1", sim=os.environ.get("NUMBA_ENABLE_CUDASIM"))
        while True:
            time.sleep(1)
    """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert os.environ[devices.SIM_ENV] == "1"
    proc = ServiceProcess("svc_env", [])
    try:
        assert proc.announced["sim"] is None
    finally:
        proc.stop()


def test_the_colocated_server_is_told_its_device(monkeypatch):
    """ColocatedRetriever resolves the device itself and passes it as --device (here 'cpu' for 'cpu',
    and 'sim' for 'auto' because this suite asked for the simulator)."""
    from migration import colocated

    started = []

    class Stop(Exception):
        pass

    def fake_process(module, args, **kw):
        started.append(args)
        raise Stop

    monkeypatch.setattr(colocated, "ServiceProcess", fake_process)
    dataset = types.SimpleNamespace(source_dir="/a/corpus")
    for device, told in (("cpu", "cpu"), ("auto", "sim")):
        with pytest.raises(Stop):
            colocated.ColocatedRetriever.build(dataset, device=device, served=True)
        assert started[-1][started[-1].index("--device") + 1] == told


def test_the_command_loads_no_numba_before_a_device_is_chosen():
    """`import cli` (every `andromeda` command, `--help` included) imports no numba module: the CUDA
    simulator can still be chosen, and a command that needs no compiled code starts fast."""
    proc = _python("""
        import sys
        import cli
        print(sorted(m for m in sys.modules if m == "numba" or m.startswith("numba.")))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
