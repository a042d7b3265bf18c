"""Every primitive flax's standard layers emit has a sharding rule, and a model built from
them trains under ShardParallel as under ``jax.jit``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_mini
from alpa_mini.shard.strategies import loop_nest

#: What nn.Embed, nn.MultiHeadDotProductAttention, nn.Conv, nn.BatchNorm, nn.avg_pool,
#: nn.max_pool, nn.Dropout and nn.Dense emit in a train step with optax's cross entropy and
#: Adam (jax 0.10, flax 0.12), less the dead code XLA drops (abs's derivative's ``sign``);
#: each has a rule.
FLAX_PRIMITIVES = {
    "abs", "add", "add_any", "bitcast_convert_type", "broadcast_in_dim", "concatenate",
    "conv_general_dilated", "convert_element_type", "div", "dot_general", "eq", "exp",
    "gather", "ge", "gt", "integer_pow", "is_finite", "log", "lt", "max", "mul", "neg", "or",
    "pad", "pow", "random_bits", "random_fold_in", "random_unwrap", "random_wrap",
    "reduce_max", "reduce_sum", "reduce_window_max", "reduce_window_sum", "reshape", "rsqrt",
    "scatter-add", "select_and_scatter_add", "select_n", "shift_right_logical",
    "split", "sqrt", "square", "stop_gradient", "sub", "transpose",
}  # fmt: skip


def _case() -> tuple[Any, Any, tuple[Any, ...]]:
    import flax.linen as nn
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array, images: jax.Array) -> jax.Array:
            t = nn.Embed(64, 16)(tokens)
            t = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(t)
            x = nn.Conv(8, (3, 3))(images)
            x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
            x = nn.max_pool(nn.avg_pool(x, (2, 2), strides=(2, 2)), (2, 2), strides=(2, 2))
            x = nn.Dropout(0.25, deterministic=False)(x).reshape((x.shape[0], -1))
            return nn.Dense(4)(jnp.concatenate([jnp.mean(t, axis=1), x], axis=-1))

    rng = np.random.default_rng(0)
    batch = {
        "t": rng.integers(0, 64, (16, 8)).astype(np.int32),
        "i": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
        "y": rng.integers(0, 4, (16,)).astype(np.int32),
    }
    model = Net()
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = model.init(keys, batch["t"], batch["i"])
    tx = optax.adam(1e-3)

    def step(params, batch_stats, opt_state, rng, batch):
        def loss_fn(p):
            logits, updates = model.apply(
                {"params": p, "batch_stats": batch_stats}, batch["t"], batch["i"],
                mutable=["batch_stats"], rngs={"dropout": rng},
            )  # fmt: skip
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        upd, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), updates["batch_stats"], opt_state, loss

    args = (
        variables["params"],
        variables["batch_stats"],
        tx.init(variables["params"]),
        jax.random.PRNGKey(2),
        batch,
    )
    return step, tx, args


@pytest.fixture
def cpu8():
    alpa_mini.shutdown()
    alpa_mini.init(cluster="local", num_cpu_devices=8)
    yield
    alpa_mini.shutdown()


@pytest.mark.slow  # 7-14 s: the fast suite keeps its 3-minute limit
def test_flax_standard_layers_have_a_rule_for_every_primitive_and_train(cpu8) -> None:
    step, _, args = _case()
    pstep = alpa_mini.parallelize(step, method=alpa_mini.ShardParallel(mesh_shape=(2, 4)))
    graph = pstep._trace(pstep._prepare(args)).graph
    ops = [n for n in graph.nodes if n.kind == "op"]
    assert {n.primitive for n in ops} == FLAX_PRIMITIVES
    assert [n.primitive for n in ops if loop_nest(n, graph) is None] == []
    got, want = pstep(*args), jax.jit(step)(*args)
    # Adam: compared by loss and within a few lr (fp32 reduction order moves near-zero
    # gradients by lr-sized steps); batch statistics and the first moments tightly.
    np.testing.assert_allclose(float(got[3]), float(want[3]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=3e-3)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
