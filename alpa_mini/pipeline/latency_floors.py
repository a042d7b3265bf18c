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

from .layers import layer_starts
from .stage_cost import _StageModel, stage_launches

__all__ = ["latency_floor_cells", "step_floor"]


def step_floor(forward, capture, cluster, method, sizes: tuple[float, float]) -> float:
    """Seconds per iteration that no pipeshard plan of this step beats on ``cluster`` under
    the cost model, traced with one micro-batch (``forward``, ``capture``): every layer's
    latency floor on all the cluster's devices, summed.

    A plan runs its slowest stage once per micro-batch, and that stage's latency is at least
    its layers' floors on its own ``n_s`` devices, ``W_s / n_s``; since ``max_s W_s / n_s >=
    sum_s W_s / sum_s n_s``, B micro-batches take at least B times the step's work per
    micro-batch over all N devices. That work is affine in a micro-batch's rows (flops and
    activations scale with them; weights are read once per micro-batch), so B times it is
    least at B = 1: the whole batch's work over N devices. Collectives, resharding, bubbles,
    recomputation, launches (left out: a profile's overhead may differ per device count) and
    the optimiser update only add to it. (``sizes``: the step's optimiser-state and parameter
    bytes, as ``plan_pipeline`` takes them.)"""
    starts = layer_starts(forward, method.layer_option)
    ends = (*starts[1:], len(forward.jaxpr.eqns))
    model = _StageModel(forward, capture, cluster, method, *sizes)
    model.composed_layers = frozenset(zip(starts, ends, strict=True))
    whole = (cluster.num_hosts, cluster.devices_per_host)
    n = whole[0] * whole[1]
    return sum(model.work_floor(i, j, whole, (n,)) for i, j in zip(starts, ends, strict=True))


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
