"""The model zoo: Alpa's GPT, MoE and Wide-ResNet suites and Megatron-LM's GPT table.

Each suite row is checked against the published numbers (written out below from the sources
each YAML cites), its parameter count against the closed form, the real init's shapes and the
published size, and the largest configs are built from abstract shapes without allocating.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from alpa_mini.errors import ConfigError
from alpa_mini.graph.markers import pipeline_boundary_p
from alpa_mini.models import (
    GPTConfig,
    MoELMConfig,
    WideResNetConfig,
    count_params,
    init_moe_lm,
    init_wide_resnet,
    make_moe_lm_batch,
    make_wide_resnet_batch,
    moe_lm_layer_kinds,
    moe_lm_loss,
    moe_lm_num_params,
    wide_resnet_loss,
    wide_resnet_num_params,
)
from alpa_mini.models.specs import ModelSpec, PublishedParallelism, available_models
from alpa_mini.models.wide_resnet import _max_pool_3x3_s2

# Alpa (OSDI'22), alpa-projects/alpa benchmark/alpa: suite_manual_gpt.py / suite_auto_gpt.py.
ALPA_GPT_GPUS = {
    "gpt-350m": 1,
    "gpt-760m": 2,
    "gpt-1.3b": 4,
    "gpt-2.6b": 8,
    "gpt-6.7b": 16,
    "gpt-15b": 32,
    "gpt-39b": 64,
}
# suite_manual_moe.py moe_specs (S=1024, heads=16, V=32000, S_=2048) and suite_auto_moe.py
# perf_test_suite: name -> (hidden, layers, experts, GPUs, nominal size).
ALPA_MOE = {
    "moe-380m": (768, 8, 8, 1, 380e6),
    "moe-690m": (768, 8, 16, 2, 690e6),
    "moe-1.3b": (768, 16, 16, 4, 1.3e9),
    "moe-2.4b": (1024, 16, 16, 8, 2.4e9),
    "moe-10b": (1536, 16, 32, 16, 10e9),
    "moe-27b": (2048, 16, 48, 32, 27e9),
    "moe-70b": (2048, 32, 64, 64, 70e9),
}
# suite_wresnet.py wresnet_specs (image 224, fp32) and perf_test_auto_suite:
# name -> (num_layers, num_channels, width_factor, GPUs, global batch, nominal size).
ALPA_WRN = {
    "wresnet-250m": (50, 160, 2, 1, 1536, 250e6),
    "wresnet-500m": (50, 224, 2, 2, 1536, 500e6),
    "wresnet-1b": (50, 320, 2, 4, 1536, 1e9),
    "wresnet-2b": (50, 448, 2, 8, 1536, 2e9),
    "wresnet-4b": (50, 640, 2, 16, 1536, 4e9),
    "wresnet-6.8b": (50, 320, 16, 32, 1536, 6.8e9),
    "wresnet-13b": (101, 320, 16, 64, 1520, 13e9),
}
RESNET_STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}
# Narayanan et al., SC'21, Table 1 (seq 2048, vocab 51200): name -> (published size in
# billions, heads, hidden, layers, tensor-parallel, pipeline-parallel, GPUs, global batch).
MEGATRON = {
    "megatron-1.7b": (1.7, 24, 2304, 24, 1, 1, 32, 512),
    "megatron-3.6b": (3.6, 32, 3072, 30, 2, 1, 64, 512),
    "megatron-7.5b": (7.5, 32, 4096, 36, 4, 1, 128, 512),
    "megatron-18.4b": (18.4, 48, 6144, 40, 8, 1, 256, 1024),
    "megatron-39.1b": (39.1, 64, 8192, 48, 8, 2, 512, 1536),
    "megatron-76.1b": (76.1, 80, 10240, 60, 8, 4, 1024, 1792),
    "megatron-145.6b": (145.6, 96, 12288, 80, 8, 8, 1536, 2304),
    "megatron-310.1b": (310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    "megatron-529.6b": (529.6, 128, 20480, 105, 8, 35, 2520, 2520),
    "megatron-1t": (1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
}
# Alpa's names are rounded (1.3B for 1.35B, 13B for 12.6B): counts must be within 5% of them.
ALPA_NAME_TOLERANCE = 0.05

TINY_MOE = MoELMConfig(
    vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_layers=3, num_experts=4, ffn_ratio=2
)
TINY_WRN = WideResNetConfig(
    image_size=12,
    in_channels=3,
    width=4,
    num_blocks=4,
    num_classes=6,
    block="bottleneck",
    stage_sizes=(1, 1, 1, 1),
    width_factor=2,
)


def _leaves_are_abstract(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(type(leaf) is jax.ShapeDtypeStruct for leaf in leaves)


def _boundaries(jaxpr: Any) -> int:
    return sum(eqn.primitive is pipeline_boundary_p for eqn in jaxpr.jaxpr.eqns)


# ----------------------------------------------------------------------------- loading


def test_available_models_lists_every_suite() -> None:
    names = set(available_models())
    assert set(ALPA_GPT_GPUS) | set(ALPA_MOE) | set(ALPA_WRN) | set(MEGATRON) <= names


@pytest.mark.parametrize("name", available_models())
def test_every_bundled_config_loads_and_round_trips(name: str) -> None:
    spec = ModelSpec.named(name)
    assert ModelSpec.from_yaml(spec.to_yaml(), name=name) == spec
    if spec.gpus is not None or spec.published is not None:
        assert spec.source, "a config with a published GPU count must cite its source"


@pytest.mark.parametrize("name", sorted(ALPA_GPT_GPUS))
def test_alpa_gpt_suite_gpus(name: str) -> None:
    spec = ModelSpec.named(name)
    assert spec.gpus == ALPA_GPT_GPUS[name]
    assert "Alpa" in spec.source and spec.published is None


@pytest.mark.parametrize("name", sorted(ALPA_MOE))
def test_alpa_moe_suite_rows(name: str) -> None:
    hidden, layers, experts, gpus, nominal = ALPA_MOE[name]
    spec = ModelSpec.named(name)
    config = spec.config
    assert spec.family == "moe" and isinstance(config, MoELMConfig)
    assert (config.hidden, config.num_layers, config.num_experts) == (hidden, layers, experts)
    assert (config.seq_len, config.vocab_size, config.num_heads) == (1024, 32000, 16)
    assert (config.ffn_ratio, config.expert_group_size, config.capacity_factor) == (8, 2048, 1.0)
    assert config.dtype == "float16" and spec.batch_size == 1024 and spec.gpus == gpus
    n = spec.num_params()
    assert n == moe_lm_num_params(config) == count_params(spec.abstract_params())
    assert abs(n - nominal) / nominal < ALPA_NAME_TOLERANCE


@pytest.mark.parametrize("name", sorted(ALPA_WRN))
def test_alpa_wresnet_suite_rows(name: str) -> None:
    layers, channels, width_factor, gpus, batch, nominal = ALPA_WRN[name]
    spec = ModelSpec.named(name)
    config = spec.config
    assert spec.family == "wresnet" and isinstance(config, WideResNetConfig)
    assert (config.block, config.stage_sizes) == ("bottleneck", RESNET_STAGES[layers])
    assert (config.width, config.width_factor) == (channels, width_factor)
    assert (config.image_size, config.in_channels, config.num_classes) == (224, 3, 1024)
    assert config.dtype == "float32" and spec.batch_size == batch and spec.gpus == gpus
    n = spec.num_params()
    assert n == wide_resnet_num_params(config) == count_params(spec.abstract_params())
    assert abs(n - nominal) / nominal < ALPA_NAME_TOLERANCE


def test_wresnet_count_equals_alpas_flax_model() -> None:
    # Alpa's ResNet-50 WRN, 160 channels, width factor 2, 1024 classes, counted by hand from
    # its layers: 7x7 stem, 16 bottleneck blocks (4 projecting), dense head; scale + bias per
    # batch norm.
    assert ModelSpec.named("wresnet-250m").num_params() == 254_123_104


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_megatron_table_rows(name: str) -> None:
    size, heads, hidden, layers, tp, pp, gpus, batch = MEGATRON[name]
    spec = ModelSpec.named(name)
    config = spec.config
    assert spec.family == "gpt" and isinstance(config, GPTConfig)
    assert (config.num_heads, config.hidden, config.num_layers) == (heads, hidden, layers)
    assert (config.seq_len, config.vocab_size, config.dtype) == (2048, 51200, "float16")
    assert spec.batch_size == batch and spec.gpus == gpus
    assert spec.published == PublishedParallelism(tp, pp, gpus // (tp * pp))
    assert spec.published.gpus == gpus
    n = spec.num_params()
    # Megatron's formula P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)), plus our final
    # layer norm; the table rounds to 0.1B.
    v, s, h, la = 51200, 2048, hidden, layers
    assert n - 2 * h == 12 * la * h * h + 13 * la * h + (v + s) * h
    assert abs(n - size * 1e9) < 0.05e9


# ----------------------------------------------------------------------------- abstract shapes


@pytest.mark.parametrize("name", ["moe-70b", "wresnet-13b", "megatron-1t"])
def test_largest_configs_are_built_without_allocation(name: str) -> None:
    spec = ModelSpec.named(name)
    before = sum(a.nbytes for a in jax.live_arrays())
    params = spec.abstract_params()
    batch = spec.abstract_batch()
    after = sum(a.nbytes for a in jax.live_arrays())
    assert _leaves_are_abstract(params) and _leaves_are_abstract(batch)
    param_bytes = sum(
        math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(params)
    )
    assert param_bytes > 4e10  # 12.6B fp32 parameters and up: no real allocation of these
    assert after - before < 1e6
    assert count_params(params) == spec.num_params()
    assert all(leaf.shape[0] == spec.batch_size for leaf in jax.tree.leaves(batch))
    out = jax.eval_shape(spec.loss_fn(), params, batch)
    assert out.shape == () and out.dtype == jnp.float32


SMALL = {
    "gpt": ("gpt", GPTConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_layers=2)),
    "moe": ("moe", TINY_MOE),
    "wresnet": ("wresnet", TINY_WRN),
    "mlp": ("mlp", ModelSpec.named("mlp-small").config),
}


@pytest.mark.parametrize("family", sorted(SMALL))
def test_loss_and_grads_trace_to_a_jaxpr_on_abstract_shapes(family: str) -> None:
    name, config = SMALL[family]
    spec = ModelSpec("small", name, config, 4)
    params, batch = spec.abstract_params(), spec.abstract_batch()
    jaxpr = jax.make_jaxpr(jax.value_and_grad(spec.loss_fn()))(params, batch)
    loss, grads = jaxpr.out_avals[0], jaxpr.out_avals[1:]
    assert loss.shape == () and len(grads) == len(jax.tree.leaves(params))


@pytest.mark.parametrize(
    ("config", "blocks"),
    [
        (dataclasses.replace(TINY_MOE, pipeline_marks=True), TINY_MOE.num_layers),
        (dataclasses.replace(TINY_WRN, pipeline_marks=True), TINY_WRN.num_blocks),
        (
            WideResNetConfig(
                image_size=6,
                in_channels=3,
                width=8,
                num_blocks=3,
                num_classes=5,
                pipeline_marks=True,
            ),
            3,
        ),
    ],
)
def test_pipeline_marks_cut_between_blocks(config: Any, blocks: int) -> None:
    family = "moe" if isinstance(config, MoELMConfig) else "wresnet"
    spec = ModelSpec("marked", family, config, 2)
    args = (spec.abstract_params(), spec.abstract_batch())
    # One boundary after the stem (or embedding) and one between consecutive blocks.
    assert _boundaries(jax.make_jaxpr(spec.loss_fn())(*args)) == blocks
    unmarked = dataclasses.replace(spec, config=dataclasses.replace(config, pipeline_marks=False))
    assert _boundaries(jax.make_jaxpr(unmarked.loss_fn())(*args)) == 0


# ----------------------------------------------------------------------------- MoE LM numerics

moe_lm_value_and_grad = jax.jit(jax.value_and_grad(moe_lm_loss), static_argnums=2)


@pytest.fixture(scope="module")
def tiny_moe() -> tuple[dict, dict]:
    params = jax.jit(init_moe_lm, static_argnums=0)(TINY_MOE, jax.random.key(0))
    batch = jax.jit(make_moe_lm_batch, static_argnums=(0, 2))(TINY_MOE, jax.random.key(1), 4)
    return params, batch


def test_moe_lm_has_an_moe_ffn_in_every_other_block(tiny_moe: tuple) -> None:
    params, _ = tiny_moe
    kinds = ["moe" if "moe" in layer else "dense" for layer in params["layers"]]
    assert kinds == ["moe", "dense", "moe"] == list(moe_lm_layer_kinds(TINY_MOE))
    longer = dataclasses.replace(TINY_MOE, num_layers=6)
    assert moe_lm_layer_kinds(longer) == ("moe", "dense") * 3
    assert count_params(params) == moe_lm_num_params(TINY_MOE)
    # One top-2 routing (top_k) per MoE block in the forward pass.
    batch = jax.eval_shape(lambda: make_moe_lm_batch(TINY_MOE, jax.random.key(1), 2))
    jaxpr = jax.make_jaxpr(lambda p, b: moe_lm_loss(p, b, TINY_MOE))(params, batch)
    assert sum(eqn.primitive.name == "top_k" for eqn in jaxpr.jaxpr.eqns) == 2


@pytest.mark.slow
def test_moe_lm_loss_and_grads_are_finite(tiny_moe: tuple) -> None:
    # The suite's settings: fp16 compute, capacity factor 1, groups of two sequences. (fp32
    # losses are exercised below.)
    params, batch = tiny_moe
    config = dataclasses.replace(
        TINY_MOE, capacity_factor=1.0, expert_group_size=16, dtype="float16"
    )
    loss, grads = moe_lm_value_and_grad(params, batch, config)
    assert np.isfinite(float(loss))
    assert abs(float(loss) - math.log(TINY_MOE.vocab_size)) < 0.5  # near uniform at init
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    expert_grads = grads["layers"][0]["moe"]["experts"]["w_in"]
    assert float(jnp.max(jnp.abs(expert_grads))) > 0  # the experts are trained


@pytest.mark.slow
def test_moe_lm_gating_groups_only_matter_through_capacity(tiny_moe: tuple) -> None:
    params, batch = tiny_moe
    loss = jax.jit(moe_lm_loss, static_argnums=2)
    # Without a capacity limit no token is dropped, so however tokens are grouped the model
    # computes the same function.
    ref = float(loss(params, batch, TINY_MOE))
    for group in (4, 16, 1024):  # half a sequence, two, and clamped to the whole batch
        config = dataclasses.replace(TINY_MOE, expert_group_size=group)
        np.testing.assert_allclose(float(loss(params, batch, config)), ref, rtol=1e-6)
    # A tight capacity drops assignments and changes the loss.
    tight = dataclasses.replace(TINY_MOE, capacity_factor=0.25)
    assert abs(float(loss(params, batch, tight)) - ref) > 1e-6


def test_moe_lm_errors_name_the_problem(tiny_moe: tuple) -> None:
    params, batch = tiny_moe
    with pytest.raises(ValueError, match=r"spans 2 sequences, which does not divide"):
        moe_lm_loss(
            params,
            jax.tree.map(lambda a: a[:3], batch),
            dataclasses.replace(TINY_MOE, expert_group_size=16),
        )
    with pytest.raises(ValueError, match=r"params have num_experts=4 but MoELMConfig"):
        moe_lm_loss(params, batch, dataclasses.replace(TINY_MOE, num_experts=8))
    with pytest.raises(ConfigError, match=r"MoELMConfig\.num_experts: 1 is invalid; top-2"):
        dataclasses.replace(TINY_MOE, num_experts=1)
    with pytest.raises(ConfigError, match=r"MoELMConfig\.expert_group_size: 12 is invalid"):
        dataclasses.replace(TINY_MOE, expert_group_size=12)


# ----------------------------------------------------------------------------- WRN numerics


@pytest.mark.slow
def test_bottleneck_wresnet_loss_and_grads_are_finite() -> None:
    params = jax.jit(init_wide_resnet, static_argnums=0)(TINY_WRN, jax.random.key(0))
    assert count_params(params) == wide_resnet_num_params(TINY_WRN)
    assert sum("proj" in b for b in params["blocks"]) == len(TINY_WRN.stage_sizes)
    batch = jax.jit(make_wide_resnet_batch, static_argnums=(0, 2))(TINY_WRN, jax.random.key(1), 3)
    value_and_grad = jax.jit(jax.value_and_grad(wide_resnet_loss), static_argnums=2)
    loss, grads = value_and_grad(params, batch, TINY_WRN)
    assert abs(float(loss) - math.log(TINY_WRN.num_classes)) < 1.0
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.max(jnp.abs(grads["stem"]["w"]))) > 0
    # fp16 compute (forward only: compiling fp16 conv gradients on CPU is slow).
    half = jax.jit(wide_resnet_loss, static_argnums=2)
    np.testing.assert_allclose(
        float(half(params, batch, dataclasses.replace(TINY_WRN, dtype="float16"))),
        float(loss),
        rtol=1e-2,
    )


def test_bottleneck_stages_halve_the_resolution() -> None:
    # 224 -> stem /2 -> pool /2 = 56, then 56, 28, 14, 7 over the four stages: the last
    # block's 3x3 conv sees a 14x14 input and writes 7x7.
    spec = ModelSpec.named("wresnet-250m")
    jaxpr = jax.make_jaxpr(spec.loss_fn())(spec.abstract_params(), spec.abstract_batch(2))
    convs = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    spatial = [tuple(e.outvars[0].aval.shape[1:3]) for e in convs]
    assert spatial[0] == (112, 112) and spatial[-1] == (7, 7)
    assert sorted(set(spatial), reverse=True) == [(112, 112), (56, 56), (28, 28), (14, 14), (7, 7)]


@pytest.mark.parametrize("size", [7, 8, 112])
def test_max_pool_equals_reduce_window(size: int) -> None:
    x = jax.random.normal(jax.random.key(2), (2, size, size, 3))
    ref = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    np.testing.assert_array_equal(np.asarray(_max_pool_3x3_s2(x)), np.asarray(ref))


# ----------------------------------------------------------------------------- bad YAML

MOE_YAML = """\
family: moe
batch_size: 8
gpus: 4
source: a test
published: {tp: 2, pp: 1, dp: 2}
model: {vocab_size: 64, seq_len: 8, hidden: 16, num_heads: 2, num_layers: 2, num_experts: 4}
"""
WRN_YAML = """\
family: wresnet
batch_size: 8
model:
  image_size: 32
  in_channels: 3
  width: 8
  num_blocks: 16
  num_classes: 10
  block: bottleneck
  stage_sizes: [3, 4, 6, 3]
  width_factor: 2
