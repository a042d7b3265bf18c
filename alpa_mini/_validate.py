"""Shared checks for user-given values: each error names the field, the value and what is
valid. No JAX here, so the cluster descriptions can use it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .errors import ConfigError

__all__ = [
    "MAX_SIZE",
    "Fields",
    "check_choice",
    "check_int",
    "check_list",
    "check_number",
    "format_bytes",
    "positive_int",
]


#: The largest array dimension or count the planner represents: shapes become int64 numpy
#: arrays and products of a few dimensions must not overflow them.
MAX_SIZE = 2**31 - 1


def positive_int(
    where: str, value: Any, error: type[ValueError] = ConfigError, high: int | None = None
) -> int:
    """``value`` if it is an int in [1, ``high``] (not a bool); else ``error`` naming
    ``where``, the value and the valid range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{where}: {_shown(value)} is invalid; expected an integer >= 1")
    if high is not None and value > high:
        raise error(f"{where}: {value} is too large; expected an integer from 1 to {high}")
    return int(value)


def format_bytes(b: float, digits: int = 1) -> str:
    """A byte count in the unit that shows it: ``512 B``, ``1.5 KiB``, ... ``2.0 TiB``."""
    value = float(b)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.{digits}f} {unit}"
        value /= 1024
    return f"{value:.{digits}f} TiB"


def check_choice(where: str, value: Any, choices: Sequence[str]) -> None:
    """Raise a ``ConfigError`` naming ``where`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{where}: {value!r} is not one of {valid}")


_MISSING: Any = object()


class Fields:
    """Typed reads of one mapping from a file (a saved plan, a config), each error naming
    the field's full path (``plan.stages[1].devices[2]``), the value and what is valid; no
    silent conversions (1.5 is not an int, true is not a number, NaN is not a latency)."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_shown(data)}")
        self.data, self.where = data, where

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise ConfigError(f"{self.where}.{key}: missing")
        return default

    def int(self, key: str, *, low: int | None = None, default: Any = _MISSING) -> int:
        return check_int(f"{self.where}.{key}", self._get(key, default), low=low)

    def number(self, key: str, *, low: float | None = None, default: Any = _MISSING) -> float:
        return check_number(f"{self.where}.{key}", self._get(key, default), low=low)

    def text(self, key: str, choices: Sequence[str] | None = None, default: Any = _MISSING) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise ConfigError(f"{self.where}.{key}: {_shown(value)} is invalid; expected a string")
        if choices is not None:
            check_choice(f"{self.where}.{key}", value, choices)
        return value

    def list(self, key: str, *, length: int | None = None, default: Any = _MISSING) -> list[Any]:
        return check_list(f"{self.where}.{key}", self._get(key, default), length=length)

    def ints(
        self,
        key: str,
        *,
        length: int | None = None,
        low: int | None = None,
        default: Any = _MISSING,
    ) -> tuple[int, ...]:
        values = self.list(key, length=length, default=default)
        return tuple(
            check_int(f"{self.where}.{key}[{i}]", v, low=low) for i, v in enumerate(values)
        )

    def sub(self, key: str) -> Fields:
        return Fields(self._get(key, _MISSING), f"{self.where}.{key}")


def check_int(where: str, value: Any, *, low: int | None = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``low``; else a ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {_shown(value)} is invalid; expected an integer")
    if low is not None and value < low:
        raise ConfigError(f"{where}: {value} is invalid; expected an integer >= {low}")
    return value


def check_number(where: str, value: Any, *, low: float | None = None) -> float:
    """``value`` as a float if it is a finite number (not a bool) of at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: {_shown(value)} is invalid; expected a finite number")
    if low is not None and value < low:
        raise ConfigError(f"{where}: {value} is invalid; expected a number >= {low}")
    return float(value)


def check_list(where: str, value: Any, *, length: int | None = None) -> list[Any]:
    """``value`` if it is a list (of ``length`` items, when given)."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}: {_shown(value)} is invalid; expected a list")
    if length is not None and len(value) != length:
        raise ConfigError(f"{where}: {_shown(value)} has {len(value)} items; expected {length}")
    return list(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
