"""Benchmark model configurations: ``ModelSpec`` (a model config plus its global batch).

The bundled configs ship inside the package as ``alpa_mini.model_configs`` (the folder
``configs/models``), the model zoo of the evaluation harness: Alpa's (OSDI'22) benchmark
suites, GPT (``gpt-350m`` ... ``gpt-39b``, plus ``gpt-76b``), MoE (``moe-380m`` ...
``moe-70b``) and Wide-ResNet (``wresnet-250m`` ... ``wresnet-13b``); Megatron-LM's GPT
weak-scaling table (``megatron-1.7b`` ... ``megatron-1t``, Narayanan et al., SC'21, Table 1);
``gpt3-175b``; and small models for tests and the demo (``gpt-tiny``, ``gpt-small``,
``mlp-small``). ``ModelSpec.named("gpt-1.3b")`` / ``ModelSpec.load_any(name_or_path)`` load
them and ``available_models()`` lists them. Every one is planned from abstract shapes
(``abstract_params``/``abstract_batch``): nothing is allocated.

A model YAML has these top-level keys::

    family: gpt            # "gpt" (GPTConfig), "mlp" (MLPConfig), "moe" (MoELMConfig)
                           # or "wresnet" (WideResNetConfig)
    description: "..."     # optional
    batch_size: 1024       # global batch, an integer >= 1
    gpus: 8                # optional: the GPU count the published benchmark ran it on
    source: "..."          # optional: where the configuration comes from
    published: {tp: 8, pp: 1, dp: 32}   # optional: the published parallel layout;
                                        # tp * pp * dp must equal gpus when both are given
    model:                 # the config dataclass's fields, by name
      vocab_size: 51200
      ...

A spec's name is the file's stem. Every error is a ``ConfigError`` whose message names the
file, the field, the offending value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import yaml

from alpa_mini.cluster.spec import bundled_yaml_files
from alpa_mini.errors import ConfigError
from alpa_mini.models.gpt import (
    GPTConfig,
    gpt_abstract_batch,
    gpt_abstract_params,
    gpt_loss,
    gpt_num_params,
)
from alpa_mini.models.mlp import (
    MLPConfig,
    check_positive_int,
    init_mlp,
    make_mlp_batch,
    mlp_loss,
    mlp_num_params,
)
from alpa_mini.models.moe import (
    MoELMConfig,
    moe_lm_abstract_batch,
    moe_lm_abstract_params,
    moe_lm_loss,
    moe_lm_num_params,
)
from alpa_mini.models.wide_resnet import (
    WideResNetConfig,
    wide_resnet_abstract_batch,
    wide_resnet_abstract_params,
    wide_resnet_loss,
    wide_resnet_num_params,
)

__all__ = ["ModelSpec", "PublishedParallelism", "available_models"]

ModelConfig = GPTConfig | MLPConfig | MoELMConfig | WideResNetConfig

_CONFIG_PACKAGE = "alpa_mini.model_configs"
# Source checkout without an install: the configs folder next to the package.
_SOURCE_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


@dataclass(frozen=True)
class _Family:
    """What a model family needs: its config class and its closed-form and abstract views."""

    config: type
    num_params: Callable[[Any], int]
    abstract_params: Callable[[Any], Any]
    abstract_batch: Callable[[Any, int], Any]
    loss: Callable[..., jax.Array]


def _mlp_abstract_params(config: MLPConfig) -> Any:
    """The MLP's parameters as ``jax.ShapeDtypeStruct`` leaves."""
    return jax.eval_shape(lambda key: init_mlp(config, key), jax.random.key(0))


def _mlp_abstract_batch(config: MLPConfig, size: int) -> Any:
    """An MLP batch of ``size`` rows as ``jax.ShapeDtypeStruct`` leaves."""
    return jax.eval_shape(lambda key: make_mlp_batch(config, key, size), jax.random.key(0))


