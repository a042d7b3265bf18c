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
- ``strong-grid`` (called ``megatron`` before; old result files still say so): Megatron's
  configuration space with our ILP inside every stage: ``pp`` stages of equal layer counts
  on equal submeshes, each a (dp, tp) mesh with tensor parallelism inside one host and the
  batch split over dp, and the micro-batch count; each stage's layouts are the ILP's best on
  its mesh. As strong as our intra-operator search by construction, so it bounds how much
  of our gain comes from the stage search alone.
- ``megatron-lm``: Megatron-LM's own tensor parallelism for GPT, the grid above with every
  parameter's layout pinned as Megatron-LM lays it out (``megatron_splits``): attention
  q/k/v weights and biases split by heads and the first MLP matmul and its bias by columns
  (column-parallel), the attention output projection by heads and the second MLP matmul by
  rows (row-parallel), so attention and MLP each need one all-reduce over tp in the forward
  and one in the backward pass; the word embedding split by vocabulary; layer norms, the
  position embedding and the biases added after an all-reduce replicated. Everything is
  replicated over dp, the batch split over dp alone; tp must divide the heads, the MLP width
  and the vocabulary, as in Megatron-LM. Optimiser state is kept like each parameter (split
  over tp, replicated over dp), Megatron-LM's default (its distributed optimiser is opt-in).
  The pins are per-input filters (``ShardParallel(layout="megatron", tensor_splits=...)``,
  ``alpa_mini/options/param_splits.py``); the stage ILP chooses what they leave open, the
  activation layouts inside a stage. On the A100 cost model that is Megatron-LM's own plan
  where activations dominate (a block's forward all-reduces its attention and MLP outputs
  over tp; its backward the MLP's input gradient and, as gpt.py keeps q, k and v as three
  matmuls where Megatron-LM fuses one, three attention input gradients:
  ``tests/benchmarks/test_faithful_baselines.py``), but the ILP may also split the sequence
  between the matmuls (Megatron's sequence parallelism), gather a small weight for one use,
  or gather a small micro-batch over dp instead of reducing weight gradients. Solved to
  optimality, ``megatron-lm`` is thus no slower than Megatron-LM's exact plan in our cost
  model: a conservative baseline. Pinning activations too would need per-operator filters
  in the stage ILP (``shard/problem.py``).
- ``deepspeed-moe``: DeepSpeed-MoE as Alpa's paper ran it: ZeRO stage 2 (optimiser state
  and gradients sharded over all devices, parameters replicated) with expert parallelism
  (each expert weight split along its expert dimension, ``expert_splits``, over ep devices,
  the most that divide both the experts and the devices, as DeepSpeed requires; replicated
  over the other devices / ep), the batch split over every device; no pipeline, no tensor
  parallelism. Its gradients are priced as DeepSpeed's ZeRO-2 runs them: reduce-scattered
  into each device's partition after every micro-batch, only that partition held all step
  (``alpa_mini.pipeline.grad_pricing``), where the generic ``zero-2`` is this runtime's
  preset (accumulated, reduced once per step). Its micro-batch counts are DeepSpeed's
  gradient-accumulation steps: those given and every power of two below the largest, where
  each device gets whole rows. Tokens reach their experts by
  all-to-all, which the stage ILP finds between the batch-split tokens and the
  expert-split weights where bandwidth matters (with a few KiB per collective it may
  gather the tokens and all-reduce the combined output instead: fewer collectives).

``FAITHFUL`` names the baseline each model family's users run (Alpa's paper compared with
these): Megatron-LM for GPT, DeepSpeed-MoE for MoE, PP-DP for Wide-ResNet.

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

import contextlib
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import alpa_mini
from alpa_mini.cluster.spec import ClusterSpec
from alpa_mini.errors import ConfigError, MemoryBudgetError
from alpa_mini.options.param_splits import ParamSplit, ParamSplits
from alpa_mini.options.pipeshard import ManualLayerOption, PipeshardParallel, UniformStageOption
from alpa_mini.options.shard import ShardParallel
from alpa_mini.pipeline.grad_pricing import reduced_every_micro_batch
from alpa_mini.pipeline.plan import PipeshardPlan
from alpa_mini.pipeline.simulate import Simulation, simulate_plan
from benchmarks.baseline_names import (
    BASELINES,
    FAITHFUL,
    GENERIC,
    RENAMED,
    baseline_name,
    family_baselines,
)

__all__ = [
    "BASELINES",
    "FAITHFUL",
    "GENERIC",
    "BaselineResult",
    "baseline_name",
    "deepspeed_moe_configs",
    "evaluate_plan",
    "expert_splits",
    "family_baselines",
    "megatron_configs",
    "megatron_splits",
    "run_baseline",
    "run_baselines",
]

