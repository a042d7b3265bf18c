"""The default whole-stage refinement and the stage tracing it relies on: a slice traced
through one jitted call per layer is the graph traced equation by equation, dead code is not
priced, and the refined plan is the faster of each stage's composition and whole ILP."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import alpa_mini
from alpa_mini import AutoStageOption, ManualLayerOption, PipeshardParallel
from alpa_mini.cluster.spec import ClusterSpec
from alpa_mini.models import adam, make_train_step
from alpa_mini.models.gpt import GPTConfig, gpt_abstract_batch, gpt_abstract_params, gpt_loss
from alpa_mini.pipeline.executable import StepFun, prepare_step
from alpa_mini.pipeline.stage_cost import _StageModel

CONFIG = GPTConfig(
    vocab_size=512, seq_len=64, hidden=128, num_heads=4, num_layers=4, pipeline_marks=True
)
CLUSTER = dataclasses.replace(ClusterSpec.named("dgx-a100").with_hosts(1), devices_per_host=4)
OPT = adam(1e-3)


def _gpt_args(config: GPTConfig = CONFIG) -> tuple[Any, tuple[Any, ...]]:
    step = make_train_step(lambda p, b: gpt_loss(p, b, config), OPT, alpa_mini.value_and_grad)
    params = gpt_abstract_params(config)
    return step, (params, jax.eval_shape(OPT.init, params), gpt_abstract_batch(config, 16))


def _prepared(step: Any, args: tuple[Any, ...], method: PipeshardParallel) -> Any:
    leaves, tree = jax.tree.flatten(args)
    roles = [r for a, r in zip(args, ("param", "state", "batch"), strict=True) for _ in
             jax.tree.leaves(a)]  # fmt: skip
    return prepare_step(StepFun(step, (), tree), leaves, roles, method, CLUSTER)


def _method(**stage: Any) -> PipeshardParallel:
    """One micro-batch: a pipeline buys nothing, so the plan is one stage of every layer."""
    return PipeshardParallel(
        num_micro_batches=1, layer_option=ManualLayerOption(), stage_option=AutoStageOption(**stage)
    )


def _summary(graph: Any) -> tuple:
    """What the ILP prices of a graph: its operators, flops and bytes."""
    ops = collections.Counter(n.primitive for n in graph.nodes)
    flops = sum(n.flops * n.multiplier for n in graph.nodes)
    moved = sum(n.bytes_accessed * n.multiplier for n in graph.nodes)
    return ops, flops, moved, len(graph.tensors)


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_a_stage_traced_through_layer_calls_is_the_plain_graph() -> None:
    step, args = _gpt_args()
    prepared = _prepared(step, args, _method())
    plan, sizes = prepared.plan, (0.0, 0.0)
    ends = (*plan.layer_starts[1:], plan.num_equations)
    whole = (plan.layer_starts[0], plan.num_equations)
    graphs = []
    for layered in (True, False):
        model = _StageModel(prepared.forward, prepared.capture, CLUSTER, _method(), *sizes)
        if layered:
            model.composed_layers = frozenset(zip(plan.layer_starts, ends, strict=True))
        io = model._io(*whole)
        assert (model._layer_calls(io[0]) is not None) == layered
        graphs.append(model._graph(io))
    (by_calls, res_calls, _), (plain, res_plain, _) = graphs
    assert len(plan.layer_starts) == CONFIG.num_layers + 1  # the embedding, then each block
    assert _summary(by_calls) == _summary(plain)
    assert res_calls == res_plain > 0


def test_dead_code_in_the_step_is_not_priced() -> None:
    """The loss computes a cosine it never reads: XLA drops it, so no stage prices it."""

    def loss(params: Any, batch: Any) -> Any:
        h = jnp.tanh(batch["x"] @ params[0])
        jnp.cos(h) * 3.0  # dead
        alpa_mini.mark_pipeline_boundary()
        return jnp.mean((h @ params[1] - batch["y"]) ** 2)

    step = make_train_step(loss, OPT, alpa_mini.value_and_grad)
    params = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 2
    batch = {k: jax.ShapeDtypeStruct((16, 64), jnp.float32) for k in ("x", "y")}
    args = (params, jax.eval_shape(OPT.init, params), batch)
    prepared = _prepared(step, args, _method())
    assert any(e.primitive.name == "cos" for e in prepared.forward.jaxpr.eqns)
    model = _StageModel(prepared.forward, prepared.capture, CLUSTER, _method(), 0.0, 0.0)
    graph, _, _ = model._graph(model._io(0, prepared.plan.layer_starts[1]))
    ops = {n.primitive for n in graph.nodes}
    assert "tanh" in ops and "cos" not in ops and "sin" not in ops


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_the_default_refinement_keeps_each_stage_at_its_faster_plan(monkeypatch) -> None:
    """Each chosen stage ends at the faster of its composition and its whole-stage ILP (the
    same layers, submesh and config), and the refined plan is never slower than the DP's."""
    from alpa_mini.pipeline import executable

    step, args = _gpt_args()
    plan = _prepared(step, args, _method()).plan
    monkeypatch.setattr(executable, "refine_stages", lambda plan, *a, **k: plan)
    unrefined = _prepared(step, args, _method()).plan
    assert len(plan.stages) == 1 and plan.planning.refine_seconds > 0
    assert plan.stage_solution.stages == unrefined.stage_solution.stages
    assert plan.predicted_time <= plan.stage_solution.objective * (1 + 1e-12)
    refined = 0
    for st, composed in zip(plan.stages, unrefined.stages, strict=True):
        assert (st.layer_start, st.layer_end, st.submesh) == (
            composed.layer_start, composed.layer_end, composed.submesh,
        )  # fmt: skip
        assert st.latency <= composed.latency
        refined += st.latency < composed.latency
    assert refined == plan.planning.stages_refined
    assert alpa_mini.PipeshardPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("option", "layers"),
    [
        pytest.param(AutoStageOption(refine=True), 4, marks=pytest.mark.slow),  # 4 s
        # one whole-stage ILP per layer range: two blocks (64 s with four)
        pytest.param(AutoStageOption(profiling="whole"), 2, marks=pytest.mark.slow),
    ],
)
def test_no_default_refinement_where_stages_are_not_composed(option, layers: int) -> None:
    step, args = _gpt_args(dataclasses.replace(CONFIG, num_layers=layers))
    method = PipeshardParallel(
        num_micro_batches=2, layer_option=ManualLayerOption(), stage_option=option
    )
    assert _prepared(step, args, method).plan.planning.refine_seconds == 0