# family name -> its config dataclass (the ``model:`` mapping) and functions
_FAMILY_OPS: dict[str, _Family] = {
    "gpt": _Family(GPTConfig, gpt_num_params, gpt_abstract_params, gpt_abstract_batch, gpt_loss),
    "mlp": _Family(MLPConfig, mlp_num_params, _mlp_abstract_params, _mlp_abstract_batch, mlp_loss),
    "moe": _Family(
        MoELMConfig,
        moe_lm_num_params,
        moe_lm_abstract_params,
        moe_lm_abstract_batch,
        moe_lm_loss,
    ),
    "wresnet": _Family(
        WideResNetConfig,
        wide_resnet_num_params,
        wide_resnet_abstract_params,
        wide_resnet_abstract_batch,
        wide_resnet_loss,
    ),
}
_FAMILIES: dict[str, type] = {name: fam.config for name, fam in _FAMILY_OPS.items()}
_TOP_LEVEL = {"family", "description", "batch_size", "gpus", "source", "published", "model"}
_REQUIRED = {"family", "batch_size", "model"}
_TYPE_NAMES = {
    int: "an integer",
    bool: "a bool (true/false)",
    str: "a string",
    float: "a number",
    type(None): "null",
}


@dataclass(frozen=True)
class PublishedParallelism:
    """A published run's parallel layout: tensor, pipeline and data parallel degrees."""

    tp: int
    pp: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            check_positive_int("PublishedParallelism", name, getattr(self, name))

    @property
    def gpus(self) -> int:
        """Devices the layout occupies: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class ModelSpec:
    """A named model configuration of one family, with the global batch it is planned at.

    ``gpus``, ``source`` and ``published`` record where a benchmark configuration comes from:
    the GPU count it was published on, a citation, and the published parallel layout.
    """

    name: str
    family: str  # "gpt" | "mlp" | "moe" | "wresnet"
    config: ModelConfig
    batch_size: int
    description: str = ""
    gpus: int | None = None
    source: str = ""
    published: PublishedParallelism | None = None

    def __post_init__(self) -> None:
        if self.family not in _FAMILIES:
            raise ConfigError(
                f"ModelSpec.family: {self.family!r} is invalid; "
                f"expected one of {', '.join(sorted(_FAMILIES))}"
            )
        expected = _FAMILIES[self.family]
        if not isinstance(self.config, expected):
            raise ConfigError(
                f"ModelSpec.config: a {type(self.config).__name__} is invalid for family "
                f"{self.family!r}; expected a {expected.__name__}"
            )
        check_positive_int("ModelSpec", "batch_size", self.batch_size)
        for name in ("description", "source"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(
                    f"ModelSpec.{name}: {getattr(self, name)!r} is invalid; expected a string"
                )
        if self.gpus is not None:
            check_positive_int("ModelSpec", "gpus", self.gpus)
        pub = self.published
        if pub is not None and not isinstance(pub, PublishedParallelism):
            raise ConfigError(
                f"ModelSpec.published: {pub!r} is invalid; expected a PublishedParallelism"
            )
        if pub is not None and self.gpus is not None and pub.gpus != self.gpus:
            raise ConfigError(
                f"ModelSpec.published: tp*pp*dp = {pub.tp}*{pub.pp}*{pub.dp} = {pub.gpus} "
                f"is invalid; it must equal gpus ({self.gpus})"
            )

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: Any, name: str) -> ModelSpec:
        """Build from a parsed YAML document; errors name the field (not the file)."""
        if not isinstance(data, dict):
            raise ConfigError(
                f"expected a mapping with keys {', '.join(sorted(_TOP_LEVEL))}, "
                f"got {type(data).__name__}"
            )
        unknown = sorted(set(data) - _TOP_LEVEL, key=str)
        if unknown:
            raise ConfigError(
                f"{unknown[0]}: unknown field; valid fields: {', '.join(sorted(_TOP_LEVEL))}"
            )
        missing = sorted(_REQUIRED - set(data))
        if missing:
            raise ConfigError(
                f"{missing[0]}: missing field; required fields: {', '.join(sorted(_REQUIRED))}"
            )
        family = data["family"]
        if not isinstance(family, str) or family not in _FAMILIES:
            raise ConfigError(
                f"family: {family!r} is invalid; expected one of {', '.join(sorted(_FAMILIES))}"
            )
        batch_size = data["batch_size"]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size: {batch_size!r} is invalid; expected an integer >= 1")
        description, source = (_optional_str(data, key) for key in ("description", "source"))
        gpus = data.get("gpus")
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
            raise ConfigError(f"gpus: {gpus!r} is invalid; expected an integer >= 1 (or omit it)")
        published = _build_published(data.get("published"))
        config = _build_config(_FAMILIES[family], data["model"])
        try:
            return cls(name, family, config, batch_size, description, gpus, source, published)
        except ConfigError as err:  # a cross-field check: name the top-level field
            raise ConfigError(str(err).removeprefix("ModelSpec.")) from None

    @classmethod
    def from_yaml(cls, text: str, name: str = "<string>") -> ModelSpec:
        """Parse YAML ``text``; ``name`` is the spec's name and labels errors."""
        return cls._parse(text, name=name, where=name)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelSpec:
        """Load a model YAML file; the spec is named after the file's stem."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such model file")
        return cls._parse(path.read_text(), name=path.stem, where=str(path))

    @classmethod
    def named(cls, name: str) -> ModelSpec:
        """A bundled model by name (see ``available_models()``), e.g. ``"gpt-1.3b"``.

        An unknown name raises ``ConfigError`` listing the bundled names.
        """
        files = _bundled_files()
        if not isinstance(name, str) or name not in files:
            raise ConfigError(
                f"model {name!r}: unknown model name; bundled models: "
                f"{', '.join(sorted(files))} (or give the path of a model YAML)"
            )
        entry = files[name]
        return cls._parse(entry.read_text(), name=name, where=f"{entry.name} (bundled)")

    @classmethod
    def load_any(cls, name_or_path: str | os.PathLike[str]) -> ModelSpec:
        """An existing model YAML path, else a bundled model name.

        A string that looks like a path (ends in ``.yaml``/``.yml`` or contains a path
        separator) but names no file raises ``ConfigError`` ("no such model file").
        """
        if isinstance(name_or_path, os.PathLike) or (
            isinstance(name_or_path, str)
            and (Path(name_or_path).is_file() or _looks_like_path(name_or_path))
        ):
            return cls.load(name_or_path)
        return cls.named(name_or_path)  # an unknown name raises, listing the bundled names

    @classmethod
    def _parse(cls, text: str, *, name: str, where: str) -> ModelSpec:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{where}: not valid YAML ({err})") from None
        try:
            return cls.from_dict(data, name)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """The YAML document this spec loads from (the name is not part of it).

        The optional ``gpus``, ``source`` and ``published`` appear only when set.
        """
        out: dict[str, Any] = {
            "family": self.family,
            "description": self.description,
            "batch_size": self.batch_size,
        }
        if self.gpus is not None:
            out["gpus"] = self.gpus
        if self.source:
            out["source"] = self.source
        if self.published is not None:
            out["published"] = dataclasses.asdict(self.published)
        model = dataclasses.asdict(self.config)
        out["model"] = {k: list(v) if isinstance(v, tuple) else v for k, v in model.items()}
        return out

    def to_yaml(self) -> str:
        """YAML text that ``ModelSpec.from_yaml(text, name)`` reads back to an equal spec."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ------------------------------------------------------------------ the model
    def num_params(self) -> int:
        """Closed-form parameter count of the model."""
        return _FAMILY_OPS[self.family].num_params(self.config)

    def abstract_params(self) -> Any:
        """The parameter pytree with ``jax.ShapeDtypeStruct`` leaves; nothing is allocated."""
        return _FAMILY_OPS[self.family].abstract_params(self.config)

    def abstract_batch(self, batch_size: int | None = None) -> Any:
        """One batch with ``jax.ShapeDtypeStruct`` leaves (default: the spec's global batch)."""
        size = self.batch_size if batch_size is None else batch_size
        check_positive_int("abstract_batch", "batch_size", size)
        return _FAMILY_OPS[self.family].abstract_batch(self.config, size)

    def loss_fn(self) -> Callable[[Any, Any], jax.Array]:
        """``loss(params, batch) -> scalar`` with this spec's config bound."""
        return functools.partial(_FAMILY_OPS[self.family].loss, config=self.config)


