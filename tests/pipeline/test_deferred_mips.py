"""Layer MIPs left at their LP bound until the stage DP needs them (``defer_fractional``):
the plan is the one every MIP solved exactly gives, and only the chosen stages' layers are
ever solved exactly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from alpa_mini.options.pipeshard import AutoStageOption
from alpa_mini.pipeline import stage_cost, stage_search
from alpa_mini.pipeline.micro_batch_search import Dominated
from alpa_mini.pipeline.stage_search import BEAT
from alpa_mini.solvers import FractionalRelaxation
from helpers.floors import explore_every_pair
from helpers.mlp import plan_marked_mlp


def _plan(monkeypatch, bound_share: float | None, **method_options):
    """The marked MLP's plan on cpu-2x4; with ``bound_share``, every deferrable layer ILP
    reports that share of its true optimum, less the host load of the inputs it may leave
    out (``free_inputs``: activations handed on), as a fractional relaxation's bound (a
    valid, and deliberately loose, bound)."""
    real = stage_cost.plan_sharding
    asked: list[float] = []

    def fractional(graph, cost, *args, defer_fractional=False, free_inputs=(), **kwargs):
        plan = real(graph, cost, *args, **kwargs)
        if defer_fractional and bound_share is not None:
            asked.append(plan.predicted_time)
            load = sum(_bytes_per_device(plan, k) for k in free_inputs)
            rest = plan.predicted_time - load / cost.cluster.intra_host.bandwidth
            raise FractionalRelaxation("every layer MIP fractional", bound_share * rest)
        return plan

    monkeypatch.setattr(stage_cost, "plan_sharding", fractional)
    explore_every_pair(monkeypatch)  # every pair's bounds made, the unpicked ones kept
    return plan_marked_mlp(4, **method_options), asked


def _bytes_per_device(plan, k: int) -> float:
    t = plan.tensors[plan.inputs[k]]
    return math.prod(t.shape) * np.dtype(t.dtype).itemsize / t.spec.num_shards(plan.mesh_shape)


def _stages(plan) -> list:
    return json.loads(plan.to_json())["stages"]


@pytest.mark.parametrize("share", [0.0, 0.5, 0.999])
def test_bounds_give_the_exact_plan_solving_only_what_it_uses(monkeypatch, devices8, share):
    exact, asked = _plan(monkeypatch, None)
    assert not asked and exact.planning.ilps_bounded == 0
    deferred, asked = _plan(monkeypatch, share)
    assert asked  # every layer ILP was deferred once...
    assert _stages(deferred) == _stages(exact)
    assert deferred.predicted_time == exact.predicted_time
    # ...and only the chosen stages' layers (one ILP per distinct layer and config) were
    # then solved exactly: the other cells stayed at their bounds. (Shown for the DP alone:
    # the slicings it finds with transfers charged are settled too, and on bounds of 0 they
    # walk every cell.)
    monkeypatch.setattr(stage_search, "transfer_charges", lambda *args: [])
    alone, asked = _plan(monkeypatch, share)
    assert 0 < alone.planning.ilps_bounded < len(asked)


@pytest.mark.parametrize("share", [None, 0.5])
def test_a_count_that_cannot_beat_the_fastest_stops_at_a_bound_below_its_time(
    monkeypatch, devices8, share
):
    """The micro-batch search's ``BEAT``: a plan whose stage DP objective (over bound cells,
    with ``share``) exceeds it stops with ``Dominated`` at a bound between it and the plan's
    true predicted time; at exactly that time, or with ``refine``, the plan is made. (The
    DP alone: its slicings with transfers charged, weighed by simulation, are left out.)"""
    monkeypatch.setattr(stage_search, "transfer_charges", lambda *args: [])
    exact, _ = _plan(monkeypatch, None)
    t = exact.predicted_time
    token = BEAT.set(t * (1 - 1e-9))
    try:
        with pytest.raises(Dominated) as stopped:
            _plan(monkeypatch, share)
        assert t * (1 - 1e-9) < stopped.value.bound <= t
        refined, _ = _plan(monkeypatch, share, stage_option=AutoStageOption(refine=True))
        assert refined.predicted_time <= t
    finally:
        BEAT.reset(token)
    token = BEAT.set(t)
    try:
        again, _ = _plan(monkeypatch, share)
    finally:
        BEAT.reset(token)
    assert _stages(again) == _stages(exact)


def test_a_bound_without_some_inputs_never_exceeds_the_optimum_less_their_cost():
    """``plan_sharding(free_inputs=...)``'s bound (``shard.problem._bound_without``): the
    problem re-solved with those nodes' costs zeroed. On odd rings with random node costs,
    brute force checks it against min over assignments of (total - the freed nodes' cost)."""
    import itertools
    import random

    from alpa_mini.shard.problem import _bound_without
    from alpa_mini.solvers import ShardingProblem, solve_sharding

    rng = random.Random(0)
    for _ in range(20):
        n = 5
        costs = [[rng.uniform(0, 2), rng.uniform(0, 2)] for _ in range(n)]
        problem = ShardingProblem.from_lists(
            costs=costs,
            edges=[(k, (k + 1) % n) for k in range(n)],
            edge_costs=[[1.0, 0.0, 0.0, 1.0]] * n,
        )
        freed = rng.sample(range(n), rng.randrange(1, n))
        rest = min(
            sum(costs[v][c[v]] for v in range(n) if v not in freed)
            + sum(c[k] == c[(k + 1) % n] for k in range(n))
            for c in itertools.product((0, 1), repeat=n)
        )
        bound = _bound_without(problem, freed, "highs", None, solve_sharding)
        assert bound <= rest + 1e-9
