"""Shared checks for user-given values: each error names the field, the value and what is
valid. No JAX here, so the cluster descriptions can use it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import ConfigError

__all__ = ["check_choice", "positive_int"]


def positive_int(where: str, value: Any, error: type[ValueError] = ConfigError) -> int:
    """``value`` if it is an int >= 1 (not a bool); else ``error`` naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{where}: {value!r} is invalid; expected an integer >= 1")
    return int(value)


def check_choice(where: str, value: Any, choices: Sequence[str]) -> None:
    """Raise a ``ConfigError`` naming ``where`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{where}: {value!r} is not one of {valid}")
