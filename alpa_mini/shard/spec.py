"""How one tensor is laid out on a logical mesh: per dimension, the mesh axes it is split over.

A ``ShardingSpec`` is the planner's own, mesh-independent view of a ``PartitionSpec``: axes are
integer indices into the logical mesh shape, so the same spec prices and lowers on any mesh
of that rank. Axes not named by any dimension hold replicas.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["ShardingSpec", "enumerate_specs"]


@dataclass(frozen=True, eq=False)
class ShardingSpec:
    """``dims[i]``: the mesh axes (major to minor) that tensor dimension i is split over."""

    dims: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for i, axes in enumerate(self.dims):
            for a in axes:
                if a in seen or a < 0:
                    raise ValueError(
                        f"ShardingSpec.dims[{i}]: mesh axis {a} is negative or used twice "
                        f"in {self.dims}"
                    )
                seen.add(a)
        # Specs key many dicts while planning; hash the tuple once.
        object.__setattr__(self, "_hash", hash(self.dims))
        object.__setattr__(self, "_used", frozenset(seen))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardingSpec) and self.dims == other.dims

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @classmethod
    def replicated(cls, ndim: int) -> ShardingSpec:
        return cls(((),) * ndim)

    @classmethod
    def from_partition_spec(
        cls, pspec: Sequence[object], ndim: int, axis_names: Sequence[str]
    ) -> ShardingSpec:
        """The spec of a ``PartitionSpec`` over a mesh with ``axis_names``."""
        index = {name: i for i, name in enumerate(axis_names)}
        dims: list[tuple[int, ...]] = []
        entries = list(pspec) + [None] * (ndim - len(pspec))
        for i, entry in enumerate(entries[:ndim]):
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            for name in names:
                if name not in index:
                    raise ValueError(
                        f"PartitionSpec[{i}]: axis {name!r} is not a mesh axis; "
                        f"valid axes are {list(axis_names)}"
                    )
            dims.append(tuple(index[n] for n in names))
        return cls(tuple(dims))

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def used_axes(self) -> frozenset[int]:
        return self._used  # type: ignore[attr-defined]

    @property
    def placement(self) -> dict[int, tuple[int, int]]:
        """Mesh axis -> (tensor dim, position among that dim's axes); shared, do not mutate."""
        return _placement(self)

    def num_shards(self, mesh_shape: Sequence[int]) -> int:
        return _num_shards(self, tuple(mesh_shape))

    def dim_shards(self, dim: int, mesh_shape: Sequence[int]) -> int:
        return math.prod(mesh_shape[a] for a in self.dims[dim])

    def fits(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
        """Every split dimension divides evenly and every axis exists on the mesh."""
        if len(shape) != self.ndim:
            return False
        for size, axes in zip(shape, self.dims, strict=True):
            if any(a >= len(mesh_shape) for a in axes):
                return False
            if size % math.prod(mesh_shape[a] for a in axes):
                return False
        return True

    def shard_shape(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(
            size // math.prod(mesh_shape[a] for a in axes)
            for size, axes in zip(shape, self.dims, strict=True)
        )

    def to_partition_spec(self, axis_names: Sequence[str]) -> object:
        """The ``jax.sharding.PartitionSpec`` (imported lazily so this module stays light)."""
        from jax.sharding import PartitionSpec

        entries: list[object] = []
        for axes in self.dims:
            if not axes:
                entries.append(None)
            elif len(axes) == 1:
                entries.append(axis_names[axes[0]])
            else:
                entries.append(tuple(axis_names[a] for a in axes))
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def label(self, axis_names: Sequence[str] | None = None) -> str:
        """Compact text: ``R`` per replicated dim, else its split axes, e.g. ``S(x)R``."""
        if not self.dims:
            return "scalar"
        parts = []
        for axes in self.dims:
            if not axes:
                parts.append("R")
            else:
                names = [axis_names[a] if axis_names else str(a) for a in axes]
                parts.append("S(" + ",".join(names) + ")")
        return "".join(parts)

    def __str__(self) -> str:
        return self.label()

    def to_list(self) -> list[list[int]]:
        return [list(axes) for axes in self.dims]

    @classmethod
    def from_list(cls, data: Sequence[Sequence[int]]) -> ShardingSpec:
        return cls(tuple(tuple(int(a) for a in axes) for axes in data))


@functools.lru_cache(maxsize=65536)
def _placement(spec: ShardingSpec) -> dict[int, tuple[int, int]]:
    return {a: (d, i) for d, axes in enumerate(spec.dims) for i, a in enumerate(axes)}


@functools.lru_cache(maxsize=65536)
def _num_shards(spec: ShardingSpec, mesh_shape: tuple[int, ...]) -> int:
    """Devices one shard spans the tensor over: the planner's hottest question, so cached."""
    return math.prod(mesh_shape[a] for axes in spec.dims for a in axes)


def enumerate_specs(
    shape: Sequence[int], mesh_shape: Sequence[int], *, allowed_dims: Sequence[int] | None = None
) -> Iterator[ShardingSpec]:
    """Every spec that gives each mesh axis of size > 1 to one dimension (or none) and divides.

    Axes split one dimension in increasing axis order; size-1 mesh axes are never used (they
    change nothing). ``allowed_dims`` restricts which dimensions may be split.
    """
    ndim = len(shape)
    dims_ok = list(range(ndim)) if allowed_dims is None else list(allowed_dims)
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    seen: set[ShardingSpec] = set()
    for assignment in itertools.product([None, *dims_ok], repeat=len(axes)):
        dims: list[list[int]] = [[] for _ in range(ndim)]
        for axis, dim in zip(axes, assignment, strict=True):
            if dim is not None:
                dims[dim].append(axis)
        spec = ShardingSpec(tuple(tuple(d) for d in dims))
        if spec in seen or not spec.fits(shape, mesh_shape):
            continue
        seen.add(spec)
        yield spec
