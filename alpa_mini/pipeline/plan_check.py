"""A saved pipeshard plan checked against the cluster and the step it is replayed on, before
anything is compiled or sent to a worker.

``PipeshardPlan.from_json`` has already checked what a file alone can say (types, finite
numbers, signs); here: equation and layer ranges that cover the step's loss, device ids of the
cluster used once, logical meshes that match their devices, and layouts whose rank, mesh axes
and divisibility fit the values they lay out. Each error names the stage, the field, the value
and what is valid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr

from ..cluster.spec import ClusterSpec
from ..errors import ConfigError
from ..graph.grad_capture import GradCapture
from ..shard.spec import ShardingSpec
from .plan import PipeshardPlan, StagePlan
from .stage_slice import slice_stage

__all__ = ["check_plan"]

#: Logical mesh ranks the runtime names axes for (``x``, ``y``, ``z``).
MAX_MESH_RANK = 3


def check_plan(
    plan: PipeshardPlan,
    cluster: ClusterSpec,
    forward: ClosedJaxpr,
    capture: GradCapture,
    num_micro_batches: int,
) -> None:
    """Raise ``ConfigError`` unless ``plan`` can run this step (its flat ``forward``, scan
    splits applied) on ``cluster`` with ``num_micro_batches``."""
    n = len(forward.jaxpr.eqns)
    if plan.num_equations != n:
        raise ConfigError(
            f"plan.num_equations: {plan.num_equations}, but this step's loss has {n} equations "
            "with plan.scan_splits and plan.row_splits applied (the plan was made for another "
            "step, or its splits were edited)"
        )
    if plan.num_micro_batches != num_micro_batches:
        raise ConfigError(
            f"plan.num_micro_batches: {plan.num_micro_batches}, but the step runs with "
            f"{num_micro_batches}; use PipeshardParallel.from_plan(plan)"
        )
    _check_layers(plan.layer_starts, n)
    _check_ranges(plan, n)
    used: dict[int, int] = {}
    for k, stage in enumerate(plan.stages):
        where = f"plan.stages[{k}]"
        _check_devices(where, stage, cluster, used, k)
        sl = slice_stage(forward.jaxpr, stage.eqn_start, stage.eqn_end, capture.diff)
        _check_specs(f"{where}.in_specs", stage.in_specs, [v.aval for v in sl.invars], stage)
        _check_specs(f"{where}.out_specs", stage.out_specs, [v.aval for v in sl.outvars], stage)
        for i, (e, o, spec) in enumerate(stage.inner_specs):
            at = f"{where}.inner_specs[{i}]"
            if not stage.eqn_start <= e < stage.eqn_end:
                raise ConfigError(
                    f"{at}: equation {e} is outside the stage; expected {stage.eqn_start}.."
                    f"{stage.eqn_end - 1}"
                )
            outs = forward.jaxpr.eqns[e].outvars
            if o >= len(outs):
                raise ConfigError(
                    f"{at}: result {o} of equation {e}, which has {len(outs)}; expected "
                    f"0..{len(outs) - 1}"
                )
            _check_spec(at, spec, outs[o].aval, stage)


def _check_layers(starts: Sequence[int], n: int) -> None:
    if not starts or starts[0] != 0:
        raise ConfigError(f"plan.layer_starts: {list(starts)} must start at equation 0")
    for i in range(1, len(starts)):
        if not starts[i - 1] < starts[i] < n:
            raise ConfigError(
                f"plan.layer_starts[{i}]: {starts[i]} is invalid; expected increasing equation "
                f"indices below {n} (after {starts[i - 1]})"
            )


def _check_ranges(plan: PipeshardPlan, n: int) -> None:
    """Stages cover the loss's equations and the layers, in order, each at least one."""
    num_layers = len(plan.layer_starts)
    eqn, layer = 0, 0
    for k, s in enumerate(plan.stages):
        where = f"plan.stages[{k}]"
        if s.eqn_start != eqn or not s.eqn_start < s.eqn_end <= n:
            raise ConfigError(
                f"{where}.equations: [{s.eqn_start}, {s.eqn_end}] is invalid; expected "
                f"[{eqn}, e] with {eqn} < e <= {n} (stages cover the loss's equations in order)"
            )
        if s.layer_start != layer or not s.layer_start <= s.layer_end < num_layers:
            raise ConfigError(
                f"{where}.layers: [{s.layer_start}, {s.layer_end}] is invalid; expected "
                f"[{layer}, l] with {layer} <= l < {num_layers} (stages cover the layers in "
                f"order; plan.layer_starts has {num_layers})"
            )
        if plan.layer_starts[s.layer_start] != s.eqn_start:
            raise ConfigError(
                f"{where}.equations: starts at {s.eqn_start}, but its first layer "
                f"{s.layer_start} starts at equation {plan.layer_starts[s.layer_start]}"
            )
        eqn, layer = s.eqn_end, s.layer_end + 1
    if eqn != n or layer != num_layers:
        raise ConfigError(
            f"plan.stages: cover equations 0..{eqn - 1} and layers 0..{layer - 1}; expected "
            f"0..{n - 1} (plan.num_equations) and 0..{num_layers - 1} (plan.layer_starts)"
        )


