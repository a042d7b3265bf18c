"""Assignments of mesh axes to an operator's loops: its candidate layouts on a mesh.

A ``LoopNest`` describes an operator as loops over its operands' and results' dimensions
(``strategies`` derives one per primitive). ``candidate_layouts`` lists every way to split
those loops over a mesh's axes that divides evenly, as ``Layout`` records that
``strategies.node_strategies`` prices.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .spec import ShardingSpec

__all__ = ["Layout", "LoopNest", "Map", "axis_names", "candidate_layouts", "canonical_order"]

Map = tuple[int | None, ...]


@dataclass(frozen=True)
class LoopNest:
    """``operands[k][d]`` / ``outputs[k][d]``: the loop that dimension d runs over (None: the
    dimension is never split). ``operands[k] is None`` marks an operand with no layout
    requirement. Loops in no result must be reductions (``reductions``) or ``fixed``."""

    sizes: tuple[int, ...]
    operands: tuple[Map | None, ...]
    outputs: tuple[Map, ...]
    reductions: tuple[tuple[int, str], ...] = ()
    fixed: frozenset[int] = frozenset()


def axis_names(axes: Sequence[int]) -> str:
    """Mesh axes as a strategy name writes them ("0,1")."""
    return ",".join(str(a) for a in axes)


@dataclass(frozen=True)
class Layout:
    """The mesh-only part of a strategy: layouts, split parallelism, the collectives' shape."""

    name: str
    in_specs: tuple[ShardingSpec | None, ...]
    out_specs: tuple[ShardingSpec, ...]
    parallel: int
    partial_shards: tuple[int, ...]  # shards of each result while its sum is partial
    groups: tuple[tuple[int, ...], ...]  # all-reduce axes, one group per split reduction
    scatter: tuple[int, ...] | None  # reduce-scatter axes instead of the all-reduces


@functools.lru_cache(maxsize=1 << 16)
def candidate_layouts(
    nest: LoopNest,
    in_shapes: tuple[tuple[int, ...] | None, ...],
    out_shapes: tuple[tuple[int, ...], ...],
    mesh_shape: tuple[int, ...],
    twins: tuple[tuple[int, int], ...],
    native_rs: bool,
) -> tuple[Layout, ...]:
    """Every valid assignment of mesh axes to the nest's loops, as layouts. It depends only on
    shapes and the mesh, so the many nodes of a model that share them are enumerated once;
    the shapes only decide which of the nest's candidate layouts divide evenly, so each
    micro-batch size filters one enumeration (``_candidates``) instead of redoing it."""
    unsized = dataclasses.replace(nest, sizes=(0,) * len(nest.sizes))
    found: dict[tuple, Layout] = {}
    for splits, lay, key in _candidates(unsized, mesh_shape, twins, native_rs):
        if key in found or any(nest.sizes[loop] % n for loop, n in splits):
            continue
        # Operand dims of size 1 or not divisible by their loop's split cannot carry it.
        if any(
            sp is not None and shape is not None and not sp.fits(shape, mesh_shape)
            for sp, shape in zip(lay.in_specs, in_shapes, strict=True)
        ):
            continue
        if any(
            not sp.fits(shape, mesh_shape)
            for sp, shape in zip(lay.out_specs, out_shapes, strict=True)
        ):
            continue
        found[key] = lay
    return tuple(found.values())


@functools.lru_cache(maxsize=1 << 12)
def _candidates(
    nest: LoopNest,
    mesh_shape: tuple[int, ...],
    twins: tuple[tuple[int, int], ...],
    native_rs: bool,
) -> tuple[tuple[tuple[tuple[int, int], ...], Layout, tuple], ...]:
    """Every layout of an (unsized) nest before shapes are checked, in enumeration order:
    (the (loop, shards) splits its loop sizes must divide by, the layout, its identity)."""
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    in_result = {loop for m in nest.outputs for loop in m if loop is not None}
    reduce_kind = dict(nest.reductions)
    splittable = [
        loop
        for loop in range(len(nest.sizes))
        if loop not in nest.fixed and (loop in in_result or loop in reduce_kind)
    ]
    out: list[tuple[tuple[tuple[int, int], ...], Layout, tuple]] = []
    for assignment in itertools.product([None, *splittable], repeat=len(axes)):
        if twins and not canonical_order(assignment, axes, twins):
            continue
        loop_axes: dict[int, list[int]] = {}
        for axis, loop in zip(axes, assignment, strict=True):
            if loop is not None:
                loop_axes.setdefault(loop, []).append(axis)
        splits = tuple(
            (loop, math.prod(mesh_shape[a] for a in ax)) for loop, ax in loop_axes.items()
        )
        reduced = tuple(
            sorted(a for loop, ax in loop_axes.items() if loop in reduce_kind for a in ax)
        )

        def spec(
            m: Map, extra: dict[int, tuple[int, ...]] | None = None, loop_axes=loop_axes
        ) -> ShardingSpec:
            dims = []
            for d, loop in enumerate(m):
                ax = tuple(loop_axes.get(loop, ())) if loop is not None else ()
                if extra and d in extra:
                    ax = ax + extra[d]
                dims.append(ax)
            return ShardingSpec(tuple(dims))

        in_specs = tuple(None if m is None else spec(m) for m in nest.operands)
        parallel = math.prod(mesh_shape[a] for ax in loop_axes.values() for a in ax)
        base_out = tuple(spec(m) for m in nest.outputs)
        label = (
            " ".join(f"L{loop}={axis_names(ax)}" for loop, ax in sorted(loop_axes.items()))
            or "replicated"
        )
        # XLA combines partial results one reduced dimension at a time: one all-reduce per
        # split reduction loop, over that loop's axes.
        groups = tuple(tuple(ax) for loop, ax in sorted(loop_axes.items()) if loop in reduce_kind)
        shards = tuple(sp.num_shards(mesh_shape) for sp in base_out)
        variants: list[tuple[str, tuple[ShardingSpec, ...], tuple[int, ...] | None, tuple]] = []
        if not reduced:
            variants.append((label, base_out, None, ()))
        else:
            ar_key = tuple(("all-reduce", g) for g in groups)
            variants.append((f"{label} AR({axis_names(reduced)})", base_out, None, ar_key))
            kinds = {reduce_kind[loop] for loop in loop_axes if loop in reduce_kind}
            if kinds == {"sum"} and len(base_out) == 1 and len(groups) == 1:
                kind = "reduce-scatter" if native_rs else "all-reduce"
                for d in range(len(nest.outputs[0])):
                    have = base_out[0].dims[d]
                    if have and max(have) > min(reduced):
                        continue  # keep axes in increasing order within a dim
                    cand = spec(nest.outputs[0], {d: reduced})
                    name = f"{label} RS({axis_names(reduced)})@{d}"
                    variants.append((name, (cand,), reduced, ((kind, reduced),)))
        for name, outs, scatter, coll_key in variants:
            lay = Layout(name, in_specs, outs, parallel, shards, groups if reduced else (), scatter)
            out.append((splits, lay, (in_specs, outs, coll_key)))
    return tuple(out)


def canonical_order(
    assignment: Sequence[int | None], axes: Sequence[int], twins: Sequence[tuple[int, int]]
) -> bool:
    where = dict(zip(axes, assignment, strict=True))
    for a, b in twins:
        la, lb = where.get(a), where.get(b)
        if (math.inf if la is None else la) > (math.inf if lb is None else lb):
            return False
    return True
