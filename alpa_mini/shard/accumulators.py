"""Gradient accumulators a pipeline stage keeps across micro-batches, as its ILP prices them.

Each parameter's gradient is added into an accumulator that lives from the stage's first
backward to the step's end (``pipeline/lower/partials.py``): with several micro-batches,
through every later forward too, which is what the ILPs below count. With one micro-batch
the accumulator is the gradient itself, from its production on, as its group's partial: a
whole-stage ILP counts the gradient as an output in its own layout, and the plan's peak
gains the partial's excess over that (``partial_excess``).
A parameter read by data-parallel rows keeps its group's *unreduced* partial sum: laid out
like the parameter less the data-parallel axes (the mesh axes that split the rows), so a
layout sharded over those axes (ZeRO) still holds a whole copy per group. Other parameters
accumulate in their own layout, which is never larger; counting every parameter as a partial
errs on the safe side. The exception is exact: a parameter whose layout splits a dimension a
contraction pairs with the rows' values (``paired_dims``: an expert dimension, each expert's
weight with its own tokens) over the data-parallel axes is not grouped by the runtime (expert
parallelism needs no reduction), so it accumulates in its own layout.

An ILP node's usage cannot depend on another node's choice, and the data-parallel axes are
the rows' choice. So the ILP first counts each accumulator in its parameter's own layout
(never more than the truth: a relaxation), and the plan read back is re-priced with its own
data-parallel axes (``extra_bytes``). Where that no longer fits, ``plan_sharding`` solves
again once per possible set of data-parallel axes, with the rows pinned to it and the
accumulators priced exactly (``pinned_rows``), and keeps the fastest plan.

The layers a pipeline stage is composed from are priced after the solve instead
(``plan_sharding(accumulators_in_ilp=False)``): their ILPs are solved as without
accumulators and each plan's peak gains its own. A layer's budget is the whole device's, a
necessary condition only; the composed stage's memory (``pipeline/compose.py``) is the
check, and counting accumulators inside the layer ILPs made them bind and solve 1.8x slower
on Megatron's 1T model for the same plan.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._validate import format_bytes
from ..errors import MemoryBudgetError
from ..graph.op_graph import OpGraph
from .plan import ShardingPlan
from .spec import ShardingSpec

__all__ = [
    "accumulator_bytes",
    "data_parallel_axes",
    "extra_bytes",
    "fit_accumulators",
    "held_accumulators",
    "paired_dims",
    "partial_excess",
    "pinned_rows",
    "row_axis_choices",
    "row_inputs",
]


def row_inputs(graph: OpGraph | ShardingPlan) -> list[int]:
    """Input positions of the values that carry the micro-batch's rows: batch-role inputs
    (the step's batch, activations, cotangents) whose leading size is the first one's."""
    tensors = [graph.tensors[t] for t in graph.inputs]
    batch = [i for i, t in enumerate(tensors) if t.role == "batch" and t.shape]
    if not batch:
        return []
    rows = tensors[batch[0]].shape[0]
    return [i for i in batch if tensors[i].shape[0] == rows]


def held_accumulators(plan: ShardingPlan) -> float:
    """Bytes per device of the accumulators of a plan's parameters, with its own rows'
    data-parallel axes."""
    specs = [plan.tensors[t].spec for t in plan.inputs]
    params = [i for i, t in enumerate(plan.inputs) if plan.tensors[t].role == "param"]
    return extra_bytes(plan, specs, params, plan.mesh_shape, counted=False)


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def data_parallel_axes(
    specs: Sequence[ShardingSpec | None], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """The mesh axes that split the rows: those of the first row input split along its
    leading dimension (as the runtime's ``_group_split`` reads them), else none."""
    for spec in specs:
        if spec is not None and spec.ndim and math.prod(mesh_shape[a] for a in spec.dims[0]) > 1:
            return spec.dims[0]
    return ()


def accumulator_bytes(
    nbytes: float,
    spec: ShardingSpec,
    mesh_shape: Sequence[int],
    dp_axes: Sequence[int],
    paired: Sequence[int] = (),
) -> float:
    """Bytes per device of the accumulator of a parameter of ``nbytes`` laid out as ``spec``:
    split only over the axes of ``spec`` that do not split the rows, unless it splits one of
    its ``paired`` dimensions over them (expert parallelism: its own layout)."""
    if any(set(spec.dims[d]) & set(dp_axes) for d in paired if d < spec.ndim):
        dp_axes = ()
    split = math.prod(mesh_shape[a] for a in spec.used_axes if a not in dp_axes)
    return nbytes / split


def paired_dims(graph: OpGraph) -> dict[int, tuple[int, ...]]:
    """Per parameter input (position), the dimensions a ``dot_general`` reading it (or a cast
    of it, its shape kept) takes as batch dimensions, paired with the other operand's: what
    the runtime's ``plan_partials`` does not group when they split over the rows' axes."""
    users = graph.consumers()
    out: dict[int, tuple[int, ...]] = {}
    for i, t in enumerate(graph.inputs):
        tensor = graph.tensors[t]
        if tensor.role != "param":
            continue
        dims: set[int] = set()
        chain, todo = {t}, [t]
        while todo:
            for n, k in users.get(todo.pop(), ()):
                node = graph.nodes[n]
                if node.primitive == "dot_general" and len(node.inputs) == 2:
                    dims.update(node.params["dimension_numbers"][1][k])
                elif all(x is None or x in chain for x in node.inputs) and len(node.outputs) == 1:
                    o = node.outputs[0]
                    if graph.tensors[o].shape == tensor.shape and o not in chain:
                        chain.add(o)
                        todo.append(o)
        if dims:
            out[i] = tuple(sorted(dims))
    return out


def _partials(
    plan: ShardingPlan,
    specs: Sequence[ShardingSpec | None],
    inputs: Sequence[int],
    mesh_shape: Sequence[int],
) -> Iterator[tuple[int, float, float]]:
    """Per input of ``inputs`` that takes a layout in ``specs``: (its position, its bytes,
    its accumulator's bytes per device with the plan's own data-parallel axes)."""
    dp = data_parallel_axes([specs[i] for i in row_inputs(plan)], mesh_shape)
    for i in inputs:
        spec = specs[i]
        if spec is None:
            continue
        t = plan.tensors[plan.inputs[i]]
        nbytes = math.prod(t.shape) * _itemsize(t.dtype)
        yield i, nbytes, accumulator_bytes(nbytes, spec, mesh_shape, dp, t.paired_dims)


def extra_bytes(
    plan: ShardingPlan,
    specs: Sequence[ShardingSpec | None],
    accumulated: Sequence[int],
    mesh_shape: Sequence[int],
    counted: bool = True,
) -> float:
    """What a plan whose inputs take ``specs`` holds beyond its ILP's count: each accumulated
    input's accumulator with the plan's own data-parallel axes, less (``counted``) the same
    in the parameter's layout, which the ILP counted."""
    extra = 0.0
    for i, nbytes, partial in _partials(plan, specs, accumulated, mesh_shape):
        extra += partial
        if counted:
            extra -= accumulator_bytes(nbytes, specs[i], mesh_shape, ())
    return extra


def partial_excess(
    plan: ShardingPlan, gradients: Sequence[tuple[int, int]], mesh_shape: Sequence[int]
) -> float:
    """What a plan of one micro-batch holds beyond its ILP's count: the runtime keeps each
    (parameter input, gradient output) pair's gradient as its data-parallel group's
    unreduced partial until the step's sync, where the ILP counted the gradient in its own
    output layout (a ZeRO layout's partial is a whole copy per group)."""
    specs = [plan.tensors[t].spec for t in plan.inputs]
    output = dict(gradients)
    extra = 0.0
    for i, nbytes, partial in _partials(plan, specs, list(output), mesh_shape):
        out = plan.output_specs[output[i]]
        if out is not None:
            extra += max(0.0, partial - accumulator_bytes(nbytes, out, mesh_shape, ()))
    return extra


def fit_accumulators(
    graph: OpGraph,
    mesh_shape: Sequence[int],
    layouts: Sequence[Sequence[ShardingSpec]],
    filters: Sequence[Callable[[ShardingSpec], bool] | None],
    memory_budget: float,
    solve_pinned: Callable[..., tuple[ShardingPlan, object]],
) -> ShardingPlan:
    """The fastest plan with its accumulators priced exactly: one ILP per set of axes the
    rows may split over (``layouts``: each input's allowed specs), the rows pinned to it.
    ``solve_pinned(input_filters=..., dp_axes=...)`` solves one (``plan_sharding``)."""
    best, smallest = None, None
    for axes in row_axis_choices(graph, layouts, mesh_shape):
        pinned = pinned_rows(graph, filters, mesh_shape, axes)
        try:
            plan, _ = solve_pinned(input_filters=pinned, dp_axes=axes)
        except ValueError as err:  # MemoryBudgetError, or no layout splits the rows so
            peak = getattr(err, "min_budget", None)
            if peak is not None:
                smallest = peak if smallest is None else min(peak, smallest)
            continue
        if best is None or plan.predicted_time < best.predicted_time:
            best = plan
    if best is None:
        need = "unknown" if smallest is None else format_bytes(smallest, 2)
        raise MemoryBudgetError(
            f"memory_budget: {format_bytes(memory_budget, 2)} per device is too small for this "
            f"program on mesh {tuple(mesh_shape)} with its gradient accumulators (several "
            f"micro-batches); the smallest peak found is {need} per device (raise the budget, "
            "use more devices, or a larger mesh)",
            smallest,
        )
    return best


def row_axis_choices(
    graph: OpGraph, layouts: Sequence[Sequence[ShardingSpec]], mesh_shape: Sequence[int]
) -> list[tuple[int, ...]]:
    """Every set of data-parallel axes the first row input can take (``layouts``: each
    input's allowed specs), the unsplit rows first."""
    rows = row_inputs(graph)
    if not rows:
        return []
    seen = {data_parallel_axes([s], mesh_shape) for s in layouts[rows[0]]}
    return sorted(seen, key=lambda axes: (len(axes), axes))


def pinned_rows(
    graph: OpGraph,
    filters: Sequence[Callable[[ShardingSpec], bool] | None],
    mesh_shape: Sequence[int],
    dp_axes: tuple[int, ...],
) -> list[Callable[[ShardingSpec], bool] | None]:
    """``filters`` with every row input held to split its rows over exactly ``dp_axes``
    (and its own filter, if any)."""
    out = list(filters)
    for i in row_inputs(graph):
        out[i] = functools.partial(_rows_over, dp_axes, tuple(mesh_shape), out[i])
    return out


def _rows_over(
    axes: tuple[int, ...], mesh_shape: Sequence[int], also: Any, spec: ShardingSpec
) -> bool:
    """A spec filter: rows split over exactly ``axes`` (and ``also``, if any)."""
    ok = data_parallel_axes([spec], mesh_shape) == axes
    return ok and (also is None or also(spec))
