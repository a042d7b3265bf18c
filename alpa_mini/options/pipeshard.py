"""``PipeshardParallel`` and its layer/stage options (inter-operator + intra-operator).

Layers: ``ManualLayerOption()`` cuts at ``mark_pipeline_boundary()``; ``AutoLayerOption(n)``
clusters the forward into ``n`` balanced layers. Stages: ``AutoStageOption()`` runs the stage
DP over a cost table of per-stage ILPs; ``UniformStageOption`` splits layers evenly onto equal
submeshes; ``ManualStageOption`` says exactly which layers go where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .._validate import check_choice, positive_int
from ..errors import ConfigError
from ..pipeline.schedules import SCHEDULES, ScheduleName
from .shard import ShardParallel

__all__ = [
    "AutoLayerOption",
    "AutoStageOption",
    "ManualLayerOption",
    "ManualStageOption",
    "PipeshardParallel",
    "UniformStageOption",
]


#: How a stage's cost is found: composed from per-layer ILPs, or one ILP per layer range.
Profiling = Literal["individual", "whole"]
#: Which logical meshes a submesh offers (see ``AutoStageOption``).
LogicalShapeSpace = Literal["auto", "1d", "model_parallel_in_host"]
#: Which submeshes the stage DP may use (see ``AutoStageOption``).
SubmeshSpace = Literal["power_of_two", "divisors", "all", "one_host"]
#: How a stage prices bringing gradients into their parameters' layouts.
GradientSync = Literal["after", "ilp"]
LOGICAL_SHAPE_SPACES: tuple[str, ...] = get_args(LogicalShapeSpace)


def _shape(owner: str, name: str, value: object, dims: int | None = None) -> tuple[int, ...]:
    try:
        shape = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        shape = ()
    if (
        not shape
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape)
        or (dims is not None and len(shape) != dims)
        or len(shape) > 3
    ):
        want = f"{dims} positive ints" if dims else "1 to 3 positive ints"
        raise ConfigError(f"{owner}.{name}: {value!r} is invalid; expected {want}")
    return shape


@dataclass(frozen=True)
class AutoLayerOption:
    """Cluster the forward into ``layer_num`` layers of balanced flops (within 1 + eps).

    eps None (the default) balances within 1.1 where the model allows it and otherwise as
    tightly as it allows (the plan's ``layer_eps`` says which); a number is a strict limit.
    """

    layer_num: int
    eps: float | None = None

    def __post_init__(self) -> None:
        positive_int("AutoLayerOption.layer_num", self.layer_num)
        if self.eps is not None and not (
            isinstance(self.eps, int | float) and not isinstance(self.eps, bool) and self.eps >= 0
        ):
            raise ConfigError(
                f"AutoLayerOption.eps: {self.eps!r} is invalid; expected a number >= 0, or None "
                "to relax the balance as far as the model needs"
            )


@dataclass(frozen=True)
class ManualLayerOption:
    """Layers end at the step's ``mark_pipeline_boundary()`` calls. A step without any is cut
    at its repeated blocks (a Python loop over layers: one layer per block, one per stretch
    between runs of alike blocks; ``pipeline.layers.repeated_block_starts``), or stays one
    layer where nothing repeats that holds most of its flops. Blocks that differ only in the
    index they read a stacked weight or split keys at (``w[i]``, ``keys[i]``) are alike."""


@dataclass(frozen=True)
class AutoStageOption:
    """Stage slicing by the stage DP over a table of per-stage ILP costs.

    profiling: "individual" composes a layer range's cost from per-layer ILPs plus the
    resharding between them (fast, Alpa's individual mode); "whole" solves one ILP per range.
    logical_shapes: "model_parallel_in_host" (the default) 1-D and every 2-D (n / k, k) whose
    second axis k > 1 divides a host's devices (Alpa's single-node model parallel space: every
    (dp, tp) split Megatron would use); "auto" 1-D and one 2-D logical mesh per submesh; "1d"
    only 1-D. The smaller spaces plan faster and may miss the best (dp, tp).
    memory_budget: moved to ``PipeshardParallel(memory_budget=...)``, the one place a
    pipeline's per-device budget is set (setting it here is an error that says so).
    submesh_space: "divisors" (the default) searches submeshes of 1, 2, 4, ... hosts (and the
    power-of-two slices of one host), as Alpa does, and also every host count that divides
    the cluster's (192 hosts: also 3, 6, 12, 24, 48, 96 and 192, so that 8 even stages of
    24 hosts, as Megatron-LM runs GPT 145.6B, are in reach: 19.29 s per iteration there
    against 20.97 s without); on a power-of-two host count the two are the same.
    "power_of_two" is Alpa's space alone; "all" also tries every other host count (many
    more ILPs on large clusters); "one_host" only submeshes inside one host (what the Ray
    runtime can run without a ``jax.distributed`` group of its hosts).
    refine: with individual profiling, also solve each chosen stage as one ILP in every
    config of its submesh (each logical mesh, and the ZeRO-3 column under ``memory_lean``)
    and keep the cheapest (whole-stage ILPs per distinct chosen stage: slower planning; the
    composition's estimate no longer decides the final plan). Without it, a one-stage plan
    on one host is still re-planned whole on its chosen config, once, with its repeated
    layers tied (``pipeline.refine``: about 1.5 s on GPT-3 1.3B).
    refine_within: with ``refine``, re-plan only the configs whose composed estimate for the
    stage is within this fraction of the chosen config's (the chosen one always); None:
    every config. Whole-stage ILPs dominate refined planning, so this trades a little of
    refine's reach for time.
    memory_lean: also offer the DP, per submesh, stages whose layers keep parameters and
    optimiser state fully sharded (ZeRO-3's layouts on the 1-D mesh). Per-layer ILPs choose
    layouts for speed alone, so stages composed from them can miss memory that a sharded
    stage fits; one more (restricted, fast) ILP per layer and submesh. On by default.
    """

    profiling: Profiling = "individual"
    logical_shapes: LogicalShapeSpace = "model_parallel_in_host"
    memory_budget: float | None = None
    submesh_space: SubmeshSpace = "divisors"
    refine: bool = False
    memory_lean: bool = True
    refine_within: float | None = None

    def __post_init__(self) -> None:
        check_choice("AutoStageOption.profiling", self.profiling, get_args(Profiling))
        check_choice("AutoStageOption.logical_shapes", self.logical_shapes, LOGICAL_SHAPE_SPACES)
        for name in ("refine", "memory_lean"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"AutoStageOption.{name}: {value!r} is not True or False")
        check_choice("AutoStageOption.submesh_space", self.submesh_space, get_args(SubmeshSpace))
        if self.memory_budget is not None:
            raise ConfigError(
                f"AutoStageOption.memory_budget: {self.memory_budget!r}; the per-device budget "
                "of a pipeline is set in one place now: PipeshardParallel(memory_budget=...)"
            )
        w = self.refine_within
        if w is not None and (isinstance(w, bool) or not isinstance(w, int | float) or not w >= 0):
            raise ConfigError(
                f"AutoStageOption.refine_within: {w!r} is invalid; expected a fraction >= 0 "
                "(0.05: configs whose composed estimate is within 5% of the chosen one's) or "
                "None (every config)"
            )


@dataclass(frozen=True)
class UniformStageOption:
    """``num_stages`` stages of equal layer counts, each on a ``submesh_shape`` (hosts,
    devices) submesh (default: the cluster's devices divided evenly among the stages) with
    logical mesh ``logical_shape`` (default: 1-D over the submesh).

    profiling: "whole" solves each distinct stage as one ILP; "individual" composes it from
    per-layer ILPs as ``AutoStageOption`` does (a few small ILPs instead of one per stage,
    which is how a grid of uniform configurations is screened quickly)."""

    num_stages: int
    submesh_shape: tuple[int, int] | None = None
    logical_shape: tuple[int, ...] | None = None
    profiling: Profiling = "whole"

    def __post_init__(self) -> None:
        positive_int("UniformStageOption.num_stages", self.num_stages)
        check_choice("UniformStageOption.profiling", self.profiling, get_args(Profiling))
        sub = None
        if self.submesh_shape is not None:
            sub = _shape("UniformStageOption", "submesh_shape", self.submesh_shape, 2)
            object.__setattr__(self, "submesh_shape", sub)
        if self.logical_shape is not None:
            log = _shape("UniformStageOption", "logical_shape", self.logical_shape)
            object.__setattr__(self, "logical_shape", log)
        if sub is not None and self.logical_shape is not None:
            log = self.logical_shape
            if math.prod(log) != math.prod(sub):
                raise ConfigError(
                    f"UniformStageOption.logical_shape: {log} has {math.prod(log)} devices but "
                    f"submesh_shape {sub} has {math.prod(sub)}"
                )


@dataclass(frozen=True)
class ManualStageOption:
    """Exact stages: ``forward_stage_layer_ids[s]`` lists stage s's (contiguous) layers, on a
    ``submesh_physical_shapes[s]`` (hosts, devices) submesh with logical mesh
    ``submesh_logical_shapes[s]``. ``submesh_devices`` (optional) pins each stage's flat
    device indices, as a saved plan does."""

    forward_stage_layer_ids: tuple[tuple[int, ...], ...]
    submesh_physical_shapes: tuple[tuple[int, int], ...]
    submesh_logical_shapes: tuple[tuple[int, ...], ...] | None = None
    submesh_devices: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        owner = "ManualStageOption"
        ids = tuple(tuple(int(i) for i in layer_ids) for layer_ids in self.forward_stage_layer_ids)
        if not ids or any(not s for s in ids):
            raise ConfigError(
                f"{owner}.forward_stage_layer_ids: {self.forward_stage_layer_ids!r} must list "
                "at least one layer per stage"
            )
        flat = [i for s in ids for i in s]
        if flat != list(range(len(flat))):
            raise ConfigError(
                f"{owner}.forward_stage_layer_ids: {ids} must cover layers 0..L-1 once, in "
                "order, each stage a contiguous run"
            )
        object.__setattr__(self, "forward_stage_layer_ids", ids)
        subs = tuple(
            _shape(owner, f"submesh_physical_shapes[{s}]", x, 2)
            for s, x in enumerate(self.submesh_physical_shapes)
        )
        if len(subs) != len(ids):
            raise ConfigError(
                f"{owner}.submesh_physical_shapes: {len(subs)} shapes for {len(ids)} stages"
            )
        object.__setattr__(self, "submesh_physical_shapes", subs)
        if self.submesh_logical_shapes is not None:
            logs = tuple(
                _shape(owner, f"submesh_logical_shapes[{s}]", x)
                for s, x in enumerate(self.submesh_logical_shapes)
            )
            if len(logs) != len(ids):
                raise ConfigError(
                    f"{owner}.submesh_logical_shapes: {len(logs)} shapes for {len(ids)} stages"
                )
            for s, (log, sub) in enumerate(zip(logs, subs, strict=True)):
                if math.prod(log) != math.prod(sub):
                    raise ConfigError(
                        f"{owner}.submesh_logical_shapes[{s}]: {log} does not have the "
                        f"{math.prod(sub)} devices of submesh {sub}"
                    )
            object.__setattr__(self, "submesh_logical_shapes", logs)
        if self.submesh_devices is not None:
            devs = tuple(tuple(int(d) for d in x) for x in self.submesh_devices)
            if len(devs) != len(ids) or any(
                len(d) != math.prod(sub) for d, sub in zip(devs, subs, strict=False)
            ):
                raise ConfigError(
                    f"{owner}.submesh_devices: {self.submesh_devices!r} must give each stage "
                    "as many device indices as its submesh has devices"
                )
            object.__setattr__(self, "submesh_devices", devs)


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages over submeshes, each stage auto-sharded by the ILP.

    num_micro_batches: B, the batch is split along its leading dimension. None (the default)
    searches it: the batch's divisors nearest each power of two, by bisection on the
    predicted iteration time (the plan's ``planning.micro_batches_tried`` lists each count
    planned; a step whose batch cannot be split gets B = 1).
    pipeline_schedule: "1f1b" or "gpipe". default_auto_sharding_option: ILP options per stage
    (a ``ShardParallel``; its backend, time_limit, layout and batch_axis; the fields a stage
    cannot use, mesh_shape, num_micro_batches, replicate_outputs and memory_budget, must be
    left at their defaults). memory_budget: bytes per device for every stage (None: the
    cluster's device memory); this is the one place a pipeline's budget is set.
    gradient_sync: how a stage prices bringing each parameter's gradient into the
    parameter's layout (where the optimiser applies it). "ilp" (the default): tied inside the
    ILP, which then also picks layouts that avoid it. "after": priced once the stage's ILP is
    solved (the ILP does not see it). Both charge it once per step (1/B per micro-batch), as
    the runtime syncs. With the other defaults, "ilp" planned 1.0-1.2x longer and found
    plans up to 12% faster (megatron-1.7b 6.41 -> 6.18 s, moe-27b 4.40 -> 3.85 s: "after"
    leaves the ILP blind to the data-parallel gradient traffic its layouts cause).
    fuse_programs: run each stretch of a stage's work between two transfers (under 1F1B the
    last stage's forward and backward of a micro-batch; a one-stage step whole, its
    micro-batches as one loop) as one program, one launch instead of one per task. False
    keeps a program per forward, backward, sync and apply: per-task timelines (``trace``)
    and HLO, at a launch each.
    """

    num_micro_batches: int | None = None
    layer_option: AutoLayerOption | ManualLayerOption = field(default_factory=ManualLayerOption)
    stage_option: AutoStageOption | UniformStageOption | ManualStageOption = field(
        default_factory=AutoStageOption
    )
    pipeline_schedule: ScheduleName = "1f1b"
    default_auto_sharding_option: ShardParallel = field(default_factory=ShardParallel)
    gradient_sync: GradientSync = "ilp"
    plan: Any = None  # a PipeshardPlan to replay without planning
    memory_budget: float | None = None
    fuse_programs: bool = True

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether stages keep optimiser state and gradients sharded over their devices
        (ZeRO-2 style): under every layout but "data" and "megatron" (state laid out like
        its parameter), as the planner prices them."""
        return self.default_auto_sharding_option.layout not in ("data", "megatron")

    @classmethod
    def from_plan(cls, plan: Any, **options: Any) -> PipeshardParallel:
        """Replay a saved ``PipeshardPlan`` (or its JSON text): same stages, devices, layouts."""
        from ..pipeline.plan import PipeshardPlan

        if isinstance(plan, str):
            plan = PipeshardPlan.from_json(plan)
        return cls(
            num_micro_batches=plan.num_micro_batches,
            pipeline_schedule=plan.schedule,
            plan=plan,
            **options,
        )

    def __post_init__(self) -> None:
        if self.num_micro_batches is not None:
            positive_int("PipeshardParallel.num_micro_batches", self.num_micro_batches)
        if not isinstance(self.layer_option, AutoLayerOption | ManualLayerOption):
            raise ConfigError(
                f"PipeshardParallel.layer_option: {self.layer_option!r} is not an "
                "AutoLayerOption or ManualLayerOption"
            )
        if not isinstance(
            self.stage_option, AutoStageOption | UniformStageOption | ManualStageOption
        ):
            raise ConfigError(
                f"PipeshardParallel.stage_option: {self.stage_option!r} is not an "
                "AutoStageOption, UniformStageOption or ManualStageOption"
            )
        if not isinstance(self.fuse_programs, bool):
            raise ConfigError(
                f"PipeshardParallel.fuse_programs: {self.fuse_programs!r} is invalid; expected "
                "True or False"
            )
        check_choice("PipeshardParallel.gradient_sync", self.gradient_sync, get_args(GradientSync))
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ConfigError(
                f"PipeshardParallel.memory_budget: {self.memory_budget!r} is invalid; expected "
                "bytes > 0 or None (the device's memory)"
            )
        sched = str(self.pipeline_schedule).lower()
        if sched not in SCHEDULES:
            raise ConfigError(
                f"PipeshardParallel.pipeline_schedule: {self.pipeline_schedule!r} is not one of "
                f"{SCHEDULES}"
            )
        object.__setattr__(self, "pipeline_schedule", sched)
        if not isinstance(self.default_auto_sharding_option, ShardParallel):
            raise ConfigError(
                "PipeshardParallel.default_auto_sharding_option: expected a ShardParallel, got "
                f"{self.default_auto_sharding_option!r}"
            )
        _check_stage_sharding(self.default_auto_sharding_option)


#: ShardParallel fields a pipeline stage cannot use, with why.
_UNUSED_PER_STAGE = {
    "mesh_shape": "each stage's logical mesh comes from the stage option",
    "num_micro_batches": "set PipeshardParallel(num_micro_batches=...)",
    "replicate_outputs": "stage outputs are laid out for the next stage",
    "memory_budget": "set PipeshardParallel(memory_budget=...)",
}


def _check_stage_sharding(option: ShardParallel) -> None:
    """Refuse a field of ``default_auto_sharding_option`` that stages would ignore."""
    default = ShardParallel()
    for name, why in _UNUSED_PER_STAGE.items():
        value = getattr(option, name)
        if value != getattr(default, name):
            raise ConfigError(
                f"PipeshardParallel.default_auto_sharding_option.{name}: {value!r} is not used "
                f"by pipeline stages ({why}); leave it at {getattr(default, name)!r}"
            )
