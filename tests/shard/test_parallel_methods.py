"""Presets (ZeRO-2/3) against the compiled HLO, and bad input caught before XLA sees it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_mini
from alpa_mini import ClusterSpec, ConfigError, ShardParallel, Zero2Parallel, Zero3Parallel
from alpa_mini.inspect.hlo_collectives import parse_collectives
from alpa_mini.models import adam

CPU = ClusterSpec.named("cpu-1x8")
HIDDEN, BATCH = 64, 32


def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


# eps well above fp32 noise: Adam's update g / (|g| + eps) turns reduction-order noise in a
# near-zero gradient into a full-size step when eps is tiny; at 1e-3 it stays ~1e-6.
OPT = adam(1e-2, eps=1e-3)


def adam_step(p, state, batch):
    loss, g = jax.value_and_grad(loss_fn)(p, batch)
    p, state = OPT.update(g, state, p)
    return p, state, loss


def inputs():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    p = {
        "w1": jax.random.normal(k[0], (HIDDEN, HIDDEN)) / 8,
        "w2": jax.random.normal(k[1], (HIDDEN, HIDDEN)) / 8,
    }
    batch = {
        "x": jax.random.normal(k[2], (BATCH, HIDDEN)),
        "y": jax.random.normal(k[3], (BATCH, HIDDEN)),
    }
    return p, OPT.init(p), batch


def run_and_compare(step, args, steps: int = 3):
    p, s, batch = args
    ps, ss = p, s
    serial = jax.jit(adam_step)
    for _ in range(steps):
        p, s, loss = step(p, s, batch)
        ps, ss, loss_s = serial(ps, ss, batch)
        np.testing.assert_allclose(loss, loss_s, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ps), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return p, s


def weight_collectives(ex, kind: str) -> list:
    weight = HIDDEN * HIDDEN * 4
    return [
        c
        for c in parse_collectives(ex.get_hlo_text())
        if c.kind == kind and weight in c.result_bytes
    ]


def test_zero2_shards_optimizer_state_and_all_gathers_updated_parameters(devices4) -> None:
    args = inputs()
    step = alpa_mini.parallelize(adam_step, method=Zero2Parallel())
    ex = step.get_executable(*args)
    names = {ex.plan.tensors[t].name: tuple(ex.plan.partition_spec(t)) for t in ex.plan.inputs}
    assert names["[0]['w1']"] == () and names["[0]['w2']"] == ()
    for leaf in ("mu", "nu"):
        for w in ("w1", "w2"):
            assert "x" in str(names[f"[1]['{leaf}']['{w}']"]), names
    # Each gradient is combined and scattered into the state's shards (XLA on CPU emits an
    # all-reduce and a local slice: it has no reduce-scatter), and each updated weight is
    # all-gathered back to the replicated parameters.
    gathers = weight_collectives(ex, "all-gather")
    assert len(gathers) == 2
    assert ex.collectives().counts()["all-gather"][0] == ex.collectives().counts()["all-gather"][1]
    run_and_compare(step, args)


def test_zero3_keeps_parameters_sharded_between_steps(devices4) -> None:
    args = inputs()
    step = alpa_mini.parallelize(adam_step, method=Zero3Parallel())
    ex = step.get_executable(*args)
    p, _ = run_and_compare(step, args)
    for name, arr in (("w1", p["w1"]), ("w2", p["w2"])):
        planned = ex.plan.partition_spec(f"[0]['{name}']")
        assert "x" in str(planned)
        assert not arr.sharding.is_fully_replicated
        assert arr.sharding.spec == planned  # the updated value keeps the input's layout
    # The ILP may use the shards in place rather than gather them (that is its job); either
    # way the compiled program's collectives are the ones the plan predicted.
    counts = ex.collectives().counts()
    assert all(planned == compiled for planned, compiled in counts.values()), counts


# ---------------------------------------------------------------- bad input
def test_non_array_argument_is_named(devices4) -> None:
    step = alpa_mini.parallelize(lambda p, b: p["w"] * b, method=ShardParallel())
    with pytest.raises(TypeError, match=r"argument \[0\]\['w'\]: str is not an array"):
        step({"w": "weights"}, jnp.ones(4))


def test_unknown_mesh_shape_lists_valid_shapes(devices4) -> None:
    step = alpa_mini.parallelize(lambda p, b: p * b, method=ShardParallel(mesh_shape=(3,)))
    with pytest.raises(ConfigError, match=r"mesh_shape: \(3,\) has 3 devices but 4 .*\(2, 2\)"):
        step(jnp.ones(4), jnp.ones(4))
    with pytest.raises(ConfigError, match="mesh_shape"):
        ShardParallel(mesh_shape=(2, 0))


def test_function_returning_a_non_array_is_a_clear_error(devices4) -> None:
    step = alpa_mini.parallelize(lambda p, b: (p * b, "done"), method=ShardParallel())
    with pytest.raises(TypeError, match="must return arrays"):
        step(jnp.ones(4), jnp.ones(4))


def test_data_parallel_batch_not_divisible_names_the_input(devices4) -> None:
    step = alpa_mini.parallelize(lambda p, b: (b @ p).sum(), method=alpa_mini.DataParallel())
    with pytest.raises(ConfigError, match=r"input \[1\] \(batch\): shape \(30, 8\)"):
        step(jnp.ones((8, 8)), jnp.ones((30, 8)))


def test_shapes_not_divisible_by_the_mesh_fall_back_to_replicated_dims(devices4) -> None:
    def f(p, b):
        return jnp.tanh(b @ p).sum(axis=1)

    step = alpa_mini.parallelize(f, method=ShardParallel(mesh_shape=(4,)))
    p, b = jnp.ones((6, 6)) / 6, jnp.arange(30.0).reshape(5, 6) / 30
    np.testing.assert_allclose(step(p, b), f(p, b), rtol=1e-6)
    ex = step.get_executable(p, b)
    assert all(t.spec is None or t.spec.fits(t.shape, ex.plan.mesh_shape) for t in ex.plan.tensors)


def test_calling_before_init_is_a_clear_error() -> None:
    alpa_mini.shutdown()
    step = alpa_mini.parallelize(lambda p, b: p * b, method=ShardParallel())
    with pytest.raises(RuntimeError, match=r"alpa_mini.init\(\) has not been called"):
        step(jnp.ones(4), jnp.ones(4))


def test_method_must_be_an_instance() -> None:
    with pytest.raises(TypeError, match="pass an instance"):
        alpa_mini.parallelize(lambda x: x, method=ShardParallel)
