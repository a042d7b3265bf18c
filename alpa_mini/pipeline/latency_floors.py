"""Latency floors of composed stages: what the stage DP stands on for the (submesh, config)
pairs whose layer ILPs have not been built yet.

Every layer ILP's objective is a sum of node costs (an input's load, an operator's compute
and collectives) and edge costs (resharding, never negative), so every operator's work split
over all the submesh's devices, with no communication, is a floor under it and under its LP
relaxation (``shard.problem.cost_floor``): one pass over the layer's graph per submesh, no
strategies, edges or solve, the same for every config of the submesh. A composed stage
costs its layers' latencies, less credits for values handed between them that never exceed
what their ILPs charged for those values (the floor leaves those out), plus resharding and
shared-parameter costs that are never negative. So a range's floor, the sum of its layers'
with the stage's program launches, is at most its composed cost, on every range the memory
screen leaves open. The stage DP over a table whose unexplored pairs hold floors is a lower
bound on the DP over the real table, and where its best slicing uses explored pairs only,
that slicing is best outright (``stage_search._settled_dp``): pairs it never picks are
never built (gpt-1.3b on 4 GPUs: the 1- and 2-device submeshes, whose floors already lose).
Stage tables larger than ``stage_search.LAZY_TABLE_BYTES`` build every pair at once instead.
"""

from __future__ import annotations

import numpy as np

from .stage_cost import stage_launches

__all__ = ["latency_floor_cells"]


def latency_floor_cells(
    model, starts, ends, shapes, configs, memory, cost: np.ndarray, max_succ: np.ndarray
) -> list[tuple[int, int]]:
    """Write into the DP's ``cost`` and ``max_succ`` arrays (L x L x submeshes x configs),
    for every searched (submesh, config), each layer range at its latency floor where it fits
    at its memory floor (``memory``: ``memory_screen``'s cells, or None without a budget:
    every range fits, with as many micro-batches in flight as there are layers); return
    those pairs."""
    L = len(starts)
    pairs = []
    for si, sub in enumerate(shapes):
        logical = configs[si][0].shape  # every config of the submesh: the same floors
        floors = np.array([model.latency_floor(starts[k], ends[k], sub, logical) for k in range(L)])
        ranges = _range_sums(floors) + stage_launches(model, sub, logical)
        for ci in range(len(configs[si])):
            if memory is None:
                fits, succ = np.isfinite(ranges), L - 1
            else:
                fits, succ = memory[(si, ci)]
                fits = fits & np.isfinite(ranges)
                succ = succ[fits]
            cost[:, :, si, ci][fits] = ranges[fits]
            max_succ[:, :, si, ci][fits] = succ
            pairs.append((si, ci))
    return pairs


def _range_sums(floors: np.ndarray) -> np.ndarray:
    """(i, j) -> the sum of ``floors[i..j]`` for j >= i (inf where any is inf), inf below
    the diagonal."""
    L = len(floors)
    out = np.full((L, L), np.inf)
    for i in range(L):
        out[i, i:] = np.cumsum(floors[i:])
    return out
