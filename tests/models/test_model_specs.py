"""Bundled model YAMLs load and validate; abstract params match the closed-form counts."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml

from alpa_mini.errors import ConfigError
from alpa_mini.models.gpt import GPTConfig
from alpa_mini.models.mlp import MLPConfig, count_params
from alpa_mini.models.moe import MoELMConfig
from alpa_mini.models.specs import ModelSpec, available_models
from alpa_mini.models.wide_resnet import WideResNetConfig

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
SHIPPED = sorted(p.stem for p in MODELS.glob("*.yaml"))
ALPA_GPT_SUITE = {
    # name: (hidden, num_layers, num_heads) of Alpa's gpt_specs, plus GPT-3 175B
    "gpt-350m": (1024, 24, 16),
    "gpt-760m": (1536, 24, 16),
    "gpt-1.3b": (2048, 24, 32),
    "gpt-2.6b": (2560, 32, 32),
    "gpt-6.7b": (4096, 32, 32),
    "gpt-15b": (5120, 48, 40),
    "gpt-39b": (8192, 48, 64),
    "gpt-76b": (10240, 60, 80),
    "gpt3-175b": (12288, 96, 96),
}

TINY_YAML = """\
family: gpt
description: a test model
batch_size: 4
model: {vocab_size: 64, seq_len: 8, hidden: 16, num_heads: 2, num_layers: 2}
"""


def _approx(n: int) -> str:
    """The rounded count the YAML descriptions state, e.g. 1.01T, 1.32B, 356M, 218K."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def test_available_models_lists_every_shipped_yaml() -> None:
    assert available_models() == tuple(sorted(SHIPPED))
    assert set(ALPA_GPT_SUITE) | {"gpt-tiny", "gpt-small", "mlp-small"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_yaml_loads(name: str) -> None:
    spec = ModelSpec.named(name)
    assert spec.name == name
    assert spec == ModelSpec.load(MODELS / f"{name}.yaml")
    assert spec == ModelSpec.load_any(name) == ModelSpec.load_any(str(MODELS / f"{name}.yaml"))
    expected = {
        "gpt": GPTConfig,
        "mlp": MLPConfig,
        "moe": MoELMConfig,
        "wresnet": WideResNetConfig,
    }[spec.family]
    assert isinstance(spec.config, expected)
    # The description states the (rounded and exact) parameter count of the config.
    n = spec.num_params()
    assert f"{_approx(n)} parameters ({n:,})" in spec.description


@pytest.mark.parametrize("name", sorted(ALPA_GPT_SUITE))
def test_alpa_gpt_suite_shapes(name: str) -> None:
    spec = ModelSpec.named(name)
    config = spec.config
    assert isinstance(config, GPTConfig)
    assert (config.hidden, config.num_layers, config.num_heads) == ALPA_GPT_SUITE[name]
    assert (config.seq_len, config.vocab_size, config.dtype) == (1024, 51200, "float16")
    assert spec.batch_size == 1024


@pytest.mark.parametrize(
    ("name", "count", "nominal"),
    [
        ("gpt-1.3b", 1_315_557_376, 1.3e9),
        ("gpt-39b", 39_087_652_864, 39e9),
        ("gpt3-175b", 174_603_264_000, 175e9),
    ],
)
def test_parameter_counts_match_the_nominal_sizes(name: str, count: int, nominal: float) -> None:
    n = ModelSpec.named(name).num_params()
    assert n == count
    assert abs(n - nominal) / nominal < 0.03


@pytest.mark.parametrize("name", SHIPPED)
def test_abstract_params_are_shapes_only(name: str) -> None:
    spec = ModelSpec.named(name)
    leaves = jax.tree.leaves(spec.abstract_params())
    assert leaves and all(type(leaf) is jax.ShapeDtypeStruct for leaf in leaves)
    assert sum(math.prod(leaf.shape) for leaf in leaves) == spec.num_params()
    batch = jax.tree.leaves(spec.abstract_batch())
    assert batch and all(type(leaf) is jax.ShapeDtypeStruct for leaf in batch)
    assert all(leaf.shape[0] == spec.batch_size for leaf in batch)
    assert all(leaf.shape[0] == 3 for leaf in jax.tree.leaves(spec.abstract_batch(3)))


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-small"])
def test_loss_fn_traces_on_the_abstract_shapes(name: str) -> None:
    spec = ModelSpec.named(name)
    out = jax.eval_shape(spec.loss_fn(), spec.abstract_params(), spec.abstract_batch(2))
    assert out.shape == () and out.dtype == jnp.float32
    assert count_params(spec.abstract_params()) == spec.num_params()


def test_from_yaml_round_trip() -> None:
    spec = ModelSpec.from_yaml(TINY_YAML, name="tiny")
    assert spec.name == "tiny" and spec.family == "gpt" and spec.batch_size == 4
    assert spec.config == GPTConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_layers=2)
    assert ModelSpec.from_yaml(spec.to_yaml(), name="tiny") == spec
    mlp = ModelSpec.named("mlp-small")
    assert ModelSpec.from_yaml(mlp.to_yaml(), name="mlp-small") == mlp


