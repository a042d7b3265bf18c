"""Against serial JAX: every parallel method reproduces ``jax.jit`` training, step by step.

Each test runs ``NUM_STEPS`` training steps from identical inputs (same params, same batches)
through ``alpa_mini.parallelize`` and through plain ``jax.jit`` on one device, and compares
losses, final parameters and optimiser state.

Tolerances (fp32 throughout; "measured" is the worst case over every test here):

- SGD parameters, ``SGD_RTOL = 1e-5``, ``SGD_ATOL = 1e-7``. A sharded program computes the
  same sums in another order: per-device partial matmuls and partial batch means are added by
  an all-reduce, and XLA tiles a reduction on a shard differently than on the whole array.
  Reassociating an fp32 sum moves it by a few ulp of its largest *terms*, so O(0.1-1) weights
  differ by ~1 ulp (measured max |diff| 1.3e-7, absorbed by rtol), and values near zero (biases
  that start at 0, whose gradients partly cancel) differ by ``lr * (ulp of the terms)``, which
  a relative test cannot absorb; that is the atol. Measured: the smallest atol that passes at
  rtol 1e-5 is 1.4e-8 (flax momentum trace; <= 2.5e-9 for the bundled models), so 1e-7 keeps
  a ~7x margin. rtol 1e-6 would need atol 5e-8: too close to call honest.
- Losses, ``LOSS_RTOL = 1e-6``: O(0.1-3) scalars from the same reassociated reductions;
  measured relative difference <= 2.4e-7.
- Adam. ``mu`` is linear and ``nu`` quadratic in the gradient, so after the *first* step
  (identical parameters in) the moments are compared as tightly as SGD
  (``ADAM_STATE_RTOL = 1e-5``, ``ADAM_STATE_ATOL = 1e-8``; measured need 2.3e-9). This is what
  catches a missing or doubled gradient reduction, to which Adam's update is blind (it is
  invariant to a gradient's scale; ``test_adam_state_check_detects_a_scaled_gradient``).
  Parameters cannot be held that tight: the update ``lr * m / (sqrt(v) + eps)`` maps a
  gradient component at the fp32 noise floor (|g| ~ 1e-9, a weight whose contributions cancel
  exactly) and a reassociation difference d in it to an update difference ~ ``lr * d / eps``,
  anything up to a whole ``lr``; and from step 2 on the moments inherit those parameter
  differences. Measured worst case: 2.0e-4 = 2% of one step (GPT_TINY under ZeRO-3; a
  Wide-ResNet stem weight with |g| = 1.9e-9 gave 1.7% in an earlier single-batch run).
  Parameters are compared to within ``ADAM_PARAM_ATOL_STEPS * lr`` = 10% of one step (plus
  rtol 1e-5); the bugs that matter (a wrong bias correction, a stale moment, a wrong learning
  rate) move every element by O(lr).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import alpa_mini
import alpa_mini.models as M
from helpers.parallel_cases import (
    ADAM_LR,
    BATCH,
    NUM_STEPS,
    SGD_LR,
    assert_trees_close,
    initial,
    model_case,
    optimizer,
    run_steps,
    serial_result,
    train_step,
)

# fp32 agreement with serial JAX is what this module is for: it runs with LLVM at its default
# optimisation level, not -O0 (tests/conftest.py: NUMERICS_XLA_FLAGS, TEST_XLA_FLAGS).
pytestmark = pytest.mark.optimized_codegen

SGD_RTOL, SGD_ATOL = 1e-5, 1e-7
LOSS_RTOL, LOSS_ATOL = 1e-6, 1e-7
ADAM_STATE_RTOL, ADAM_STATE_ATOL = 1e-5, 1e-8
ADAM_PARAM_ATOL_STEPS = 0.1  # in units of one Adam step (lr); see the module docstring

MODELS = ("mlp", "gpt", "gpt_scan", "moe", "wide_resnet")
MESHES = ((8,), (2, 4), (2, 2, 2))
# One Adam case per model; the transformer-like ones on the 1-D mesh, where planning their
# larger (optimiser-state) graphs takes ~1 s instead of ~5-10 s on (2, 4).
ADAM_MESH = {"mlp": (2, 4), "gpt": (8,), "gpt_scan": (8,), "moe": (8,), "wide_resnet": (2, 4)}
# The fast lane (``./scripts/test --fast``) keeps the MLP on every mesh; the other graphs
# take 7-30 s each to plan and run (3-D meshes the most: 3^k strategies per k-dim operator)
# and are marked slow.
FAST = {*(("mlp", mesh) for mesh in MESHES)}


@pytest.fixture(scope="module", autouse=True)
def _cluster() -> Any:
    previous = alpa_mini.current_cluster() if alpa_mini.is_initialized() else None
    alpa_mini.init(cluster="local", num_cpu_devices=8)
    yield
    if previous is None:
        alpa_mini.shutdown()
    else:
        alpa_mini.init(previous)


def _assert_matches_serial(got: Any, want: Any, opt: str, *, what: str) -> None:
    params, state, losses, first_state = got
    ref_params, ref_state, ref_losses, ref_first_state = want
    if opt == "sgd":
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, atol=LOSS_ATOL)
        assert_trees_close(params, ref_params, rtol=SGD_RTOL, atol=SGD_ATOL, what=f"{what} params")
        assert_trees_close(state, ref_state, rtol=0, atol=0, what=f"{what} state")
        return
    # After step 1 (identical params in) the moments are functions of one gradient: tight.
    assert_trees_close(
        first_state,
        ref_first_state,
        rtol=ADAM_STATE_RTOL,
        atol=ADAM_STATE_ATOL,
        what=f"{what} opt_state after step 1",
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert_trees_close(
        params,
        ref_params,
        rtol=SGD_RTOL,
        atol=ADAM_PARAM_ATOL_STEPS * ADAM_LR,
        what=f"{what} params",
    )


@functools.cache
def _parallel_step(model: str, opt: str, method: alpa_mini.ShardParallel) -> Any:
    """One decorated step per (model, optimiser, method): tests that inspect the same plan
    share it (``ParallelizedFunction`` caches its executable per argument signature)."""
    return alpa_mini.parallelize(train_step(model, opt), method=method)


def _run_parallel(model: str, opt: str, method: alpa_mini.ShardParallel) -> tuple[Any, Any]:
    params, batches = initial(model)
    state = optimizer(opt).init(params)
    step = _parallel_step(model, opt, method)
    ex = step.get_executable(params, state, batches[0])
    return run_steps(step, params, state, batches), ex


def _params(model: str, meshes: tuple[tuple[int, ...], ...]) -> list[Any]:
    return [
        pytest.param(
            model,
            mesh,
            id=f"{model}-{'x'.join(map(str, mesh))}",
            marks=[] if (model, mesh) in FAST else [pytest.mark.slow],
        )
        for mesh in meshes
    ]


# ---------------------------------------------------------------- 1. ShardParallel, every model
@pytest.mark.parametrize(("model", "mesh"), [p for m in MODELS for p in _params(m, MESHES)])
def test_shard_parallel_sgd_matches_serial(model: str, mesh: tuple[int, ...]) -> None:
    got, ex = _run_parallel(model, "sgd", alpa_mini.ShardParallel(mesh_shape=mesh))
    assert ex.plan.mesh_shape == mesh
    _assert_matches_serial(got, serial_result(model, "sgd"), "sgd", what=model)


@pytest.mark.parametrize(
    "model", [m if m == "mlp" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS]
)
def test_shard_parallel_adam_matches_serial(model: str) -> None:
    mesh = ADAM_MESH[model]
    got, ex = _run_parallel(model, "adam", alpa_mini.ShardParallel(mesh_shape=mesh))
    assert ex.plan.mesh_shape == mesh
    _assert_matches_serial(got, serial_result(model, "adam"), "adam", what=model)


def test_adam_state_check_detects_a_scaled_gradient() -> None:
    """The Adam comparison is not vacuous: a gradient scaled by the device count (a doubled-up
    all-reduce, say) leaves Adam's parameters within tolerance, since the update is invariant
    to the gradient's scale, but the moments after step 1 expose it."""
    params, batches = initial("mlp")
    opt = optimizer("adam")
    loss = model_case("mlp").loss

    def scaled_step(p: Any, s: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(p, batch)
        new_p, new_s = opt.update(jax.tree.map(lambda g: g * 8, grads), s, p)
        return new_p, new_s, value

    got = run_steps(jax.jit(scaled_step), params, opt.init(params), batches)
    want = serial_result("mlp", "adam")
    atol = ADAM_PARAM_ATOL_STEPS * ADAM_LR
    assert_trees_close(got[0], want[0], rtol=SGD_RTOL, atol=atol, what="scaled params")
    with pytest.raises(AssertionError, match=r"opt_state after step 1\['mu'\]"):
        _assert_matches_serial(got, want, "adam", what="mlp")


# ---------------------------------------------------------------- 2. data parallel and ZeRO
PRESETS = [
    ("data", "sgd"),
    ("zero2", "adam"),
    ("zero3", "adam"),
]
_PRESET_METHODS = {
    "data": alpa_mini.DataParallel,
    "zero2": alpa_mini.Zero2Parallel,
    "zero3": alpa_mini.Zero3Parallel,
}


def _splittable(shape: tuple[int, ...], n: int = 8) -> bool:
    return any(d % n == 0 for d in shape)


def _leaf_names(arg: int, tree: Any) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [f"[{arg}]{jax.tree_util.keystr(p)}" for p, _ in paths]


@pytest.mark.parametrize(
    ("preset", "opt", "model"),
    [
        pytest.param(p, o, m, id=f"{p}-{m}", marks=[pytest.mark.slow] if m == "gpt_tiny" else [])
        for m in ("mlp", "gpt_tiny")
        for p, o in PRESETS
    ],
)
def test_preset_matches_serial(preset: str, opt: str, model: str) -> None:
    got, ex = _run_parallel(model, opt, _PRESET_METHODS[preset]())
    assert ex.plan.mesh_shape == (8,)
    _assert_matches_serial(got, serial_result(model, opt), opt, what=f"{preset} {model}")


@pytest.mark.parametrize("model", ["mlp", pytest.param("gpt_tiny", marks=pytest.mark.slow)])
def test_zero3_keeps_params_sharded_in_the_planned_layout(model: str) -> None:
    params, batches = initial(model)
    opt = optimizer("adam")
    state = opt.init(params)
    step = _parallel_step(model, "adam", alpa_mini.Zero3Parallel())
    ex = step.get_executable(params, state, batches[0])
    new_params, new_state, _ = step(params, state, batches[0])

    names = [ex.plan.tensors[t].name for t in ex.plan.inputs]
    leaves = jax.tree.leaves(new_params)
    param_names = _leaf_names(0, params)
    assert names[: len(param_names)] == param_names
    split = 0
    for name, arr in zip(param_names, leaves, strict=True):
        planned = NamedSharding(ex.mesh, ex.plan.partition_spec(name))
        assert arr.sharding.is_equivalent_to(planned, arr.ndim), (name, arr.sharding, planned)
        if _splittable(arr.shape):
            assert not arr.sharding.is_fully_replicated, (name, arr.shape, arr.sharding)
            split += 1
        else:
            assert arr.sharding.is_fully_replicated, (name, arr.shape, arr.sharding)
    assert split >= 3
    # The optimiser's moments are sharded like ZeRO-3 says, too.
    for name, arr in zip(_leaf_names(1, state), jax.tree.leaves(new_state), strict=True):
        assert arr.sharding.is_fully_replicated != _splittable(arr.shape), (name, arr.sharding)
    # Feeding the outputs back needs no resharding: the second step takes them as they are.
    again, _, _ = step(new_params, new_state, batches[1])
    for arr, before in zip(jax.tree.leaves(again), leaves, strict=True):
        assert arr.sharding.is_equivalent_to(before.sharding, arr.ndim)


@pytest.mark.parametrize("model", ["mlp", pytest.param("gpt_tiny", marks=pytest.mark.slow)])
def test_zero2_shards_optimizer_state_and_replicates_params(model: str) -> None:
    params, batches = initial(model)
    opt = optimizer("adam")
    state = opt.init(params)
    step = _parallel_step(model, "adam", alpa_mini.Zero2Parallel())
    ex = step.get_executable(params, state, batches[0])
    new_params, new_state, _ = step(params, state, batches[0])

    for name, arr in zip(_leaf_names(0, params), jax.tree.leaves(new_params), strict=True):
        assert ex.plan.tensor(name).spec is None or not ex.plan.tensor(name).spec.used_axes
        assert arr.sharding.is_fully_replicated, (name, arr.sharding)
    split = 0
    for name, arr in zip(_leaf_names(1, state), jax.tree.leaves(new_state), strict=True):
        planned = NamedSharding(ex.mesh, ex.plan.partition_spec(name))
        assert arr.sharding.is_equivalent_to(planned, arr.ndim), (name, arr.sharding, planned)
        if _splittable(arr.shape):
            assert not arr.sharding.is_fully_replicated, (name, arr.shape, arr.sharding)
            split += 1
        else:
            assert arr.sharding.is_fully_replicated, (name, arr.shape, arr.sharding)
    assert split >= 6  # mu and nu of at least three weights


# ---------------------------------------------------------------- 3. flax + optax
def _flax_case() -> tuple[Any, Any, Any]:
    import flax.linen as nn

    class Block(nn.Module):
        """A pre-norm residual MLP block with a projection head."""

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Dense(16)(x)
            h = nn.LayerNorm()(x)
            h = nn.Dense(32)(h)
            x = x + nn.Dense(16)(nn.gelu(h))
            return nn.Dense(4)(x)

    model = Block()
    key = jax.random.key(7)
    xs = jax.random.normal(key, (NUM_STEPS, BATCH * 2, 12), jnp.float32)
    ys = jnp.tanh(xs[..., :4] * 2.0)
    variables = jax.device_get(model.init(jax.random.key(0), xs[0]))
    batches = [{"x": np.asarray(x), "y": np.asarray(y)} for x, y in zip(xs, ys, strict=True)]
    return model, variables, batches


@pytest.mark.slow
@pytest.mark.parametrize("tx_name", ["sgd_momentum", "adamw"])
def test_flax_optax_step_matches_serial(tx_name: str) -> None:
    import optax

    model, variables, batches = _flax_case()
    if tx_name == "sgd_momentum":
        tx = optax.sgd(SGD_LR, momentum=0.9)
    else:
        tx = optax.adamw(ADAM_LR, weight_decay=1e-2)

    @alpa_mini.parallelize(method=alpa_mini.ShardParallel(mesh_shape=(2, 4)))
    def parallel_step(params: Any, opt_state: Any, batch: Any) -> Any:
        def loss_fn(p: Any) -> jax.Array:
            return jnp.mean(jnp.square(model.apply(p, batch["x"]) - batch["y"]))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    serial_step = jax.jit(parallel_step.__wrapped__)
    state = tx.init(variables)
    got = run_steps(parallel_step, variables, state, batches)
    want = run_steps(serial_step, variables, state, batches)
    if tx_name == "sgd_momentum":
        np.testing.assert_allclose(got[2], want[2], rtol=LOSS_RTOL, atol=LOSS_ATOL)
        assert_trees_close(got[0], want[0], rtol=SGD_RTOL, atol=SGD_ATOL, what="flax params")
        assert_trees_close(got[1], want[1], rtol=SGD_RTOL, atol=SGD_ATOL, what="sgd trace")
    else:
        _assert_matches_serial(got, want, "adam", what="flax adamw")


# ---------------------------------------------------------------- 4. gradient accumulation
def test_micro_batch_accumulation_equals_full_batch_step() -> None:
    cfg = M.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=3)
    params = jax.device_get(M.init_mlp(cfg, jax.random.key(0)))
    batches = [jax.device_get(M.make_mlp_batch(cfg, jax.random.key(i), 32)) for i in range(3)]
    opt = M.sgd(SGD_LR)

    def step(p: Any, s: Any, batch: Any) -> Any:
        loss, grads = alpa_mini.value_and_grad(M.mlp_loss)(p, batch)
        new_p, new_s = opt.update(grads, s, p)
        return new_p, new_s, loss

    accumulated = alpa_mini.parallelize(
        step, method=alpa_mini.ShardParallel(mesh_shape=(2, 4), num_micro_batches=4)
    )
    ex = accumulated.get_executable(params, opt.init(params), batches[0])
    # The step really is split: the loss/gradient equations run in a 4-trip loop.
    assert any(n.multiplier == 4 for n in ex.graph.nodes)
    got = run_steps(accumulated, params, opt.init(params), batches)
    want = run_steps(jax.jit(step), params, opt.init(params), batches)  # one full batch
    # The mean of 4 micro-batch means is the full-batch mean summed in another order.
    np.testing.assert_allclose(got[2], want[2], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert_trees_close(got[0], want[0], rtol=SGD_RTOL, atol=SGD_ATOL, what="accumulated params")


# ---------------------------------------------------------------- 5. indivisible shapes
@pytest.mark.parametrize("mesh", [pytest.param((8,), marks=pytest.mark.slow), (2, 4)])
def test_indivisible_shapes_fall_back_to_replication(mesh: tuple[int, ...]) -> None:
    cfg = M.MLPConfig(in_dim=6, hidden=6, out_dim=3, num_layers=3)  # 6, 3 divide no axis of 8/4
    params = jax.device_get(M.init_mlp(cfg, jax.random.key(0)))
    batches = [jax.device_get(M.make_mlp_batch(cfg, jax.random.key(i), 12)) for i in range(3)]
    opt = M.sgd(SGD_LR)
    step_fn = M.make_train_step(M.mlp_loss, opt)
    step = alpa_mini.parallelize(step_fn, method=alpa_mini.ShardParallel(mesh_shape=mesh))
    ex = step.get_executable(params, opt.init(params), batches[0])
    for t in ex.plan.tensors:
        if t.spec is None:
            continue
        for size, axes in zip(t.shape, t.spec.dims, strict=True):
            shards = math.prod(mesh[a] for a in axes)
            assert size % shards == 0, (t.name, t.shape, t.spec)
    got = run_steps(step, params, opt.init(params), batches)
    want = run_steps(jax.jit(step_fn), params, opt.init(params), batches)
    np.testing.assert_allclose(got[2], want[2], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert_trees_close(got[0], want[0], rtol=SGD_RTOL, atol=SGD_ATOL, what="params")


def test_fewer_devices_cluster_matches_serial() -> None:
    """Planning for a 4-device cluster description uses 4 devices and still matches."""
    cluster = dataclasses.replace(alpa_mini.ClusterSpec.named("cpu-1x8"), devices_per_host=4)
    previous = alpa_mini.current_cluster()
    alpa_mini.init(cluster=cluster)
    try:
        got, ex = _run_parallel("mlp", "sgd", alpa_mini.ShardParallel(mesh_shape=(2, 2)))
    finally:
        alpa_mini.init(previous)
    assert ex.mesh.devices.size == 4
    _assert_matches_serial(got, serial_result("mlp", "sgd"), "sgd", what="mlp on 4 devices")


def test_data_parallel_rejects_an_indivisible_batch_by_name() -> None:
    """DataParallel has no replicated fallback for the batch: it says which input and why."""
    cfg = M.MLPConfig(in_dim=6, hidden=6, out_dim=3, num_layers=2)
    params = M.init_mlp(cfg, jax.random.key(0))
    opt = M.sgd(SGD_LR)
    step_fn = M.make_train_step(M.mlp_loss, opt)
    step = alpa_mini.parallelize(step_fn, method=alpa_mini.DataParallel())
    batch = M.make_mlp_batch(cfg, jax.random.key(1), 12)
    with pytest.raises(alpa_mini.ConfigError, match=r"\[2\]\['x'\].*\(12, 6\)"):
        step.get_executable(params, opt.init(params), batch)


# ---------------------------------------------------------------- 6. donation
_DONATION_SCRIPT = """
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
import alpa_mini, alpa_mini.models as M
alpa_mini.init(cluster="local", num_cpu_devices=8)
cfg = M.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=3)
params = M.init_mlp(cfg, jax.random.key(0))
batches = [M.make_mlp_batch(cfg, jax.random.key(i), 8) for i in range(3)]
opt = M.adam(1e-2)
step = M.make_train_step(M.mlp_loss, opt)
donating = alpa_mini.parallelize(
    step, method=alpa_mini.ShardParallel(mesh_shape=(2, 4)), donate_argnums="auto"
)
serial = jax.jit(step)
p, s, rp, rs = params, opt.init(params), params, opt.init(params)
s = {**s, "nu": s["mu"]}  # the same buffers in two donated leaves: parallelize must copy one
for b in batches:
    rp, rs, rl = serial(rp, rs, b)
    p, s, l = donating(p, s, b)
    np.testing.assert_allclose(l, rl, rtol=1e-6)
for a, e in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-3)
print("OK")
"""


def test_donated_adam_step_matches_serial() -> None:
    """Donating params and optimiser state changes nothing numerically. Runs in a subprocess
    because the failure mode (one buffer donated twice) is a jaxlib segfault, which would
    take the test session down."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _DONATION_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
