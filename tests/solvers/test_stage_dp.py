"""Stage DP (DESIGN 5.2): exact solver and Alpa's reference against brute force and closed forms."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alpa_mini.solvers.brute_force import random_stage_problem, solve_stages_reference
from alpa_mini.solvers.brute_force.stages import brute_force_stages
from alpa_mini.solvers.errors import InfeasibleError, SolverInputError
from alpa_mini.solvers.stages import (
    Stage,
    StageProblem,
    StageSolution,
    solve_stages,
    stage_objective,
    submesh_shapes,
)

CLUSTERS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)]


# --------------------------------------------------------------------------- helpers


def check_solution(problem: StageProblem, solution: StageSolution) -> float:
    """Assert ``solution`` is a valid slicing of ``problem`` and return its recomputed T."""
    stages = solution.stages
    assert stages, "a solution has at least one stage"
    assert stages[0].layer_start == 0
    assert stages[-1].layer_end == problem.num_layers - 1
    for a, b in itertools.pairwise(stages):
        assert b.layer_start == a.layer_end + 1
    shapes = problem.submesh_shapes
    assert sum(shapes[s.submesh_index][0] * shapes[s.submesh_index][1] for s in stages) == (
        problem.num_hosts * problem.devices_per_host
    )
    for position, s in enumerate(stages):
        assert s.layer_start <= s.layer_end
        assert s.submesh_shape == shapes[s.submesh_index]
        assert s.num_devices == s.submesh_shape[0] * s.submesh_shape[1]
        cost = problem.cost[s.layer_start, s.layer_end, s.submesh_index, s.config_index]
        assert math.isfinite(cost)
        assert s.latency == cost
        later = len(stages) - 1 - position
        assert problem.max_succ[s.layer_start, s.layer_end, s.submesh_index, s.config_index] >= (
            later
        )
    lat = [s.latency for s in stages]
    value = sum(lat) + (problem.num_micro_batches - 1) * max(lat)
    assert math.isclose(solution.objective, value, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(solution.sum_latency, sum(lat), rel_tol=1e-12, abs_tol=1e-12)
    assert solution.max_latency == max(lat)
    assert solution.num_micro_batches == problem.num_micro_batches
    return value


@st.composite
def small_problems(draw: st.DrawFn) -> StageProblem:
    """Tiny random instances: ties (integer costs), inf holes, binding memory limits."""
    hosts, per_host = draw(st.sampled_from(CLUSTERS))
    num_submeshes = len(submesh_shapes(hosts, per_host))
    num_configs = draw(st.integers(1, 3))
    # keep brute force fast: at most ~12^4 assignments per slicing
    max_layers = 5 if num_submeshes * num_configs <= 6 else 4
    num_layers = draw(st.integers(1, max_layers))
    shape = (num_layers, num_layers, num_submeshes, num_configs)
    size = int(np.prod(shape))
    inf_share = draw(st.sampled_from([0.0, 0.3, 0.6]))
    integer = draw(st.booleans())
    value = st.integers(0, 9).map(float) if integer else st.floats(0.0, 10.0, allow_nan=False)
    hole = st.floats(0.0, 1.0).map(lambda u: u < inf_share)
    cells = draw(st.lists(st.tuples(hole, value), min_size=size, max_size=size))
    cost = np.array([math.inf if h else v for h, v in cells]).reshape(shape)
    max_succ = np.array(draw(st.lists(st.integers(0, 4), min_size=size, max_size=size)))
    return StageProblem(
        num_hosts=hosts,
        devices_per_host=per_host,
        cost=cost,
        max_succ=max_succ.reshape(shape),
        num_micro_batches=draw(st.integers(1, 8)),
    )


def one_device_per_layer_problem(num_layers: int, b: int) -> StageProblem:
    """1 x L cluster; a range on one device costs its length; wider meshes are useless (inf)."""
    shapes = submesh_shapes(1, num_layers)
    cost = np.full((num_layers, num_layers, len(shapes), 1), math.inf)
    for i in range(num_layers):
        for j in range(i, num_layers):
            cost[i, j, 0, 0] = j - i + 1.0
    return StageProblem(1, num_layers, cost, np.full(cost.shape, 99), b)


# --------------------------------------------------------------------------- brute force


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _matches_brute_force(problem: StageProblem, solver) -> StageSolution | None:
    """Solve with ``solver``; infeasible exactly when brute force is, else the same optimum."""
    expected = brute_force_stages(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solver(problem)
        return None
    got = solver(problem)
    assert math.isclose(got.objective, expected.objective, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(
        check_solution(problem, got), expected.objective, rel_tol=1e-9, abs_tol=1e-12
    )
    return got


def test_subnormal_latencies_do_not_overflow_the_search() -> None:
    """Found by hypothesis: a latency of 2.2e-313 (subnormal) made the incumbent search's
    threshold ladder step underflow to zero, and it climbed until 2**k overflowed."""
    inf = math.inf
    cost = np.full((4, 4, 1, 1), inf)
    cost[0, :, 0, 0] = [1.0, 1.0, 1.0, 2.2250738585e-313]
    for i in range(1, 4):
        cost[i, i:, 0, 0] = 0.0
    problem = StageProblem(
        num_hosts=1,
        devices_per_host=1,
        cost=cost,
        max_succ=np.zeros((4, 4, 1, 1), dtype=np.int64),
        num_micro_batches=2,
    )
    got = _matches_brute_force(problem, solve_stages)
    assert got is not None and got.objective == 2 * 2.2250738585e-313


@SETTINGS
@given(small_problems())
def test_fast_solver_matches_brute_force(problem: StageProblem) -> None:
    got = _matches_brute_force(problem, solve_stages)
    if got is None:
        return
    assert got.method == "stage_dp"
    trace_t = [t for t, _ in got.tmax_trace]
    assert trace_t == sorted(trace_t)
    assert min(v for _, v in got.tmax_trace) == pytest.approx(got.objective, rel=1e-12)


@SETTINGS
@given(small_problems())
def test_reference_matches_brute_force(problem: StageProblem) -> None:
    got = _matches_brute_force(problem, solve_stages_reference)
    if got is not None:
        assert got.method == "reference"


@pytest.mark.parametrize(
    ("layers", "hosts", "per_host", "b", "seed"),
    [
        (12, 2, 4, 8, 1),
        pytest.param(12, 4, 8, 64, 2, marks=pytest.mark.slow),  # 3 s
        pytest.param(16, 4, 8, 64, 3, marks=pytest.mark.slow),  # 5-11 s each: full suite
        pytest.param(10, 4, 8, 1, 4, marks=pytest.mark.slow),  # 3 s
        pytest.param(16, 1, 8, 8, 5, marks=pytest.mark.slow),
    ],
)
def test_fast_solver_matches_reference_on_realistic_instances(
    layers: int, hosts: int, per_host: int, b: int, seed: int
) -> None:
    problem = random_stage_problem(layers, hosts, per_host, num_micro_batches=b, seed=seed)
    got = solve_stages(problem)
    ref = solve_stages_reference(problem)
    assert math.isclose(got.objective, ref.objective, rel_tol=1e-9)
    check_solution(problem, got)
    check_solution(problem, ref)


# --------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("b", [1, 2, 7, 64])
def test_single_device_runs_everything_in_one_stage(b: int) -> None:
    # 1 device: exactly one stage (all layers); T = B * L.
    cost = np.full((5, 5, 1, 1), math.inf)
    for i in range(5):
        for j in range(i, 5):
            cost[i, j, 0, 0] = 2.0 * (j - i + 1)
    problem = StageProblem(1, 1, cost, np.zeros(cost.shape, dtype=np.int64), b)
    sol = solve_stages(problem)
    assert sol.objective == pytest.approx(b * 10.0)
    assert [(s.layer_start, s.layer_end) for s in sol.stages] == [(0, 4)]


@pytest.mark.parametrize(("layers", "b"), [(2, 1), (3, 4), (4, 16)])
def test_one_layer_per_device_pipeline(layers: int, b: int) -> None:
    # L devices, only single-device stages exist: L stages of one layer, T = L + (B-1) * 1.
    problem = one_device_per_layer_problem(layers, b)
    sol = solve_stages(problem)
    assert sol.objective == pytest.approx(layers + (b - 1))
    assert [(s.layer_start, s.layer_end, s.submesh_shape) for s in sol.stages] == [
        (k, k, (1, 1)) for k in range(layers)
    ]


def two_layer_choice(b: int, first_stage_max_succ: int) -> StageProblem:
    """1x2 cluster, 2 layers: one stage on (1,2) costs 1.2; or two (1,1) stages costing 1."""
    cost = np.full((2, 2, 2, 1), math.inf)
    cost[0, 1, 1, 0] = 1.2  # both layers on two devices
    cost[0, 0, 0, 0] = 1.0
    cost[1, 1, 0, 0] = 1.0
    max_succ = np.full(cost.shape, 5)
    max_succ[0, 0, 0, 0] = first_stage_max_succ
    return StageProblem(1, 2, cost, max_succ, b)


@pytest.mark.parametrize("b", [1, 4, 5, 6, 8, 64])
def test_pipelining_pays_off_only_for_enough_micro_batches(b: int) -> None:
    # one stage: T = 1.2 B; two stages: T = 2 + (B - 1) = B + 1. Break-even at B = 5.
    sol = solve_stages(two_layer_choice(b, first_stage_max_succ=1))
    assert sol.objective == pytest.approx(min(1.2 * b, b + 1.0))
    ref = solve_stages_reference(two_layer_choice(b, first_stage_max_succ=1))
    assert ref.objective == pytest.approx(sol.objective)


@pytest.mark.parametrize("b", [1, 8, 64])
def test_memory_limit_forbids_the_pipeline(b: int) -> None:
    # the first stage cannot hold activations for one later stage: only the single stage is left
    sol = solve_stages(two_layer_choice(b, first_stage_max_succ=0))
    assert sol.objective == pytest.approx(1.2 * b)
    assert len(sol.stages) == 1


def test_cheaper_config_with_less_memory_is_used_only_where_it_fits() -> None:
    # 1x2 cluster, 2 single-layer stages. Config 0 is cheap but tolerates no later stage,
    # config 1 costs more but does: stage 0 must use config 1, stage 1 may use config 0.
    cost = np.full((2, 2, 2, 2), math.inf)
    cost[0, 0, 0] = [1.0, 1.5]
    cost[1, 1, 0] = [1.0, 1.5]
    max_succ = np.zeros(cost.shape, dtype=np.int64)
    max_succ[0, 0, 0] = [0, 1]
    max_succ[1, 1, 0] = [0, 1]
    problem = StageProblem(1, 2, cost, max_succ, 3)
    sol = solve_stages(problem)
    assert [s.config_index for s in sol.stages] == [1, 0]
    assert sol.objective == pytest.approx(2.5 + 2 * 1.5)


# --------------------------------------------------------------------------- infeasibility


def test_uncovered_layer_is_reported() -> None:
    cost = np.full((3, 3, 1, 1), math.inf)
    cost[0, 0, 0, 0] = 1.0
    problem = StageProblem(1, 1, cost, np.zeros(cost.shape, dtype=np.int64), 4)
    with pytest.raises(InfeasibleError, match="layer 1"):
        solve_stages(problem)
    with pytest.raises(InfeasibleError):
        solve_stages_reference(problem)
    assert brute_force_stages(problem) is None


def test_device_count_mismatch_is_reported() -> None:
    # 1 layer, 1x2 cluster, but only the one-device submesh fits: cannot use both devices
    cost = np.full((1, 1, 2, 1), math.inf)
    cost[0, 0, 0, 0] = 1.0
    problem = StageProblem(1, 2, cost, np.zeros(cost.shape, dtype=np.int64), 4)
    with pytest.raises(InfeasibleError, match="sum to exactly"):
        solve_stages(problem)


def test_too_many_devices_needed_is_reported() -> None:
    # 2 layers, one device, each layer alone needs the device: two stages need 2 devices
    cost = np.full((2, 2, 1, 1), math.inf)
    cost[0, 0, 0, 0] = cost[1, 1, 0, 0] = 1.0
    problem = StageProblem(1, 1, cost, np.ones(cost.shape, dtype=np.int64), 4)
    with pytest.raises(InfeasibleError, match="at least 2 devices") as info:
        solve_stages(problem)
    assert info.value.details["min_devices"] == 2


def test_memory_infeasibility_is_reported() -> None:
    problem = one_device_per_layer_problem(2, 4)
    max_succ = np.zeros(problem.cost.shape, dtype=np.int64)  # nobody tolerates a later stage
    problem = StageProblem(1, 2, problem.cost, max_succ, 4)
    with pytest.raises(InfeasibleError, match="memory"):
        solve_stages(problem)
    assert brute_force_stages(problem) is None


# --------------------------------------------------------------------------- records


def test_submesh_shapes() -> None:
    assert submesh_shapes(1, 1) == ((1, 1),)
    assert submesh_shapes(2, 4) == ((1, 1), (1, 2), (1, 4), (2, 4))
    assert submesh_shapes(3, 8) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8))
    assert submesh_shapes(1, 6) == ((1, 1), (1, 2), (1, 6))  # widths that divide the next
    assert submesh_shapes(2, 3) == ((1, 1), (1, 3), (2, 3))
    assert submesh_shapes(3, 1) == ((1, 1), (2, 1), (3, 1))
    with pytest.raises(SolverInputError, match="num_hosts"):
        submesh_shapes(0, 4)


def test_stage_objective() -> None:
    assert stage_objective([1.0, 3.0, 2.0], 5) == pytest.approx(6.0 + 4 * 3.0)
    with pytest.raises(SolverInputError, match="latencies"):
        stage_objective([], 2)


def test_problem_json_round_trip() -> None:
    problem = random_stage_problem(5, 2, 4, num_configs=3, num_micro_batches=7, seed=11)
    assert np.isinf(problem.cost).any()
    text = problem.to_json()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text)  # standard JSON
    again = StageProblem.from_json(text)
    assert again == problem
    assert again.config_names == problem.config_names
    assert solve_stages(again).objective == solve_stages(problem).objective


def _searching(problem: StageProblem, keep: list[bool]) -> StageProblem:
    """``problem``'s table over the submeshes ``keep`` marks only."""
    shapes = tuple(s for s, k in zip(problem.submesh_shapes, keep, strict=True) if k)
    return StageProblem(
        problem.num_hosts, problem.devices_per_host, problem.cost[:, :, keep],
        problem.max_succ[:, :, keep], problem.num_micro_batches, problem.config_names, shapes,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_a_table_over_some_submeshes_solves_as_the_full_table_with_the_rest_unfit(seed):
    """A planner searching some submesh shapes gives the DP their columns alone: the same
    optimum (objective, layer ranges, shapes, configs) as the full table with every other
    column unfit, and brute force's, and the stages name their shapes in the full list."""
    full = random_stage_problem(5, 4, 4, num_configs=2, num_micro_batches=6, seed=seed)
    rng = np.random.default_rng(seed)
    keep = list(rng.random(len(full.submesh_shapes)) < 0.6)
    keep[-1] = True  # (4, 4): one stage over the cluster keeps some slicing feasible
    compact = _searching(full, keep)
    cost = np.where(np.array(keep)[None, None, :, None], full.cost, np.inf)
    masked = StageProblem(4, 4, cost, full.max_succ, 6, full.config_names)
    got, want = solve_stages(compact), solve_stages(masked)
    assert math.isclose(got.objective, want.objective, rel_tol=1e-12)
    assert math.isclose(got.objective, brute_force_stages(compact).objective, rel_tol=1e-12)
    check_solution(compact, got)
    key = [(s.layer_start, s.layer_end, s.submesh_shape, s.config_index) for s in got.stages]
    assert key == [(s.layer_start, s.layer_end, s.submesh_shape, s.config_index)
                   for s in want.stages]  # fmt: skip
    assert compact.cost.shape[2] == sum(keep) < len(submesh_shapes(4, 4))


def test_a_table_over_some_submeshes_round_trips_and_records_without_them_read_as_all():
    full = random_stage_problem(5, 2, 4, num_configs=3, num_micro_batches=7, seed=11)
    compact = _searching(full, [True, False, True, True])
    again = StageProblem.from_json(compact.to_json())
    assert again == compact and again.submesh_shapes == ((1, 1), (1, 4), (2, 4))
    assert compact != _searching(full, [True, True, False, True])  # same shape, not equal
    record = full.to_dict()
    assert record["submeshes"] is None and StageProblem.from_dict(record) == full
    del record["submeshes"]  # written before the field
    assert StageProblem.from_dict(record).submesh_shapes == submesh_shapes(2, 4)


@pytest.mark.parametrize(
    ("submeshes", "pattern"),
    [
        (((1, 1), (3, 4)), r"submeshes\[1\] = \(3, 4\) is not a submesh shape of 2 hosts x 4"),
        (((2, 4), (1, 1)), r"distinct shapes in increasing device count"),
        (((1, 1), (1, 1)), r"distinct shapes in increasing device count"),
        ((), r"at least one"),
        (((1, 1), (2, True)), r"submeshes\[1\]: expected \[hosts, devices\] as two ints"),
        ("(1, 1)", r"submeshes: expected a list of \[hosts, devices\], got '\(1, 1\)'"),
        (((1, 1), (2, 4), (1, 4)), r"increasing device count"),
    ],
)
def test_submeshes_are_shapes_of_the_cluster_in_order(submeshes, pattern):
    with pytest.raises(SolverInputError, match=pattern):
        StageProblem(2, 4, np.ones((2, 2, 2, 1)), np.zeros((2, 2, 2, 1), np.int64), 4,
                     submeshes=submeshes)  # fmt: skip
    with pytest.raises(SolverInputError, match=r"cost\.shape\[2:\] must be \(S, C\) = \(2,"):
        StageProblem(2, 4, np.ones((2, 2, 3, 1)), np.zeros((2, 2, 3, 1), np.int64), 4,
                     submeshes=((1, 1), (2, 4)))  # fmt: skip


def test_problem_records_hold_only_the_cells_that_are_set() -> None:
    """A planner's table is mostly ``inf``: the record lists the finite cells (and any
    nonzero ``max_succ``) alone, reads back equal, and the dense lists that older records
    hold still read back equal."""
    problem = random_stage_problem(5, 2, 4, num_configs=3, num_micro_batches=7, seed=11)
    cost, succ = np.array(problem.cost), np.array(problem.max_succ)
    cost[0, 1, 0, 0], succ[0, 1, 0, 0] = np.inf, 2  # a stage that does not fit, with a bound
    problem = StageProblem(2, 4, cost, succ, 7, problem.config_names)
    record = problem.to_dict()
    set_cells = np.isfinite(problem.cost) | (problem.max_succ != 0)
    assert record["shape"] == list(problem.cost.shape)
    assert len(record["cells"]) == int(set_cells.sum()) < problem.cost.size
    assert [0, 1, 0, 0, None, 2] in record["cells"]
    assert StageProblem.from_json(json.dumps(record)) == problem
    dense = {k: v for k, v in record.items() if k not in ("shape", "cells")}
    nested = problem.cost.astype(object)
    nested[~np.isfinite(problem.cost)] = None
    dense.update(cost=nested.tolist(), max_succ=problem.max_succ.tolist())
    assert StageProblem.from_dict(json.loads(json.dumps(dense))) == problem


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"shape": [5, 5, 4]}, r"shape: expected \[L, L, S, C\]"),
        ({"cells": "none"}, "cells: expected a list of cells, got str"),
        ({"cells": [[0, 0, 0, 0, 1.0]]}, r"cells\[0\]: expected \[i, j, submesh"),
        ({"cells": [[0, 5, 0, 0, 1.0, 0]]}, r"cells\[0\]: .*inside shape \[5, 5, 4, 3\]"),
        ({"cells": [[0, 0, 0, 0, "fast", 0]]}, r"cells\[0\]"),
        ({"cells": [[0, 0, 0, 0, -1.0, 0]]}, "negative|>= 0"),
    ],
)
def test_bad_problem_records_name_the_cell(change, match) -> None:
    record = random_stage_problem(5, 2, 4, num_configs=3, seed=1).to_dict()
    with pytest.raises(SolverInputError, match=match):
        StageProblem.from_dict({**record, **change})


