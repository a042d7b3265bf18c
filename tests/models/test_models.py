"""The bundled models and optimisers against closed forms and independent numpy references."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_mini.models as models
from alpa_mini.models import (
    GPT2_1_3B,
    GPT_TINY,
    GPTConfig,
    MLPConfig,
    MoEConfig,
    WideResNetConfig,
    adam,
    count_params,
    gpt_abstract_batch,
    gpt_abstract_params,
    gpt_forward,
    gpt_loss,
    gpt_num_params,
    init_gpt,
    init_mlp,
    init_moe,
    init_wide_resnet,
    make_gpt_batch,
    make_mlp_batch,
    make_moe_batch,
    make_train_step,
    make_wide_resnet_batch,
    mlp_forward,
    mlp_loss,
    mlp_num_params,
    moe_forward,
    moe_num_params,
    moe_routing,
    sgd,
    stack_layers,
    unstack_layers,
    wide_resnet_forward,
    wide_resnet_num_params,
)
from alpa_mini.models.wide_resnet import conv3x3

# Two layers, so that scanning over the stack is a real loop.
GPT_TEST = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_heads=4, num_layers=2)
MOE_TEST = MoEConfig(hidden=8, ffn=16, num_experts=4, seq_len=8)

init_gpt_jit = jax.jit(init_gpt, static_argnums=0)
make_gpt_batch_jit = jax.jit(make_gpt_batch, static_argnums=(0, 2))
gpt_forward_jit = jax.jit(gpt_forward)
gpt_value_and_grad = jax.jit(jax.value_and_grad(gpt_loss), static_argnums=2)


def _gpt_variant(**changes: object) -> GPTConfig:
    return dataclasses.replace(GPT_TEST, **changes)


def _primitives(jaxpr: Any) -> set[str]:
    """Names of every primitive in a jaxpr, looking inside sub-jaxprs (jit, scan, remat)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


@pytest.fixture(scope="module")
def gpt_setup() -> tuple[dict, dict]:
    """GPT_TEST weights (unrolled layout) and a batch of 2 sequences."""
    params = init_gpt_jit(GPT_TEST, jax.random.key(0))
    return params, make_gpt_batch_jit(GPT_TEST, jax.random.key(1), 2)


@pytest.fixture(scope="module")
def gpt_reference(gpt_setup: tuple) -> tuple[jax.Array, dict]:
    """Loss and gradients of the plain unrolled model, the reference for every variant."""
    params, batch = gpt_setup
    return gpt_value_and_grad(params, batch, None)


def _tree_allclose(a: object, b: object, rtol: float, atol: float = 0.0) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _np_layer_norm(p: dict, x: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * np.asarray(p["scale"]) + np.asarray(p["bias"])


def _np_gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def test_package_exports_are_explicit_unique_and_importable() -> None:
    assert len(models.__all__) == len(set(models.__all__))
    for name in models.__all__:
        assert getattr(models, name) is not None


# ----------------------------------------------------------------------------- MLP


@pytest.mark.parametrize(
    "config",
    [
        MLPConfig(in_dim=5, hidden=7, out_dim=3),
        MLPConfig(in_dim=5, hidden=7, out_dim=3, num_layers=1, use_bias=False),
        MLPConfig(in_dim=4, hidden=6, out_dim=2, num_layers=4, activation="tanh"),
    ],
)
def test_mlp_param_count_matches_closed_form(config: MLPConfig) -> None:
    params = jax.eval_shape(lambda k: init_mlp(config, k), jax.random.key(0))
    d = (config.in_dim, *[config.hidden] * (config.num_layers - 1), config.out_dim)
    bias = sum(d[1:]) if config.use_bias else 0
    assert (
        count_params(params)
        == mlp_num_params(config)
        == sum(a * b for a, b in itertools.pairwise(d)) + bias
    )
    assert len(params["layers"]) == config.num_layers
    assert all(("b" in layer) == config.use_bias for layer in params["layers"])


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
def test_mlp_forward_equals_numpy_reference(activation: str) -> None:
    config = MLPConfig(in_dim=3, hidden=5, out_dim=2, num_layers=3, activation=activation)
    params = init_mlp(config, jax.random.key(1))
    params["layers"][0]["b"] = jnp.arange(5, dtype=jnp.float32) / 10  # non-zero bias is used
    x = np.asarray(jax.random.normal(jax.random.key(2), (4, 3)))
    act = {"relu": lambda v: np.maximum(v, 0), "gelu": _np_gelu, "tanh": np.tanh}[activation]
    ref = x
    for i, layer in enumerate(params["layers"]):
        ref = ref @ np.asarray(layer["w"]) + np.asarray(layer["b"])
        ref = act(ref) if i < 2 else ref
    out = mlp_forward(params, jnp.asarray(x), config)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)


