"""A flax ``TrainState`` step as flax users write it: its weak-typed step counter survives both
local runtimes, so the step compiles on its first call only."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_mini
from alpa_mini import (
    ClusterSpec,
    ManualLayerOption,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _state_and_batch() -> tuple[Any, dict[str, np.ndarray]]:
    import flax.linen as nn
    import optax
    from flax.training.train_state import TrainState

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = jnp.tanh(nn.Dense(16)(x))
            alpa_mini.mark_pipeline_boundary()
            return nn.Dense(4)(x)

    x = jax.random.normal(jax.random.key(1), (16, 8))
    model = MLP()
    variables = model.init(jax.random.key(0), x)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))
    return state, {"x": np.asarray(x), "y": np.asarray(jnp.tanh(x[:, :4]))}


def _step(state: Any, batch: Any) -> tuple[Any, jax.Array]:
    def loss_fn(params: Any) -> jax.Array:
        return jnp.mean(jnp.square(state.apply_fn(params, batch["x"]) - batch["y"]))

    loss, grads = alpa_mini.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("kind", ["shard", "pipeshard"])
def test_a_train_state_step_compiles_once_across_three_calls(kind: str) -> None:
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    method = (
        ShardParallel(mesh_shape=(2, 4), num_micro_batches=2)
        if kind == "shard"
        else PipeshardParallel(
            num_micro_batches=2,
            layer_option=ManualLayerOption(),
            stage_option=UniformStageOption(2),
        )
    )
    step = alpa_mini.parallelize(_step, method=method)
    state, batch = _state_and_batch()
    assert state.step.weak_type if hasattr(state.step, "weak_type") else isinstance(state.step, int)
    compiled: list[str] = []

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        after = []
        for _ in range(3):
            state, loss = step(state, batch)
            jax.block_until_ready(loss)
            after.append(len(compiled))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert after[0] > 0 and after[1] == after[0] and after[2] == after[0], after
    assert int(state.step) == 3 and state.step.weak_type
    alpa_mini.shutdown()


def test_an_unmarked_flax_loop_over_blocks_pipelines_and_matches_serial() -> None:
    """A flax model that applies one block in a Python loop, no markers: each block is a
    layer (the input and output projections one each), and two stages at B = 2 equal the
    serial step (SGD, 1e-6)."""
    import flax.linen as nn
    import optax
    from flax.training.train_state import TrainState

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Dense(16)(x)
            for _ in range(4):
                x = Block()(x)
            return nn.Dense(4)(x)

    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    batch = {"x": np.asarray(x), "y": np.asarray(jnp.tanh(x[:, :4]))}
    model = Net()
    state = TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=optax.sgd(0.1)
    )
    method = PipeshardParallel(num_micro_batches=2, stage_option=UniformStageOption(2, (1, 4)))
    step = alpa_mini.parallelize(_step, method=method)
    par, ser = state, state
    for _ in range(2):
        par, loss = step(par, batch)
        ser, ser_loss = jax.jit(_step)(ser, batch)
        np.testing.assert_allclose(float(loss), float(ser_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(par.params), jax.tree.leaves(ser.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert step.get_executable(state, batch).plan.num_layers == 6
    alpa_mini.shutdown()
