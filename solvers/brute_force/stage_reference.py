"""Alpa's plain stage DP (every distinct ``t_max``, one full inner DP each), kept as the
reference ``solve_stages`` is checked against, and a generator of random stage problems.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..errors import InfeasibleError
from ..stages.problem import (
    _INF,
    StageProblem,
    StageSolution,
    _check_positive_int,
    _make_solution,
    stage_objective,
    submesh_shapes,
)

__all__ = ["random_stage_problem", "solve_stages_reference"]


def _reference_inner(problem: StageProblem, t: float) -> tuple[float, list[tuple[int, ...]]]:
    """Alpa's inner DP with every stage ``<= t``: ``F[s, k, d]`` = least latency sum of layers
    ``k..L-1`` in exactly ``s`` stages on exactly ``d`` devices, memory limits included."""
    num_layers = problem.num_layers
    total = problem.num_devices
    sizes = problem.submesh_sizes
    cost, max_succ = problem.cost, problem.max_succ
    under = cost <= t
    f = np.full((num_layers + 1, num_layers + 1, total + 1), np.inf)
    f[0, num_layers, 0] = 0.0
    for s in range(1, num_layers + 1):
        # a stage followed by s - 1 later stages needs max_succ >= s - 1
        best_cfg = np.where(under & (max_succ >= s - 1), cost, np.inf).min(axis=3)  # (k, j, m)
        for m, n in enumerate(sizes):
            shifted = np.full((num_layers, total + 1), np.inf)  # [j, d] = F[s-1, j+1, d-n]
            shifted[:, n:] = f[s - 1, 1:, : total + 1 - n]
            cand = (best_cfg[:, :, m, None] + shifted[None, :, :]).min(axis=1)
            np.minimum(f[s, :num_layers], cand, out=f[s, :num_layers])
    best_s = int(np.argmin(f[:, 0, total]))
    g = float(f[best_s, 0, total])
    if not math.isfinite(g):
        return g, []
    # walk back through the table
    choices: list[tuple[int, ...]] = []
    k, s, d = 0, best_s, total
    while k < num_layers:
        target = f[s, k, d]
        found = False
        for j in range(k, num_layers):
            for m, n in enumerate(sizes):
                if n > d:
                    continue
                ok = under[k, j, m] & (max_succ[k, j, m] >= s - 1)
                if not ok.any():
                    continue
                c = int(np.argmin(np.where(ok, cost[k, j, m], np.inf)))
                if cost[k, j, m, c] + f[s - 1, j + 1, d - n] == target:
                    choices.append((k, j, m, c))
                    k, s, d = j + 1, s - 1, d - int(n)
                    found = True
                    break
            if found:
                break
        if not found:  # pragma: no cover - the table is self-consistent by construction
            raise AssertionError("reference DP reconstruction lost the optimum")
    return g, choices


def solve_stages_reference(problem: StageProblem) -> StageSolution:
    """Alpa's scheme: every distinct finite cost as ``t_max`` (ascending), one full inner DP
    each, stopping once ``(B - 1) * t_max`` alone reaches the best ``T``. Slow but simple."""
    t0 = time.perf_counter()
    b1 = problem.num_micro_batches - 1
    finite = problem.cost[np.isfinite(problem.cost)]
    best_val, best_choices = _INF, None
    trace: list[tuple[float, float]] = []
    for t in np.unique(finite):
        if b1 * t >= best_val:
            break
        g, choices = _reference_inner(problem, float(t))
        if not math.isfinite(g):
            trace.append((float(t), _INF))
            continue
        lat = [float(problem.cost[c]) for c in choices]
        val = stage_objective(lat, problem.num_micro_batches)
        trace.append((float(t), val))
        if val < best_val:
            best_val, best_choices = val, choices
    if best_choices is None:
        raise InfeasibleError(
            "no slicing uses exactly all "
            f"{problem.num_hosts}x{problem.devices_per_host} devices with finite costs and "
            "satisfied memory limits"
        )
    return _make_solution(problem, best_choices, trace, t0, "reference")


def random_stage_problem(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_configs: int = 4,
    num_micro_batches: int = 64,
    seed: int = 0,
) -> StageProblem:
    """A realistic synthetic cost table (transformer-like layers on a GPU cluster).

    Compute divides over devices with imperfect efficiency; config ``c`` splits ``n`` devices
    into ``tp = n ** (c / (C - 1))`` tensor-parallel x ``n / tp`` data-parallel ways, trading
    per-layer activation all-reduces (tp) against gradient all-reduces (dp). A collective over
    an axis that spans hosts pays the slow inter-host link. Memory holds the parameters (split
    by tp) plus one activation set per in-flight micro-batch (1F1B: later stages + 1), so small
    submeshes cannot hold long ranges (inf) and ``max_succ`` shrinks with range length.
    """
    num_layers = _check_positive_int("num_layers", num_layers)
    num_configs = _check_positive_int("num_configs", num_configs)
    rng = np.random.default_rng(seed)
    shapes = submesh_shapes(num_hosts, devices_per_host)
    hosts = np.array([h for h, _ in shapes], dtype=np.float64)
    per_host = np.array([d for _, d in shapes], dtype=np.float64)
    n = hosts * per_host
    total = num_hosts * devices_per_host
    flops = rng.uniform(0.8, 1.2, num_layers)
    flops[0] *= 1.5  # embedding-ish first layer
    flops[-1] *= 2.0  # LM-head-ish last layer
    params = rng.uniform(0.8, 1.2, num_layers)
    acts = rng.uniform(0.8, 1.2, num_layers) * rng.uniform(0.1, 0.3)
    iu, ju = np.triu_indices(num_layers)
    length = (ju - iu + 1.0)[:, None]  # (P, 1) per range p = layers iu[p]..ju[p]

    def range_sum(x: np.ndarray) -> np.ndarray:
        prefix = np.concatenate(([0.0], np.cumsum(x)))
        return (prefix[ju + 1] - prefix[iu])[:, None]

    r_flops, r_params, r_acts = range_sum(flops), range_sum(params), range_sum(acts)
    # memory per device: the model fits on the cluster with room to spare, not on one device
    capacity = rng.uniform(2.0, 4.0) * params.sum() / min(total, num_layers)
    intra_beta, inter_beta = 0.02, 0.25  # time per unit moved, per link kind
    alpha = 0.002  # latency per collective call

    compute = r_flops / n * (1.0 + 0.07 * np.log2(n))  # (P, S)
    exps = np.linspace(0.0, 1.0, num_configs) if num_configs > 1 else np.array([0.5])
    noise = rng.uniform(0.95, 1.05, (len(shapes), num_configs))
    cost_u = np.empty((iu.size, len(shapes), num_configs))
    succ_u = np.empty(cost_u.shape, dtype=np.int64)
    for c, e in enumerate(exps):
        tp = n**e
        dp = n / tp
        tp_beta = np.where(tp <= per_host, intra_beta, inter_beta)  # tp axis inside one host?
        dp_beta = np.where(hosts == 1, intra_beta, inter_beta)
        tp_comm = 2.0 * (tp - 1.0) / tp * r_acts / dp * tp_beta + (tp > 1) * alpha * length
        # gradient sync once per iteration, amortised over a typical 16 micro-batches
        dp_comm = (2.0 * (dp - 1.0) / dp * r_params / tp * dp_beta + (dp > 1) * alpha) / 16.0
        latency = (compute + tp_comm + dp_comm) * noise[:, c]
        # 1F1B: parameters (split by tp) + one activation set per in-flight micro-batch
        slots = np.floor((capacity - r_params / tp) / (r_acts / n))
        fits = slots >= 1
        cost_u[:, :, c] = np.where(fits, latency, np.inf)
        succ_u[:, :, c] = np.where(fits, np.minimum(slots - 1, 10**6), 0)
    cost = np.full((num_layers, num_layers, len(shapes), num_configs), np.inf)
    max_succ = np.zeros(cost.shape, dtype=np.int64)
    cost[iu, ju] = cost_u
    max_succ[iu, ju] = succ_u
    names = tuple(f"tp=n^{e:.2f}" for e in exps)
    return StageProblem(
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        cost=cost,
        max_succ=max_succ,
        num_micro_batches=num_micro_batches,
        config_names=names,
    )
