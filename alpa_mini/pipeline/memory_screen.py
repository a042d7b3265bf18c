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


def screen_memory(model, starts, ends, shapes, configs, budget: float, names) -> dict:
    """Raise ``InfeasibleError`` when no slicing fits ``budget`` per device even with every
    layer at its memory floor; otherwise return, per searched (submesh, config), which layer
    ranges fit at their floors and their ``max_succ`` (the full table decides the rest).

    Most counts fit: an even slicing over one submesh shape that fits at the floors shows
    it without the stage DP (which, at Megatron's 1T on 384 hosts, spends seconds on a
    table of every host count)."""
    L, cluster = len(starts), model.cluster
    C = max(len(c) for c in configs)
    cells: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for si, sub in enumerate(shapes):
        for ci, (logical, layout) in enumerate(configs[si]):
            floors = np.array(
                [model.memory_floor(starts[k], ends[k], sub, logical, layout) for k in range(L)]
            )
            cells[(si, ci)] = _floor_cells(floors, budget)
    total = cluster.num_hosts * cluster.devices_per_host
    for (si, _), (fits, succ) in cells.items():
        size = shapes[si][0] * shapes[si][1]
        if total % size == 0 and _even_slicing_fits(fits, succ, total // size):
            return cells
    cost = np.full((L, L, len(shapes), C), np.inf)
    max_succ = np.zeros((L, L, len(shapes), C), dtype=np.int64)
    for (si, ci), (fits, succ) in cells.items():
        cost[:, :, si, ci][fits] = 0.0
        max_succ[:, :, si, ci][fits] = succ[fits]
    problem = StageProblem(
        cluster.num_hosts, cluster.devices_per_host, cost, max_succ,
        model.method.num_micro_batches, names, tuple(shapes),
    )  # fmt: skip
    try:
        solve_stages(problem)
    except InfeasibleError as err:
        raise InfeasibleError(
            f"{err}; even with every layer's parameters, gradients and activations split "
            "evenly over its stage's devices",
            **err.details,
        ) from None
    return cells


def _floor_cells(floors: np.ndarray, budget: float) -> tuple[np.ndarray, np.ndarray]:
    """Which layer ranges (i, j) of one (submesh, config) fit ``budget`` at their floor with
    one micro-batch in flight, and the most later stages' in-flight micro-batches each then
    allows (``max_succ``, as ``stage_search._fill_cells`` counts it). ``floors``: per layer
    (held, residual, state) bytes per device."""
    L = len(floors)
    held, res, state = (floors[:, c] for c in range(3))
    fits = np.zeros((L, L), dtype=bool)
    succ = np.zeros((L, L), dtype=np.int64)
    # Round-off in the cumulative sums may only ever admit a cell, never drop one.
    room = budget * (1.0 + 1e-9)
    for i in range(L):
        first = np.cumsum(held[i:]) - np.minimum.accumulate(held[i:]) + np.cumsum(state[i:])
        per = np.cumsum(res[i:])
        fits[i, i:] = first <= room
        with np.errstate(divide="ignore", invalid="ignore"):
            extra = np.where(per > 0, np.floor((room - first) / per), L)
        k = np.clip(extra + 1, 1, L)  # micro-batches in flight: memory(k) <= room
        succ[i, i:] = np.where(fits[i, i:], k - 1, 0).astype(np.int64)
    return fits, succ


def _even_slicing_fits(fits: np.ndarray, succ: np.ndarray, stages: int) -> bool:
    """Whether the layers split into ``stages`` consecutive stages, all on this submesh and
    config, each fitting with the later stages' micro-batches in flight (1F1B: stage s of S
    holds S - s)."""
    L = len(fits)
    if stages > L:
        return False
    reach = np.zeros(L + 1, dtype=bool)  # reach[i]: layers before i are placed
    reach[0] = True
    for s in range(stages):
        ok = fits & (succ >= stages - 1 - s)
        nxt = np.zeros(L + 1, dtype=bool)
        nxt[1:] = (reach[:L, None] & ok).any(axis=0)
        reach = nxt
        if not reach.any():
            return False
    return bool(reach[L])
