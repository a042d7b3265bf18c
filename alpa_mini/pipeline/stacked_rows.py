"""A split stack's row pieces at a pipeshard step's edge: inputs cut into the pieces the
stages read, outputs joined into one ``jax.Array`` per user leaf.

Pieces of equal length and layout on disjoint, equally shaped meshes join without a copy
into one array sharded along its leading (layer) axis over all their devices; fed back, such
an array is cut into pieces without a copy either. Equal-length pieces whose stages laid
them out differently are first resharded, each inside its own stage's mesh, into the first
piece's layout (stages plan their layouts independently), then joined so. Pieces on the same
mesh are concatenated there; anything else is gathered onto the first piece's mesh (a copy,
with a warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .lower.apply_grad import entry_axes

__all__ = ["STACK_AXIS", "join_rows", "take_rows", "union_sharding"]

#: The mesh axis that orders joined pieces (the stages holding them).
STACK_AXIS = "stack"


def take_rows(x: Any, start: int, stop: int, layout: NamedSharding | None) -> Any:
    """Rows ``start:stop`` of ``x``: its own device buffers when they already are those rows
    in ``layout``, else a slice (the step moves it into place)."""
    if isinstance(x, jax.Array) and layout is not None:
        shape = (stop - start, *x.shape[1:])
        want = layout.devices_indices_map(shape)
        have = {s.device: s for s in x.addressable_shards}
        bufs = []
        for device, index in want.items():
            shard = have.get(device)
            if shard is None or _bounds(shard.index, x.shape) != _bounds(
                index, shape, offset=start
            ):
                bufs = None
                break
            bufs.append(shard.data)
        if bufs is not None:
            return jax.make_array_from_single_device_arrays(shape, layout, bufs)
    if isinstance(x, jax.Array):
        return x[start:stop]
    return np.asarray(x)[start:stop]


def _bounds(index: tuple[Any, ...], shape: Sequence[int], offset: int = 0) -> tuple:
    """(start, stop) per dimension of a shard index, the first shifted by ``offset``."""
    out = []
    for d, size in enumerate(shape):
        sl = index[d] if d < len(index) else slice(None)
        a, b, _ = sl.indices(size)
        out.append((a + offset, b + offset) if d == 0 else (a, b))
    return tuple(out)


def join_rows(parts: Sequence[Any], name: str = "a stacked output") -> Any:
    """One array of ``parts``' rows in order (see the module docstring for where it lives)."""
    if not all(isinstance(p, jax.Array) and isinstance(p.sharding, NamedSharding) for p in parts):
        return jnp.concatenate([jnp.asarray(p) for p in parts])
    groups: list[list[jax.Array]] = []
    for p in parts:
        if groups and groups[-1][0].sharding.device_set == p.sharding.device_set:
            groups[-1].append(p)
        else:
            groups.append([p])
    joined = [g[0] if len(g) == 1 else _concat_on(g, g[0].sharding) for g in groups]
    if len(joined) == 1:
        return joined[0]
    union = _union(joined)
    if union is None:  # stages laid the rows out differently: align them, each on its own mesh
        aligned = _aligned(joined)
        union = None if aligned is None else _union(aligned)
    if union is not None:
        return union
    warnings.warn(
        f"{name}: its row pieces differ in length or layout across stages, so it is gathered "
        "onto the first stage's devices (a copy each step); cut the stack into equal runs on "
        "equal submeshes to keep it in place",
        stacklevel=3,
    )
    first = joined[0].sharding
    home = NamedSharding(first.mesh, PartitionSpec())
    return _concat_on([jax.device_put(p, home) for p in joined], home)


def _aligned(parts: Sequence[jax.Array]) -> list[jax.Array] | None:
    """The pieces each resharded, on its own devices, into the first piece's layout, when
    their meshes have one shape and axis names (a reshard inside each stage's submesh, not
    a gather onto one stage); None otherwise."""
    first = parts[0].sharding
    out = []
    for p in parts:
        sh = p.sharding
        if sh.mesh.axis_names != first.mesh.axis_names or sh.mesh.devices.shape != (
            first.mesh.devices.shape
        ):
            return None
        want = NamedSharding(sh.mesh, first.spec)
        if not _divides(want, p.shape):
            return None
        out.append(
            p if PartitionSpec(*sh.spec) == PartitionSpec(*first.spec) else jax.device_put(p, want)
        )
    return out


def _concat_on(parts: Sequence[jax.Array], sharding: NamedSharding) -> jax.Array:
    total = sum(p.shape[0] for p in parts)
    if not _divides(sharding, (total, *parts[0].shape[1:])):
        sharding = NamedSharding(sharding.mesh, PartitionSpec())
    return jax.jit(lambda *p: jnp.concatenate(p), out_shardings=sharding)(*parts)


def _divides(sharding: NamedSharding, shape: Sequence[int]) -> bool:
    for d, entry in enumerate(sharding.spec):
        n = 1
        for a in entry_axes(entry):
            n *= sharding.mesh.shape[a]
        if d < len(shape) and shape[d] % n:
            return False
    return True


def _union(parts: Sequence[jax.Array]) -> jax.Array | None:
    """The pieces as one array sharded over a mesh (piece, *the pieces' mesh axes), when
    they have one length, one layout and meshes of one shape on disjoint devices."""
    if len({(p.shape, p.dtype) for p in parts}) != 1:
        return None
    sharding = union_sharding([p.sharding for p in parts], parts[0].ndim)
    if sharding is None:
        return None
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    bufs = [s.data for p in parts for s in p.addressable_shards]
    return jax.make_array_from_single_device_arrays(shape, sharding, bufs)


def union_sharding(shardings: Sequence[Any], ndim: int) -> NamedSharding | None:
    """The layout of equal-length row pieces laid out by ``shardings`` joined along their
    leading axis: a mesh (``STACK_AXIS``, *their axes*) over all their devices, the rows
    split over ``STACK_AXIS`` first. None when the pieces' meshes or layouts differ."""
    if not shardings or not all(isinstance(s, NamedSharding) for s in shardings) or ndim < 1:
        return None
    first = shardings[0]
    mesh = first.mesh
    if STACK_AXIS in mesh.axis_names:
        return None
    for sh in shardings[1:]:
        if (
            sh.mesh.axis_names != mesh.axis_names
            or sh.mesh.devices.shape != mesh.devices.shape
            or PartitionSpec(*sh.spec) != PartitionSpec(*first.spec)
        ):
            return None
    devices = np.stack([sh.mesh.devices for sh in shardings])
    if len({d.id for d in devices.flat}) != devices.size:
        return None
    spec = [*first.spec] + [None] * (ndim - len(first.spec))
    lead = (STACK_AXIS, *entry_axes(spec[0]))
    spec[0] = lead if len(lead) > 1 else lead[0]
    return NamedSharding(Mesh(devices, (STACK_AXIS, *mesh.axis_names)), PartitionSpec(*spec))
