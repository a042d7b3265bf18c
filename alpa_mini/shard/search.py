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

from .._heap import release_free_memory
from ..cluster.spec import ClusterSpec
from ..errors import ConfigError, MemoryBudgetError
from ..graph.op_graph import OpGraph
from ..options.shard import ShardParallel
from .cost_model import CostModel
from .plan import MeshTrial, ShardingPlan
from .problem import plan_sharding

__all__ = ["AXIS_NAMES", "plan_shard"]

AXIS_NAMES = ("x", "y", "z")


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
    planned; the returned plan's ``mesh_search`` lists them all."""
    plans, trials, errors = [], [], []
    for shape in method.mesh_shapes(cluster.num_devices, cluster.devices_per_host):
        t0 = time.perf_counter()
        try:
            plan = _plan_on(graph, cluster, method, roles, shape, aliases, donated)
        except MemoryBudgetError as err:
            errors.append((shape, err))
            trial = _failed(shape, err, t0)
        except ValueError as err:
            if method.mesh_shape is not None or method.layout != "auto":
                raise ConfigError(str(err)) from None
            errors.append((shape, err))
            trial = _failed(shape, err, t0)
        else:
            plans.append(plan)
            trial = MeshTrial(
                shape, plan.predicted_time, time.perf_counter() - t0,
                outcome=str(plan.solver.get("status", "optimal")),
                peak_memory=plan.peak_memory, core_nodes=plan.solver.get("core_nodes"),
            )  # fmt: skip
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
    release_free_memory()  # each mesh's ILP is garbage now
    if not plans:
        _raise_nothing_fits(errors)
    best = min(plans, key=lambda p: p.predicted_time)
    return dataclasses.replace(best, mesh_search=tuple(trials))


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
