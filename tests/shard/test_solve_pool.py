"""Solver child processes (``shard.solve_pool``): the same answers as in-process, errors
carried over, a failed child replaced by in-process solving, sessions that stop their
children, and a plan that does not change when its ILPs are solved in children."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from alpa_mini.pipeline import stage_cost
from alpa_mini.shard import solve_pool
from alpa_mini.shard.solve_pool import SolvePool, active_pool, session_pool, solve_session
from alpa_mini.solvers.errors import InfeasibleError
from alpa_mini.solvers.sharding.problem import ShardingProblem
from alpa_mini.solvers.sharding.solve import solve_sharding
from helpers.mlp import plan_marked_mlp
from helpers.problems import problems


@pytest.fixture(scope="module")
def pool():
    pool = SolvePool(2)
    yield pool
    pool.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_a_child_solves_as_in_process(pool, problem: ShardingProblem) -> None:
    try:
        want = solve_sharding(problem, lp_first=True)
    except InfeasibleError as err:
        with pytest.raises(InfeasibleError) as got:
            pool.solve(problem, lp_first=True)
        assert str(got.value) == str(err) and got.value.details == err.details
        return
    got = pool.solve(problem, lp_first=True)
    assert got.choice == want.choice
    assert got.objective == want.objective and got.status == want.status


def _chain(n: int, k: int, limit: float | None) -> ShardingProblem:
    rng = np.random.default_rng(n * 31 + k)
    return ShardingProblem.from_lists(
        costs=[list(rng.uniform(1, 10, k)) for _ in range(n)],
        usages=[[1.0] * k for _ in range(n)],
        intervals=[(i, i + 2) for i in range(n)],
        edges=[(i, i + 1) for i in range(n - 1)],
        edge_costs=[list(rng.uniform(0, 5, k * k)) for _ in range(n - 1)],
        usage_limit=limit,
    )


def test_an_infeasible_limit_raises_with_its_details_from_the_child(pool) -> None:
    problem = _chain(6, 3, limit=0.5)  # two results are live at once: at least 2.0
    with pytest.raises(InfeasibleError) as err:
        pool.solve(problem)
    assert err.value.details["min_peak"] == pytest.approx(2.0)


def test_a_child_that_dies_is_dropped_and_its_ilp_solved_in_process() -> None:
    pool = SolvePool(2)
    try:
        problem = _chain(8, 4, limit=None)
        want = solve_sharding(problem)
        assert pool.solve(problem).choice == want.choice  # starts the children
        for child in list(pool._children):
            child.proc.kill()
            child.proc.wait(timeout=10)
        assert pool.solve(problem).choice == want.choice
        assert pool.solve(problem).choice == want.choice
        assert pool.size == 0
    finally:
        pool.close()


def test_sessions_nest_start_children_on_demand_and_stop_them_at_the_end() -> None:
    assert active_pool() is None and session_pool() is None  # no session: no children
    with solve_session(2):
        assert active_pool() is None  # nothing started until asked
        with solve_session(2):
            pool = session_pool()
            assert pool is not None and pool.size == 2
        assert session_pool() is pool  # the inner session's end keeps the outer's pool
        procs = [c.proc for c in pool._children]
    assert active_pool() is None
    assert all(p.poll() is not None for p in procs)
    with solve_session(1):
        assert session_pool() is None  # one CPU: threads only


def test_children_run_below_the_planner_and_a_pool_closed_as_they_start_exits_quietly(
    capfd,
) -> None:
    """Children are niced below the planner (its Python feeds them); a pool closed before
    its children said they were ready (planning that ended early) leaves them to exit with
    status 0 and nothing on stderr."""
    import os

    pool = SolvePool(2)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(mine + solve_pool.CHILD_NICENESS, 19)
    assert [os.getpriority(os.PRIO_PROCESS, c.proc.pid) for c in pool._children] == [want] * 2
    procs = [c.proc for c in pool._children]
    pool.close()
    assert [p.wait(timeout=30) for p in procs] == [0, 0]
    assert capfd.readouterr().err == ""


def _plan_json(monkeypatch, min_nodes: int) -> dict:
    monkeypatch.setattr(stage_cost, "POOL_MIN_NODES", min_nodes)
    return _without_timings(json.loads(plan_marked_mlp(4).to_json()))


def _without_timings(d):
    """A plan's JSON less its seconds, which differ from run to run."""
    if isinstance(d, dict):
        return {k: _without_timings(v) for k, v in d.items() if not _timing(k)}
    if isinstance(d, list):
        return [_without_timings(x) for x in d]
    return d


def _timing(key: str) -> bool:
    return key in ("planning", "solve_time", "solve_time_s", "build_time", "timings")


def test_a_plan_is_the_same_with_its_ilps_solved_in_children(monkeypatch, devices8) -> None:
    calls = []
    real = SolvePool.solve

    def counted(self, problem, **kwargs):
        calls.append(problem.num_nodes)
        return real(self, problem, **kwargs)

    monkeypatch.setattr(SolvePool, "solve", counted)
    monkeypatch.setattr(solve_pool, "usable_cpus", lambda: 2)
    in_children = _plan_json(monkeypatch, 0)
    assert calls  # the layer ILPs went to the children
    n = len(calls)
    in_threads = _plan_json(monkeypatch, 10**9)
    assert len(calls) == n  # ...and here none did
    assert in_children == in_threads


@pytest.mark.parametrize("warm_bytes", [0, None])
def test_a_step_with_large_parameters_starts_its_children_before_it_is_traced(
    monkeypatch, devices8, warm_bytes
) -> None:
    """From ``WARM_POOL_BYTES`` of parameters the solver children start before the step is
    traced (their imports overlap the trace); below it, not until enough ILPs need them."""
    from alpa_mini.pipeline import executable

    monkeypatch.setattr(solve_pool, "usable_cpus", lambda: 2)
    if warm_bytes is not None:
        monkeypatch.setattr(executable, "WARM_POOL_BYTES", warm_bytes)
    seen = []
    real = executable.trace_with_grads

    def traced(*args, **kwargs):
        seen.append(active_pool() is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(executable, "trace_with_grads", traced)
    plan_marked_mlp(4)
    assert seen == [warm_bytes is not None]