def _optional_str(data: dict[str, Any], key: str) -> str:
    """Top-level ``key`` as a string ("" when absent or null); else a ConfigError naming it."""
    value = data.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: {value!r} is invalid; expected a string")
    return value


def _build_published(data: Any) -> PublishedParallelism | None:
    """The ``published:`` mapping ``{tp, pp, dp}``; errors name ``published.<field>``."""
    if data is None:
        return None
    fields = ("tp", "pp", "dp")
    if not isinstance(data, dict):
        raise ConfigError(
            f"published: {data!r} is invalid; expected a mapping with keys {', '.join(fields)}"
        )
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            f"published.{unknown[0]}: unknown field; valid fields: {', '.join(fields)}"
        )
    for key in fields:
        if key not in data:
            raise ConfigError(f"published.{key}: missing field; required: {', '.join(fields)}")
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"published.{key}: {value!r} is invalid; expected an integer >= 1")
    return PublishedParallelism(data["tp"], data["pp"], data["dp"])


def _describe(hint: Any) -> str:
    """A type hint in words, for error messages."""
    if typing.get_origin(hint) is tuple:
        return "a list of integers"
    args = typing.get_args(hint)
    if args:
        return " or ".join(_describe(a) for a in args)
    return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _coerce(hint: Any, value: Any) -> tuple[bool, Any]:
    """(whether ``value`` fits the hint, the value to construct with).

    A bool never passes for a number, an int passes for a float, and a list of ints passes for
    ``tuple[int, ...]`` (YAML has no tuples).
    """
    if typing.get_origin(hint) is tuple:
        ok = isinstance(value, list | tuple) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
        return ok, tuple(value) if ok else value
    args = typing.get_args(hint)
    if args:  # a union such as ``int | None``
        for arg in args:
            ok, out = _coerce(arg, value)
            if ok:
                return True, out
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return True, float(value)
    ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
    return ok, value


