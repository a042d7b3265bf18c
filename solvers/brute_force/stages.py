"""Exhaustive reference for the stage DP: every slicing x submesh x config, from the definition.

Exponential in the number of layers; for tests on tiny instances only. It shares nothing with
:mod:`..stages` but the problem and solution records.
"""

from __future__ import annotations

import itertools
import math
import time

from ..stages.problem import Stage, StageProblem, StageSolution

__all__ = ["brute_force_stages"]


def _slicings(num_layers: int) -> list[list[tuple[int, int]]]:
    """Every way to cut layers ``0..L-1`` into contiguous, non-empty, inclusive ranges."""
    out = []
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        ranges, start = [], 0
        for layer, cut in enumerate(cuts):
            if cut:
                ranges.append((start, layer))
                start = layer + 1
        ranges.append((start, num_layers - 1))
        out.append(ranges)
    return out


def brute_force_stages(problem: StageProblem) -> StageSolution | None:
    """Best slicing by enumeration, or ``None`` when no slicing is feasible.

    A slicing is feasible when every stage has a finite cost, the stage followed by ``k``
    later stages has ``max_succ >= k``, and the submesh device counts sum to ``N * M``.
    ``T = sum(latency) + (B - 1) * max(latency)``; among equal ``T`` the first found is kept.
    """
    t0 = time.perf_counter()
    shapes = problem.submesh_shapes
    sizes = [h * d for h, d in shapes]
    total = problem.num_devices
    b1 = problem.num_micro_batches - 1
    cost, max_succ = problem.cost, problem.max_succ
    best_value = math.inf
    best: list[tuple[int, int, int, int]] | None = None
    for ranges in _slicings(problem.num_layers):
        num_stages = len(ranges)
        options = []
        for position, (i, j) in enumerate(ranges):
            later = num_stages - 1 - position
            options.append(
                [
                    (s, c)
                    for s in range(len(shapes))
                    for c in range(problem.num_configs)
                    if math.isfinite(cost[i, j, s, c]) and max_succ[i, j, s, c] >= later
                ]
            )
        for assignment in itertools.product(*options):
            if sum(sizes[s] for s, _ in assignment) != total:
                continue
            latencies = [
                float(cost[i, j, s, c]) for (i, j), (s, c) in zip(ranges, assignment, strict=True)
            ]
            value = sum(latencies) + b1 * max(latencies)
            if value < best_value:
                best_value = value
                best = [(i, j, s, c) for (i, j), (s, c) in zip(ranges, assignment, strict=True)]
    if best is None:
        return None
    stages = tuple(Stage(i, j, s, shapes[s], c, float(cost[i, j, s, c])) for i, j, s, c in best)
    latencies = [st.latency for st in stages]
    return StageSolution(
        stages=stages,
        objective=best_value,
        sum_latency=sum(latencies),
        max_latency=max(latencies),
        num_micro_batches=problem.num_micro_batches,
        tmax_trace=(),
        solve_time_s=time.perf_counter() - t0,
        method="brute_force",
    )