#: Megatron-LM's split of the parameters of ``models/gpt.py``'s layout (``models/moe.py``
#: shares it), by the end of the leaf's key path: the dimension split over tp, counted
#: without a stacked layer axis. Leaves not listed are replicated.
MEGATRON_SPLITS: dict[tuple[str, ...], int] = {
    ("attn", "w_q"): 1,  # [H, N, D]: column-parallel, by heads
    ("attn", "w_k"): 1,
    ("attn", "w_v"): 1,
    ("attn", "b_q"): 0,  # [N, D]: a column-parallel layer's bias follows its columns
    ("attn", "b_k"): 0,
    ("attn", "b_v"): 0,
    ("attn", "w_out"): 0,  # [N, D, H]: row-parallel, by heads (b_out [H] replicated)
    ("mlp", "w_in"): 1,  # [H, F]: column-parallel
    ("mlp", "b_in"): 0,  # [F]
    ("mlp", "w_out"): 0,  # [F, H]: row-parallel (b_out [H] replicated)
    ("wte",): 0,  # [V, H]: vocabulary-parallel embedding (and tied LM head)
}


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
    pricing: str = ""  # how its gradients were priced where not as this runtime syncs

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


def _leaves(params: Any) -> list[tuple[str, tuple[str, ...], tuple[int, ...], bool]]:
    """(key path, its dict keys, shape, stacked) of each parameter leaf. Stacked: a leaf under
    a "layers" dict rather than a list of layers (``gpt.py``'s scanned layout), whose first
    axis is the layer axis."""
    import jax

    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        stacked = any(
            isinstance(k, jax.tree_util.DictKey)
            and k.key == "layers"
            and isinstance(after, jax.tree_util.DictKey)
            for k, after in itertools.pairwise(path)
        )
        out.append((jax.tree_util.keystr(path), keys, tuple(leaf.shape), stacked))
    return out


def megatron_splits(params: Any) -> ParamSplits:
    """Megatron-LM's tensor-parallel split of each leaf of a GPT's ``params`` (by key path,
    ``MEGATRON_SPLITS``); a ``ConfigError`` for parameters that are not such a GPT's."""
    entries = []
    for name, keys, shape, stacked in _leaves(params):
        if "experts" in keys:
            raise ConfigError(
                f"megatron-lm: {name} is an expert weight; Megatron-LM's tensor parallelism is "
                "the GPT baseline (MoE models use deepspeed-moe)"
            )
        dim = next((d for k, d in MEGATRON_SPLITS.items() if keys[-len(k) :] == k), None)
        entries.append(ParamSplit(name, shape, None if dim is None else dim + stacked, stacked))
    if all(e.dim is None for e in entries):
        raise ConfigError(
            "megatron-lm: no parameter is laid out as models/gpt.py's (attn w_q/w_k/w_v/w_out, "
            "mlp w_in/w_out, wte); Megatron-LM's layouts apply to GPTs"
        )
    return ParamSplits(tuple(entries))


def expert_splits(params: Any) -> ParamSplits:
    """DeepSpeed's expert parallelism: every leaf under an "experts" key (``moe.py``'s
    ``[E, ...]`` expert weights) split along its expert dimension, the rest replicated."""
    entries = []
    for name, keys, shape, stacked in _leaves(params):
        dim = int(stacked) if "experts" in keys else None
        entries.append(ParamSplit(name, shape, dim, stacked))
    if all(e.dim is None for e in entries):
        raise ConfigError(
            "deepspeed-moe: no parameter lives under an 'experts' key (models/moe.py's layout); "
            "expert parallelism applies to MoE models"
        )
    return ParamSplits(tuple(entries))