def _edited(edit) -> str:
    data = yaml.safe_load(TINY_YAML)
    edit(data)
    return yaml.safe_dump(data)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda d: d["model"].__setitem__("hiddn", 16),
            r"bad\.yaml: model\.hiddn: unknown field for GPTConfig; valid fields: vocab_size",
        ),
        (
            lambda d: d["model"].__setitem__("hidden", "16"),
            r"bad\.yaml: model\.hidden: '16' is invalid; expected an integer",
        ),
        (
            lambda d: d["model"].__setitem__("remat", 1),
            r"model\.remat: 1 is invalid; expected a bool",
        ),
        (
            lambda d: d["model"].__setitem__("num_layers", True),
            r"model\.num_layers: True is invalid; expected an integer",
        ),
        (
            lambda d: d["model"].__setitem__("dtype", "float8"),
            r"bad\.yaml: model: GPTConfig\.dtype: 'float8' is invalid; expected one of bfloat16",
        ),
        (
            lambda d: d["model"].__setitem__("num_heads", 3),
            r"GPTConfig\.num_heads: 3 does not divide hidden 16",
        ),
        (lambda d: d["model"].pop("seq_len"), r"model\.seq_len: missing field"),
        (
            lambda d: d.__setitem__("family", "bert"),
            r"bad\.yaml: family: 'bert' is invalid; expected one of gpt, mlp",
        ),
        (
            lambda d: d.__setitem__("batch_size", -8),
            r"bad\.yaml: batch_size: -8 is invalid; expected an integer >= 1",
        ),
        (lambda d: d.__setitem__("batch_size", 0), r"batch_size: 0 is invalid"),
        (lambda d: d.__setitem__("batch_size", 2.5), r"batch_size: 2\.5 is invalid"),
        (
            lambda d: d.__setitem__("seq_len", 8),
            r"bad\.yaml: seq_len: unknown field; valid fields: batch_size, description",
        ),
        (lambda d: d.pop("batch_size"), r"batch_size: missing field"),
        (lambda d: d.__setitem__("description", 3), r"description: 3 is invalid"),
        (lambda d: d.__setitem__("model", [1, 2]), r"model: expected a mapping of GPTConfig"),
    ],
)
def test_bad_inputs_name_the_file_and_field(edit, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelSpec.from_yaml(_edited(edit), name="bad.yaml")


def test_bad_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(_edited(lambda d: d.__setitem__("family", "vit")))
    with pytest.raises(ConfigError, match=r"broken\.yaml: family: 'vit' is invalid"):
        ModelSpec.load_any(str(path))
    path.write_text("family: [gpt\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML"):
        ModelSpec.load(path)
    with pytest.raises(ConfigError, match=r"missing\.yaml: no such model file"):
        ModelSpec.load_any(str(tmp_path / "missing.yaml"))


def test_load_any_prefers_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(TINY_YAML)
    spec = ModelSpec.load_any(path)
    assert spec.name == "mine" and spec.batch_size == 4
    assert ModelSpec.load_any(str(path)) == spec


def test_unknown_name_lists_the_bundled_models() -> None:
    with pytest.raises(ConfigError, match=r"'gpt-7b': unknown model name.*gpt-1\.3b.*mlp-small"):
        ModelSpec.named("gpt-7b")
    with pytest.raises(ConfigError, match=r"unknown model name; bundled models: gpt-1\.3b"):
        ModelSpec.load_any("gpt-7b")


def test_direct_construction_is_validated() -> None:
    config = GPTConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_layers=2)
    with pytest.raises(ConfigError, match=r"ModelSpec\.batch_size: -1 is invalid"):
        ModelSpec("x", "gpt", config, -1)
    with pytest.raises(ConfigError, match=r"ModelSpec\.family: 'bert' is invalid"):
        ModelSpec("x", "bert", config, 1)
    with pytest.raises(ConfigError, match=r"ModelSpec\.config: a GPTConfig is invalid"):
        ModelSpec("x", "mlp", config, 1)
    spec = ModelSpec("x", "gpt", config, 2)
    with pytest.raises(ConfigError, match=r"batch_size: 0 is invalid"):
        spec.abstract_batch(0)
