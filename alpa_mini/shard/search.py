"""The ShardParallel mesh search: plan a traced step on every candidate logical mesh of the
cluster and keep the fastest predicted plan.

In: an ``OpGraph``, the cluster, the method and what the step's arguments are (roles,
aliases, donation). Out: a ``ShardingPlan`` (its ``mesh_search`` lists every shape tried).
Pure planning: no devices are needed, so any cluster can be planned from abstract shapes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._heap import lenient_gc, release_free_memory
from ..cluster.spec import ClusterSpec
from ..errors import ConfigError, MemoryBudgetError
from ..graph.op_graph import OpGraph
from ..options.shard import ShardParallel
from .cost_model import CostModel
from .plan import MeshTrial, ShardingPlan
from .problem import plan_sharding

__all__ = ["AXIS_NAMES", "plan_shard"]

AXIS_NAMES = ("x", "y", "z")


def check_replayed_plan(plan: ShardingPlan, graph: OpGraph, cluster: ClusterSpec) -> None:
    """Refuse a saved plan that was made for another step or another device count."""
    devices = math.prod(plan.mesh_shape)
    if devices != cluster.num_devices:
        raise ConfigError(
            f"plan: made for a mesh {plan.mesh_shape} of {devices} devices; cluster "
            f"{cluster.name} has {cluster.num_devices}"
        )
    problem = other_structure(plan, graph) or next(
        (
            f"tensor {t.name or g.id} is {t.dtype}{list(t.shape)} in the plan and "
            f"{g.dtype}{list(g.shape)} here"
            for t, g in zip(plan.tensors, graph.tensors, strict=True)
            if tuple(t.shape) != tuple(g.shape) or t.dtype != g.dtype
        ),
        None,
    )
    if problem:
        raise ConfigError(f"plan: made for another step: {problem}")


def other_structure(plan: ShardingPlan, graph: OpGraph) -> str | None:
    """How ``graph`` differs from the one ``plan`` was made for, shapes aside (None: alike)."""
    if len(plan.nodes) != len(graph.nodes) or len(plan.tensors) != len(graph.tensors):
        return (
            f"{len(plan.nodes)} operators and {len(plan.tensors)} tensors in the plan, "
            f"{len(graph.nodes)} and {len(graph.tensors)} in this step"
        )
    if tuple(plan.inputs) != tuple(graph.inputs) or tuple(plan.outputs) != tuple(graph.outputs):
        return "its inputs or outputs are other tensors"
    for n, g in zip(plan.nodes, graph.nodes, strict=True):
        if n.primitive != g.primitive:
            return f"operator {g.id} is {n.primitive} in the plan and {g.primitive} here"
    return None


def resized_plan(plan: ShardingPlan, graph: OpGraph) -> tuple[str, ShardingPlan | None]:
    """``plan`` for the same step with other batch rows (``graph``): the same layouts on the
    new shapes, or why they do not fit (the structure differs, or a split stops dividing)."""
    other = other_structure(plan, graph)
    if other:
        return f"the traced step has another structure on this batch size ({other})", None
    tensors = []
    for t, g in zip(plan.tensors, graph.tensors, strict=True):
        if t.spec is not None:
            for d, axes in enumerate(t.spec.dims):
                parts = math.prod(plan.mesh_shape[a] for a in axes)
                if g.shape[d] % parts:
                    return (
                        f"tensor {t.name or g.id} {list(g.shape)} no longer divides its "
                        f"dimension {d} into {parts} parts as planned"
                    ), None
        tensors.append(dataclasses.replace(t, shape=tuple(g.shape)))
    return "", dataclasses.replace(plan, tensors=tuple(tensors))


def plan_shard(
    graph: OpGraph,
    cluster: ClusterSpec,
    method: ShardParallel,
    roles: Sequence[str],
    *,
    aliases: Sequence[tuple[int, int]] = (),
    donated: Sequence[int] = (),
    on_trial: Callable[[MeshTrial], None] | None = None,
) -> ShardingPlan:
    """The fastest plan over ``method.mesh_shapes`` of the cluster's devices.

    Shapes where nothing fits the memory budget are skipped; when none fits, the error names
    the smallest budget found. Invalid requests (an explicit mesh shape or layout that cannot
    be planned) raise ``ConfigError``. ``on_trial`` hears of each mesh as soon as it is
    planned; the returned plan's ``mesh_search`` lists them all. ``method.plan`` (a saved
    plan) is checked against the graph and returned instead."""
    if method.plan is not None:
        check_replayed_plan(method.plan, graph, cluster)
        return method.plan
    plans, trials, errors = [], [], []
    with lenient_gc():  # ILP building allocates many short-lived objects
        for shape in method.mesh_shapes(cluster.num_devices, cluster.devices_per_host):
            plan, trial, error = _trial(graph, cluster, method, roles, shape, aliases, donated)
            if plan is not None:
                plans.append(plan)
            if error is not None:
                errors.append((shape, error))
            trials.append(trial)
            if on_trial is not None:
                on_trial(trial)
    release_free_memory()  # each mesh's ILP is garbage now
    if not plans:
        _raise_nothing_fits(errors)
    best = min(plans, key=lambda p: p.predicted_time)
    return dataclasses.replace(best, mesh_search=tuple(trials))


def _trial(
    graph: OpGraph, cluster: ClusterSpec, method: ShardParallel, roles, shape, aliases, donated
) -> tuple[ShardingPlan | None, MeshTrial, Exception | None]:
    """Plan on one mesh shape: (the plan or None, its trial record, why it failed or None).
    A shape the method named itself (or a preset layout) that has no layout is the user's
    error, raised as a ``ConfigError``."""
    t0 = time.perf_counter()
    try:
        plan = _plan_on(graph, cluster, method, roles, shape, aliases, donated)
    except MemoryBudgetError as err:
        return None, _failed(shape, err, t0), err
    except ValueError as err:
        if method.mesh_shape is not None or method.layout != "auto":
            raise ConfigError(str(err)) from None
        return None, _failed(shape, err, t0), err
    trial = MeshTrial(
        shape, plan.predicted_time, time.perf_counter() - t0,
        outcome=str(plan.solver.get("status", "optimal")),
        peak_memory=plan.peak_memory, core_nodes=plan.solver.get("core_nodes"),
    )  # fmt: skip
    return plan, trial, None


def _failed(shape: tuple[int, ...], err: Exception, t0: float) -> MeshTrial:
    return MeshTrial(
        shape, None, time.perf_counter() - t0, outcome=type(err).__name__, detail=str(err)
    )


def _plan_on(
    graph: OpGraph,
    cluster: ClusterSpec,
    method: ShardParallel,
    roles: Sequence[str],
    shape: tuple[int, ...],
    aliases: Sequence[tuple[int, int]],
    donated: Sequence[int],
) -> ShardingPlan:
    """The ILP's plan on one logical mesh of the cluster's devices."""
    logical = cluster.logical_mesh(shape, _submesh(cluster, cluster.num_devices))
    filters = [
        method.input_filter(role, graph.tensors[t].shape, shape)
        for role, t in zip(roles, graph.inputs, strict=True)
    ]
    out_filter = _replicated_only if method.replicate_outputs else None
    return plan_sharding(
        graph,
        CostModel(cluster, logical),
        AXIS_NAMES[: len(shape)],
        input_filters=filters,
        output_filters=[out_filter] * len(graph.outputs),
        aliases=list(aliases),
        donated=list(donated),
        memory_budget=method.memory_budget or cluster.device.memory_bytes,
        backend=method.backend,
        time_limit=method.time_limit,
        tie_repeats=True,  # unrolled repeated layers plan as fast as a scanned stack
    )


def _raise_nothing_fits(errors: list[tuple[tuple[int, ...], Exception]]) -> None:
    """Re-raise the most informative failure: the smallest memory budget any shape needs."""
    _, err = min(errors, key=lambda e: getattr(e[1], "min_budget", None) or math.inf)
    if isinstance(err, MemoryBudgetError):
        raise MemoryBudgetError(
            f"{err} (tried mesh shapes {[s for s, _ in errors]})", err.min_budget
        ) from None
    raise err


def _replicated_only(spec: Any) -> bool:
    return not spec.used_axes


def _submesh(cluster: ClusterSpec, num: int) -> tuple[int, int]:
    if num >= cluster.devices_per_host:
        return (num // cluster.devices_per_host, cluster.devices_per_host)
    return (1, num)
