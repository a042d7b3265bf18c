"""The sharding ILP against brute force, closed forms and the contest's proven optima."""

from __future__ import annotations

import gzip
import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from alpa_mini.solvers.brute_force.sharding import brute_force_min_peak, brute_force_sharding
from alpa_mini.solvers.errors import FractionalRelaxation, InfeasibleError, SolverInputError
from alpa_mini.solvers.sharding.mip_model import build_mip
from alpa_mini.solvers.sharding.problem import (
    ShardingProblem,
    evaluate,
    load_iopddl,
    save_iopddl,
)
from alpa_mini.solvers.sharding.simplify import simplify
from alpa_mini.solvers.sharding.solve import ShardingSolution, solve_sharding
from helpers.problems import FORBID, problems

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "iopddl"
EXAMPLE = DATA / "example.json"


def _optimum(problem: ShardingProblem) -> float | None:
    found = brute_force_sharding(problem)
    return None if found is None else found[1].cost


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(problems())
def test_ilp_equals_brute_force(problem: ShardingProblem) -> None:
    best = _optimum(problem)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_sharding(problem)
        return
    sol = solve_sharding(problem)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-9)
    ev = evaluate(problem, sol.choice)
    assert ev.feasible
    assert ev.cost == pytest.approx(sol.objective)
    assert sol.node_cost + sol.edge_cost == pytest.approx(sol.objective)


@FAST
@given(problems())
def test_lp_first_equals_brute_force(problem: ShardingProblem) -> None:
    """Settling by the LP relaxation (and its dive) never returns a worse plan, whether the
    relaxation is integral or branch-and-bound has to take over."""
    best = _optimum(problem)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_sharding(problem, simplify_graph=False, lp_first=True)
        return
    sol = solve_sharding(problem, simplify_graph=False, lp_first=True)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-9)


@FAST
@given(problems(coarse=True))
def test_strategies_merged_by_equal_edge_rows_keep_the_optimum(problem: ShardingProblem) -> None:
    """The MIP merges strategies whose rows (or columns) of an edge's matrix are equal into
    one class there; the optimum, by MIP and by LP first, is still brute force's."""
    best = _optimum(problem)
    for lp_first in (False, True):
        if best is None:
            with pytest.raises(InfeasibleError):
                solve_sharding(problem, simplify_graph=False, lp_first=lp_first)
            continue
        sol = solve_sharding(problem, simplify_graph=False, lp_first=lp_first)
        assert sol.status == "optimal"
        assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_equal_edge_rows_share_pair_columns() -> None:
    """Four strategies on each side of an edge, two distinct layouts each: 2 x 2 pair
    columns, not 4 x 4."""
    layout = np.array([0, 0, 1, 1])
    mat = np.where(layout[:, None] == layout[None, :], 0.0, 5.0)
    problem = ShardingProblem.from_lists(
        [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]],
        [[0.0] * 4] * 2,
        [[0, 1], [1, 2]],
        [[0, 1]],
        [mat.ravel().tolist()],
    )
    mip = build_mip(simplify(problem, enabled=False).core)
    assert mip.num_cols == 8 + 4
    sol = solve_sharding(problem, simplify_graph=False)
    # Cheapest alike pairs: (0, 1) and (2, 3) at 4; the cheapest pair (0, 3) costs 1 + 1 + 5
    # across layouts.
    assert sol.objective == pytest.approx(4.0) == evaluate(problem, sol.choice).cost


@FAST
@given(problems())
def test_simplification_never_changes_the_optimum(problem: ShardingProblem) -> None:
    try:
        plain = solve_sharding(problem, simplify_graph=False).objective
    except InfeasibleError:
        plain = None
    try:
        simplified = solve_sharding(problem).objective
    except InfeasibleError:
        simplified = None
    assert (plain is None) == (simplified is None)
    if plain is not None:
        assert simplified == pytest.approx(plain, rel=1e-9, abs=1e-9)