def _build_config(cls: type, data: Any) -> ModelConfig:
    """Type-check ``data`` against ``cls``'s fields, then construct (which checks values)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(data, dict):
        raise ConfigError(
            f"model: expected a mapping of {cls.__name__} fields "
            f"({', '.join(fields)}), got {type(data).__name__}"
        )
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            f"model.{unknown[0]}: unknown field for {cls.__name__}; "
            f"valid fields: {', '.join(fields)}"
        )
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [n for n in required if n not in data]
    if missing:
        raise ConfigError(
            f"model.{missing[0]}: missing field; {cls.__name__} requires {', '.join(required)}"
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        ok, values[key] = _coerce(hints[key], value)
        if not ok:
            raise ConfigError(
                f"model.{key}: {value!r} is invalid; expected {_describe(hints[key])}"
            )
    try:
        return cls(**values)
    except ConfigError as err:
        raise ConfigError(f"model: {err}") from None


def _bundled_files() -> dict[str, Any]:
    """Bundled model name -> its YAML."""
    return bundled_yaml_files(_CONFIG_PACKAGE, _SOURCE_CONFIGS)


def available_models() -> tuple[str, ...]:
    """Names of the bundled model configs, for ``ModelSpec.named`` / ``ModelSpec.load_any``."""
    return tuple(sorted(_bundled_files()))


def _looks_like_path(text: str) -> bool:
    seps = {"/", os.sep, *([os.altsep] if os.altsep else [])}
    return text.endswith((".yaml", ".yml")) or any(sep in text for sep in seps)
