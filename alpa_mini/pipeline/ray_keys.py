"""Typed PRNG keys on the Ray runtime: they travel as their key data.

Host workers take step inputs and hand back step outputs as NumPy arrays (through Ray's
object store), which a key array (``jax.random.key``) cannot be. So the driver plans and
runs the step with each key argument replaced by its data (``jax.random.key_data``: uint32,
the key's shape plus the implementation's trailing dimensions), wraps the data back into a
key of the same implementation inside the traced step (``KeysAsData``), and returns key
outputs as their data, which the driver wraps again for the caller. The key's bits are
unchanged both ways, so the step draws the same numbers as on the local runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ..errors import ConfigError
from ..graph.tracing import is_prng_key

__all__ = ["KeysAsData", "data_aval", "data_to_keys", "key_impls", "keys_to_data"]


def key_impls(avals: Sequence[Any]) -> dict[int, str]:
    """Flat leaf -> the name of its PRNG implementation, for the leaves that are keys."""
    out: dict[int, str] = {}
    for k, a in enumerate(avals):
        if is_prng_key(a):
            seen: list[str] = []
            jax.eval_shape(lambda x, seen=seen: seen.append(str(jax.random.key_impl(x))), a)
            out[k] = seen[0]
    return out


def data_aval(aval: Any) -> jax.ShapeDtypeStruct:
    """The abstract key data of an abstract key array."""
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))


@dataclass(eq=False)  # hashed by identity, as jax.jit wants of a function
class KeysAsData:
    """A flat step (``executable.StepFun``) that takes its key leaves ``impls`` as key data
    and returns its key outputs as key data; picklable, as workers trace it too.
    ``out_impls`` records, once traced, which flat outputs were keys (and their
    implementations)."""

    step_fun: Any
    impls: dict[int, str]
    out_impls: dict[int, str] = field(default_factory=dict)

    def __call__(self, *leaves: Any) -> Any:
        args = list(leaves)
        for k, impl in self.impls.items():
            args[k] = jax.random.wrap_key_data(args[k], impl=impl)
        out = self.step_fun(*args)
        flat, tree = jax.tree.flatten(out)
        self.out_impls = {
            o: str(jax.random.key_impl(x)) for o, x in enumerate(flat) if is_prng_key(x)
        }
        return jax.tree.unflatten(
            tree, [jax.random.key_data(x) if is_prng_key(x) else x for x in flat]
        )

    @property
    def leaf_names(self) -> list[str]:
        return self.step_fun.leaf_names


def keys_to_data(flat: list[Any], impls: dict[int, str], names: Sequence[str]) -> None:
    """Replace, in place, each key argument leaf with its data as a NumPy array; a leaf that
    is not a key of the planned implementation is an error naming it."""
    for k, impl in impls.items():
        leaf = flat[k]
        got = str(jax.random.key_impl(leaf)) if is_prng_key(leaf) else None
        if got != impl:
            what = "not a PRNG key" if got is None else f"a {got} key"
            raise ConfigError(
                f"argument leaf {names[k] if k < len(names) else k}: "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)} is {what}; this step was "
                f"planned for a {impl} key (jax.random.key(..., impl={impl!r}))"
            )
        flat[k] = np.asarray(jax.random.key_data(leaf))


def data_to_keys(outs: list[Any], impls: dict[int, str]) -> None:
    """Replace, in place, each key output's data (a fetched handle or an array) with the key:
    a small array on the driver's default device."""
    for o, impl in impls.items():
        outs[o] = jax.random.wrap_key_data(np.asarray(outs[o]), impl=impl)