def test_mlp_batches_share_one_teacher_so_training_reduces_the_loss() -> None:
    config = MLPConfig(in_dim=8, hidden=32, out_dim=4)
    optimizer = adam(1e-2)
    step = make_train_step(lambda p, b: mlp_loss(p, b, config), optimizer)
    steps, batch_size = 60, 64
    data = make_mlp_batch(config, jax.random.key(1), steps * batch_size)
    batches = jax.tree.map(lambda a: a.reshape(steps, batch_size, -1), data)

    @jax.jit
    def train(params: dict, held_out: dict) -> tuple[jax.Array, jax.Array]:
        def body(carry: tuple, batch: dict) -> tuple[tuple, None]:
            return step(*carry, batch)[:2], None

        (trained, _), _ = jax.lax.scan(body, (params, optimizer.init(params)), batches)
        return mlp_loss(params, held_out, config), mlp_loss(trained, held_out, config)

    held_out = make_mlp_batch(config, jax.random.key(10_000), 256)  # other inputs, same teacher
    before, after = train(init_mlp(config, jax.random.key(0)), held_out)
    assert float(after) < 0.2 * float(before)


def test_mlp_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"MLPConfig.activation: 'swish' is invalid; .*relu"):
        MLPConfig(in_dim=1, hidden=1, out_dim=1, activation="swish")
    with pytest.raises(ValueError, match=r"MLPConfig.num_layers: 0 is invalid"):
        MLPConfig(in_dim=1, hidden=1, out_dim=1, num_layers=0)


# ----------------------------------------------------------------------------- GPT


@pytest.mark.parametrize(
    "config",
    [
        GPT_TINY,
        GPTConfig(vocab_size=10, seq_len=6, hidden=12, num_heads=3, num_layers=2, mlp_ratio=2),
    ],
)
def test_gpt_param_count_matches_closed_form(config: GPTConfig) -> None:
    v, s, h, n_layers, r = (
        config.vocab_size,
        config.seq_len,
        config.hidden,
        config.num_layers,
        config.mlp_ratio,
    )
    # ln1, ln2: 4H; q, k, v, out projections: 4H^2 + 4H; MLP: 2rH^2 + rH + H.
    per_layer = 4 * h + 4 * h * h + 4 * h + 2 * r * h * h + r * h + h
    expected = v * h + s * h + n_layers * per_layer + 2 * h
    assert count_params(gpt_abstract_params(config)) == gpt_num_params(config) == expected


def test_gpt2_1_3b_is_traced_abstractly_with_the_published_size() -> None:
    v, s, h, n_layers = 51200, 1024, 2048, 24
    params = gpt_abstract_params(GPT2_1_3B)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params))
    expected = v * h + s * h + n_layers * (12 * h * h + 13 * h) + 2 * h
    assert count_params(params) == expected == 1_315_557_376
    batch = gpt_abstract_batch(GPT2_1_3B, 2)
    loss = jax.eval_shape(gpt_loss, params, batch)
    assert (loss.shape, loss.dtype) == ((), jnp.float32)
    jaxpr = jax.make_jaxpr(gpt_loss)(params, batch)
    top_level = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert "gather" in top_level  # the embedding lookup is a gather the tracer sees directly