def _stale_start_problem() -> ShardingProblem:
    """Hypothesis's example where HiGHS, started from the heuristic's cost-1 assignment,
    reported "optimal" at 0 yet returned the start's vector (presolve emptied the model)."""
    return ShardingProblem(
        num_strategies=np.array([1, 3, 3, 3, 2]),
        node_costs=np.zeros(12),
        node_usages=np.array([0, 0, 0, 1, 0, 1, 0, 0, 3, 0, 0, 0], dtype=float),
        intervals=np.array([[0, 0], [0, 1], [0, 1], [0, 1], [0, 0]]),
        edges=np.array([[1, 3], [2, 3], [0, 4]]),
        # Edge matrices, row-major: 3x3 (nodes 1, 3), 3x3 (2, 3), 1x2 (0, 4).
        edge_costs=np.concatenate(
            [
                [0, FORBID, FORBID, 0, 0, FORBID, FORBID, 0, 0],
                [FORBID, FORBID, FORBID, FORBID, FORBID, 0, 1, 0, 1],
                [FORBID, 0],
            ]
        ),
        usage_limit=3,
        aliases=np.zeros((0, 2), dtype=np.int64),
    )


def test_a_stale_warm_start_never_comes_back_as_the_optimum() -> None:
    problem = _stale_start_problem()
    assert _optimum(problem) == 0.0
    sol = solve_sharding(problem)
    assert sol.status == "optimal" and sol.objective == 0.0
    assert evaluate(problem, sol.choice).cost == 0.0


def test_highs_returns_the_vector_of_the_objective_it_reports() -> None:
    """Given the cost-1 start, the MIP result's vector must price at its own objective (0)."""
    from alpa_mini.solvers.sharding.backends import run_mip

    core = simplify(_stale_start_problem()).core
    model = build_mip(core)
    start = model.columns_from(core, np.array([0, 1, 0]))
    assert model.c @ start == pytest.approx(1.0 / model.cost_scale)
    result = run_mip(model, "highs", time_limit=None, warm_start=start)
    assert result.status == "optimal"
    assert model.c @ result.x == pytest.approx(result.objective, abs=1e-12)
    assert result.objective == pytest.approx(0.0, abs=1e-12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=5))
def test_reduction_maps_back_and_never_grows(problem: ShardingProblem) -> None:
    try:
        red = simplify(problem)
    except InfeasibleError:
        assert brute_force_sharding(problem) is None
        return
    stats = red.stats
    assert stats.nodes_after <= stats.nodes_before
    assert stats.strategies_after <= stats.strategies_before
    # Every core assignment expands to a full assignment with the same cost and peak.
    rng = np.random.default_rng(0)
    core = red.core
    for _ in range(5):
        core_choice = np.array([rng.integers(len(c)) for c in core.costs], dtype=np.int64)
        cost, peak = core.evaluate(core_choice)
        full = evaluate(problem.with_usage_limit(None), red.expand(core_choice))
        if math.isinf(cost):
            continue
        assert full.cost == pytest.approx(cost, rel=1e-9, abs=1e-9)
        if problem.usage_limit is not None and peak <= problem.usage_limit:
            # Where the core says memory fits, the original assignment fits too.
            assert evaluate(problem, red.expand(core_choice)).feasible or full.forbidden_edges


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=4))
def test_cbc_backend_equals_brute_force(problem: ShardingProblem) -> None:
    best = _optimum(problem)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_sharding(problem, backend="cbc")
        return
    sol = solve_sharding(problem, backend="cbc", simplify_graph=False)
    assert sol.backend == "cbc"
    assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-9)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(aliases=False))
def test_infeasible_memory_reports_the_minimum_peak(problem: ShardingProblem) -> None:
    if problem.usage_limit is None or brute_force_sharding(problem.with_usage_limit(None)) is None:
        return
    if brute_force_sharding(problem) is not None:
        return
    min_peak = brute_force_min_peak(problem)
    with pytest.raises(InfeasibleError) as info:
        solve_sharding(problem)
    assert "cannot be met" in str(info.value)
    assert info.value.details["min_peak"] == pytest.approx(min_peak)
    sol = solve_sharding(problem, on_infeasible="return")
    assert sol.status == "infeasible"
    assert sol.peak_usage == pytest.approx(min_peak)


