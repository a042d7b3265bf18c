"""Tests for the heuristic sharding search (solvers.local_search).

Small cores are built directly (so simplification cannot solve them away) and checked
against a vectorised brute force over every assignment; small ShardingProblems go through
``simplify`` and are checked on the original nodes with ``evaluate``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from alpa_mini.solvers.errors import InfeasibleError, SolverInputError
from alpa_mini.solvers.sharding.local_search import (
    HeuristicResult,
    exact_peak,
    greedy_assignment,
    local_search,
    min_peak_assignment,
)
from alpa_mini.solvers.sharding.problem import ShardingProblem, evaluate, load_iopddl
from alpa_mini.solvers.sharding.simplify import CoreProblem, simplify

DATA = Path(__file__).resolve().parents[3] / "shared/data/iopddl"

# --------------------------------------------------------------------------- helpers


def random_core(
    rng: np.random.Generator,
    n: int,
    kmax: int = 3,
    *,
    tree: bool = False,
    edge_p: float = 0.5,
    forbid_p: float = 0.0,
    memory: bool = True,
    limit_quantile: float = 0.4,
) -> CoreProblem:
    """A random core; the limit sits at a quantile of the peaks of all assignments."""
    k = rng.integers(1, kmax + 1, n)
    costs = tuple(rng.integers(0, 30, kx).astype(float) for kx in k)
    if tree:
        pairs = [(int(rng.integers(0, v)), v) for v in range(1, n)]
    else:
        pairs = [(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < edge_p]
    mats = []
    for a, b in pairs:
        mat = rng.integers(0, 30, (k[a], k[b])).astype(float)
        mat[rng.random(mat.shape) < forbid_p] = math.inf
        mats.append(mat)
    term_var, term_iv, term_use = [], [], []
    if memory:
        for x in range(n):
            for _ in range(int(rng.integers(0, 3))):
                s = int(rng.integers(0, 8))
                term_var.append(x)
                term_iv.append((s, s + int(rng.integers(1, 5))))
                term_use.append(rng.integers(0, 10, k[x]).astype(float))
    const_iv = [(int(s), int(s) + 3) for s in rng.integers(0, 8, 2)] if memory else []
    const_use = [float(u) for u in rng.integers(0, 5, len(const_iv))]
    core = CoreProblem(
        costs=costs,
        edges=np.array(pairs, dtype=np.int64).reshape(-1, 2),
        edge_costs=tuple(mats),
        term_var=np.array(term_var, dtype=np.int64),
        term_intervals=np.array(term_iv, dtype=np.int64).reshape(-1, 2),
        term_usages=tuple(term_use),
        const_intervals=np.array(const_iv, dtype=np.int64).reshape(-1, 2),
        const_usages=np.array(const_use, dtype=np.float64),
        usage_limit=None,
        const_cost=float(rng.integers(0, 5)),
    )
    if not memory:
        return core
    _, peaks = brute_force_core(core)
    limit = float(np.quantile(peaks, limit_quantile))
    return dataclasses.replace(core, usage_limit=limit)


def brute_force_core(core: CoreProblem) -> tuple[np.ndarray, np.ndarray]:
    """(cost, peak) of every assignment, in itertools.product order (vectorised)."""
    k = [len(c) for c in core.costs]
    assign = np.array(list(itertools.product(*(range(kx) for kx in k))), dtype=np.int64)
    assign = assign.reshape(-1, len(k))
    cost = np.full(len(assign), float(core.const_cost))
    for x, c in enumerate(core.costs):
        cost += c[assign[:, x]]
    for (a, b), mat in zip(core.edges.tolist(), core.edge_costs, strict=True):
        cost += mat[assign[:, a], assign[:, b]]
    times = sorted(
        {int(t) for iv in (core.term_intervals, core.const_intervals) for t in iv.ravel()}
    )
    if not times:
        return cost, np.zeros(len(assign))
    grid = np.array(times)
    usage = np.zeros((len(assign), len(grid)))
    for (s, e), u in zip(core.const_intervals.tolist(), core.const_usages, strict=True):
        usage[:, (grid >= s) & (grid < e)] += u
    for x, (s, e), u in zip(
        core.term_var.tolist(), core.term_intervals.tolist(), core.term_usages, strict=True
    ):
        usage[:, (grid >= s) & (grid < e)] += u[assign[:, x]][:, None]
    return cost, usage.max(axis=1)


def brute_optimum(core: CoreProblem) -> float:
    """Least cost of a feasible assignment (inf if none)."""
    cost, peak = brute_force_core(core)
    ok = np.isfinite(cost)
    if core.usage_limit is not None:
        ok &= peak <= core.usage_limit * (1 + 1e-9)
    return float(cost[ok].min()) if ok.any() else math.inf


def check_result(core: CoreProblem, res: HeuristicResult) -> None:
    """The result's numbers are those of its assignment, recomputed independently."""
    assert res.choice.shape == (core.num_vars,)
    assert np.all((res.choice >= 0) & (res.choice < [len(c) for c in core.costs]))
    cost, peak = core.evaluate(res.choice)
    assert res.peak_usage == pytest.approx(peak, rel=1e-12, abs=1e-9)
    if res.feasible:
        assert math.isfinite(cost)
        assert res.cost == pytest.approx(cost, rel=1e-12)
        assert core.usage_limit is None or peak <= core.usage_limit * (1 + 1e-9)
    else:
        assert res.cost == math.inf