def test_gpt_loss_at_init_is_close_to_log_vocab() -> None:
    params = init_gpt_jit(GPT_TINY, jax.random.key(0))
    batch = make_gpt_batch_jit(GPT_TINY, jax.random.key(1), 4)
    loss = float(jax.jit(gpt_loss)(params, batch))
    assert abs(loss - math.log(GPT_TINY.vocab_size)) < 0.1


def test_gpt_batch_labels_are_the_next_tokens(gpt_setup: tuple) -> None:
    _, batch = gpt_setup
    assert batch["tokens"].shape == batch["labels"].shape == (2, GPT_TEST.seq_len)
    assert batch["tokens"].dtype == batch["labels"].dtype == jnp.int32
    np.testing.assert_array_equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert int(batch["tokens"].min()) >= 0 and int(batch["tokens"].max()) < GPT_TEST.vocab_size


def test_gpt_is_causal(gpt_setup: tuple) -> None:
    params, batch = gpt_setup
    tokens = batch["tokens"]
    t = 3
    changed = np.asarray(tokens).copy()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % GPT_TEST.vocab_size
    before = np.asarray(gpt_forward_jit(params, tokens))
    after = np.asarray(gpt_forward_jit(params, jnp.asarray(changed)))
    assert before.shape == (2, GPT_TEST.seq_len, GPT_TEST.vocab_size)
    np.testing.assert_array_equal(before[:, : t + 1], after[:, : t + 1])
    assert np.abs(before[:, t + 1 :] - after[:, t + 1 :]).max() > 1e-3  # later positions see it


def test_gpt_lm_head_is_tied_to_the_token_embedding(gpt_setup: tuple) -> None:
    params, batch = gpt_setup
    assert set(params) == {"wte", "wpe", "layers", "ln_f"}  # no separate head matrix
    # wte is both the input table and the head: zero it and every logit is exactly zero.
    zeroed = {**params, "wte": jnp.zeros_like(params["wte"])}
    np.testing.assert_array_equal(np.asarray(gpt_forward_jit(zeroed, batch["tokens"])), 0.0)
    assert np.abs(np.asarray(gpt_forward_jit(params, batch["tokens"]))).max() > 1e-3


def test_scan_layout_holds_the_same_weights_and_round_trips(gpt_setup: tuple) -> None:
    unrolled, _ = gpt_setup
    scanned = init_gpt_jit(_gpt_variant(scan_layers=True), jax.random.key(0))
    h, n = GPT_TEST.hidden, GPT_TEST.num_heads
    assert scanned["layers"]["attn"]["w_q"].shape == (GPT_TEST.num_layers, h, n, h // n)
    _tree_allclose(scanned, stack_layers(unrolled), rtol=0.0)
    _tree_allclose(unstack_layers(scanned), unrolled, rtol=0.0)


@pytest.mark.parametrize(
    ("scan", "remat"),
    # each compiles a GPT's gradient (3-5 s): the fast lane keeps each feature alone
    [(True, False), (False, True), pytest.param(True, True, marks=pytest.mark.slow)],
)
def test_scan_and_remat_match_the_unrolled_loss_and_gradients(
    gpt_setup: tuple, gpt_reference: tuple, scan: bool, remat: bool
) -> None:
    params, batch = gpt_setup
    ref_loss, ref_grads = gpt_reference
    config = _gpt_variant(scan_layers=scan, remat=remat)
    other = stack_layers(params) if scan else params
    loss, grads = gpt_value_and_grad(other, batch, config)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _tree_allclose(unstack_layers(grads) if scan else grads, ref_grads, rtol=1e-5, atol=1e-7)
    jaxpr = jax.make_jaxpr(gpt_loss, static_argnums=2)(other, batch, config)
    primitives = _primitives(jaxpr.jaxpr)
    assert ("scan" in primitives) == scan
    assert any("remat" in p or "checkpoint" in p for p in primitives) == remat


def test_gpt_bfloat16_compute_keeps_fp32_params_and_logits(
    gpt_setup: tuple, gpt_reference: tuple
) -> None:
    params, batch = gpt_setup
    config = _gpt_variant(dtype="bfloat16")
    logits = jax.eval_shape(lambda p, t: gpt_forward(p, t, config), params, batch["tokens"])
    assert logits.dtype == jnp.float32
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    loss = float(jax.jit(gpt_loss, static_argnums=2)(params, batch, config))
    assert loss != float(gpt_reference[0])  # the compute really ran in lower precision
    np.testing.assert_allclose(loss, float(gpt_reference[0]), atol=0.05)


def test_gpt_config_and_shape_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"GPTConfig.num_heads: 5 does not divide hidden 64"):
        GPTConfig(vocab_size=8, seq_len=8, hidden=64, num_heads=5, num_layers=1)
    with pytest.raises(ValueError, match=r"GPTConfig.dtype: 'int8' is invalid"):
        GPTConfig(vocab_size=8, seq_len=8, hidden=8, num_heads=2, num_layers=1, dtype="int8")
    params = gpt_abstract_params(GPT_TEST)
    wrong = _gpt_variant(num_heads=8)
    with pytest.raises(ValueError, match=r"num_heads=4 but GPTConfig.num_heads is 8"):
        jax.eval_shape(lambda p, b: gpt_loss(p, b, wrong), params, gpt_abstract_batch(GPT_TEST, 1))


