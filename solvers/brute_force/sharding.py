"""Exhaustive reference for the sharding ILP: try every assignment (tests only)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..sharding.problem import Evaluation, ShardingProblem, evaluate

__all__ = ["brute_force_min_peak", "brute_force_sharding"]

MAX_ASSIGNMENTS = 2_000_000


def _assignments(problem: ShardingProblem) -> itertools.product:
    total = math.prod(int(k) for k in problem.num_strategies)
    if total > MAX_ASSIGNMENTS:
        raise ValueError(f"problem has {total} assignments; brute force stops at {MAX_ASSIGNMENTS}")
    return itertools.product(*(range(int(k)) for k in problem.num_strategies))


def brute_force_sharding(problem: ShardingProblem) -> tuple[np.ndarray, Evaluation] | None:
    """The cheapest feasible assignment and its evaluation, or None if none is feasible.

    Ties keep the lexicographically first assignment.
    """
    best: tuple[np.ndarray, Evaluation] | None = None
    for choice in _assignments(problem):
        ev = evaluate(problem, choice)
        if ev.feasible and (best is None or ev.cost < best[1].cost):
            best = (np.array(choice, dtype=np.int64), ev)
    return best


def brute_force_min_peak(problem: ShardingProblem) -> float | None:
    """The smallest peak usage over assignments that avoid forbidden costs and alias clashes."""
    best = None
    for choice in _assignments(problem):
        ev = evaluate(problem, choice)
        if ev.forbidden_nodes or ev.forbidden_edges or ev.alias_violations:
            continue
        if best is None or ev.peak_usage < best:
            best = ev.peak_usage
    return best
