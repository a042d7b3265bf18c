"""Layer MIPs left at their LP bound until the stage DP needs them (``defer_fractional``):
the plan is the one every MIP solved exactly gives, and only the chosen stages' layers are
ever solved exactly."""

from __future__ import annotations

import json

import pytest

from alpa_mini.options.pipeshard import AutoStageOption
from alpa_mini.pipeline import stage_cost
from alpa_mini.pipeline.micro_batch_search import Dominated
from alpa_mini.pipeline.stage_search import BEAT
from alpa_mini.solvers import FractionalRelaxation
from helpers.mlp import plan_marked_mlp


def _plan(monkeypatch, bound_share: float | None, **method_options):
    """The marked MLP's plan on cpu-2x4; with ``bound_share``, every deferrable layer ILP
    reports that share of its true optimum as a fractional relaxation's bound (a valid, and
    deliberately loose, bound)."""
    real = stage_cost.plan_sharding
    asked: list[float] = []

    def fractional(*args, defer_fractional=False, **kwargs):
        plan = real(*args, **kwargs)
        if defer_fractional and bound_share is not None:
            asked.append(plan.predicted_time)
            raise FractionalRelaxation(
                "every layer MIP fractional", bound_share * plan.predicted_time
            )
        return plan

    monkeypatch.setattr(stage_cost, "plan_sharding", fractional)
    return plan_marked_mlp(4, **method_options), asked


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
    # then solved exactly: the other cells stayed at their bounds.
    assert 0 < deferred.planning.ilps_bounded < len(asked)


@pytest.mark.parametrize("share", [None, 0.5])
def test_a_count_that_cannot_beat_the_fastest_stops_at_a_bound_below_its_time(
    monkeypatch, devices8, share
):
    """The micro-batch search's ``BEAT``: a plan whose stage DP objective (over bound cells,
    with ``share``) exceeds it stops with ``Dominated`` at a bound between it and the plan's
    true predicted time; at exactly that time, or with ``refine``, the plan is made."""
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