def deepspeed_moe_configs(
    num_devices: int, num_experts: int, batch_size: int, micro_batches: Iterable[int]
) -> list[dict[str, int]]:
    """DeepSpeed-MoE's grid: one stage over every device, the batch split over all of them
    (dp = devices), experts over the most devices ep that divide both the experts and the
    devices (DeepSpeed's rule). Micro-batch counts (gradient-accumulation steps): those
    given and every power of two below the largest, each micro-batch splitting over dp."""
    ep = math.gcd(num_experts, num_devices)
    given = [b for b in micro_batches if b >= 1]
    counts = set(given) | {2**k for k in range(max(given, default=0).bit_length())}
    return [
        {"dp": num_devices, "ep": ep, "pp": 1, "micro_batches": b}
        for b in sorted(counts)
        if batch_size % b == 0 and (batch_size // b) % num_devices == 0
    ]


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


#: The ``pricing`` of DeepSpeed-MoE's results: ZeRO-2's gradients reduced into their
#: partitions every micro-batch (results without it were priced as this runtime syncs).
DEEPSPEED_PRICING = "zero2-every-micro-batch"


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
    if name in RENAMED:
        raise ConfigError(
            f"baseline: {name!r} is now {RENAMED[name]!r} (the ILP inside Megatron's grid); "
            "Megatron-LM's own layouts are 'megatron-lm'"
        )
    if name not in BASELINES:
        raise ConfigError(f"baseline: {name!r} is not one of {', '.join(BASELINES)}")
    n, per_host = cluster.num_devices, cluster.devices_per_host
    grid = functools.partial(megatron_configs, n, per_host, num_layers, batch_size)
    configs, option, why_none = _space(
        name, args[0], n, grid, batch_size, micro_batches, ilp_option or ShardParallel()
    )
    # DeepSpeed's ZeRO-2 reduces its gradient partitions every micro-batch.
    deepspeed = name == "deepspeed-moe"
    pricing = reduced_every_micro_batch if deepspeed else contextlib.nullcontext
    priced = DEEPSPEED_PRICING if deepspeed else ""
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
            stage_option=UniformStageOption(c["pp"], submesh, _logical(c), profiling=profiling),
            pipeline_schedule=schedule,
            default_auto_sharding_option=option,
            gradient_sync="ilp",
        )
        try:
            with pricing():
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
        why = reasons[0] if reasons else why_none
        return BaselineResult(
            name, math.inf, tried=len(configs), infeasible=infeasible, reason=why,
            seconds=elapsed, pricing=priced,
        )  # fmt: skip
    return dataclasses.replace(
        best, tried=len(configs), infeasible=infeasible, seconds=elapsed, pricing=priced
    )


def run_baselines(
    step: Callable[..., Any],
    args: tuple[Any, ...],
    cluster: ClusterSpec,
    *,
    num_layers: int,
    batch_size: int,
    names: Sequence[str] = GENERIC,
    **options: Any,
) -> list[BaselineResult]:
    """``run_baseline`` for each of ``names`` (default: those for every model family; add
    ``FAITHFUL[family]`` or use ``family_baselines``)."""
    return [
        run_baseline(
            name, step, args, cluster, num_layers=num_layers, batch_size=batch_size, **options
        )
        for name in names
    ]


def _space(
    name: str,
    params: Any,
    n: int,
    grid: Callable[[Sequence[int]], list[dict[str, int]]],
    batch_size: int,
    micro_batches: Sequence[int],
    ilp: ShardParallel,
) -> tuple[list[dict[str, int]], ShardParallel, str]:
    """Baseline ``name``'s configurations, the stage option pinning its layouts, and why
    there are no configurations when there are none. ``grid``: Megatron's grid over the
    micro-batch counts."""
    none = "no configuration divides the batch and devices"
    if name == "strong-grid":
        return grid(micro_batches), dataclasses.replace(ilp, batch_axis=0, layout="auto"), none
    if name == "pp-dp":
        configs = [c for c in grid(micro_batches) if c["tp"] == 1]
        return configs, dataclasses.replace(ilp, batch_axis=0, layout="data"), none
    if name == "megatron-lm":
        splits = megatron_splits(params)
        configs = [c for c in grid(micro_batches) if not splits.indivisible(c["tp"])]
        option = dataclasses.replace(ilp, batch_axis=None, layout="megatron", tensor_splits=splits)
        return configs, option, none + " with tp dividing every split dimension"
    if name == "deepspeed-moe":
        splits = expert_splits(params)
        experts = {e.shape[e.dim] for e in splits.entries if e.dim is not None}
        configs = deepspeed_moe_configs(n, min(experts), batch_size, micro_batches)
        option = dataclasses.replace(ilp, batch_axis=None, layout="zero2", tensor_splits=splits)
        return configs, option, f"{none} with {min(experts)} experts over {n} devices"
    configs = [
        {"dp": n, "tp": 1, "pp": 1, "micro_batches": b}
        for b in sorted(set(micro_batches))
        if b >= 1 and batch_size % b == 0 and (batch_size // b) % n == 0
    ]
    layout = {"data-parallel": "data"}.get(name, name.replace("-", ""))
    return configs, dataclasses.replace(ilp, batch_axis=None, layout=layout), none


def _logical(c: dict[str, int]) -> tuple[int, int]:
    """A configuration's stage mesh: (dp, tp), or (dp / ep, ep) with experts on the last."""
    return (c["dp"] // c["ep"], c["ep"]) if "ep" in c else (c["dp"], c["tp"])


def _label(c: dict[str, int]) -> str:
    split = f"ep={c['ep']}" if "ep" in c else f"tp={c['tp']}"
    return f"dp={c['dp']} {split} pp={c['pp']} B={c['micro_batches']}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tiles(per_stage: int, per_host: int) -> bool:
    """Equal submeshes of ``per_stage`` devices tile hosts of ``per_host``."""
    if per_stage >= per_host:
        return per_stage % per_host == 0
    return per_host % per_stage == 0