def test_example_closed_form() -> None:
    """The contest's example: hand-checkable optimum 445 at (0, 0, 2, 1, 0)."""
    problem = load_iopddl(EXAMPLE)
    sol = solve_sharding(problem)
    assert sol.objective == 445
    assert sol.choice == (0, 0, 2, 1, 0)
    assert sol.status == "optimal"
    ev = evaluate(problem, sol.choice)
    assert ev.node_cost == 15 + 55 + 35 + 75 + 95
    assert ev.edge_cost == 30 + 40 + 10 + 30 + 60
    assert ev.peak_usage <= 50
    # Without the memory limit, strategy 0 of node 2 (usage 15 → cheaper) becomes reachable.
    free = solve_sharding(problem.with_usage_limit(None))
    assert free.objective == brute_force_sharding(problem.with_usage_limit(None))[1].cost


def test_a_limit_that_can_bind_gets_a_warm_start_even_on_small_cores() -> None:
    """The example's limit (50) excludes its unconstrained optimum, so the MIP is handed a
    local-search incumbent (a time limit then still ends with a plan); a limit no assignment
    can reach costs nothing extra."""
    problem = load_iopddl(EXAMPLE)
    bound = solve_sharding(problem, time_limit=10.0)
    assert "heuristic" in bound.timings
    assert bound.objective == 445
    loose = solve_sharding(problem.with_usage_limit(1e12), time_limit=10.0)
    assert "heuristic" not in loose.timings
    assert loose.objective == 415


def test_alias_pairs_force_equal_choices() -> None:
    # Node 1 alone prefers strategy 1, node 0 strategy 0; aliased, they must agree.
    problem = ShardingProblem.from_lists(costs=[[0.0, 5.0], [7.0, 0.0]], aliases=[[0, 1]])
    sol = solve_sharding(problem)
    assert sol.choice[0] == sol.choice[1]
    assert sol.objective == 5.0


def test_forbidden_everywhere_is_infeasible_whatever_the_budget() -> None:
    problem = ShardingProblem.from_lists(
        costs=[[1.0, 2.0], [1.0, 1.0]],
        edges=[[0, 1]],
        edge_costs=[[FORBID, FORBID, FORBID, FORBID]],
    )
    with pytest.raises(InfeasibleError, match="forbidden"):
        solve_sharding(problem)


# Each takes 4-8 s: both run with the slow tests (the fast lane's 3 minutes, scripts/test).
@pytest.mark.slow
@pytest.mark.parametrize(("name", "best"), [("B", 532_843), ("G", 217_039)])
def test_contest_instances_solved_to_proven_optimality(name: str, best: int) -> None:
    problem = load_iopddl(DATA / f"asplos-2025-iopddl-{name}.json.gz")
    sol = solve_sharding(problem, time_limit=120)
    assert sol.status == "optimal"
    assert sol.objective == best
    assert evaluate(problem, sol.choice).feasible
    assert sol.reduction["nodes"][1] < sol.reduction["nodes"][0] / 2


# ---------------------------------------------------------------- file format and validation
def _example_dict() -> dict:
    return json.loads(EXAMPLE.read_text())


def test_iopddl_round_trip(tmp_path: Path) -> None:
    problem = load_iopddl(EXAMPLE)
    for name in ("p.json", "p.json.gz"):
        save_iopddl(problem, tmp_path / name)
        again = load_iopddl(tmp_path / name)
        assert again.to_iopddl_dict() == problem.to_iopddl_dict()
    with gzip.open(tmp_path / "p.json.gz", "rt") as fh:
        assert json.load(fh) == _example_dict()