"""


def _edited(text: str, edit: Any) -> str:
    data = yaml.safe_load(text)
    edit(data)
    return yaml.safe_dump(data)


def test_new_families_and_fields_parse() -> None:
    moe = ModelSpec.from_yaml(MOE_YAML, name="moe")
    assert (
        moe.gpus == 4 and moe.source == "a test" and moe.published == PublishedParallelism(2, 1, 2)
    )
    assert isinstance(moe.config, MoELMConfig) and moe.config.capacity_factor is None
    wrn = ModelSpec.from_yaml(WRN_YAML, name="wrn")
    assert wrn.config.stage_sizes == (3, 4, 6, 3) and wrn.gpus is None and wrn.published is None
    # An integer is a valid float; the config stays hashable (usable as a jit static arg).
    cf = ModelSpec.from_yaml(_edited(MOE_YAML, lambda d: d["model"].update(capacity_factor=1)), "m")
    assert cf.config.capacity_factor == 1.0 and isinstance(cf.config.capacity_factor, float)
    hash(wrn.config)


@pytest.mark.parametrize(
    ("text", "edit", "match"),
    [
        (MOE_YAML, lambda d: d["model"].pop("num_experts"), r"bad: model\.num_experts: missing"),
        (
            MOE_YAML,
            lambda d: d["model"].update(experts=8),
            r"model\.experts: unknown field for MoELMConfig; valid fields: vocab_size",
        ),
        (
            MOE_YAML,
            lambda d: d["model"].update(num_experts=1),
            r"model: MoELMConfig\.num_experts: 1 is invalid; top-2 gating needs >= 2",
        ),
        (
            MOE_YAML,
            lambda d: d["model"].update(capacity_factor="1"),
            r"model\.capacity_factor: '1' is invalid; expected a number or null",
        ),
        (
            MOE_YAML,
            lambda d: d["model"].update(capacity_factor=0),
            r"MoELMConfig\.capacity_factor: 0\.0 is invalid; expected None or a number > 0",
        ),
        (
            MOE_YAML,
            lambda d: d["model"].update(expert_group_size=12),
            r"expert_group_size: 12 is invalid; expected a multiple or a divisor of seq_len 8",
        ),
        (
            MOE_YAML,
            lambda d: d["model"].update(expert_group_size=True),
            r"model\.expert_group_size: True is invalid; expected an integer or null",
        ),
        (
            MOE_YAML,
            lambda d: d["model"].update(dtype="fp16"),
            r"MoELMConfig\.dtype: 'fp16' is invalid; expected one of bfloat16, float16, float32",
        ),
        (
            WRN_YAML,
            lambda d: d["model"].update(stage_sizes=[3, 4]),
            r"WideResNetConfig\.num_blocks: 16 is invalid; stage_sizes \(3, 4\) has 7 blocks",
        ),
        (
            WRN_YAML,
            lambda d: d["model"].update(stage_sizes="3,4,6,3"),
            r"model\.stage_sizes: '3,4,6,3' is invalid; expected a list of integers",
        ),
        (
            WRN_YAML,
            lambda d: d["model"].update(stage_sizes=[3, 0, 6, 7]),
            r"WideResNetConfig\.stage_sizes entry: 0 is invalid; expected an integer >= 1",
        ),
        (
            WRN_YAML,
            lambda d: d["model"].update(block="wide"),
            r"WideResNetConfig\.block: 'wide' is invalid; expected one of basic, bottleneck",
        ),
        (
            WRN_YAML,
            lambda d: d["model"].update(block="basic"),
            r"WideResNetConfig\.stage_sizes: \(3, 4, 6, 3\) is invalid for block 'basic'",
        ),
        (
            WRN_YAML,
            lambda d: d["model"].update(stage_sizes=[], block="basic"),
            r"WideResNetConfig\.width_factor: 2 is invalid for block 'basic'; expected 1",
        ),
        (
            WRN_YAML,
            lambda d: d["model"].update(stage_sizes=[]),
            r"WideResNetConfig\.stage_sizes: \(\) is invalid for block 'bottleneck'",
        ),
        (
            MOE_YAML,
            lambda d: d.update(gpus=0),
            r"bad: gpus: 0 is invalid; expected an integer >= 1",
        ),
        (MOE_YAML, lambda d: d.update(gpus="8"), r"gpus: '8' is invalid"),
        (MOE_YAML, lambda d: d.update(source=3), r"bad: source: 3 is invalid; expected a string"),
        (
            MOE_YAML,
            lambda d: d["published"].pop("dp"),
            r"bad: published\.dp: missing field; required: tp, pp, dp",
        ),
        (
            MOE_YAML,
            lambda d: d["published"].update(ep=2),
            r"published\.ep: unknown field; valid fields: tp, pp, dp",
        ),
        (
            MOE_YAML,
            lambda d: d["published"].update(tp=0),
            r"published\.tp: 0 is invalid; expected an integer >= 1",
        ),
        (MOE_YAML, lambda d: d.update(published=[2, 1, 2]), r"published: \[2, 1, 2\] is invalid"),
        (
            MOE_YAML,
            lambda d: d.update(gpus=8),
            r"bad: published: tp\*pp\*dp = 2\*1\*2 = 4 is invalid; it must equal gpus \(8\)",
        ),
        (
            MOE_YAML,
            lambda d: d.update(tp=2),
            r"bad: tp: unknown field; valid fields: batch_size, description, family, gpus",
        ),
        (
            MOE_YAML,
            lambda d: d.update(family="moes"),
            r"family: 'moes' is invalid; expected one of gpt, mlp, moe, wresnet",
        ),
    ],
)
def test_bad_fields_are_named(text: str, edit: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelSpec.from_yaml(_edited(text, edit), name="bad")


def test_direct_construction_checks_the_new_fields() -> None:
    config = ModelSpec.from_yaml(MOE_YAML, name="m").config
    with pytest.raises(ConfigError, match=r"ModelSpec\.gpus: 0 is invalid"):
        ModelSpec("x", "moe", config, 8, gpus=0)
    with pytest.raises(ConfigError, match=r"ModelSpec\.published: tp\*pp\*dp = 1\*1\*2 = 2"):
        ModelSpec("x", "moe", config, 8, gpus=4, published=PublishedParallelism(1, 1, 2))
    with pytest.raises(ConfigError, match=r"ModelSpec\.config: a MoELMConfig is invalid for"):
        ModelSpec("x", "wresnet", config, 8)
    with pytest.raises(ConfigError, match=r"PublishedParallelism\.pp: 0 is invalid"):
        PublishedParallelism(1, 0, 1)
