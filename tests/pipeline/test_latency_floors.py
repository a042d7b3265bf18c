"""Latency floors (``pipeline.latency_floors``): each layer's floor is at most its exact
cost on every mesh and config of its submesh (on one device, exactly that cost less the
loads a composition credits back), the stage DP builds only the (submesh, config) pairs it
picks yet plans as if it had built them all, and a count whose floors already lose stops
before any layer ILP."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_refine import CLUSTER, _gpt_args, _prepared

from alpa_mini import AutoStageOption, ManualLayerOption, PipeshardParallel
from alpa_mini.pipeline import stage_cost
from alpa_mini.pipeline.micro_batch_search import Dominated
from alpa_mini.pipeline.stage_configs import stage_configs
from alpa_mini.pipeline.stage_cost import _StageModel
from alpa_mini.pipeline.stage_search import BEAT
from alpa_mini.solvers.stages import submesh_shapes
from helpers.floors import explore_every_pair

METHOD = PipeshardParallel(
    num_micro_batches=4, layer_option=ManualLayerOption(), stage_option=AutoStageOption()
)


def _stages(plan) -> list:
    return json.loads(plan.to_json())["stages"]


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_each_layer_floor_is_at_most_its_exact_cost_and_equal_on_one_device() -> None:
    step, args = _gpt_args()
    prepared = _prepared(step, args, METHOD)
    plan = prepared.plan
    model = _StageModel(prepared.forward, prepared.capture, CLUSTER, METHOD, 0.0, 0.0)
    ends = (*plan.layer_starts[1:], plan.num_equations)
    load = 1.0 / CLUSTER.intra_host.bandwidth
    checked = below = 0
    for sub in submesh_shapes(1, 4):
        for logical, layout in stage_configs(sub, METHOD.stage_option):
            for a, b in zip(plan.layer_starts, ends, strict=True):
                floor = model.latency_floor(a, b, sub, logical)
                exact = model.cost(a, b, sub, logical, layout)
                if exact is None:
                    continue
                assert 0 < floor <= exact.latency * (1 + 1e-12)
                checked, below = checked + 1, below + (floor < exact.latency * (1 - 1e-9))
                if sub == (1, 1):  # one strategy per node, no resharding
                    job = model._job(model._io(a, b), sub, logical, layout)
                    inputs = job.graph.inputs
                    handed = sum(job.graph.tensors[inputs[k]].nbytes for k in job.handed)
                    assert floor == pytest.approx(exact.latency - handed * load, rel=1e-9)
    assert checked >= 15 and below > 0


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_the_dp_builds_only_the_pairs_it_picks_and_plans_as_with_all_built(monkeypatch) -> None:
    step, args = _gpt_args()
    counted: list[int] = []
    real = stage_cost.plan_sharding

    def counting(*a, **k):
        counted.append(1)
        return real(*a, **k)

    monkeypatch.setattr(stage_cost, "plan_sharding", counting)
    # One micro-batch: a pipeline buys nothing, so the plan is one stage on all 4 devices,
    # and the smaller submeshes' floors lose at once.
    method = dataclasses.replace(METHOD, num_micro_batches=1)
    lazy = _prepared(step, args, method).plan
    lazy_ilps, counted[:] = len(counted), []
    explore_every_pair(monkeypatch)
    eager = _prepared(step, args, method).plan
    assert [s.submesh for s in lazy.stages] == [(1, 4)]
    assert _stages(lazy) == _stages(eager)
    assert lazy.predicted_time == eager.predicted_time
    assert lazy.planning.cost_entries < eager.planning.cost_entries
    assert lazy_ilps < len(counted)


def test_a_count_whose_floors_lose_stops_before_any_layer_ilp(monkeypatch) -> None:
    step, args = _gpt_args()
    plan = _prepared(step, args, METHOD).plan
    counted: list[int] = []
    monkeypatch.setattr(stage_cost, "plan_sharding", lambda *a, **k: counted.append(1))
    beat = plan.stage_solution.objective * 0.5
    token = BEAT.set(beat)
    try:
        with pytest.raises(Dominated) as out:
            _prepared(step, args, METHOD)
    finally:
        BEAT.reset(token)
    assert not counted
    assert beat < out.value.bound <= plan.stage_solution.objective
    assert np.isfinite(out.value.bound)