def _check_devices(
    where: str, s: StagePlan, cluster: ClusterSpec, used: dict[int, int], k: int
) -> None:
    hosts, per_host = s.submesh
    if hosts > cluster.num_hosts or per_host > cluster.devices_per_host:
        raise ConfigError(
            f"{where}.submesh: {list(s.submesh)} does not fit cluster {cluster.name} "
            f"({cluster.num_hosts} hosts x {cluster.devices_per_host} devices)"
        )
    if not 1 <= len(s.logical_shape) <= MAX_MESH_RANK:
        raise ConfigError(
            f"{where}.logical_shape: {list(s.logical_shape)} is invalid; expected 1 to "
            f"{MAX_MESH_RANK} positive sizes"
        )
    count = hosts * per_host
    if math.prod(s.logical_shape) != count or len(s.devices) != count:
        raise ConfigError(
            f"{where}: logical_shape {list(s.logical_shape)}, submesh {list(s.submesh)} and "
            f"{len(s.devices)} devices disagree; expected as many devices as the submesh "
            f"holds ({count}) and a logical shape of that size"
        )
    for i, d in enumerate(s.devices):
        if d >= cluster.num_devices:
            raise ConfigError(
                f"{where}.devices[{i}]: {d} is invalid; cluster {cluster.name} has devices "
                f"0..{cluster.num_devices - 1}"
            )
        if d in used:
            other = "this stage" if used[d] == k else f"stage {used[d]}"
            raise ConfigError(
                f"{where}.devices[{i}]: device {d} is already used by {other}; each device "
                "belongs to one stage, once"
            )
        used[d] = k


def _check_specs(
    where: str, specs: Sequence[ShardingSpec | None], avals: Sequence[Any], s: StagePlan
) -> None:
    if len(specs) != len(avals):
        raise ConfigError(
            f"{where}: {len(specs)} layouts for the stage's {len(avals)} values; expected "
            f"{len(avals)} (null for the default layout)"
        )
    for i, (spec, aval) in enumerate(zip(specs, avals, strict=False)):
        if spec is not None:
            _check_spec(f"{where}[{i}]", spec, aval, s)


def _check_spec(where: str, spec: ShardingSpec, aval: Any, s: StagePlan) -> None:
    shape = tuple(getattr(aval, "shape", ()))
    if len(spec.dims) != len(shape):
        raise ConfigError(
            f"{where}: {spec.to_list()} lays out {len(spec.dims)} dimensions; the value "
            f"{list(shape)} has {len(shape)}"
        )
    rank = len(s.logical_shape)
    for d, axes in enumerate(spec.dims):
        size = 1
        for a in axes:
            if a >= rank:
                raise ConfigError(
                    f"{where}[{d}]: mesh axis {a} is invalid; the stage's logical mesh "
                    f"{list(s.logical_shape)} has axes 0..{rank - 1}"
                )
            size *= s.logical_shape[a]
        if shape[d] % size:
            raise ConfigError(
                f"{where}[{d}]: mesh axes {list(axes)} ({size} devices) do not divide "
                f"dimension {d} of the value {list(shape)}"
            )
