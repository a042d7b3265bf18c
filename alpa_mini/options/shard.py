"""Parallel methods: how ``@parallelize`` should plan a step (options, not algorithms).

``ShardParallel`` lets the ILP choose every layout on one logical mesh. The presets pin the
inputs' layouts and let the ILP fill in the rest consistently:

- ``DataParallel``: batch split over every device, parameters and state replicated.
- ``Zero2Parallel``: as data parallel, but optimiser state sharded, so gradients are
  reduce-scattered into it and the updated parameters all-gathered back.
- ``Zero3Parallel``: parameters sharded too; they stay sharded between steps.
- ``layout="megatron"`` with ``tensor_splits``: hand-written tensor parallelism on a
  (dp, tp) mesh: each parameter split as the table says over tp (axis 1) and replicated over
  dp, the batch split over dp alone, optimiser state laid out like its parameter.
- ``layout="zero2"`` with ``tensor_splits``: ZeRO-2 whose parameters the table names are
  split over the mesh's last axis instead of replicated (DeepSpeed's expert parallelism).

Roles come from the step's signature: leaves of ``batch_argnums`` are the batch, leaves of
the first argument the parameters, leaves of any other argument optimiser/other state.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from .._validate import check_choice, positive_int
from ..errors import ConfigError
from ..shard.spec import ShardingSpec
from .param_splits import ParamSplits

__all__ = [
    "DataParallel",
    "ShardParallel",
    "Zero2Parallel",
    "Zero3Parallel",
    "candidate_mesh_shapes",
]

#: How inputs are laid out: chosen by the ILP, or pinned like a preset.
Layout = Literal["auto", "data", "zero2", "zero3", "megatron"]
#: The MIP backend: HiGHS where highspy is installed ("auto"), else CBC.
Backend = Literal["auto", "highs", "cbc"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
BACKENDS: tuple[str, ...] = get_args(Backend)


@dataclass(frozen=True)
class ShardParallel:
    """Intra-operator auto-sharding of a whole step on one logical mesh.

    mesh_shape: logical mesh over all devices; None searches 1-D, 2-D and 3-D shapes and keeps
        the fastest predicted plan. memory_budget: bytes per device (None: the device's memory).
    batch_axis: force the batch's leading dim to be split over this mesh axis.
    num_micro_batches: gradient accumulation for ``alpa_mini.grad``/``value_and_grad`` in the
        step. replicate_outputs: return every output that is not updated state replicated (as
    a serial program would); by default outputs keep whatever layout is cheapest.
    backend/time_limit: for the ILP solver. layout: "auto" lets the ILP choose; the others
    pin the inputs' layouts (see the module docstring). tensor_splits: the hand-written split
    of each parameter, by shape, for ``layout="megatron"`` (required) or ``"zero2"``.
    """

    mesh_shape: tuple[int, ...] | None = None
    memory_budget: float | None = None
    batch_axis: int | None = None
    num_micro_batches: int = 1
    replicate_outputs: bool = False
    backend: Backend = "auto"
    time_limit: float = 60.0
    layout: Layout = "auto"
    tensor_splits: ParamSplits | None = None
    plan: Any = None  # a ShardingPlan to replay without planning (``from_plan``)

    @classmethod
    def from_plan(cls, plan: Any, **options: Any) -> ShardParallel:
        """Replay a saved ``ShardingPlan`` (the object, its JSON text or a path to the JSON
        file) without planning; the step it is used on must be the one it was made for."""
        from ..shard.plan import ShardingPlan

        is_json = isinstance(plan, str) and plan.lstrip().startswith("{")
        if isinstance(plan, os.PathLike) or (isinstance(plan, str) and not is_json):
            path = Path(plan)
            if not path.is_file():
                raise ConfigError(f"plan: {str(plan)!r} is neither plan JSON nor a file")
            plan = path.read_text()
        if isinstance(plan, str):
            try:
                plan = ShardingPlan.from_json(plan)
            except (ValueError, KeyError, TypeError, IndexError) as err:
                raise ConfigError(f"plan: not a saved ShardingPlan ({err!r})") from None
        if not isinstance(plan, ShardingPlan):
            raise ConfigError(
                f"plan: {type(plan).__name__} is not a ShardingPlan, its JSON or a JSON file"
            )
        return cls(mesh_shape=plan.mesh_shape, plan=plan, **options)

    def __post_init__(self) -> None:
        if self.mesh_shape is not None:
            shape = tuple(self.mesh_shape)
            if not shape or any(not isinstance(s, int) or s < 1 for s in shape) or len(shape) > 3:
                raise ConfigError(
                    f"mesh_shape: {self.mesh_shape!r} is invalid; expected 1 to 3 positive "
                    "integers (e.g. (8,), (2, 4), (2, 2, 2)) or None to search"
                )
            object.__setattr__(self, "mesh_shape", shape)
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ConfigError(
                f"memory_budget: {self.memory_budget!r} is invalid; expected bytes > 0 or None"
            )
        if self.batch_axis is not None and (
            not isinstance(self.batch_axis, int) or self.batch_axis < 0
        ):
            raise ConfigError(f"batch_axis: {self.batch_axis!r} is not a mesh axis index >= 0")
        positive_int("num_micro_batches", self.num_micro_batches)
        check_choice("layout", self.layout, LAYOUTS)
        self._check_tensor_splits()
        check_choice("backend", self.backend, BACKENDS)
        if not self.time_limit > 0:
            raise ConfigError(f"time_limit: {self.time_limit!r} must be seconds > 0")

    def _check_tensor_splits(self) -> None:
        splits = self.tensor_splits
        if splits is None:
            if self.layout == "megatron":
                raise ConfigError(
                    "tensor_splits: None is invalid with layout='megatron'; expected a "
                    "ParamSplits saying which dimension of each parameter tp splits"
                )
            return
        if not isinstance(splits, ParamSplits):
            raise ConfigError(f"tensor_splits: {type(splits).__name__} is not a ParamSplits")
        if self.layout not in ("megatron", "zero2"):
            raise ConfigError(
                f"tensor_splits: given with layout={self.layout!r}; valid only with layout "
                "'megatron' (tensor parallelism) or 'zero2' (expert parallelism on ZeRO-2)"
            )

    def mesh_shapes(
        self, num_devices: int, devices_per_host: int | None = None
    ) -> list[tuple[int, ...]]:
        """The shapes to plan on; a given shape must use exactly ``num_devices``."""
        if self.mesh_shape is not None:
            if math.prod(self.mesh_shape) != num_devices:
                valid = ", ".join(str(s) for s in candidate_mesh_shapes(num_devices))
                raise ConfigError(
                    f"mesh_shape: {self.mesh_shape} has {math.prod(self.mesh_shape)} devices but "
                    f"{num_devices} are available; valid shapes include {valid}"
                )
            return [self.mesh_shape]
        if self.layout == "megatron":
            raise ConfigError(
                "mesh_shape: None is invalid with layout='megatron'; expected (dp, tp)"
            )
        if self.layout != "auto":
            return [(num_devices,)]
        return candidate_mesh_shapes(num_devices, devices_per_host)

    def input_filter(
        self, role: str, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
    ) -> Callable[[ShardingSpec], bool] | None:
        """Which layouts an input of ``role`` may take under this method (None: any)."""
        axes = tuple(a for a, n in enumerate(mesh_shape) if n > 1)
        if self.layout == "megatron":
            return self._megatron_filter(role, shape, mesh_shape)
        if role == "batch":
            if self.layout != "auto":
                return _leading_split(axes, shape)
            if self.batch_axis is not None:
                if self.batch_axis >= len(mesh_shape):
                    raise ConfigError(
                        f"batch_axis: {self.batch_axis} is not an axis of mesh {mesh_shape}"
                    )
                axis = self.batch_axis
                if not shape or mesh_shape[axis] == 1:
                    return None
                return lambda s: axis in s.dims[0]
            return None
        if role == "param" and self.tensor_splits is not None:
            return self._pinned_split(shape, mesh_shape)
        sharded = (self.layout == "zero2" and role == "state") or (
            self.layout == "zero3" and role in ("param", "state")
        )
        if sharded:
            return _fully_sharded(axes, shape, mesh_shape)
        if self.layout in ("data", "zero2", "zero3"):
            return _replicated
        return None

    def _megatron_filter(
        self, role: str, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
    ) -> Callable[[ShardingSpec], bool]:
        """Megatron-LM on a (dp, tp) mesh: the batch (and activations arriving from an
        earlier stage) split over dp only, parameters as the table says, optimiser state
        like its parameter (replicated when the table does not know its shape, e.g. a step
        count)."""
        if len(mesh_shape) != 2:
            raise ConfigError(
                f"layout: 'megatron' plans on a (dp, tp) mesh; got mesh {tuple(mesh_shape)}"
            )
        if role == "batch":
            return _leading_split((0,) if mesh_shape[0] > 1 else (), shape)
        assert self.tensor_splits is not None  # __post_init__ requires it
        if role == "state" and self.tensor_splits.find(shape) is None:
            return _replicated
        return self._pinned_split(shape, mesh_shape)

    def _pinned_split(
        self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
    ) -> Callable[[ShardingSpec], bool]:
        """Exactly the table's split over the mesh's last axis, nothing else."""
        assert self.tensor_splits is not None
        dim, axis = self.tensor_splits.dim(shape), len(mesh_shape) - 1
        ways = mesh_shape[axis]
        if dim is None or ways == 1:
            return _replicated
        if shape[dim] % ways:
            raise ConfigError(
                f"tensor_splits: a parameter of shape {tuple(shape)} splits dim {dim} "
                f"({shape[dim]}) over mesh axis {axis} of {ways} devices, which does not "
                "divide it"
            )
        want = tuple((axis,) if i == dim else () for i in range(len(shape)))
        return lambda spec: spec.dims == want

    def state_devices(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
        """Devices one copy of a parameter's optimiser state is spread over: 1 under "data"
        (a whole copy each), the parameter's own tp split under "megatron" (Megatron-LM's
        default optimiser keeps state like its parameters), else every device (ZeRO)."""
        if self.layout == "data":
            return 1
        if self.layout == "megatron":
            assert self.tensor_splits is not None
            return 1 if self.tensor_splits.dim(shape) is None else mesh_shape[-1]
        return math.prod(mesh_shape)


def _replicated(spec: ShardingSpec) -> bool:
    return not spec.used_axes


def _leading_split(axes: tuple[int, ...], shape: tuple[int, ...]):
    if not shape or not axes:
        return _replicated

    def ok(spec: ShardingSpec) -> bool:
        return spec.dims[0] == axes and all(not d for d in spec.dims[1:])

    return ok


def _fully_sharded(axes: tuple[int, ...], shape: tuple[int, ...], mesh_shape: tuple[int, ...]):
    n = math.prod(mesh_shape[a] for a in axes)
    if not axes or not any(size % n == 0 for size in shape):
        return _replicated  # one device, or too small to split (a step counter, an odd bias)

    def ok(spec: ShardingSpec) -> bool:
        return sum(1 for d in spec.dims if d) == 1 and spec.used_axes == frozenset(axes)

    return ok


def DataParallel(**options: object) -> ShardParallel:
    """Data parallelism: batch split over all devices, parameters and state replicated."""
    return ShardParallel(layout="data", **options)  # type: ignore[arg-type]


def Zero2Parallel(**options: object) -> ShardParallel:
    """ZeRO-2: optimiser state sharded, gradients reduce-scattered, parameters replicated."""
    return ShardParallel(layout="zero2", **options)  # type: ignore[arg-type]


def Zero3Parallel(**options: object) -> ShardParallel:
    """ZeRO-3: parameters and optimiser state sharded and kept sharded between steps."""
    return ShardParallel(layout="zero3", **options)  # type: ignore[arg-type]


def candidate_mesh_shapes(
    num_devices: int, devices_per_host: int | None = None
) -> list[tuple[int, ...]]:
    """The logical meshes the search plans on: 1-D and 2-D factorisations of ``num_devices``.

    On one host (a, b) and (b, a) differ only in which axis is major when one tensor dim is
    split over both; the search keeps a <= b to halve its time (ask for the other order with
    ``mesh_shape=``). Across hosts the orders use different links, so both are planned. 3-D
    meshes are planned when asked for (``mesh_shape=``); their symmetric axes make the ILP
    much slower for plans a 2-D mesh already expresses.
    """
    per_host = devices_per_host or num_devices
    one_host = num_devices <= per_host
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    for a in range(2, num_devices):
        if num_devices % a == 0:
            b = num_devices // a
            if b > 1 and (not one_host or a <= b):
                shapes.append((a, b))
    return shapes
