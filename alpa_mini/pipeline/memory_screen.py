"""A micro-batch count that no pipeline plan fits, found before any layer ILP is solved.

A composed stage (``compose._composed_row``) holds ``held_k`` of every layer k (its
parameters and their gradients as laid out, and its residuals) plus the largest
``peak_k - held_k``. Parameters split over the submesh's n devices can be split no further,
so ``held_k >= 2p_k + r_k`` with ``p`` and ``r`` a layer's parameters and residuals split
evenly; and a peak is never negative, so the largest ``peak_k - held_k`` is at least
``-min_k held_k``. The composed peak is therefore at least ``sum(held) - min(held)``, which
only grows with each ``held_k``: with ``held_k = 2p_k + r_k`` it is a floor for every plan
of the range, with the optimiser state and in-flight residuals added as the ILPs charge
them. (A floor that also counted each layer's peak as at least ``max(2p, r)`` would be
tighter but is not safe: ILP peaks below that were measured on MoE and Wide-ResNet layers.)
The stage DP over those floors (latency 0) finds no slicing only if the real table would
find none either, so a count that fits nowhere costs its trace and this DP instead of
every layer MIP.
"""

from __future__ import annotations

import numpy as np

from ..solvers.errors import InfeasibleError
from ..solvers.stages import StageProblem, solve_stages


def screen_memory(model, starts, ends, shapes, configs, allowed, budget: float, names) -> None:
    """Raise ``InfeasibleError`` when no slicing fits ``budget`` per device even with every
    layer at its memory floor; return quietly otherwise (the full table decides)."""
    L, cluster = len(starts), model.cluster
    C = max(len(c) for c in configs)
    cost = np.full((L, L, len(shapes), C), np.inf)
    max_succ = np.zeros((L, L, len(shapes), C), dtype=np.int64)
    for si, sub in enumerate(shapes):
        if not allowed[si]:
            continue
        for ci, (logical, layout) in enumerate(configs[si]):
            floors = np.array(
                [model.memory_floor(starts[k], ends[k], sub, logical, layout) for k in range(L)]
            )
            _fill_floor(cost[:, :, si, ci], max_succ[:, :, si, ci], floors, budget)
    problem = StageProblem(
        cluster.num_hosts, cluster.devices_per_host, cost, max_succ,
        model.method.num_micro_batches, names,
    )  # fmt: skip
    try:
        solve_stages(problem)
    except InfeasibleError as err:
        raise InfeasibleError(
            f"{err}; even with every layer's parameters, gradients and activations split "
            "evenly over its stage's devices",
            **err.details,
        ) from None


def _fill_floor(cost: np.ndarray, max_succ: np.ndarray, floors: np.ndarray, budget: float):
    """Cells (i, j) of one (submesh, config) whose floor fits ``budget`` with one micro-batch
    in flight get latency 0 and the most later stages' in-flight micro-batches the floor
    allows (as ``stage_search._fill_cells`` counts them). ``floors``: per layer (held,
    residual, state) bytes per device."""
    L = len(floors)
    held, res, state = (floors[:, c] for c in range(3))
    # Round-off in the cumulative sums may only ever admit a cell, never drop one.
    room = budget * (1.0 + 1e-9)
    for i in range(L):
        first = np.cumsum(held[i:]) - np.minimum.accumulate(held[i:]) + np.cumsum(state[i:])
        per = np.cumsum(res[i:])
        fits = first <= room
        cost[i, i:][fits] = 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            extra = np.where(per > 0, np.floor((room - first) / per), L)
        k = np.clip(extra + 1, 1, L)  # micro-batches in flight: memory(k) <= room
        max_succ[i, i:][fits] = (k[fits] - 1).astype(np.int64)
