"""Reductions kept out of accumulation loops, as Alpa's gradient-accumulation rewrite does.

Inside a scan that accumulates (``graph/accumulation.py``: ``alpa_mini.grad``'s micro-batch
loop, a transposed layer stack), a matmul or sum that contracts a dimension split over mesh
axes S would be reduced across S in every iteration. Lowered here, it instead yields each
group's partial result: an array with a leading groups axis laid out over S, computed
without communication. Linear steps carry that axis along (``jax.vmap``), the loop's carry
adds the partials up, and one reduction after the loop gives the planned layout. Anything
else that reads a partial value reduces it first, where the plan priced the reduction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..graph.accumulation import linear_operands
from ..graph.jaxpr_walk import bind_equation

__all__ = ["Grouped", "apply_linear", "grouped_sharding", "into_groups", "source"]


@dataclass(frozen=True)
class Grouped:
    """A value held as per-group partial sums: ``value[g]`` for group ``g`` of the devices
    along mesh ``axes``; the value itself is ``value.sum(0)``."""

    value: Any
    axes: tuple[str, ...]

    def reduced(self) -> Any:
        return jnp.sum(self.value, axis=0)


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entries(spec: PartitionSpec | None, ndim: int) -> list[Any]:
    entries = list(spec) if spec is not None else []
    return entries + [None] * (ndim - len(entries))


def grouped_sharding(
    mesh: Mesh, spec: PartitionSpec | None, axes: tuple[str, ...], ndim: int
) -> NamedSharding:
    """Layout of partials of a value planned as ``spec``: groups over ``axes``, the value's
    own dimensions as planned minus those axes."""
    rest = []
    for entry in _entries(spec, ndim):
        kept = tuple(a for a in _axes_of(entry) if a not in axes)
        rest.append(kept if len(kept) > 1 else kept[0] if kept else None)
    lead = axes if len(axes) > 1 else axes[0]
    return NamedSharding(mesh, PartitionSpec(lead, *rest))


def into_groups(x: Any, mesh: Mesh, axes: tuple[str, ...]) -> Any:
    """``x`` as partials: all of it in group 0, zeros elsewhere (exact, and local)."""
    groups = math.prod(mesh.shape[a] for a in axes)
    first = (jnp.arange(groups) == 0).reshape((groups,) + (1,) * x.ndim)
    return jnp.where(first, x[None], jnp.zeros_like(x)[None])


def apply_linear(eqn: Any, invals: Sequence[Any], mesh: Mesh) -> Grouped | None:
    """The equation applied group by group, if every partial operand sits in a slot it is
    linear in and they share their groups; else None. A sum's ordinary terms join group 0."""
    grouped = [k for k, x in enumerate(invals) if isinstance(x, Grouped)]
    linear = linear_operands(eqn)
    if not grouped or not set(grouped) <= set(linear) or eqn.primitive.multiple_results:
        return None
    axes = {invals[k].axes for k in grouped}
    if len(axes) != 1:
        return None
    (group_axes,) = axes
    if len(linear) > 1:  # a sum: every term takes part
        invals = [
            x if isinstance(x, Grouped) else Grouped(into_groups(x, mesh, group_axes), group_axes)
            for x in invals
        ]
    elif set(grouped) != set(linear):
        return None
    in_axes = [0 if isinstance(x, Grouped) else None for x in invals]
    vals = [x.value if isinstance(x, Grouped) else x for x in invals]
    out = jax.vmap(lambda *a: bind_equation(eqn, list(a))[0], in_axes=in_axes)(*vals)
    return Grouped(out, group_axes)


def source(
    eqn: Any, invals: Sequence[Any], in_specs: Sequence[PartitionSpec | None], mesh: Mesh
) -> Grouped | None:
    """A matmul or sum that contracts a dimension split over mesh axes, evaluated per group
    of those axes (no reduction); None for anything else."""
    name = eqn.primitive.name
    if name == "dot_general" and len(invals) == 2:
        (lc, rc), _ = eqn.params["dimension_numbers"]
        lhs, rhs = invals
        ls, rs = _entries(in_specs[0], lhs.ndim), _entries(in_specs[1], rhs.ndim)
        for i, j in zip(lc, rc, strict=True):
            axes = _axes_of(ls[i])
            if axes and axes == _axes_of(rs[j]):
                split = [_split(lhs, i, ls, axes, mesh), _split(rhs, j, rs, axes, mesh)]
                if None in split:
                    return None
                fn = lambda a, b: bind_equation(eqn, [a, b])[0]  # noqa: E731
                return Grouped(jax.vmap(fn, in_axes=(i, j))(*split), axes)
        return None
    if name == "reduce_sum" and len(invals) == 1:
        (x,) = invals
        xs = _entries(in_specs[0], x.ndim)
        for ax in eqn.params["axes"]:
            axes = _axes_of(xs[ax])
            if axes:
                split = _split(x, ax, xs, axes, mesh)
                if split is None:
                    return None
                fn = lambda a: bind_equation(eqn, [a])[0]  # noqa: E731
                return Grouped(jax.vmap(fn, in_axes=ax)(split), axes)
    return None


def _split(x: Any, dim: int, entries: list[Any], axes: tuple[str, ...], mesh: Mesh) -> Any:
    """``x`` with ``dim`` reshaped into (groups, rest), groups laid out over ``axes`` as the
    dimension was (contiguous blocks), so no data moves."""
    groups = math.prod(mesh.shape[a] for a in axes)
    size = x.shape[dim]
    if size % groups:
        return None
    y = x.reshape((*x.shape[:dim], groups, size // groups, *x.shape[dim + 1 :]))
    spec = PartitionSpec(*entries[:dim], entries[dim], None, *entries[dim + 1 :])
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))