def test_solution_json_round_trip() -> None:
    problem = random_stage_problem(6, 2, 4, num_micro_batches=8, seed=3)
    sol = solve_stages(problem)
    text = sol.to_json()
    assert "Infinity" not in text and "NaN" not in text
    again = StageSolution.from_json(text)
    assert again == sol
    assert isinstance(again.stages[0], Stage)


def test_problem_is_read_only_and_ignores_lower_triangle() -> None:
    cost = np.ones((2, 2, 1, 1))
    cost[1, 0, 0, 0] = math.nan  # i > j: not a range, ignored
    problem = StageProblem(1, 1, cost, np.zeros((2, 2, 1, 1), dtype=np.int64), 2)
    assert math.isinf(problem.cost[1, 0, 0, 0])
    with pytest.raises(ValueError):
        problem.cost[0, 0, 0, 0] = 5.0
    assert problem.num_layers == 2 and problem.num_devices == 1


# --------------------------------------------------------------------------- validation


def _valid_arrays() -> tuple[np.ndarray, np.ndarray]:
    cost = np.ones((2, 2, 3, 2))
    return cost, np.zeros(cost.shape, dtype=np.int64)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (lambda c, m: (np.ones((2, 3, 3, 2)), m), r"cost must have shape"),
        (lambda c, m: (np.ones((2, 2, 4, 2)), m), r"cost\.shape\[2:\]"),
        (
            lambda c, m: (np.ones((2, 2, 3, 2)), np.zeros((2, 2, 3, 1), dtype=np.int64)),
            r"max_succ must have the shape",
        ),
        (
            lambda c, m: (np.where(np.arange(24).reshape(c.shape) == 9, np.nan, c), m),
            r"cost\[0, 1, 1, 1\] is NaN",
        ),
        (
            lambda c, m: (np.where(np.arange(24).reshape(c.shape) == 2, -1.0, c), m),
            r"cost\[0, 0, 1, 0\] = -1\.0 is negative",
        ),
        (
            lambda c, m: (c, np.where(np.arange(24).reshape(c.shape) == 3, -2, m)),
            r"max_succ\[0, 0, 1, 1\] = -2 is negative",
        ),
        (lambda c, m: (c, m + 0.5), r"max_succ\[0, 0, 0, 0\] = 0\.5 is not an integer"),
        (lambda c, m: (np.full(c.shape, "x"), m), r"cost must be a numeric array"),
    ],
)
def test_validation_names_field_index_and_value(change, pattern: str) -> None:  # type: ignore[no-untyped-def]
    cost, max_succ = change(*_valid_arrays())
    with pytest.raises(SolverInputError, match=pattern):
        StageProblem(2, 2, cost, max_succ, 4)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_micro_batches": 0}, r"num_micro_batches must be a positive int, got 0"),
        ({"num_micro_batches": 2.5}, r"num_micro_batches"),
        ({"num_hosts": 0}, r"num_hosts must be a positive int, got 0"),
        ({"devices_per_host": True}, r"devices_per_host"),
        ({"config_names": ("a",)}, r"config_names has 1 names"),
    ],
)
def test_validation_of_scalars(kwargs: dict, pattern: str) -> None:
    cost, max_succ = _valid_arrays()
    args = {
        "num_hosts": 2,
        "devices_per_host": 2,
        "cost": cost,
        "max_succ": max_succ,
        "num_micro_batches": 4,
    }
    args.update(kwargs)
    with pytest.raises(SolverInputError, match=pattern):
        StageProblem(**args)


