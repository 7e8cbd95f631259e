"""Which class serves which `--arch` (and, for the co-located engine, which device), and building it
from a corpus. The tables name modules as text and load them on first use, so the CPU-only parts
never import numba-cuda and a missing GPU costs nothing.

    MATCHERS   --arch of `andromeda match`: interfaces.TargetingIndex classes
    RETRIEVERS --arch of `andromeda retrieve`: interfaces.Retriever classes
    ENGINES    where a co-located engine runs ('cpu', 'gpu', 'sim'): interfaces.Engine classes
"""

from __future__ import annotations

import importlib

from andromeda_nb.devices import resolve
from andromeda_nb.reference import build_index

MATCHERS = {
    "oracle": "andromeda_nb.oracle:OracleIndex",
    "cpu": "cpu_baseline.index:CpuTargetingIndex",
    "gpu": "gpu.index:GpuTargetingIndex",
}
RETRIEVERS = {
    "reference": "andromeda_nb.reference:ReferenceRetriever",
    "remote": "cpu_baseline.remote:RemoteRetriever",
    "colocated": "migration.colocated:ColocatedRetriever",
    "sharded": "cluster.router:ShardedRetriever",  # the layer above: named, loaded only when asked for
}
ENGINES = {
    "cpu": "cpu_baseline.engine:CpuEngine",
    "gpu": "gpu.engine:GpuEngine",
    "sim": "gpu.engine:GpuEngine",
}
DEVICE_ARCHS = ("colocated", "sharded")  # the retrievers that take --device
DEVICE_MATCHERS = ("gpu",)  # the matchers that take --device


class ArchitectureUnavailable(RuntimeError):
    """An --arch whose module is not part of this installation (or cannot be imported here)."""


def load_class(table: dict[str, str], name: str):
    if name not in table:
        raise KeyError(f"unknown architecture {name!r}; choose from {', '.join(table)}")
    module, _, attr = table[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _load(table: dict[str, str], arch: str, kind: str):
    if arch not in table:
        raise ArchitectureUnavailable(f"unknown {kind} architecture {arch!r}; choose from {', '.join(table)}")
    try:
        return load_class(table, arch)
    except (ImportError, AttributeError) as exc:
        raise ArchitectureUnavailable(
            f"{kind} architecture {arch!r} ({table[arch]}) is not available here: {exc}") from None


def build_matcher(dataset, arch: str, device: str = "auto"):
    """The `interfaces.TargetingIndex` that `--arch` names, built over the dataset's ads (from their
    compiled targeting where the index takes it: no ad parsed); `device` goes to the ones that take it."""
    cls = _load(MATCHERS, arch, "match")
    return build_index(cls, dataset, device=device) if arch in DEVICE_MATCHERS else build_index(cls, dataset)


def remote_scorer(scorer_device: str | None) -> dict:
    """The options of the remote architecture for a scoring service on `scorer_device`: None, the CPU
    scoring service of `cpu_baseline.remote_servers`; a device word, the scoring service of `migration.scorer_server`
    on that device (the 2024 picture: match on CPU hosts, scoring on a remote GPU)."""
    if scorer_device is None:
        return {}
    return {"scorer_command": ("migration.scorer_server", ["--device", scorer_device])}


def build_retriever(dataset, arch: str, device: str = "auto", *, scorer_device: str | None = None, **options):
    """The `interfaces.Retriever` that `--arch` names; `device` goes to the ones that take it, and
    `scorer_device` to the remote architecture's scoring service (`remote_scorer`)."""
    cls = _load(RETRIEVERS, arch, "retrieve")
    if arch == "remote":
        options.update(remote_scorer(scorer_device))
    return cls.build(dataset, device=device, **options) if arch in DEVICE_ARCHS else cls.build(dataset, **options)


def build_engine(dataset, device: str = "auto", *, version=None, layout: str | None = None, say=None):
    """The co-located `interfaces.Engine` for `device` ('auto': the GPU when usable, else the CPU;
    `andromeda_nb.devices.resolve`). `version`: the GPU scoring kernel (`scoring_kernel`); the CPU
    engine has its one scorer and takes none. `layout`: the GPU engine's slot order
    (`andromeda_nb.constants.LAYOUTS`; None: its default, DEFAULT_LAYOUT); the CPU engine has no
    slots and takes only None or 'format'. `say` (`andromeda_nb.progress.Say`): told each step of the
    GPU engine's construction as it ends, with its seconds."""
    from andromeda_nb.constants import DEFAULT_LAYOUT, LAYOUTS

    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown slot layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    where = resolve(device)
    if where == "cpu" and layout not in (None, "format"):
        raise ValueError(f"the slot layout {layout!r} is the GPU engine's (--device gpu or sim); the CPU "
                         "engine lays out no slots")
    options = {"version": scoring_kernel(version)} if version is not None and where != "cpu" else {}
    if where != "cpu":
        options["layout"] = layout or DEFAULT_LAYOUT
        options["say"] = say
    return _load(ENGINES, where, "engine")(dataset, where, **options)


def scoring_kernel(version):
    """The scoring kernel `version` names: a `Version` as it is, a number looked up in the shipped
    kernels' table (`gpu.kernels.score.VERSIONS`; the superseded versions of the kernel lab are the
    benchmarks' alone), None for the shipped default. Call after the device choice (the kernels
    compile for it)."""
    if version is None or not isinstance(version, int):
        return version
    from gpu.kernels import score

    if version not in score.VERSIONS:
        raise ValueError(f"unknown scoring kernel version {version}; shipped versions: {sorted(score.VERSIONS)}")
    return score.VERSIONS[version]


__all__ = ["ArchitectureUnavailable", "DEVICE_ARCHS", "DEVICE_MATCHERS", "ENGINES", "MATCHERS", "RETRIEVERS",
           "build_engine", "build_matcher", "build_retriever", "load_class", "remote_scorer", "scoring_kernel"]
