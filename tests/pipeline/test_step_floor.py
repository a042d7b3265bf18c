"""The step floor (``latency_floors.step_floor``, ``executable.traced_floor``): no plan of any
stages, micro-batch count or stage option is faster; on one device it is the step's exact
cost less the loads a composition credits back; it splits evenly over devices; and one
micro-batch gives the least work."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from test_refine import CLUSTER, _gpt_args, _prepared

from alpa_mini import (
    AutoStageOption,
    ManualLayerOption,
    PipeshardParallel,
    UniformStageOption,
)
from alpa_mini.pipeline.executable import StepFun, traced_floor
from alpa_mini.pipeline.latency_floors import step_floor
from alpa_mini.pipeline.stage_cost import _StageModel

ONE = PipeshardParallel(num_micro_batches=1, layer_option=ManualLayerOption())


def _floor(step, args, cluster) -> float:
    leaves, tree = jax.tree.flatten(args)
    roles = [r for a, r in zip(args, ("param", "state", "batch"), strict=True) for _ in
             jax.tree.leaves(a)]  # fmt: skip
    return traced_floor(StepFun(step, (), tree), leaves, roles, ONE, cluster)


def _on(hosts: int, devices: int):
    return dataclasses.replace(CLUSTER.with_hosts(hosts), devices_per_host=devices)


@pytest.mark.slow  # plans the step four times
def test_no_plan_of_any_stages_or_count_is_faster_than_the_floor() -> None:
    step, args = _gpt_args()
    floor = _floor(step, args, CLUSTER)
    methods = [
        PipeshardParallel(num_micro_batches=b, layer_option=ManualLayerOption(), stage_option=o)
        for b, o in (
            (1, AutoStageOption()),
            (2, AutoStageOption()),
            (4, AutoStageOption()),
            (4, UniformStageOption(num_stages=2)),
        )
    ]
    times = []
    for method in methods:
        prepared = _prepared(step, args, method)
        times.append(prepared.plan.predicted_time)
        # B micro-batches of this count's size do at least the work of one of the whole batch
        sizes = (0.0, 0.0)
        per_micro_batch = step_floor(prepared.forward, prepared.capture, CLUSTER, method, sizes)
        assert method.num_micro_batches * per_micro_batch >= floor * (1 - 1e-12)
    assert all(t >= floor for t in times)
    assert min(times) <= 3 * floor  # (and not vacuous: within a small factor of the best)


@pytest.mark.slow  # traces the step four times
def test_the_floor_splits_evenly_over_devices_and_is_the_exact_cost_on_one() -> None:
    step, args = _gpt_args()
    one = _floor(step, args, _on(1, 1))
    for hosts, devices in ((1, 4), (2, 4)):
        assert _floor(step, args, _on(hosts, devices)) * hosts * devices == pytest.approx(
            one, rel=1e-9
        )
    # On one device every node has one strategy and no resharding: the floor is each layer's
    # exact cost less the loads of the values a composition hands between layers.
    prepared = _prepared(step, args, ONE)
    plan, cluster = prepared.plan, _on(1, 1)
    model = _StageModel(prepared.forward, prepared.capture, cluster, ONE, 0.0, 0.0)
    ends = (*plan.layer_starts[1:], plan.num_equations)
    model.composed_layers = frozenset(zip(plan.layer_starts, ends, strict=True))
    load = 1.0 / cluster.intra_host.bandwidth
    exact = 0.0
    for a, b in zip(plan.layer_starts, ends, strict=True):
        job = model._job(model._io(a, b), (1, 1), (1,), "auto")
        handed = sum(job.graph.tensors[job.graph.inputs[k]].nbytes for k in job.handed)
        exact += model.cost(a, b, (1, 1), (1,), "auto").latency - handed * load
    assert one == pytest.approx(exact, rel=1e-9)
