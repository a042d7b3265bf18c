"""Typed PRNG keys as step arguments (``step(params, opt_state, batch, key)``): the batch is
found past a trailing key, the key is never split over micro-batches or devices, and the
step matches serial JAX to 1e-6 with the key it returns equal too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_mini
from alpa_mini import (
    ConfigError,
    ManualLayerOption,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import sgd

OPT = sgd(0.1)


def _loss(params, batch, key):
    # Noise drawn from the key, the same for every row: each micro-batch reads the whole key,
    # so it sees what the whole batch sees serially.
    x = batch["x"] + 0.1 * jax.random.normal(key, (batch["x"].shape[-1],))
    for i, p in enumerate(params):
        x = jnp.tanh(x @ p["w"] + p["b"])
        if i < len(params) - 1:
            x = alpa_mini.mark_pipeline_boundary(x)
    return jnp.mean((x - batch["y"]) ** 2)


def _step(value_and_grad):
    def step(params, opt_state, batch, key):
        key, sub = jax.random.split(key)
        loss, grads = value_and_grad(_loss)(params, batch, sub)
        params, opt_state = OPT.update(grads, opt_state, params)
        return params, opt_state, key, loss

    return step


def _data():
    keys = jax.random.split(jax.random.key(0), 4)
    params = [{"w": jax.random.normal(k, (8, 8)) / 3, "b": jnp.zeros(8)} for k in keys]
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 8)).astype(np.float32),
             "y": rng.normal(size=(16, 8)).astype(np.float32)}  # fmt: skip
    return params, OPT.init(params), batch


METHODS = {
    "pipeshard": PipeshardParallel(
        num_micro_batches=4,
        layer_option=ManualLayerOption(),
        stage_option=UniformStageOption(num_stages=2),
    ),
    "shard": ShardParallel(num_micro_batches=2),
}


@pytest.mark.parametrize(
    "kind",
    [pytest.param("pipeshard", marks=pytest.mark.slow), "shard"],  # 4 s: the fast lane
)
def test_a_key_argument_is_read_whole_by_every_micro_batch(devices8, kind):
    params, state, batch = _data()
    serial = jax.jit(_step(jax.value_and_grad))
    step = alpa_mini.parallelize(_step(alpa_mini.value_and_grad), method=METHODS[kind])
    want = got = (params, state, jax.random.key(7))
    for _ in range(3):
        *want, want_loss = serial(*want[:2], batch, want[2])
        *got, got_loss = step(*got[:2], batch, got[2])
    for a, b in zip(jax.tree.leaves(want[0]), jax.tree.leaves(got[0]), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=0)
    assert float(got_loss) == pytest.approx(float(want_loss), abs=1e-6)
    np.testing.assert_array_equal(jax.random.key_data(got[2]), jax.random.key_data(want[2]))


def test_the_default_batch_is_the_last_argument_that_is_not_only_keys():
    params, state, batch = _data()
    step = alpa_mini.parallelize(_step(alpa_mini.value_and_grad))
    call = step._prepare((params, state, batch, jax.random.key(7)))
    n_params, n_state = len(jax.tree.leaves(params)), len(jax.tree.leaves(state))
    assert call.roles == ["param"] * n_params + ["state"] * n_state + ["batch"] * 2 + ["state"]
    # named explicitly, a key among the batch arguments is still not split
    step = alpa_mini.parallelize(_step(alpa_mini.value_and_grad), batch_argnums=(2, 3))
    assert step._prepare((params, state, batch, jax.random.key(7))).roles[-1] == "state"


def test_on_ray_keys_travel_as_their_data_and_come_back_as_keys():
    """The Ray runtime's adapter (``ray_keys``; the run itself: tests/runtime/test_ray_runtime):
    the traced step takes each key as its data and returns key outputs as data; the driver
    turns arguments into data and outputs back into keys of the planned implementation."""
    from alpa_mini.pipeline.executable import StepFun
    from alpa_mini.pipeline.ray_keys import (
        KeysAsData,
        data_aval,
        data_to_keys,
        key_impls,
        keys_to_data,
    )

    def step(x, key):
        return x + jax.random.uniform(key, x.shape), jax.random.split(key)[0]

    key = jax.random.key(5, impl="rbg")
    flat, tree = jax.tree.flatten((jnp.zeros(3), key))
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat]
    impls = key_impls(avals)
    assert impls == {1: "rbg"} and data_aval(avals[1]).shape == (4,)
    wrapped = KeysAsData(StepFun(step, (), tree), impls)
    keys_to_data(flat, impls, ["[0]", "[1]"])
    assert isinstance(flat[1], np.ndarray) and flat[1].dtype == np.uint32
    out = list(jax.jit(wrapped)(*flat))
    assert wrapped.out_impls == {1: "rbg"} and out[1].dtype == np.uint32
    data_to_keys(out, wrapped.out_impls)
    want = step(jnp.zeros(3), key)
    np.testing.assert_array_equal(out[0], want[0])
    np.testing.assert_array_equal(jax.random.key_data(out[1]), jax.random.key_data(want[1]))
    # An argument that is not a key of the planned implementation is named.
    with pytest.raises(
        ConfigError, match=r"argument leaf \[1\]: key<fry> is a threefry2x32 key; .* for a rbg"
    ):
        keys_to_data([jnp.zeros(3), jax.random.key(5)], impls, ["[0]", "[1]"])
    with pytest.raises(
        ConfigError, match=r"argument leaf \[1\]: uint32 is not a PRNG key; .* for a rbg"
    ):
        keys_to_data([jnp.zeros(3), jax.random.key_data(key)], impls, ["[0]", "[1]"])


def test_draws_and_debug_prints_run_replicated_without_a_warning(devices8, caplog):
    from alpa_mini.shard import problem

    problem._warned.clear()  # (other tests may have warned already)

    def step(params, opt_state, batch, key):
        def loss(p, b, k):
            jax.debug.print("{m}", m=jnp.mean(b["x"]))
            return _loss(p, b, jax.random.fold_in(k, 1))

        l, grads = alpa_mini.value_and_grad(loss)(params, batch, key)
        return (*OPT.update(grads, opt_state, params), l)

    params, state, batch = _data()
    with caplog.at_level("WARNING", logger="alpa_mini"):
        step = alpa_mini.parallelize(step, method=METHODS["shard"])
        step(params, state, batch, jax.random.key(1))
    assert not [r for r in caplog.records if "no sharding rule" in r.getMessage()]


def test_a_raw_key_taken_for_the_batch_is_named_in_the_error(devices8):
    params, state, batch = _data()
    step = alpa_mini.parallelize(_step(alpa_mini.value_and_grad), method=METHODS["shard"])
    with pytest.raises(TypeError) as err:  # the uint32 pair cut in two: not a key any more
        step(params, state, batch, jax.random.PRNGKey(7))
    assert "looks like a raw PRNG key" in " ".join(getattr(err.value, "__notes__", []))


def _keep(batch, key, i: int, shape) -> jax.Array:
    """Layer i's dropout mask (keep 0.8): from the step's key, or, where the batch has
    ``keys`` (one key's data per row), from each row's own key."""
    if "keys" not in batch:
        return jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, shape)
    row = lambda k: jax.random.bernoulli(jax.random.fold_in(k, i), 0.8, shape[1:])  # noqa: E731
    return jax.vmap(row)(jax.random.wrap_key_data(batch["keys"]))


def _dropout_loss(params, batch, key):
    x = batch["x"]
    for i, p in enumerate(params):
        x = jnp.tanh(x @ p["w"] + p["b"])
        x = jnp.where(_keep(batch, key, i, x.shape), x / 0.8, 0.0)
    return jnp.mean((x - batch["y"]) ** 2)


@pytest.mark.parametrize("per_row", [True, False])
def test_dropout_from_a_key_per_row_in_the_batch_matches_serial_jax(devices8, per_row):
    """With B = 4, a mask drawn from the step's key is drawn the same in every micro-batch,
    unlike serial JAX's over the whole batch; keys per row in the batch (README's recipe)
    are split with it, so the step equals serial JAX."""
    params, state, batch = _data()
    if per_row:
        batch = {**batch, "keys": jax.random.key_data(jax.random.split(jax.random.key(3), 16))}

    def step(value_and_grad):
        def run(params, opt_state, batch, key):
            loss, grads = value_and_grad(_dropout_loss)(params, batch, key)
            return (*OPT.update(grads, opt_state, params), loss)

        return run

    method = PipeshardParallel(num_micro_batches=4, stage_option=UniformStageOption(2))
    got = alpa_mini.parallelize(step(alpa_mini.value_and_grad), method=method)
    want = jax.jit(step(jax.value_and_grad))
    key = jax.random.key(5)
    (*got_state, got_loss), (*want_state, want_loss) = (
        f(params, state, batch, key) for f in (got, want)
    )
    if not per_row:
        assert abs(float(got_loss) - float(want_loss)) > 1e-3
        return
    assert float(got_loss) == pytest.approx(float(want_loss), abs=1e-6)
    for a, b in zip(jax.tree.leaves(want_state), jax.tree.leaves(got_state), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=0)