# ----------------------------------------------------------------------------- MoE


def _np_moe_reference(params: dict, x: np.ndarray, capacity: int | None) -> np.ndarray:
    """Per-token loop: top-2 of the softmax, renormalised; slots first-choice-first."""
    p = jax.tree.map(np.asarray, params)
    ex = p["experts"]
    num_experts = ex["w_in"].shape[0]
    out = x.copy()
    for b in range(x.shape[0]):
        h = _np_layer_norm(p["ln"], x[b])
        logits = h @ p["gate"]["w"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
        used = np.zeros(num_experts, int)
        for k in range(2):
            for s in range(x.shape[1]):
                e = top[s, k]
                if capacity is not None and used[e] >= capacity:
                    continue
                used[e] += 1
                gate = probs[s, e] / probs[s, top[s]].sum()
                hid = _np_gelu(h[s] @ ex["w_in"][e] + ex["b_in"][e])
                out[b, s] += gate * (hid @ ex["w_out"][e] + ex["b_out"][e])
    return out


moe_forward_jit = jax.jit(moe_forward, static_argnums=2)


@pytest.fixture(scope="module")
def moe_params_and_x() -> tuple[dict, jax.Array]:
    params = jax.jit(init_moe, static_argnums=0)(MOE_TEST, jax.random.key(0))
    rng = np.random.default_rng(5)  # non-zero expert biases, so the test sees them
    params["experts"]["b_in"] = jnp.asarray(0.1 * rng.standard_normal((4, 16)), jnp.float32)
    params["experts"]["b_out"] = jnp.asarray(0.1 * rng.standard_normal((4, 8)), jnp.float32)
    batch = jax.jit(make_moe_batch, static_argnums=(0, 2))(MOE_TEST, jax.random.key(1), 3)
    return params, batch["x"]


def test_moe_param_count_matches_closed_form() -> None:
    h, f, e = MOE_TEST.hidden, MOE_TEST.ffn, MOE_TEST.num_experts
    params = jax.eval_shape(lambda k: init_moe(MOE_TEST, k), jax.random.key(0))
    assert (
        count_params(params) == moe_num_params(MOE_TEST) == 2 * h + h * e + e * (2 * h * f + f + h)
    )
    assert params["experts"]["w_in"].shape == (e, h, f)
    assert params["experts"]["w_out"].shape == (e, f, h)


def test_moe_routes_every_token_to_two_distinct_experts(moe_params_and_x: tuple) -> None:
    params, x = moe_params_and_x
    idx, gates = moe_routing(params, x)
    tokens = x.shape[0] * x.shape[1]
    assert idx.shape == gates.shape == (tokens, 2) and idx.dtype == jnp.int32
    idx, gates = np.asarray(idx), np.asarray(gates)
    assert np.all(idx[:, 0] != idx[:, 1])
    assert np.all((idx >= 0) & (idx < MOE_TEST.num_experts))
    np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)
    assert np.all(gates[:, 0] >= gates[:, 1]) and np.all(gates[:, 1] > 0)
    # The two chosen experts are the two most probable ones under the gate logits.
    p = jax.tree.map(np.asarray, params)
    logits = _np_layer_norm(p["ln"], np.asarray(x).reshape(tokens, -1)) @ p["gate"]["w"]
    np.testing.assert_array_equal(np.sort(idx, -1), np.sort(np.argsort(-logits, -1)[:, :2], -1))
    assert len(np.unique(idx)) == MOE_TEST.num_experts  # the test exercises every expert


