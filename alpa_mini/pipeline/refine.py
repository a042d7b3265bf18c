"""The default refinement: a one-stage composed plan re-planned as one whole-stage ILP.

A stage composed from per-layer ILPs pays for what no single layer sees: values handed
between layers in the layout their producer liked, parameters shared by distant layers (a
tied embedding) laid out as their first reader liked. One ILP over the whole stage weighs
those together. Solved for every config it is Alpa-class slow (``AutoStageOption(refine=
True)``); solved once, on the chosen config, with repeated layers tied to one choice
(``shard.problem.plan_sharding(tie_repeats="only")``) and a time limit, it costs about a
second and a half on GPT-style stacks (gpt-1.3b on 4 GPUs: 32.6568 -> 32.6406 s per
iteration). It runs once, on the micro-batch count the search chose, and keeps the whole
plan only where it is faster and fits with the micro-batches the stage holds in flight; so
it never makes a plan slower or larger than the budget.

It refines one-stage plans on one host's devices (two or more), and only where tying alike
nodes halves the ILP (no plan otherwise: ``plan_sharding(tie_repeats="only")``). In a
one-stage plan every layer, both readers of a tied parameter among them, shares the stage.
Measured on 2026-11-28 (``python -m benchmarks.default_plans``): on 2-8 GPUs it took
1-5 s and made six of the seven GPT and MoE rows 0.01-0.14% faster; on several hosts it
took 15-25 s a row and made one of six rows (moe-27b) 0.11% faster; gpt-39b's five stages
took 14.7 s and none got faster; wresnet-1b's one stage, solved untied, 18.7 s, no faster.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from jax.extend.core import ClosedJaxpr

from ..cluster.spec import ClusterSpec
from ..graph.grad_capture import GradCapture
from ..options.pipeshard import AutoStageOption, PipeshardParallel
from .plan import PipeshardPlan, StagePlan
from .stage_configs import stage_configs
from .stage_cost import StageCost, _budget, _StageModel, _with_launches

__all__ = ["refine_stages", "refines"]


def refines(method: PipeshardParallel) -> bool:
    """Whether ``method``'s plans get the default refinement: auto stages composed from
    per-layer ILPs, not already refined over every config (``refine=True``)."""
    so = method.stage_option
    return isinstance(so, AutoStageOption) and so.profiling == "individual" and not so.refine


def refine_stages(
    plan: PipeshardPlan,
    forward: ClosedJaxpr,
    capture: GradCapture,
    cluster: ClusterSpec,
    method: PipeshardParallel,
    sizes: tuple[float, float],
    progress: Callable[[str], None] | None = None,
) -> PipeshardPlan:
    """``plan`` with its stage replaced by its whole-stage ILP plan (same layers, submesh and
    config, repeats tied) where that is faster and still fits, for a one-stage plan of two or
    more layers on one host; ``sizes``: the step's optimiser-state and parameter bytes."""
    solution = plan.stage_solution
    if not refines(method) or solution is None or len(plan.stages) != 1:
        return plan
    (st,), (chosen,) = plan.stages, solution.stages
    hosts, devices = st.submesh
    if hosts > 1 or devices == 1 or st.layer_end == st.layer_start:  # see the module docstring
        return plan
    t0 = time.perf_counter()
    if progress is not None:
        progress("refining the stage whole")
    model = _StageModel(forward, capture, cluster, method, *sizes)
    model.refining = True
    ends = (*plan.layer_starts[1:], plan.num_equations)
    model.composed_layers = frozenset(zip(plan.layer_starts, ends, strict=True))
    logical, layout = stage_configs(chosen.submesh_shape, method.stage_option)[chosen.config_index]
    whole = model.cost(st.eqn_start, st.eqn_end, st.submesh, logical, layout)
    if whole is not None:
        whole = _with_launches(model, whole, st.submesh, logical)
    # One stage holds one micro-batch's activations at a time (the stage DP's memory rule).
    better = whole is not None and whole.latency < st.latency
    replaced = better and whole.memory(1) <= _budget(method, cluster)
    stages = (_refined(st, whole),) if replaced else plan.stages
    stats = plan.planning
    if stats is not None:
        c = model.stats
        stats = dataclasses.replace(
            stats,
            ilps_solved=stats.ilps_solved + c.ilps_solved,
            ilp_seconds=stats.ilp_seconds + c.ilp_seconds,
            graph_seconds=stats.graph_seconds + c.graph_seconds,
            refine_seconds=time.perf_counter() - t0,
            stages_refined=int(replaced),
        )
    return dataclasses.replace(plan, stages=stages, planning=stats)


def _refined(stage: StagePlan, whole: StageCost) -> StagePlan:
    """``stage`` with the whole-stage plan's latency, memory and layouts."""
    return dataclasses.replace(
        stage,
        latency=whole.latency,
        peak_memory=whole.memory(1),
        in_specs=whole.in_specs,
        out_specs=whole.out_specs,
        inner_specs=whole.inner_specs,
        residual_bytes=whole.residual_bytes,
    )
