"""Benchmark model configurations: ``ModelSpec`` (a model config plus its global batch).

The bundled configs ship inside the package as ``alpa_mini.model_configs`` (the folder
``configs/models``): the GPT sizes of Alpa's benchmark suite (``gpt-350m`` ... ``gpt-76b``),
``gpt3-175b``, and small models for tests and the demo (``gpt-tiny``, ``gpt-small``,
``mlp-small``). ``ModelSpec.named("gpt-1.3b")`` / ``ModelSpec.load_any(name_or_path)`` load
them and ``available_models()`` lists them.

A model YAML has these top-level keys::

    family: gpt            # "gpt" (GPTConfig) or "mlp" (MLPConfig)
    description: "..."     # optional
    batch_size: 1024       # global batch, an integer >= 1
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

from alpa_mini.cluster import ConfigError, bundled_yaml_files
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

__all__ = ["ModelSpec", "available_models"]

_CONFIG_PACKAGE = "alpa_mini.model_configs"
# Source checkout without an install: the configs folder next to the package.
_SOURCE_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"

# family name -> the config dataclass its ``model:`` mapping describes
_FAMILIES: dict[str, type[GPTConfig] | type[MLPConfig]] = {"gpt": GPTConfig, "mlp": MLPConfig}
_TOP_LEVEL = {"family", "description", "batch_size", "model"}
_REQUIRED = {"family", "batch_size", "model"}
_TYPE_NAMES = {int: "an integer", bool: "a bool (true/false)", str: "a string"}


@dataclass(frozen=True)
class ModelSpec:
    """A named model configuration of one family, with the global batch it is planned at."""

    name: str
    family: str  # "gpt" | "mlp"
    config: GPTConfig | MLPConfig
    batch_size: int
    description: str = ""

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
        if not isinstance(self.description, str):
            raise ConfigError(
                f"ModelSpec.description: {self.description!r} is invalid; expected a string"
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
        description = data.get("description", "")
        if description is None:
            description = ""
        if not isinstance(description, str):
            raise ConfigError(f"description: {description!r} is invalid; expected a string")
        config = _build_config(_FAMILIES[family], data["model"])
        return cls(name, family, config, batch_size, description)

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
        """The YAML document this spec loads from (the name is not part of it)."""
        return {
            "family": self.family,
            "description": self.description,
            "batch_size": self.batch_size,
            "model": dataclasses.asdict(self.config),
        }

    def to_yaml(self) -> str:
        """YAML text that ``ModelSpec.from_yaml(text, name)`` reads back to an equal spec."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ------------------------------------------------------------------ the model
    def num_params(self) -> int:
        """Closed-form parameter count of the model."""
        if isinstance(self.config, GPTConfig):
            return gpt_num_params(self.config)
        return mlp_num_params(self.config)

    def abstract_params(self) -> Any:
        """The parameter pytree with ``jax.ShapeDtypeStruct`` leaves; nothing is allocated."""
        config = self.config
        if isinstance(config, GPTConfig):
            return gpt_abstract_params(config)
        return jax.eval_shape(lambda key: init_mlp(config, key), jax.random.key(0))

    def abstract_batch(self, batch_size: int | None = None) -> Any:
        """One batch with ``jax.ShapeDtypeStruct`` leaves (default: the spec's global batch)."""
        size = self.batch_size if batch_size is None else batch_size
        check_positive_int("abstract_batch", "batch_size", size)
        config = self.config
        if isinstance(config, GPTConfig):
            return gpt_abstract_batch(config, size)
        return jax.eval_shape(lambda key: make_mlp_batch(config, key, size), jax.random.key(0))

    def loss_fn(self) -> Callable[[Any, Any], jax.Array]:
        """``loss(params, batch) -> scalar`` with this spec's config bound."""
        if isinstance(self.config, GPTConfig):
            return functools.partial(gpt_loss, config=self.config)
        return functools.partial(mlp_loss, config=self.config)


def _build_config(cls: type[GPTConfig] | type[MLPConfig], data: Any) -> GPTConfig | MLPConfig:
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
    for key, value in data.items():
        expected = hints[key]
        ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
        if not ok:
            raise ConfigError(
                f"model.{key}: {value!r} is invalid; expected "
                f"{_TYPE_NAMES.get(expected, expected.__name__)}"
            )
    try:
        return cls(**data)
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