def test_moe_forward_equals_per_token_loop(moe_params_and_x: tuple) -> None:
    params, x = moe_params_and_x
    out = moe_forward_jit(params, x, None)
    ref = _np_moe_reference(params, np.asarray(x), capacity=None)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_moe_capacity_drops_overflow_first_choice_first(moe_params_and_x: tuple) -> None:
    params, x = moe_params_and_x
    tight = dataclasses.replace(MOE_TEST, capacity_factor=0.5)  # 2 slots per expert
    ample = dataclasses.replace(MOE_TEST, capacity_factor=2.0)  # 8 slots: no drop
    out = np.asarray(moe_forward_jit(params, x, tight))
    np.testing.assert_allclose(
        out, _np_moe_reference(params, np.asarray(x), capacity=2), rtol=1e-5, atol=1e-5
    )
    no_drop = _np_moe_reference(params, np.asarray(x), capacity=None)
    assert np.abs(out - no_drop).max() > 1e-3  # some assignment really was dropped
    np.testing.assert_allclose(
        np.asarray(moe_forward_jit(params, x, ample)), no_drop, rtol=1e-5, atol=1e-5
    )


def test_moe_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"MoEConfig.num_experts: 1 is invalid; top-2"):
        MoEConfig(hidden=4, ffn=4, num_experts=1, seq_len=4)
    with pytest.raises(ValueError, match=r"MoEConfig.capacity_factor: 0 is invalid"):
        MoEConfig(hidden=4, ffn=4, num_experts=2, seq_len=4, capacity_factor=0)


# ----------------------------------------------------------------------------- Wide-ResNet

WRN_TEST = WideResNetConfig(image_size=6, in_channels=3, width=8, num_blocks=2, num_classes=5)


def test_wide_resnet_shapes_and_param_count() -> None:
    c, w, k, n = 3, 8, 5, 2
    params = jax.eval_shape(lambda key: init_wide_resnet(WRN_TEST, key), jax.random.key(0))
    expected = 9 * c * w + n * (2 * 9 * w * w + 4 * w) + 2 * w + w * k + k
    assert count_params(params) == wide_resnet_num_params(WRN_TEST) == expected
    batch = jax.eval_shape(lambda key: make_wide_resnet_batch(WRN_TEST, key, 4), jax.random.key(1))
    assert batch["images"].shape == (4, 6, 6, 3) and batch["labels"].dtype == jnp.int32
    assert jax.eval_shape(wide_resnet_forward, params, batch["images"]).shape == (4, 5)


