"""The shape of a kernel version, one for every kernel family (the GPU match, scoring and top-K
kernels, the CPU scorer): what a benchmark times, what the tests check, what the product may ship.

Each family's shipped file holds `VERSIONS` (number -> `Version`: what ships, and its simulator
fallback where it has one) and `SHIPPED`, the number of the version the product runs; its lab file
(`gpu/lab/`, `cpu_baseline/lab/`) holds the superseded versions and `VERSIONS` of every version,
the shipped ones included. Adding a version is one entry in a table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

Recipe = TypeVar("Recipe")


@dataclass(frozen=True)
class Version(Generic[Recipe]):
    number: int
    name: str  # e.g. "v4 tiled x4"
    description: str
    recipe: Recipe  # how the family builds and launches this version (its own type per family)
    gpu_only: bool = False  # needs what the CUDA simulator lacks (warp intrinsics, register limits)


def version_table(*versions: Version) -> dict[int, Version]:
    """number -> Version, in number order; numbers are unique."""
    table = {v.number: v for v in sorted(versions, key=lambda v: v.number)}
    if len(table) != len(versions):
        raise ValueError(f"duplicate version numbers: {[v.number for v in versions]}")
    return table


def pick(table: dict[int, Version], version, default: int, family: str) -> Version:
    """The Version `version` names: itself when it is one, `table[version]` for a number, the
    `default` entry for None. A number outside the table raises ValueError naming the family."""
    if isinstance(version, Version):
        return version
    number = default if version is None else version
    if number not in table:
        raise ValueError(f"unknown {family} kernel version {number}; versions: {sorted(table)}")
    return table[number]


__all__ = ["Version", "pick", "version_table"]
