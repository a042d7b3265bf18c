"""``alpa_mini.plan``: the plan alone, from concrete or abstract arguments, for any cluster,
equal to the plan the executable runs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import (
    ClusterSpec,
    ConfigError,
    PipeshardParallel,
    PipeshardPlan,
    ShardingPlan,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import adam, make_train_step
from helpers.mlp import marked_mlp_args, marked_mlp_loss

_loss = marked_mlp_loss


def _args(layers: int = 2, width: int = 64, batch: int = 32):
    params, data = marked_mlp_args(layers, width, batch, scale=0.1, zero_y=True)
    opt = adam(1e-3)
    return opt, (params, opt.init(params), data)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _without_timings(plan: ShardingPlan) -> ShardingPlan:
    solver = {k: v for k, v in plan.solver.items() if "time" not in k}
    return dataclasses.replace(plan, solver=solver)


def test_shard_plan_from_abstract_args_equals_the_executables_plan(devices8) -> None:
    opt, args = _args()
    step = make_train_step(_loss, opt)
    method = ShardParallel()
    planned = alpa_mini.plan(step, *_abstract(args), method=method)
    assert isinstance(planned, ShardingPlan)
    assert planned.planning is not None and planned.planning.graph_seconds > 0
    ex = alpa_mini.parallelize(step, method=method).get_executable(*args)
    assert _without_timings(planned) == _without_timings(ex.plan)
    assert ex.plan.planning.total_seconds >= ex.plan.planning.ilp_seconds > 0


def test_pipeshard_plan_for_a_cluster_larger_than_the_devices_needs_no_devices() -> None:
    opt, args = _args(layers=4)
    cluster = ClusterSpec.named("cpu-2x4").with_hosts(4)  # 16 devices; the tests have 8
    method = PipeshardParallel(
        num_micro_batches=2, stage_option=UniformStageOption(2, (2, 4), (8,))
    )
    step = make_train_step(_loss, opt, alpa_mini.value_and_grad)
    planned = alpa_mini.plan(step, *_abstract(args), method=method, cluster=cluster)
    assert isinstance(planned, PipeshardPlan)
    assert sorted(d for s in planned.stages for d in s.devices) == list(range(16))
    assert planned.planning.ilps_solved >= 1 and planned.planning.trace_seconds > 0
    again = PipeshardPlan.from_json(planned.to_json())
    assert again == planned and again.planning == planned.planning


def test_a_bundled_cluster_name_plans_like_its_spec() -> None:
    opt, args = _args()
    step = make_train_step(_loss, opt)
    by_name = alpa_mini.plan(step, *_abstract(args), method=ShardParallel(), cluster="cpu-1x8")
    by_spec = alpa_mini.plan(
        step, *_abstract(args), method=ShardParallel(), cluster=ClusterSpec.named("cpu-1x8")
    )
    assert _without_timings(by_name) == _without_timings(by_spec)


@pytest.mark.parametrize(
    ("cluster", "match"),
    [(3, "cluster: 3 is not a ClusterSpec"), ("no-such-cluster", "no-such-cluster")],
)
def test_bad_clusters_are_named(cluster, match) -> None:
    opt, args = _args()
    with pytest.raises(ConfigError, match=match):
        alpa_mini.plan(make_train_step(_loss, opt), *args, method=ShardParallel(), cluster=cluster)


def test_no_cluster_and_no_init_is_a_clear_error() -> None:
    alpa_mini.shutdown()
    opt, args = _args()
    with pytest.raises(ConfigError, match=r"cluster: None plans for the cluster of alpa_mini.init"):
        alpa_mini.plan(make_train_step(_loss, opt), *args, method=ShardParallel())


def test_mesh_search_records_every_mesh_tried_and_reports_each_as_it_goes(devices8) -> None:
    """One ``MeshTrial`` per candidate mesh, in search order, the chosen one the fastest;
    ``progress`` hears of each; the trials survive JSON, and plans saved with the older
    ``[shape, time]`` pairs still load."""
    from alpa_mini.options.shard import candidate_mesh_shapes
    from alpa_mini.shard.plan import MeshTrial

    opt, args = _args()
    lines: list[str] = []
    planned = alpa_mini.plan(
        make_train_step(_loss, opt), *_abstract(args), method=ShardParallel(), progress=lines.append
    )
    shapes = candidate_mesh_shapes(8, alpa_mini.current_cluster().devices_per_host)
    assert [t.shape for t in planned.mesh_search] == shapes
    assert len(lines) == len(shapes) and all(line.startswith("mesh (") for line in lines)
    fastest = min(planned.mesh_search, key=lambda t: t.predicted_time)
    assert fastest.shape == planned.mesh_shape
    assert fastest.predicted_time == pytest.approx(planned.predicted_time)
    assert all(t.seconds > 0 and t.outcome == "optimal" for t in planned.mesh_search)
    assert planned.planning.ilps_solved == len(shapes)
    again = ShardingPlan.from_json(planned.to_json())
    assert again.mesh_search == planned.mesh_search
    legacy = MeshTrial.from_json([[2, 4], 0.5])
    assert legacy == MeshTrial((2, 4), 0.5)