def test_solution_json_round_trip() -> None:
    sol = solve_sharding(load_iopddl(EXAMPLE))
    again = ShardingSolution.from_json(sol.to_json())
    assert again == sol


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d["problem"]["nodes"].pop("usages"), r"problem\.nodes\.usages: missing field"),
        (lambda d: d["problem"].pop("nodes"), r"problem\.nodes: missing field"),
        (
            lambda d: d["problem"]["edges"]["costs"].__setitem__(2, [1, 2, 3]),
            r"edges\.costs\[2\].*needs 2x2 = 4 entries.*got 3",
        ),
        (
            lambda d: d["problem"]["nodes"]["usages"][3].__setitem__(1, -4),
            r"nodes\.usages\[3\]\[1\].*-4",
        ),
        (
            lambda d: d["problem"]["nodes"]["costs"][2].__setitem__(0, float("nan")),
            r"nodes\.costs\[2\]\[0\].*nan",
        ),
        (
            lambda d: d["problem"]["nodes"]["usages"][1].pop(),
            r"nodes\.usages\[1\]: expected 2 entries",
        ),
        (
            lambda d: d["problem"]["edges"]["nodes"].__setitem__(4, [3, 9]),
            r"edges\.nodes\[4\].*outside 0\.\.4",
        ),
        (
            lambda d: d["problem"]["nodes"]["intervals"].__setitem__(0, [70, 30]),
            r"nodes\.intervals\[0\]",
        ),
        (lambda d: d["problem"].__setitem__("usage_limit", "lots"), r"usage_limit.*'lots'"),
        (
            lambda d: d["problem"]["nodes"]["costs"].__setitem__(1, []),
            r"nodes\.costs\[1\].*non-empty",
        ),
    ],
)
def test_malformed_files_name_the_field(tmp_path: Path, mutate, match: str) -> None:
    data = _example_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SolverInputError, match=match):
        load_iopddl(path)


def test_evaluate_rejects_bad_choices() -> None:
    problem = load_iopddl(EXAMPLE)
    with pytest.raises(SolverInputError, match=r"choice\[2\]: strategy 3 does not exist"):
        evaluate(problem, [0, 0, 3, 0, 0])
    with pytest.raises(SolverInputError, match="expected 5 strategy indices"):
        evaluate(problem, [0, 0])


def test_evaluate_reports_each_violation() -> None:
    problem = ShardingProblem.from_lists(
        costs=[[1.0, FORBID], [2.0, 3.0]],
        usages=[[4.0, 4.0], [5.0, 1.0]],
        intervals=[[0, 2], [1, 3]],
        edges=[[0, 1]],
        edge_costs=[[0.0, FORBID, 1.0, 1.0]],
        usage_limit=8.0,
    )
    ok = evaluate(problem, [0, 0])
    assert (ok.cost, ok.peak_usage, ok.peak_time, ok.feasible) == (3.0, 9.0, 1, False)
    assert ok.over_limit and not ok.forbidden_nodes
    good = evaluate(problem, [0, 1])
    assert good.feasible is False and good.forbidden_edges == (0,)
    bad = evaluate(problem, [1, 1])
    assert bad.forbidden_nodes == (0,) and math.isinf(bad.cost)


def test_solver_argument_errors() -> None:
    problem = load_iopddl(EXAMPLE)
    with pytest.raises(ValueError, match="backend: 'gurobi'"):
        solve_sharding(problem, backend="gurobi")
    with pytest.raises(SolverInputError, match="time_limit"):
        solve_sharding(problem, time_limit=-1)
    with pytest.raises(SolverInputError, match="on_infeasible"):
        solve_sharding(problem, on_infeasible="ignore")


def _cycle(n: int) -> ShardingProblem:
    """``n`` nodes in a ring, two strategies each, an edge costs 1 where both ends agree."""
    return ShardingProblem.from_lists(
        costs=[[0.0, 0.0]] * n,
        edges=[(k, (k + 1) % n) for k in range(n)],
        edge_costs=[[1.0, 0.0, 0.0, 1.0]] * n,
    )