def test_conv3x3_equals_naive_same_padded_convolution() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 5, 3)).astype(np.float32)
    w = rng.standard_normal((3, 3, 3, 2)).astype(np.float32)
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    ref = np.zeros((2, 4, 5, 2))
    for i in range(4):
        for j in range(5):
            patch = padded[:, i : i + 3, j : j + 3, :]  # [N, 3, 3, C]
            ref[:, i, j, :] = np.einsum("nabc,abco->no", patch, w)
    out = conv3x3(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_wide_resnet_has_no_batch_statistics() -> None:
    params = jax.jit(init_wide_resnet, static_argnums=0)(WRN_TEST, jax.random.key(0))
    batch = jax.jit(make_wide_resnet_batch, static_argnums=(0, 2))(WRN_TEST, jax.random.key(1), 4)
    images = np.asarray(batch["images"])
    forward = jax.jit(jax.vmap(wide_resnet_forward, in_axes=(None, 0)))
    whole = np.asarray(jax.jit(wide_resnet_forward)(params, images))
    # Each image alone (a batch of one, vmapped) gives the same logits as the whole batch.
    one_by_one = np.asarray(forward(params, images[:, None]))[:, 0]
    assert whole.shape == (4, WRN_TEST.num_classes)
    np.testing.assert_allclose(whole, one_by_one, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- optimisers


def _toy_tree() -> tuple[dict, dict]:
    params = {"a": jnp.array([1.0, -2.0, 3.0]), "b": {"c": jnp.array([[0.5, 0.25]])}}
    grads = {"a": jnp.array([0.1, -0.3, 2.0]), "b": {"c": jnp.array([[-1e-3, 4.0]])}}
    return params, grads


def test_sgd_step_is_exactly_p_minus_lr_g() -> None:
    params, grads = _toy_tree()
    opt = sgd(0.125)  # a power of two: the reference arithmetic is exact
    state = opt.init(params)
    new, state = opt.update(grads, state, params)
    for p, g, q in zip(*(jax.tree.leaves(t) for t in (params, grads, new)), strict=True):
        np.testing.assert_array_equal(np.asarray(q), np.asarray(p) - 0.125 * np.asarray(g))
    assert int(state["count"]) == 1 and state["count"].dtype == jnp.int32


def test_adam_first_steps_match_closed_form_and_numpy_reference() -> None:
    params, grads = _toy_tree()
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    opt = adam(lr, b1, b2, eps)
    state = opt.init(params)
    p1, state = opt.update(grads, state, params)
    # Step 1: the bias-corrected moments are g and g^2, so the step is lr * g / (|g| + eps).
    for p, g, q in zip(*(jax.tree.leaves(t) for t in (params, grads, p1)), strict=True):
        p, g = np.asarray(p), np.asarray(g)
        np.testing.assert_allclose(np.asarray(q), p - lr * g / (np.abs(g) + eps), rtol=1e-6)
    # Step 2 with other gradients against a numpy Adam.
    grads2 = jax.tree.map(lambda g: -0.5 * g + 0.01, grads)
    p2, state = opt.update(grads2, state, p1)
    assert int(state["count"]) == 2
    for p, g1, g2, q in zip(
        *(jax.tree.leaves(t) for t in (params, grads, grads2, p2)), strict=True
    ):
        p, g1, g2 = (np.asarray(a, np.float64) for a in (p, g1, g2))
        m, v = np.zeros_like(p), np.zeros_like(p)
        for t, g in enumerate((g1, g2), start=1):
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        np.testing.assert_allclose(np.asarray(q), p, rtol=1e-5)


def test_learning_rate_schedule_sees_the_count_before_the_update() -> None:
    params, grads = _toy_tree()
    opt = sgd(lambda count: 0.5 * (count + 1))
    state = opt.init(params)
    p1, state = opt.update(grads, state, params)
    p2, state = opt.update(grads, state, p1)
    np.testing.assert_allclose(np.asarray(p2["a"]), np.asarray(params["a"] - 1.5 * grads["a"]))


def test_train_step_returns_pre_update_loss_and_the_optimizer_step() -> None:
    config = MLPConfig(in_dim=3, hidden=4, out_dim=2)
    params = init_mlp(config, jax.random.key(0))
    batch = make_mlp_batch(config, jax.random.key(1), 8)
    opt = sgd(0.1)
    step = make_train_step(mlp_loss, opt)
    assert not hasattr(step, "lower")  # an ordinary function, not a jitted one
    new, state, loss = jax.jit(step)(params, opt.init(params), batch)
    ref_loss, grads = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    assert float(loss) == float(ref_loss)
    _tree_allclose(new, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), rtol=1e-6)
    assert int(state["count"]) == 1


def test_optimizer_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"sgd.learning_rate: -1 is invalid"):
        sgd(-1)
    with pytest.raises(ValueError, match=r"adam.b1: 1.0 is invalid; expected 0 <= b1 < 1"):
        adam(1e-3, b1=1.0)
