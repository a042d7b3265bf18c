"""Hand-tuned baselines for the plan-quality benchmark, all priced by the same cost model and
simulator as our own plans.

- ``data-parallel``: one stage over every device, batch split, parameters and optimiser
  state replicated (a whole copy of the state on each device).
- ``zero-2``: the same with optimiser state sharded over the devices.
- ``zero-3``: parameters sharded too (gathered where they are used).
- ``pp-dp``: pipeline plus data parallelism, no operator sharding (the Wide-ResNet baseline
  of Alpa's paper): ``pp`` stages of equal layer counts on equal submeshes, each stage's
  parameters and optimiser state replicated over its ``dp`` devices and the micro-batch
  split over them, searched over ``pp`` and the micro-batch count.
- ``megatron``: Megatron-LM's manual space, searched exhaustively: ``pp`` stages of equal
  layer counts on equal submeshes, each a (dp, tp) mesh with tensor parallelism inside one
  host and the batch split over dp, and the micro-batch count. Each stage's tensor-parallel
  layouts are the ILP's best on its (dp, tp) mesh, which on transformer layers is Megatron's
  own column/row split, so this is Megatron's configuration search, not a weaker stand-in.

Stage ILPs tie each gradient to its parameter's layout (``gradient_sync="ilp"``), so the
gradient all-reduce of data parallelism is priced and weighed against tensor parallelism.

A configuration that does not fit in device memory (the ILP finds no layout within the
budget, or the simulated peak with the schedule's micro-batches in flight exceeds it) is
reported as infeasible with the reason, never silently dropped.

Large grids (about 100 configurations on 64 GPUs) can be screened: every configuration is
planned with stages composed from per-layer ILPs (``UniformStageOption(profiling=
"individual")``, a few small ILPs each), then the most promising are re-planned with whole
stage ILPs and the faster plan of each kept, as ``AutoStageOption(refine=True)`` does for our
own plans. Composed plans are real plans (they lower and run), so the search never keeps an
estimate.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import alpa_mini
from alpa_mini.cluster.spec import ClusterSpec
from alpa_mini.errors import ConfigError, MemoryBudgetError
from alpa_mini.options.pipeshard import ManualLayerOption, PipeshardParallel, UniformStageOption
from alpa_mini.options.shard import ShardParallel
from alpa_mini.pipeline.plan import PipeshardPlan
from alpa_mini.pipeline.simulate import Simulation, simulate_plan

__all__ = [
    "BASELINES",
    "BaselineResult",
    "evaluate_plan",
    "megatron_configs",
    "run_baseline",
    "run_baselines",
]

BASELINES = ("data-parallel", "zero-2", "zero-3", "pp-dp", "megatron")


@dataclass(frozen=True)
class BaselineResult:
    """The best configuration one baseline found (or why none fits)."""

    name: str
    iteration_time: float  # simulated seconds; inf when nothing fits
    config: dict[str, int] = field(default_factory=dict)  # dp, tp, pp, micro_batches
    peak_memory: float = math.inf  # bytes on the fullest device
    plan: PipeshardPlan | None = None
    tried: int = 0  # configurations planned
    infeasible: int = 0  # of which did not fit
    reason: str = ""  # why nothing fits, when nothing does
    seconds: float = 0.0  # wall time of the search

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.iteration_time)


def evaluate_plan(plan: PipeshardPlan, cluster: ClusterSpec) -> tuple[float, float, str]:
    """(simulated iteration time, peak bytes on the fullest device, reason it does not fit
    or ""); time is inf when the schedule's in-flight micro-batches overflow a device."""
    sim = simulate_plan(plan, cluster)
    peak, reason = _overflow(sim, plan, cluster)
    return (math.inf if reason else sim.iteration_time), peak, reason


def _overflow(sim: Simulation, plan: PipeshardPlan, cluster: ClusterSpec) -> tuple[float, str]:
    """(peak bytes on the fullest device, why it overflows device memory or "")."""
    peak = max(sim.peak_memory)
    limit = cluster.device.memory_bytes
    if peak <= limit:
        return peak, ""
    stage = max(range(len(sim.peak_memory)), key=sim.peak_memory.__getitem__)
    return peak, (
        f"stage {stage} peaks at {peak / 2**30:.1f} GiB per device with "
        f"{plan.num_micro_batches} micro-batches ({plan.schedule}); devices have "
        f"{limit / 2**30:.1f} GiB"
    )