# --------------------------------------------------------------------------- cores


@pytest.mark.parametrize("seed", range(12))
def test_random_cores_are_consistent_and_never_beat_the_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    core = random_core(rng, int(rng.integers(2, 7)), forbid_p=0.15 if seed % 2 else 0.0)
    res = local_search(core, time_limit=0.15, seed=seed)
    check_result(core, res)
    best = brute_optimum(core)
    # Facts only: it cannot beat the optimum, nor find something when nothing fits.
    if res.feasible:
        assert res.cost >= best - 1e-9
    if math.isinf(best):
        assert not res.feasible


@pytest.mark.slow  # 3 s: the fast lane's 3 minutes (scripts/test)
def test_random_cores_usually_reach_the_optimum() -> None:
    hits = total = 0
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        core = random_core(rng, int(rng.integers(3, 7)))
        best = brute_optimum(core)
        if math.isinf(best):
            continue
        res = local_search(core, time_limit=0.15, seed=seed)
        check_result(core, res)
        total += 1
        hits += res.feasible and res.cost <= best + 1e-9
    assert total >= 10
    assert hits >= 0.8 * total


@pytest.mark.parametrize("seed", range(6))
def test_tree_without_memory_is_solved_exactly(seed: int) -> None:
    # On a tree every variable joins the induced forest, so one forest DP move is exact.
    rng = np.random.default_rng(200 + seed)
    core = random_core(rng, 7, kmax=4, tree=True, memory=False, forbid_p=0.1 * (seed % 2))
    best = brute_optimum(core)
    res = local_search(core, time_limit=0.2, seed=seed)
    check_result(core, res)
    if math.isfinite(best):
        assert res.feasible
        assert res.cost == pytest.approx(best)
    else:
        assert not res.feasible


def test_initial_assignment_is_never_worsened() -> None:
    rng = np.random.default_rng(7)
    core = random_core(rng, 6, limit_quantile=0.8)
    cost, peak = brute_force_core(core)
    ok = np.flatnonzero(np.isfinite(cost) & (peak <= core.usage_limit))
    worst = ok[np.argmax(cost[ok])]
    k = [len(c) for c in core.costs]
    initial = np.array(list(itertools.product(*(range(kx) for kx in k)))[worst])
    res = local_search(core, time_limit=0.05, initial=initial)
    assert res.feasible and res.cost <= cost[worst]


def test_bad_initial_is_rejected() -> None:
    core = random_core(np.random.default_rng(5), 4)
    with pytest.raises(SolverInputError, match="initial"):
        local_search(core, time_limit=0.01, initial=np.zeros(3, dtype=np.int64))
    with pytest.raises(SolverInputError, match=r"initial\[0\]"):
        local_search(core, time_limit=0.01, initial=np.full(4, 99))


def test_nothing_fits_reports_least_peak() -> None:
    rng = np.random.default_rng(3)
    core = random_core(rng, 5)
    _, peaks = brute_force_core(core)
    tight = dataclasses.replace(core, usage_limit=float(peaks.min()) - 1.0)
    res = local_search(tight, time_limit=0.1)
    check_result(tight, res)
    assert not res.feasible and res.cost == math.inf
    assert res.peak_usage >= peaks.min()


def test_exact_peak_matches_core_evaluate() -> None:
    rng = np.random.default_rng(11)
    for _ in range(10):
        core = random_core(rng, 5)
        choice = np.array([rng.integers(len(c)) for c in core.costs])
        assert exact_peak(core, choice) == pytest.approx(core.evaluate(choice)[1])


