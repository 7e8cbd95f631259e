"""The migration layer: what needs both architectures at once, above `cpu_baseline/` (the remote-scoring
"before" picture) and `gpu/` (the co-located "after" picture), both of which stand on the shared
contract `andromeda_nb/`. `cli.py` calls it.

* `api`: the Python entry point, `load(path)` and `build(corpus, arch, device).retrieve(requests, k)`,
  exported here (`from migration import build, load`).
* `architectures`: which class serves which `--arch` and device; building them from a corpus.
* `colocated`: the co-located architecture on any device (an engine in process, or its server as a
  subprocess); `serve`: that server's entry point.
* `harness`: both architectures side by side, proven equal and measured (`andromeda compare`).
* `demo`: the migration step by step (`andromeda demo`).
* `budget`: the byte budget measured on a corpus (`andromeda budget`).
* `quality_kernel`: the fused kernel's speed on the quality experiment's models.
* `benches`: benchmarks that set one architecture beside the other (`andromeda bench match`).
* `report`: benchmark JSON of both sides -> docs/BENCHMARKS.md and charts (`andromeda bench report`).
"""

from .api import ARCHS, Index, build, load  # noqa: E402  (the entry point: README, "From Python")

__all__ = ["ARCHS", "Index", "build", "load"]