def megatron_configs(
    num_devices: int,
    devices_per_host: int,
    num_layers: int,
    batch_size: int,
    micro_batches: Iterable[int],
) -> list[dict[str, int]]:
    """Megatron's grid: dp * tp * pp = devices, tp a divisor of a host's devices, pp at most
    the layer count, equal submeshes that tile hosts, and micro-batch counts that split the
    batch into micro-batches divisible by dp."""
    out = []
    for pp in _divisors(num_devices):
        per_stage = num_devices // pp
        if pp > num_layers or not _tiles(per_stage, devices_per_host):
            continue
        for tp in _divisors(per_stage):
            if tp > devices_per_host or devices_per_host % tp:
                continue
            dp = per_stage // tp
            for b in sorted(set(micro_batches)):
                if b < 1 or batch_size % b or (batch_size // b) % dp:
                    continue
                out.append({"dp": dp, "tp": tp, "pp": pp, "micro_batches": b})
    return out


def run_baseline(
    name: str,
    step: Callable[..., Any],
    args: tuple[Any, ...],
    cluster: ClusterSpec,
    *,
    num_layers: int,
    batch_size: int,
    micro_batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
    schedule: str = "1f1b",
    ilp_option: ShardParallel | None = None,
    refine_top: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> BaselineResult:
    """Plan every configuration of baseline ``name`` for ``step`` (abstract ``args`` as for
    ``alpa_mini.plan``; the step's layers marked with ``mark_pipeline_boundary``) and keep
    the fastest simulated one that fits. ``ilp_option``: the stage ILPs' backend, time limit
    and memory budget (its layout options are the baseline's own).

    ``refine_top``: None plans every configuration with whole-stage ILPs. k screens them all
    with composed stages, then re-plans whole, fastest first, until k configurations fit
    whole (at most 3k re-plans); configurations whose composed plan overflows memory come
    last, since composition over-counts memory."""
    if refine_top is not None and (not isinstance(refine_top, int) or refine_top < 1):
        raise ConfigError(f"refine_top: {refine_top!r} is not None or a positive integer")
    if name not in BASELINES:
        raise ConfigError(f"baseline: {name!r} is not one of {', '.join(BASELINES)}")
    n, per_host = cluster.num_devices, cluster.devices_per_host
    ilp = ilp_option or ShardParallel()
    if name == "megatron":
        configs = megatron_configs(n, per_host, num_layers, batch_size, micro_batches)
        option = dataclasses.replace(ilp, batch_axis=0, layout="auto")
    elif name == "pp-dp":
        configs = [
            c
            for c in megatron_configs(n, per_host, num_layers, batch_size, micro_batches)
            if c["tp"] == 1
        ]
        option = dataclasses.replace(ilp, batch_axis=0, layout="data")
    else:
        configs = [
            {"dp": n, "tp": 1, "pp": 1, "micro_batches": b}
            for b in sorted(set(micro_batches))
            if b >= 1 and batch_size % b == 0 and (batch_size // b) % n == 0
        ]
        layout = {"data-parallel": "data"}.get(name, name.replace("-", ""))
        option = dataclasses.replace(ilp, batch_axis=None, layout=layout)
    t0 = time.perf_counter()

    def attempt(
        c: dict[str, int], profiling: str
    ) -> tuple[PipeshardPlan | None, float, float, str]:
        """(plan, simulated seconds ignoring memory, peak bytes, reason it does not fit)."""
        if progress is not None:
            progress(f"{name}: {_label(c)} ({profiling})")
        per_stage = n // c["pp"]
        submesh = (per_stage // per_host, per_host) if per_stage >= per_host else (1, per_stage)
        method = PipeshardParallel(
            num_micro_batches=c["micro_batches"],
            layer_option=ManualLayerOption(),
            stage_option=UniformStageOption(
                c["pp"], submesh, (c["dp"], c["tp"]), profiling=profiling
            ),
            pipeline_schedule=schedule,
            default_auto_sharding_option=option,
            gradient_sync="ilp",
        )
        try:
            plan = alpa_mini.plan(step, *args, method=method, cluster=cluster)
        except MemoryBudgetError as err:
            return None, math.inf, math.inf, f"{_label(c)}: {err}"
        sim = simulate_plan(plan, cluster)
        peak, reason = _overflow(sim, plan, cluster)
        return plan, sim.iteration_time, peak, f"{_label(c)}: {reason}" if reason else ""

    best: BaselineResult | None = None
    fits: dict[int, str] = {}  # config index -> "" when some plan of it fits, else why not

    def keep(k: int, plan: PipeshardPlan | None, seconds: float, peak: float, reason: str) -> None:
        nonlocal best
        if reason:
            fits.setdefault(k, reason)
            return
        fits[k] = ""
        if best is None or seconds < best.iteration_time:
            best = BaselineResult(name, seconds, dict(configs[k]), peak, plan)

    if refine_top is None:
        for k, c in enumerate(configs):
            keep(k, *attempt(c, "whole"))
    else:
        timed, untimed = [], []
        for k, c in enumerate(configs):
            plan, seconds, peak, reason = attempt(c, "individual")
            keep(k, plan, seconds, peak, reason)
            # Composition over-counts memory, so whole stages may fit where it did not:
            # simulated ones rank by time, the rest follow with more stages first.
            (timed if plan is not None else untimed).append((seconds, k))
        order = [k for _, k in sorted(timed)] + [k for _, k in reversed(untimed)]
        confirmed = 0
        for k in order[: 3 * refine_top]:
            if confirmed >= refine_top:
                break
            plan, seconds, peak, reason = attempt(configs[k], "whole")
            confirmed += not reason
            keep(k, plan, seconds, peak, reason)
    infeasible = sum(1 for why in fits.values() if why)
    reasons = [why for why in fits.values() if why]
    elapsed = time.perf_counter() - t0
    if best is None:
        why = reasons[0] if reasons else "no configuration divides the batch and devices"
        return BaselineResult(
            name, math.inf, tried=len(configs), infeasible=infeasible, reason=why, seconds=elapsed
        )
    return dataclasses.replace(best, tried=len(configs), infeasible=infeasible, seconds=elapsed)


def run_baselines(
    step: Callable[..., Any],
    args: tuple[Any, ...],
    cluster: ClusterSpec,
    *,
    num_layers: int,
    batch_size: int,
    names: Sequence[str] = BASELINES,
    **options: Any,
) -> list[BaselineResult]:
    """``run_baseline`` for each of ``names``."""
    return [
        run_baseline(
            name, step, args, cluster, num_layers=num_layers, batch_size=batch_size, **options
        )
        for name in names
    ]


def _label(c: dict[str, int]) -> str:
    return f"dp={c['dp']} tp={c['tp']} pp={c['pp']} B={c['micro_batches']}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tiles(per_stage: int, per_host: int) -> bool:
    """Equal submeshes of ``per_stage`` devices tile hosts of ``per_host``."""
    if per_stage >= per_host:
        return per_stage % per_host == 0
    return per_host % per_stage == 0
