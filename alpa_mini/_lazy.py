"""Lazy re-exports (PEP 562): a package names its public objects without importing JAX."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(
    package: str,
    table: Mapping[str, str],
    moved: Mapping[str, str] | None = None,
    subpackages: tuple[str, ...] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    ``table`` maps a public name to the module that defines it, relative to the package (a
    leading dot for a sibling package); ``moved`` maps a former name to its new home, which
    the AttributeError names; ``subpackages`` import on first attribute access, as
    ``jax.numpy`` does.
    """
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None and name in subpackages:
            return import_module(f".{name}", package)
        if module is None:
            if name in moved:
                raise AttributeError(f"{package}.{name} moved: use {moved[name]}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        relative = module if module.startswith(".") else f".{module}"
        value = getattr(import_module(relative, package), name)
        import_module(package).__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*table, *getattr(import_module(package), "__all__", ())})

    return __getattr__, __dir__
