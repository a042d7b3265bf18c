"""A plan alone traces the step only as far as its grad call (``trace_with_grads(
loss_only=True)``): planning reads the loss, not the optimiser update after it. The plans
are those of the whole step, and what the whole trace checks before the call still is."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_mini
from alpa_mini import AutoLayerOption, ClusterSpec, PipeshardParallel, UniformStageOption
from alpa_mini.graph.grad_capture import trace_with_grads
from alpa_mini.models import make_train_step, sgd
from alpa_mini.pipeline.executable import StepFun, prepare_step
from helpers.mlp import marked_mlp_args, marked_mlp_loss


def _flat(args: tuple[Any, ...]) -> tuple[list[Any], list[str], Any]:
    """(avals, roles, tree) of (params, optimiser state, batch)."""
    leaves, tree = jax.tree.flatten(args)
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    roles = [r for a, r in zip(args, ("param", "state", "batch"), strict=True)
             for _ in jax.tree.leaves(a)]  # fmt: skip
    return avals, roles, tree


def _counted_step(updates: list[int]):
    """The marked MLP's SGD step, counting how often its update is traced."""
    opt = sgd(0.1)
    train = make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)

    def step(params: Any, state: Any, batch: Any) -> Any:
        new_params, new_state, loss = train(params, state, batch)
        updates.append(1)  # runs after the grad call, while the update is traced
        return new_params, new_state, loss

    params, batch = marked_mlp_args(4, 16, 32)
    return step, (params, opt.init(params), batch)


def test_the_trace_stops_at_the_grad_call_with_the_whole_trace_loss() -> None:
    updates: list[int] = []
    step, args = _counted_step(updates)
    avals, roles, tree = _flat(args)

    def fun(*leaves: Any) -> Any:
        return step(*jax.tree.unflatten(tree, leaves))

    whole = trace_with_grads(fun, avals, roles, 4, "pipeline")
    assert len(updates) == 1 and whole.closed is not None
    alone = trace_with_grads(fun, avals, roles, 4, "pipeline", loss_only=True)
    assert len(updates) == 1, "the update was traced"
    assert alone.closed is None and alone.out_shape is None
    (got,), (want,) = alone.captures, whole.captures
    assert str(got.loss) == str(want.loss)
    assert (got.sources, got.diff, got.batch) == (want.sources, want.diff, want.batch)


@pytest.mark.parametrize("B", [2, pytest.param(None, marks=pytest.mark.slow)])  # None: 4 s
def test_a_plan_from_the_loss_alone_is_the_plan_of_the_whole_step(B: int | None) -> None:
    updates: list[int] = []
    step, args = _counted_step(updates)
    avals, roles, tree = _flat(args)
    cluster = ClusterSpec.named("cpu-2x4")
    method = PipeshardParallel(num_micro_batches=B)
    whole = prepare_step(StepFun(step, (), tree), avals, roles, method, cluster)
    traced_whole = len(updates)
    alone = prepare_step(StepFun(step, (), tree), avals, roles, method, cluster, loss_only=True)
    assert len(updates) == traced_whole, "the update was traced"
    assert whole.step is not None and alone.step is None and alone.out_tree is None
    got, want = alone.plan, whole.plan
    assert got.num_micro_batches == want.num_micro_batches
    assert got.stages == want.stages  # layers, devices, meshes, layouts, latencies, memory
    assert got.predicted_time == want.predicted_time


def test_a_differentiated_value_from_the_batch_is_still_refused() -> None:
    def step(params: Any, other: Any, batch: Any) -> Any:
        grads = alpa_mini.grad(lambda x: jnp.sum(x @ params))(batch * 2.0)
        return params - 0.1 * grads

    args = (jnp.ones((8, 8)), jnp.ones((16, 8)), jnp.ones((16, 8)))
    avals, roles, tree = _flat(args)
    fun = StepFun(step, (), tree)
    with pytest.raises(ValueError, match="derives from the step's batch arguments"):
        trace_with_grads(fun, avals, roles, 2, "pipeline", loss_only=True)


def test_a_step_that_catches_exceptions_still_stops_at_its_grad_call() -> None:
    updates: list[int] = []
    step, args = _counted_step(updates)

    def guarded(*a: Any) -> Any:
        try:
            return step(*a)
        except Exception:  # a step's own error handling must not swallow the stop
            updates.append(-1)
            raise

    avals, roles, tree = _flat(args)
    fun = StepFun(guarded, (), tree)
    alone = trace_with_grads(fun, avals, roles, 2, "pipeline", loss_only=True)
    assert alone.closed is None and updates == []


@pytest.mark.slow  # 3 s: a scanned GPT planned
def test_a_scanned_stack_the_plan_splits_is_traced_whole() -> None:
    from alpa_mini.models.gpt import GPTConfig, gpt_loss, init_gpt, make_gpt_batch

    config = GPTConfig(
        vocab_size=64, seq_len=8, hidden=32, num_heads=4, num_layers=4, scan_layers=True
    )
    opt = sgd(0.1)
    step = make_train_step(lambda p, b: gpt_loss(p, b, config), opt, alpa_mini.value_and_grad)
    params = init_gpt(config, jax.random.key(0))
    args = (params, opt.init(params), make_gpt_batch(config, jax.random.key(1), 8))
    avals, roles, tree = _flat(args)
    method = PipeshardParallel(
        num_micro_batches=2,
        layer_option=AutoLayerOption(2),
        stage_option=UniformStageOption(2, (1, 4)),
    )
    cluster = ClusterSpec.named("cpu-2x4")
    alone = prepare_step(StepFun(step, (), tree), avals, roles, method, cluster, loss_only=True)
    assert alone.plan.scan_splits and alone.step is not None  # split in the step as well


def test_a_grad_call_inside_a_jit_is_still_refused() -> None:
    """Its differentiated values are the jit's, not the step's: the record pass says so."""

    def step(params: Any, other: Any, batch: Any) -> Any:
        @jax.jit
        def inner(p: Any) -> Any:
            return alpa_mini.grad(lambda q: jnp.sum(q * q))(p)

        return params - 0.1 * inner(params)

    args = (jnp.ones((8, 8)), jnp.ones((16, 8)), jnp.ones((16, 8)))
    avals, roles, tree = _flat(args)
    with pytest.raises(ValueError, match=r"not inside a jax\.jit"):
        trace_with_grads(StepFun(step, (), tree), avals, roles, 2, "pipeline", loss_only=True)