def test_random_problem_is_realistic() -> None:
    problem = random_stage_problem(16, 4, 8, seed=0)
    cost, max_succ = problem.cost, problem.max_succ
    iu, ju = np.triu_indices(16)
    # small meshes cannot hold long ranges; the full cluster can hold every range in some config
    assert np.isinf(cost[0, 15, 0]).all()
    assert np.isfinite(cost[iu, ju, -1].min(axis=-1)).all()
    # memory: fewer later stages tolerated by longer ranges, more by bigger meshes
    assert np.isfinite(cost[0, 1, 3, -1]) and np.isfinite(cost[0, 3, 3, -1])
    assert max_succ[0, 3, 3, -1] < max_succ[0, 1, 3, -1] < max_succ[0, 1, 4, -1]
    # tensor parallelism scales well inside a host (4 -> 8 devices), badly across (8 -> 16)
    tp_only = cost[5, 5, :, -1]
    assert tp_only[2] / tp_only[3] > 1.5 > tp_only[3] / tp_only[4]


def test_a_problem_plus_extra_seconds_is_the_problem_built_with_them():
    """``StageProblem.plus``: the same problem as one built with the charged cost, sharing
    ``max_succ`` (no copy), so the DP's optimum is brute force's over the charged cells."""
    rng = np.random.default_rng(3)
    problem = random_stage_problem(4, 2, 2, num_configs=2, seed=5)
    extra = rng.uniform(0.0, 0.5, problem.cost.shape[:3])
    charged = problem.plus(extra)
    built = StageProblem(
        2, 2, problem.cost + extra[..., None], problem.max_succ, problem.num_micro_batches,
        problem.config_names,
    )  # fmt: skip
    assert charged == built
    assert charged.max_succ is problem.max_succ and not charged.cost.flags.writeable
    assert solve_stages(charged).objective == pytest.approx(
        brute_force_stages(built).objective, rel=1e-12
    )
    with pytest.raises(SolverInputError, match=r"extra must have shape \(L, L, S\)"):
        problem.plus(extra[:, :, :1])
    with pytest.raises(SolverInputError, match="finite seconds >= 0"):
        problem.plus(-extra)
