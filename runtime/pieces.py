"""An array as parts held by several processes, and laying such parts out on devices.

A buffer that crosses hosts (``Send``/``Recv``) and a checkpointed array written by several
hosts both travel as ``Pieces``: ``(index, data)`` pairs, each distinct shard once, from the
lowest process that holds it; ``place`` builds any destination layout from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Pieces", "own_pieces", "pieces_for", "place"]


@dataclass(frozen=True)
class Pieces:
    """Parts of one array of ``shape`` and ``dtype``: ``(index, data)`` pairs, ``index`` a
    tuple of slices into the whole (shards as their holders sent them)."""

    shape: tuple[int, ...]
    dtype: Any
    parts: tuple[tuple[tuple[slice, ...], Any], ...]

    def merged(self, other: Pieces) -> Pieces:
        return Pieces(self.shape, self.dtype, self.parts + other.parts)

    def region(self, index: tuple[slice, ...]) -> Any:
        """The values of ``index`` (a device's shard), put together from the parts."""
        import numpy as np

        want = [_bounds(s, n) for s, n in zip(index, self.shape, strict=True)]
        out = np.empty([hi - lo for lo, hi in want], self.dtype)
        filled = 0
        for idx, data in self.parts:
            have = [_bounds(s, n) for s, n in zip(idx, self.shape, strict=True)]
            lo = [max(a[0], b[0]) for a, b in zip(want, have, strict=True)]
            hi = [min(a[1], b[1]) for a, b in zip(want, have, strict=True)]
            if any(l >= h for l, h in zip(lo, hi, strict=True)):
                continue
            dst = tuple(slice(l - w[0], h - w[0]) for l, h, w in zip(lo, hi, want, strict=True))
            src = tuple(slice(l - v[0], h - v[0]) for l, h, v in zip(lo, hi, have, strict=True))
            out[dst] = data[src]
            filled += int(np.prod([h - l for l, h in zip(lo, hi, strict=True)]))
        if filled < out.size:
            raise RuntimeError(
                f"a transfer of a {self.shape} array lacks part of {index}: only {filled} of "
                f"{out.size} values arrived (an instruction stream split wrongly)"
            )
        return out


def _bounds(s: slice, n: int) -> tuple[int, int]:
    start, stop, _ = s.indices(n)
    return start, stop


def pieces_for(value: Any, sharding: Any, to: int) -> Pieces:
    """The shards of ``value`` held on this process that process ``to``'s devices need under
    ``sharding``, each distinct shard only from the lowest process holding it."""
    import numpy as np

    shape = tuple(value.shape)
    if not hasattr(value, "addressable_shards"):  # a host array: all of it
        whole = tuple(slice(0, n) for n in shape)
        return Pieces(shape, value.dtype, ((whole, np.asarray(value)),))
    wanted = [
        tuple(_bounds(s, n) for s, n in zip(idx, shape, strict=True))
        for d, idx in sharding.devices_indices_map(shape).items()
        if d.process_index == to
    ]
    parts = []
    for index, shard in _first_held(value):
        key = tuple(_bounds(s, n) for s, n in zip(index, shape, strict=True))
        overlaps = any(
            all(max(a[0], b[0]) < min(a[1], b[1]) for a, b in zip(key, w, strict=True))
            for w in wanted
        )
        if overlaps or not shape:
            parts.append((index, np.asarray(shard)))
    return Pieces(shape, value.dtype, tuple(parts))


def own_pieces(value: Any) -> Pieces:
    """The distinct shards of ``value`` that this process holds first (lowest process
    index): over all processes holding it, each part of the array exactly once."""
    import numpy as np

    shape = tuple(value.shape)
    if not hasattr(value, "addressable_shards"):
        whole = tuple(slice(0, n) for n in shape)
        return Pieces(shape, np.dtype(value.dtype), ((whole, np.asarray(value)),))
    parts = tuple((index, np.asarray(data)) for index, data in _first_held(value))
    return Pieces(shape, np.dtype(value.dtype), parts)


def _first_held(value: Any) -> list[tuple[tuple[slice, ...], Any]]:
    """``(index, data)`` of each distinct shard of ``value`` whose lowest holding process
    is this one (``data`` still on its device)."""
    shape = tuple(value.shape)
    first_holder: dict[Any, int] = {}
    for d, idx in value.sharding.devices_indices_map(shape).items():
        key = tuple(_bounds(s, n) for s, n in zip(idx, shape, strict=True))
        first_holder[key] = min(first_holder.get(key, d.process_index), d.process_index)
    found, seen = [], set()
    for shard in value.addressable_shards:
        key = tuple(_bounds(s, n) for s, n in zip(shard.index, shape, strict=True))
        if key in seen or first_holder[key] != shard.device.process_index:
            continue
        seen.add(key)
        found.append((shard.index, shard.data))
    return found


def place(value: Any, sharding: Any) -> Any:
    """``value`` laid out as ``sharding``, also where either spans hosts of a group.

    A value held whole on this host (numpy, or an array on local devices) becomes this
    host's shards of a sharding that spans hosts (every member host does the same with its
    own whole copy); received ``Pieces`` become the shards they cover. A value that spans
    hosts can only be re-laid over the same devices (JAX moves nothing between device sets
    across processes): it crosses by ``Send``/``Recv`` of its pieces instead.
    """
    import jax

    if isinstance(value, Pieces):
        return jax.make_array_from_callback(value.shape, sharding, value.region)
    if getattr(value, "is_fully_addressable", True):
        if sharding.is_fully_addressable or not isinstance(value, jax.Array):
            return jax.device_put(value, sharding)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
    if value.sharding.device_set != sharding.device_set:
        raise RuntimeError(
            f"a value sharded over devices {sorted(d.id for d in value.sharding.device_set)} "
            f"cannot move to devices {sorted(d.id for d in sharding.device_set)} but by "
            "Send/Recv of its pieces (an instruction stream split wrongly)"
        )
    return jax.device_put(value, sharding)
