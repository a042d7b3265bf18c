"""The configuration space of a stage: the logical meshes of a submesh (1-D, 2-D, every
(dp, tp) inside a host) and the memory-lean ZeRO-3 column, per ``AutoStageOption``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..options.pipeshard import (
    AutoStageOption,
)

__all__ = ["StageConfig", "logical_shapes", "stage_configs"]


def logical_shapes(submesh: tuple[int, int], mode: str) -> list[tuple[int, ...]]:
    """Logical meshes tried on a submesh: 1-D over all devices, then ("auto") one 2-D mesh
    or ("model_parallel_in_host") every (n / k, k) with 1 < k < n and k dividing a host's
    devices, so the second axis stays inside a host."""
    h, d = submesh
    n = h * d
    shapes: list[tuple[int, ...]] = [(n,)]
    if mode == "auto" and n >= 4:
        shapes.append((h, d) if h > 1 else (2, n // 2))
    elif mode == "model_parallel_in_host":
        shapes += [(n // k, k) for k in range(2, d + 1) if d % k == 0 and k < n]
    return shapes


class StageConfig(NamedTuple):
    """One column of the stage DP's table on a submesh: a logical mesh, and "auto" (the ILP
    picks every layout) or a preset whose input layouts are pinned ("zero3": parameters and
    optimiser state fully sharded, the memory-lean choice)."""

    shape: tuple[int, ...]
    layout: str = "auto"


def stage_configs(submesh: tuple[int, int], option: AutoStageOption) -> list[StageConfig]:
    """The logical meshes of ``option.logical_shapes`` with free layouts, then, with
    ``option.memory_lean``, the 1-D mesh with ZeRO-3's layouts: composed from per-layer ILPs
    that each chose layouts for speed alone, a stage can need far more memory than one whose
    layers all keep their weights sharded."""
    out = [StageConfig(shape) for shape in logical_shapes(submesh, option.logical_shapes)]
    if option.memory_lean and submesh[0] * submesh[1] > 1:
        out.append(StageConfig((submesh[0] * submesh[1],), "zero3"))
    return out


def _config_names(configs: Sequence[Sequence[StageConfig]]) -> tuple[str, ...]:
    """Names of the DP's config columns (column ci is the ci-th config of every submesh)."""
    C = max(len(c) for c in configs)
    names = []
    for ci in range(C):
        kinds = {
            ("1d" if len(c[ci].shape) == 1 else "2d")
            + ("" if c[ci].layout == "auto" else "-" + c[ci].layout)
            for c in configs
            if ci < len(c)
        }
        names.append("/".join(sorted(kinds)))
    return tuple(names)


def _allowed_submeshes(shapes, space: str) -> list[bool]:
    """Which submesh shapes the search uses: all, those with a power-of-two host count (and,
    for "divisors", every host count that divides the cluster's), or those inside one
    host."""
    if space == "one_host":
        return [h == 1 for h, _ in shapes]
    hosts = max(h for h, _ in shapes)
    return [
        space == "all" or (h & (h - 1)) == 0 or (space == "divisors" and hosts % h == 0)
        for h, _ in shapes
    ]