@pytest.mark.parametrize("seed", range(8))
def test_min_peak_never_above_greedy_nor_below_optimum(seed: int) -> None:
    rng = np.random.default_rng(300 + seed)
    core = random_core(rng, int(rng.integers(3, 7)))
    greedy = greedy_assignment(core, seed=seed)
    res = min_peak_assignment(core, time_limit=0.1, seed=seed)
    check_result(core, res)
    _, peaks = brute_force_core(core)
    # No forbidden pairs here, so the greedy start is conflict-free and is one of the starts.
    assert res.peak_usage <= core.evaluate(greedy)[1] + 1e-6
    assert res.peak_usage >= peaks.min() - 1e-9
    assert res.feasible == (res.peak_usage <= core.usage_limit * (1 + 1e-9))


def test_empty_core() -> None:
    core = CoreProblem(
        costs=(),
        edges=np.zeros((0, 2), dtype=np.int64),
        edge_costs=(),
        term_var=np.zeros(0, dtype=np.int64),
        term_intervals=np.zeros((0, 2), dtype=np.int64),
        term_usages=(),
        const_intervals=np.zeros((0, 2), dtype=np.int64),
        const_usages=np.zeros(0),
        usage_limit=10.0,
        const_cost=4.0,
    )
    res = local_search(core, time_limit=0.1)
    assert res.feasible and res.cost == 4.0 and res.choice.shape == (0,)


# --------------------------------------------------------------------------- problems


def random_problem(rng: np.random.Generator) -> ShardingProblem:
    n = int(rng.integers(3, 8))
    k = rng.integers(1, 4, n)
    costs = [rng.integers(0, 30, kx).tolist() for kx in k]
    usages = [rng.integers(0, 10, kx).tolist() for kx in k]
    starts = rng.integers(0, 10, n)
    intervals = [[int(s), int(s + rng.integers(0, 6))] for s in starts]
    edges = [[a, b] for a in range(n) for b in range(a + 1, n) if rng.random() < 0.4]
    edge_costs = []
    for a, b in edges:
        mat = rng.integers(0, 30, (k[a], k[b])).astype(float)
        mat[rng.random(mat.shape) < 0.1] = 1e18  # the contest's forbidden marker
        edge_costs.append(mat.tolist())
    problem = ShardingProblem.from_lists(costs, usages, intervals, edges, edge_costs)
    peaks = []
    for choice in itertools.product(*(range(kx) for kx in k)):
        ev = evaluate(problem, choice)
        if math.isfinite(ev.cost):
            peaks.append(ev.peak_usage)
    limit = float(np.quantile(peaks, 0.4)) if peaks else 0.0
    return problem.with_usage_limit(limit)


@pytest.mark.parametrize("seed", range(10))
def test_random_problems_expand_to_feasible_assignments(seed: int) -> None:
    rng = np.random.default_rng(400 + seed)
    problem = random_problem(rng)
    try:
        reduction = simplify(problem)
    except InfeasibleError:
        # simplify proved that no assignment avoids forbidden costs: brute force agrees.
        k = problem.num_strategies
        assert all(
            not math.isfinite(evaluate(problem, c).cost)
            for c in itertools.product(*(range(int(kx)) for kx in k))
        )
        return
    core = reduction.core
    res = local_search(core, time_limit=0.1, seed=seed)
    check_result(core, res)
    ev = evaluate(problem, reduction.expand(res.choice))
    if res.feasible:
        assert ev.feasible
        assert ev.cost == pytest.approx(res.cost, rel=1e-9)
    best = math.inf
    for choice in itertools.product(*(range(int(kx)) for kx in problem.num_strategies)):
        e = evaluate(problem, choice)
        if e.feasible:
            best = min(best, e.cost)
    if res.feasible:
        assert res.cost >= best - 1e-9
    if math.isinf(best):
        assert not res.feasible


# --------------------------------------------------------------------------- real instance


@pytest.mark.slow  # 4 s: full suite
def test_contest_instance_b_is_solved_feasibly() -> None:
    path = DATA / "asplos-2025-iopddl-B.json.gz"  # shared/ is beside every checkout and CI
    problem = load_iopddl(path)
    reduction = simplify(problem)
    res = local_search(reduction.core, time_limit=3.0)
    assert res.feasible
    ev = evaluate(problem, reduction.expand(res.choice))
    assert ev.feasible
    assert ev.cost == pytest.approx(res.cost, rel=1e-9)
    # The contest's best is 532,843; even a short run should be within a few times of it.
    assert res.cost < 5 * 532_843
    # On B the least-usage start already meets the lower bound on the peak (every term at
    # its least usage), and the descent never raises the peak of a start.
    low = min_peak_assignment(reduction.core, time_limit=1.0)
    assert low.feasible
    assert low.peak_usage <= res.peak_usage + 1e-9