def test_lp_first_path_when_an_integral_optimum_meets_the_lp_bound() -> None:
    """An even ring's relaxation is degenerate (all halves cost 0 too); the LP dive must still
    return an integral optimum, certified by the bound, without branch-and-bound."""
    from alpa_mini.solvers.sharding.backends import run_mip
    from alpa_mini.solvers.sharding.mip_model import build_mip

    core = simplify(_cycle(6), enabled=False).core
    model = build_mip(core)
    result = run_mip(model, "highs", time_limit=None, lp_first=True)
    assert result.status == "optimal" and result.detail == "Optimal (LP)"
    choice = model.strategies_from(result.x)
    assert [int(c) for c in choice] in ([0, 1] * 3, [1, 0] * 3)
    assert result.objective * model.cost_scale + model.offset == pytest.approx(0.0, abs=1e-12)


def test_mip_takes_over_when_the_lp_bound_is_not_integral() -> None:
    """An odd ring cannot alternate: the LP reaches 0 with halves, the optimum is 1. The dive
    must notice that fixing a node raises the objective and hand over to the MIP."""
    problem = _cycle(5)
    sol = solve_sharding(problem, simplify_graph=False, lp_first=True)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(1.0)
    assert sol.objective == pytest.approx(_optimum(problem))


def test_a_deferred_fractional_mip_reports_its_lp_bound() -> None:
    """The odd ring again, asked not to branch: the LP's 0 comes back as a bound (the optimum
    is 1), and the error survives pickling (solver processes send it back whole)."""
    with pytest.raises(FractionalRelaxation) as caught:
        solve_sharding(_cycle(5), simplify_graph=False, lp_first=True, defer_fractional=True)
    assert caught.value.lower_bound == pytest.approx(0.0, abs=1e-9)
    again = pickle.loads(pickle.dumps(caught.value))
    assert again.lower_bound == caught.value.lower_bound and str(again) == str(caught.value)
    # An even ring's relaxation settles by LP: nothing is deferred.
    sol = solve_sharding(_cycle(6), simplify_graph=False, lp_first=True, defer_fractional=True)
    assert sol.status == "optimal" and sol.objective == pytest.approx(0.0, abs=1e-12)


@FAST
@given(problems())
def test_deferring_returns_the_optimum_or_a_bound_below_it(problem: ShardingProblem) -> None:
    """With ``defer_fractional`` every answer is brute force's optimum, or a bound at or
    below it (never above: the stage DP relies on bounds only flattering a cell)."""
    best = _optimum(problem)
    if best is None:
        with pytest.raises((InfeasibleError, FractionalRelaxation)):
            solve_sharding(problem, lp_first=True, defer_fractional=True)
        return
    try:
        sol = solve_sharding(problem, lp_first=True, defer_fractional=True)
    except FractionalRelaxation as err:
        assert err.lower_bound <= best + 1e-9 * max(1.0, abs(best))
        return
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_unique_rows_equals_numpy_unique_on_edge_matrices():
    """The edge-class merge's row grouping is numpy's, exactly: sorted unique rows, each
    class's first row, every row's class (matrices with inf entries and repeats)."""
    from alpa_mini.solvers.sharding.mip_model import _unique_rows

    rng = np.random.default_rng(0)
    for trial in range(500):
        r, c = (int(x) for x in rng.integers(1, 25, 2))
        mat = rng.integers(0, 3, (r, c)).astype(float)
        if trial % 2:
            mat[mat == 2] = np.inf
        want = np.unique(mat, axis=0, return_index=True, return_inverse=True)
        got = _unique_rows(mat)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert np.array_equal(got[2], want[2].reshape(-1))


def test_a_vector_that_disagrees_with_its_objective_is_demoted() -> None:
    """If a cold re-solve still returned a mismatched vector, it is priced by itself and no
    longer called optimal."""
    from alpa_mini.solvers.sharding.backends import MipResult, _demoted, _vector_matches_objective

    core = simplify(_stale_start_problem()).core
    model = build_mip(core)
    x = model.columns_from(core, np.array([0, 1, 0]))
    claimed = MipResult("optimal", x, 0.0, 0.0, 0.1, "highs", "Optimal")
    assert not _vector_matches_objective(model, claimed)
    demoted = _demoted(model, claimed)
    assert demoted.status == "feasible"
    assert demoted.objective == pytest.approx(model.c @ x) and demoted.bound == 0.0
    assert _vector_matches_objective(model, demoted)
