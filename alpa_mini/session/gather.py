"""``alpa_mini.gather``: lay a step's outputs out on one mesh for plain JAX code.

A pipeshard step returns each stage's values on that stage's devices, so a plain ``jax.jit``
that reads parameters of two stages sees arrays on two device sets and refuses them.
Parallelized functions accept such inputs as they are; for anything else, ``gather`` copies
them device to device onto one mesh (Ray outputs come through the driver's host memory).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import local

__all__ = ["gather"]


def gather(tree: Any, sharding: Any = None) -> Any:
    """``tree`` with every array on one mesh: replicated over the devices of
    ``alpa_mini.init``'s cluster (all devices without it) by default, or laid out by
    ``sharding`` (a ``jax.sharding.Sharding``, or a pytree prefix of them, as
    ``jax.device_put`` takes)."""
    if sharding is None:
        sharding = NamedSharding(Mesh(np.array(_devices()), ("devices",)), PartitionSpec())
    elif not _is_sharding_tree(sharding):
        raise TypeError(
            f"sharding: {type(sharding).__name__} is not a jax.sharding.Sharding or a pytree "
            "of them; pass None to replicate over every device"
        )
    return jax.device_put(jax.tree.map(_on_this_process, tree), sharding)


def _devices() -> list[Any]:
    if local.is_initialized():
        return jax.devices()[: local.current_cluster().num_devices]
    return jax.devices()


def _is_sharding_tree(sharding: Any) -> bool:
    leaves = jax.tree.leaves(sharding, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return bool(leaves) and all(isinstance(x, jax.sharding.Sharding) for x in leaves)


def _on_this_process(x: Any) -> Any:
    """A Ray step's ``RemoteArray`` fetched to the driver; anything else as it is."""
    ray_driver = sys.modules.get("alpa_mini.pipeline.ray_driver")
    if ray_driver is not None and isinstance(x, ray_driver.RemoteArray):
        return np.asarray(x)
    return x
