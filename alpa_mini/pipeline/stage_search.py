"""The stage search: layers, the cost table over (layer range, submesh, config), the stage DP
(``solvers.stages``), and the chosen stages with their ILP plans and devices.

For each candidate stage the per-stage ILP (``stage_cost``) plans the stage's forward +
backward for one micro-batch; its predicted time is the stage latency and its peak memory
plus the residuals of the micro-batches held in flight decide how many later stages it can
tolerate under 1F1B (``max_succ``). Identical layers (same structural hash) are solved once.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from jax.extend.core import ClosedJaxpr

from .._validate import format_bytes
from ..cluster.spec import ClusterSpec
from ..errors import ConfigError, MemoryBudgetError
from ..graph.grad_capture import GradCapture
from ..graph.planning_stats import PlanningStats
from ..options.pipeshard import (
    AutoStageOption,
    ManualStageOption,
    PipeshardParallel,
    UniformStageOption,
)
from ..shard.problem import build_activity
from ..solvers.errors import InfeasibleError
from ..solvers.stages import StageProblem, StageSolution, solve_stages, submesh_shapes
from .compose import (
    _composed_row,
    _composed_stage,
    _layer_table,
    _LayerTable,
    _refine_configs,
    align_shared,
    bound_alignments,
    needs_alignment,
)
from .latency_floors import latency_floor_cells
from .layers import layer_starts_and_eps
from .memory_screen import screen_memory
from .micro_batch_search import Dominated
from .placement import _check_devices, assign_devices
from .plan import PipeshardPlan, StagePlan
from .stage_configs import StageConfig, _allowed_submeshes, _config_names, stage_configs
from .stage_cost import StageCost, _budget, _StageModel, _with_launches
from .stage_slice import slice_stage
from .stage_transfers import CutBytes, simulated_seconds, transfer_charges, uncharged

__all__ = ["plan_pipeline"]

T = TypeVar("T")


@dataclass
class _Chosen:
    """Stages as chosen, before their final costs: layer ranges, submeshes, logical meshes and
    devices; composed costs (individual profiling), the configs ``refine`` re-plans whole,
    and for auto stages the DP's problem and solution."""

    ranges: list[tuple[int, int]]
    subs: list[tuple[int, int]]
    logicals: list[tuple[int, ...]]
    devices: list[tuple[int, ...]]
    composed: list[StageCost | None] | None = None
    to_refine: list[list[StageConfig]] | None = None
    problem: StageProblem | None = None
    solution: StageSolution | None = None


#: Whether a DP that finds no slicing works out the least per-device memory that would fit (a
#: second cost table, of ILPs without a budget). The micro-batch search turns it off for the
#: counts it tries and asks only when no count fits.
LEAST_MEMORY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "alpa_mini_least_memory", default=True
)

#: The largest stage table (cost and ``max_succ``: 16 bytes per (range, submesh, config)
#: cell) that starts on latency floors (``latency_floors``). Each round that builds the
#: submeshes the DP picked copies the table and re-runs the DP over it, which on tables of
#: hundreds of MiB cost more planning time than the ILPs it saved (when tables had a column
#: for every host count: megatron-529.6b's 273 MiB, 215 -> 231 s; the 1T's 491 MiB). Now
#: that they hold the searched submeshes alone (``_searched_submeshes``), the 1T's is 27 MiB
#: and starts on floors too (its divisors, the same plan: 249-266 -> 187 s, 2.47 -> 1.44 GiB).
LAZY_TABLE_BYTES = 256 << 20

#: Predicted seconds a plan must beat to be worth finishing: the micro-batch search's fastest
#: count so far. Without refinement a plan's predicted time is the stage DP's objective, and
#: the DP over bound cells is a lower bound on it, so the DP stops with ``Dominated`` as soon
#: as that bound exceeds this (before the bound cells' MIPs are branched on).
BEAT: contextvars.ContextVar[float] = contextvars.ContextVar("alpa_mini_beat", default=math.inf)

#: Work for the planner's own thread while the stage DP's settling rounds wait on their few
#: ILPs (its core is mostly idle then), run at most once per plan and only once the DP has
#: shown the count is not dominated: the micro-batch search traces the counts it will likely
#: plan next there.
WHILE_SETTLING: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "alpa_mini_while_settling", default=None
)


def plan_pipeline(
    forward: ClosedJaxpr,
    capture: GradCapture,
    cluster: ClusterSpec,
    method: PipeshardParallel,
    *,
    state_bytes_total: float,
    param_bytes_total: float,
    progress: Callable[[str], None] | None = None,
) -> PipeshardPlan:
    """Layers, then stages (auto: cost table + DP; uniform; manual), each with its ILP plan:
    the ``PipeshardPlan`` of a traced step (``planning.trace_seconds`` left for the caller)."""
    t0 = time.perf_counter()
    starts, layer_eps = layer_starts_and_eps(forward, method.layer_option)
    ends = (*starts[1:], len(forward.jaxpr.eqns))
    model = _StageModel(forward, capture, cluster, method, state_bytes_total, param_bytes_total)
    so = method.stage_option
    if isinstance(so, AutoStageOption) and so.profiling == "individual":
        model.composed_layers = frozenset(zip(starts, ends, strict=True))
    if isinstance(so, AutoStageOption):
        sizes = (state_bytes_total, param_bytes_total)
        chosen = _auto_stages(model, starts, ends, sizes, progress)
    elif isinstance(so, UniformStageOption):
        chosen = _uniform_stages(model, starts, ends)
    else:
        chosen = _manual_stages(starts, cluster, so)
    stages = tuple(_stage_plan(model, chosen, k, starts, ends) for k in range(len(chosen.ranges)))
    c = model.stats
    return PipeshardPlan(
        stages=stages,
        layer_starts=starts,
        layer_eps=layer_eps,
        num_equations=len(forward.jaxpr.eqns),
        schedule=method.pipeline_schedule,
        num_micro_batches=method.num_micro_batches,
        cluster=cluster.name,
        cluster_spec=cluster,
        stage_problem=chosen.problem,
        stage_solution=chosen.solution,
        planning=PlanningStats(
            graph_seconds=c.graph_seconds,
            ilp_seconds=c.ilp_seconds,
            dp_seconds=c.dp_seconds,
            total_seconds=time.perf_counter() - t0,
            ilps_solved=c.ilps_solved,
            ilps_unproven=c.ilps_unproven,
            restricted_wins=c.restricted_wins,
            ilps_bounded=c.ilps_deferred - c.ilps_settled,
            cost_entries=c.cost_entries,
            cache_hits=c.cache_hits,
        ),
    )


def _auto_stages(model, starts, ends, sizes: tuple[float, float], progress) -> _Chosen:
    """The stage DP over the cost table of every (layer range, submesh, config)."""
    method, cluster = model.method, model.cluster
    so: AutoStageOption = method.stage_option
    L = len(starts)
    shapes = _searched_submeshes(cluster, so)
    configs = [stage_configs(s, so) for s in shapes]
    budget = _budget(method, cluster)
    names = _config_names(configs)
    C, B = max(len(c) for c in configs), method.num_micro_batches
    # Composed stages may stand on bounds of fractional layer MIPs until the DP needs them,
    # and (submesh, config) pairs on their latency floors until it picks them.
    model.defer_fractional = so.profiling == "individual"
    try:
        lazy = None
        if model.defer_fractional and L * L * len(shapes) * C * 16 <= LAZY_TABLE_BYTES:
            problem, lazy = _floor_problem(model, starts, ends, shapes, configs, names)
            entries, tables = {}, {}
        else:
            if model.defer_fractional and math.isfinite(budget):  # composed stages: the module
                screen_memory(model, starts, ends, shapes, configs, budget, names)
            entries, tables = _cost_entries(model, starts, ends, shapes, configs, so, progress)
            problem = _stage_problem(entries, L, shapes, C, budget, cluster, B, names)
        problem, solution = _settled_dp(
            model, problem, entries, tables, starts, ends, configs, lazy, progress
        )
        if solution.num_stages > 1:
            problem, solution = _transfer_aware(
                model, problem, solution, entries, tables, starts, ends, configs, lazy, progress
            )
    except InfeasibleError as err:
        if not LEAST_MEMORY.get():
            raise MemoryBudgetError(
                f"memory_budget: no pipeline plan fits {format_bytes(budget, 2)} per device "
                f"({err})",
                None,
            ) from None
        state_total, param_total = sizes
        need = _least_pipeline_memory(
            model.forward, model.capture, cluster, method, state_total, param_total,
            starts, ends, shapes, configs, names,
        )  # fmt: skip
        least = (
            f"the smallest per-device memory with a feasible plan is about {format_bytes(need, 2)}"
            if math.isfinite(need)
            else f"no plan of {L} layers fits this cluster at any memory ({len(shapes)} submesh "
            f"shapes, {cluster.num_devices} devices): use fewer devices or more layers"
        )
        raise MemoryBudgetError(
            f"memory_budget: no pipeline plan fits {format_bytes(budget, 2)} per device ({err}); "
            f"{least}",
            need,
        ) from None
    finally:
        model.defer_fractional = False
    subs = [st.submesh_shape for st in solution.stages]
    chosen = _Chosen(
        ranges=[(st.layer_start, st.layer_end) for st in solution.stages],
        subs=subs,
        logicals=[configs[st.submesh_index][st.config_index].shape for st in solution.stages],
        devices=assign_devices(subs, cluster),
        problem=problem,
        solution=solution,
    )
    if so.profiling == "individual":  # compose the chosen stages too
        chosen.composed = []
        for st in solution.stages:
            si, ci, i, j = st.submesh_index, st.config_index, st.layer_start, st.layer_end
            # (Aligned already where the stage holds both readers of a shared parameter:
            # _settled_dp.)
            chosen.composed.append(_composed_stage(model, tables[(si, ci)], starts, ends, i, j))
        if so.refine:
            _prefetch_refinement(model, chosen, tables, starts, ends, configs)
    return chosen


def _searched_submeshes(cluster: ClusterSpec, option: AutoStageOption) -> tuple:
    """The submesh shapes the stage DP searches (``AutoStageOption.submesh_space``), in
    ``submesh_shapes`` order: its table has a column for these only."""
    every = submesh_shapes(cluster.num_hosts, cluster.devices_per_host)
    allowed = _allowed_submeshes(every, option.submesh_space)
    return tuple(s for s, keep in zip(every, allowed, strict=True) if keep)


def _floor_problem(model, starts, ends, shapes, configs, names):
    """The stage DP's problem with every searched (submesh, config) pair on its latency floors
    (``latency_floors``), once the memory screen has passed, and those pairs. (A function of
    its own, so that its working arrays and the screen's cells, GBs at Megatron's 1T, are
    freed before the DP runs.)"""
    L, cluster, budget = len(starts), model.cluster, _budget(model.method, model.cluster)
    memory = None
    if math.isfinite(budget):
        memory = screen_memory(model, starts, ends, shapes, configs, budget, names)
    C = max(len(c) for c in configs)
    cost = np.full((L, L, len(shapes), C), np.inf)
    succ = np.zeros((L, L, len(shapes), C), dtype=np.int64)
    lazy = latency_floor_cells(model, starts, ends, shapes, configs, memory, cost, succ)
    del memory
    B = model.method.num_micro_batches
    problem = StageProblem(
        cluster.num_hosts, cluster.devices_per_host, cost, succ, B, names, tuple(shapes)
    )
    return problem, lazy


def _settled_dp(
    model, problem: StageProblem, entries, tables, starts, ends, configs, lazy=None,
    progress=None, charge: np.ndarray | None = None,
):  # fmt: skip
    """The stage DP's problem and best slicing, with every layer of the chosen stages solved
    exactly. A cell whose layer MIP was deferred holds its LP bound (``StageCost.bound``),
    which can only flatter it; while the DP's best slicing uses such cells, they are solved
    exactly and the DP re-run. Likewise a range holding both readers of a shared parameter
    holds a bound of aligning them (``compose.bound_alignments``) until the DP picks it and
    ``align_shared`` re-plans them, and a (submesh, config) pair whose layers were never
    built holds its latency floors (``latency_floors``; ``lazy``: the pairs that start so)
    until the DP picks it and its layer table is made. A slicing of exact cells that is best
    against bounds is best outright, so the ILPs it never needs are never built or branched
    on. (Cells it never used keep their bounds in the returned problem's table.) With
    ``charge`` (seconds per first layer, last layer and submesh: ``stage_transfers``), the DP
    runs on the charged cells; the table returned and the solution's latencies are not."""
    budget = _budget(model.method, model.cluster)
    refine = model.method.stage_option.refine
    beat = math.inf if refine or charge is not None else BEAT.get()
    idle = WHILE_SETTLING.get()
    while True:
        t_dp = time.perf_counter()
        solution = solve_stages(problem if charge is None else problem.plus(charge))
        if charge is not None:
            solution = uncharged(problem, solution)
        model.stats.dp_seconds += time.perf_counter() - t_dp
        if solution.objective > beat:  # settling only raises the objective
            raise Dominated(solution.objective, beat)
        if lazy is not None:
            picked = {(st.submesh_index, st.config_index) for st in solution.stages}
            if picked - set(tables):
                # Each round re-runs the DP; where the floors walk it from submesh to submesh
                # (they leave out communication), ``LAZY_TABLE_BYTES`` bounds its cost.
                problem = _explore(model, problem, picked, entries, tables, starts, ends, configs,
                                   lazy, progress)  # fmt: skip
                continue
        stale: dict[tuple[int, int], tuple[int, int]] = {}  # (submesh, config) -> shape
        requests = []
        for st in solution.stages if tables else ():
            si, ci = st.submesh_index, st.config_index
            for k in range(st.layer_start, st.layer_end + 1):
                if (c := tables[(si, ci)].costs[k]) is not None and c.bound:
                    requests.append((starts[k], ends[k], st.submesh_shape, configs[si][ci]))
                    stale[(si, ci)] = st.submesh_shape
        if requests:  # bound layers first: re-composing their tables re-bounds alignments
            _meanwhile(functools.partial(model.settle, requests), idle)
        else:
            stale = _meanwhile(
                functools.partial(_align_chosen, model, solution, tables, starts, ends, configs),
                idle,
            )
            if not stale:
                return problem, solution
        idle = None
        cost, succ = problem.cost.copy(), problem.max_succ.copy()
        for (si, ci), sub in stale.items():
            cost[:, :, si, ci], succ[:, :, si, ci] = np.inf, 0
            if requests:
                fresh = _config_entries(model, starts, ends, sub, si, ci, configs, entries, tables)
            else:
                fresh = _table_entries(model, tables[(si, ci)], sub, si, ci, configs, entries)
            _fill_cells(cost, succ, fresh.items(), budget)
        problem = dataclasses.replace(problem, cost=cost, max_succ=succ)


def _transfer_aware(model, problem, solution, entries, tables, starts, ends, configs, lazy,
                    progress):  # fmt: skip
    """The fastest in the pipeline simulator (transfers between stages included; never
    below the DP's objective, see ``executable._ranked_time``) of the DP's multi-stage
    ``solution`` and the slicings the DP settles on with each stage charged for the
    activations handed across its edges (``stage_transfers``: one charge per guess of the
    links), with the table they all stand on. (A one-stage solution has no transfers, and
    no other slicing can beat it so: each one's objective is at least its own.)"""
    cut = CutBytes.of(model.forward.jaxpr)
    schedule = model.method.pipeline_schedule
    found = [solution]
    charges = transfer_charges(cut, starts, ends, problem, model.cluster)
    for k, charge in enumerate(charges):
        if k and _still_optimal(found[-1], charges[k - 1], charge):
            break
        problem, other = _settled_dp(
            model, problem, entries, tables, starts, ends, configs, lazy, progress, charge
        )
        found.append(other)
    # (the table's cells used may have been re-aligned since a slicing was found)
    found = list({s.stages: s for s in (uncharged(problem, s) for s in found)}.values())
    if len(found) == 1:
        return problem, found[0]

    def seconds(s: StageSolution) -> float:
        """As the micro-batch search ranks plans (``executable._ranked_time``)."""
        return max(s.objective, simulated_seconds(s, cut, starts, ends, model.cluster, schedule))

    return problem, min(found, key=seconds)


def _still_optimal(solution: StageSolution, before: np.ndarray, after: np.ndarray) -> bool:
    """Whether ``solution``, optimal under charge ``before``, is optimal under ``after`` too:
    ``after`` charges no cell less and the solution's own cells the same."""
    cells = [(st.layer_start, st.layer_end, st.submesh_index) for st in solution.stages]
    return bool(np.all(after >= before)) and all(after[c] == before[c] for c in cells)


def _explore(model, problem, picked, entries, tables, starts, ends, configs, lazy, progress):
    """``problem`` with the layer tables made of the submeshes of the unexplored (submesh,
    config) pairs in ``picked`` (the pairs ``lazy`` holds on floors), for all of each
    submesh's pairs at once: their floors are alike (the same devices), so the DP would
    likely pick them next, and their ILPs are solved in parallel (``_StageModel.prefetch``)."""
    L = len(starts)
    subs = {si for si, ci in picked if (si, ci) not in tables}
    todo = [(si, ci) for si, ci in lazy if si in subs and (si, ci) not in tables]
    shapes = problem.submesh_shapes
    requests = [(starts[k], ends[k], shapes[si], configs[si][ci]) for si, ci in todo
                for k in range(L)]  # fmt: skip
    if progress:
        progress(f"stage costs: {len(requests)} (layer, mesh) pairs")
    model.prefetch(requests)
    cost, succ = problem.cost.copy(), problem.max_succ.copy()
    budget = _budget(model.method, model.cluster)
    for si, ci in todo:
        cost[:, :, si, ci], succ[:, :, si, ci] = np.inf, 0
        fresh = _config_entries(model, starts, ends, shapes[si], si, ci, configs, entries, tables)
        _fill_cells(cost, succ, fresh.items(), budget)
    model.stats.cost_entries += L * (L + 1) // 2 * len(todo)
    return dataclasses.replace(problem, cost=cost, max_succ=succ)  # (copied: see the caller)


def _meanwhile(work: Callable[[], T], idle: Callable[[], None] | None) -> T:
    """``work()``; with ``idle``, run on a worker thread while this thread runs ``idle()``
    (JAX tracing, which stays on the caller's thread and its thread-local settings)."""
    if idle is None:
        return work()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(contextvars.copy_context().run, work)
        _let_build(future)
        idle()
        return future.result()


def _let_build(future: Future, most: float = 1.0, quiet: int = 3) -> None:
    """Wait (at most ``most`` seconds) until ``future``'s work has begun building ILPs and
    none has been building for ``quiet`` polls in a row, or it is done. Building holds the
    GIL, so work traced meanwhile would slow it and leave the solver processes waiting."""
    began, _ = build_activity()
    deadline, still = time.monotonic() + most, 0
    while not future.done() and time.monotonic() < deadline:
        started, building = build_activity()
        still = 0 if building or started == began else still + 1
        if still >= quiet:
            return
        time.sleep(0.005)


#: A chosen stage whose shared parameters are aligned (``align_shared``) takes the other
#: configs of its submesh along where their bound for its layers is within this fraction of
#: the chosen config's: the DP, re-run, would likely pick one of them next, so they are
#: re-planned at once, in parallel, instead of in another round (gpt-1.3b on 4 GPUs: its
#: 1-D and 2-D meshes tie).
ALIGN_ALONGSIDE = 0.01


def _align_chosen(model, solution, tables, starts, ends, configs) -> dict:
    """Align the readers of shared parameters in the chosen stages whose cost is a bound of
    doing so (and in the configs ``ALIGN_ALONGSIDE`` takes along): the (submesh, config)
    tables changed, with their submesh shapes."""
    # (submesh, config) -> its submesh shape and the layer ranges to align in its table
    todo: dict[tuple[int, int], tuple[tuple[int, int], list[tuple[int, int]]]] = {}
    for st in solution.stages:
        si, ci, i, j = st.submesh_index, st.config_index, st.layer_start, st.layer_end
        if (si, ci) not in tables or not needs_alignment(tables[(si, ci)], i, j):
            continue  # (no tables: whole profiling, every stage one ILP)
        limit = _composed_row(tables[(si, ci)], i)[j - i].latency * (1.0 + ALIGN_ALONGSIDE)
        for cj in range(len(configs[si])):
            table = tables.get((si, cj))
            if table is None or not needs_alignment(table, i, j):
                continue
            cell = _composed_row(table, i)[j - i]
            if cj == ci or (cell is not None and cell.latency <= limit):
                todo.setdefault((si, cj), (st.submesh_shape, []))[1].append((i, j))

    def align(key: tuple[int, int]) -> None:  # one table's ranges in turn: it is mutated
        (si, cj), (sub, ranges) = key, todo[key]
        for i, j in ranges:
            align_shared(model, tables[key], starts, ends, sub, configs[si][cj], i, j)

    with ThreadPoolExecutor(max_workers=max(len(todo), 1)) as pool:
        list(pool.map(align, todo))
    return {key: sub for key, (sub, _) in todo.items()}


def _prefetch_refinement(model, chosen: _Chosen, tables, starts, ends, configs) -> None:
    """The configs ``refine`` re-plans whole for each chosen stage, solved up front on the
    thread pool."""
    so = model.method.stage_option
    chosen.to_refine = [
        _refine_configs(model, tables, starts, ends, st, configs, so.refine_within)
        for st in chosen.solution.stages
    ]
    model.prefetch(
        [
            (starts[i], ends[j], sub, cfg)
            for (i, j), sub, sc, cfgs in zip(
                chosen.ranges, chosen.subs, chosen.composed, chosen.to_refine, strict=True
            )
            if sc is not None
            for cfg in cfgs
        ]
    )


def _uniform_stages(model, starts, ends) -> _Chosen:
    """``num_stages`` stages of (nearly) equal layer counts on equal submeshes."""
    method, cluster = model.method, model.cluster
    so: UniformStageOption = method.stage_option
    S, L = so.num_stages, len(starts)
    if S > L:
        raise ConfigError(
            f"UniformStageOption.num_stages: {S} stages but the step has only {L} layers"
        )
    bounds = [round(k * L / S) for k in range(S + 1)]
    sub = so.submesh_shape or even_submesh(S, cluster)
    if so.logical_shape is not None and math.prod(so.logical_shape) != sub[0] * sub[1]:
        raise ConfigError(
            f"UniformStageOption.logical_shape: {so.logical_shape} has "
            f"{math.prod(so.logical_shape)} devices but each stage's submesh {sub} has "
            f"{sub[0] * sub[1]}"
        )
    subs = [sub] * S
    _check_devices(subs, cluster)
    chosen = _Chosen(
        ranges=[(bounds[k], bounds[k + 1] - 1) for k in range(S)],
        subs=subs,
        logicals=[so.logical_shape or (sub[0] * sub[1],)] * S,
        devices=assign_devices(subs, cluster),
    )
    if so.profiling == "individual":
        table = _layer_table(model, starts, ends, subs[0], chosen.logicals[0])
        config = StageConfig(chosen.logicals[0], "auto")
        for i, j in chosen.ranges:
            align_shared(model, table, starts, ends, subs[0], config, i, j)
        composed = [_composed_stage(model, table, starts, ends, i, j) for i, j in chosen.ranges]
        budget = _budget(method, cluster)
        # A composed stage over the budget (held bytes plus its largest transient; see
        # _composed_row) has no plan here.
        chosen.composed = [c if c is None or c.peak_memory <= budget else None for c in composed]
    return chosen


def even_submesh(num_stages: int, cluster: ClusterSpec) -> tuple[int, int]:
    """The (hosts, devices) submesh that divides ``cluster`` evenly among ``num_stages``
    stages: whole hosts each, or an equal share of every host."""
    H, D, S = cluster.num_hosts, cluster.devices_per_host, num_stages
    if H % S == 0:
        return (H // S, D)
    if S % H == 0 and D % (S // H) == 0:
        return (1, D // (S // H))
    raise ConfigError(
        f"UniformStageOption.num_stages: {S} stages cannot divide cluster {cluster.name} "
        f"({H} hosts x {D} devices) evenly; pass submesh_shape, or use a stage count that "
        f"divides {H} hosts or is a multiple of {H} dividing {H * D} devices"
    )


def _manual_stages(starts, cluster: ClusterSpec, so: ManualStageOption) -> _Chosen:
    """The user's layer ranges, submeshes, logical meshes and (optionally) devices."""
    L = len(starts)
    ids = so.forward_stage_layer_ids
    if ids[-1][-1] != L - 1:
        raise ConfigError(
            f"ManualStageOption.forward_stage_layer_ids: covers layers 0..{ids[-1][-1]} but "
            f"the step has {L} layers"
        )
    subs = list(so.submesh_physical_shapes)
    if so.submesh_devices is not None:
        devices = list(so.submesh_devices)
    else:
        _check_devices(subs, cluster)
        devices = assign_devices(subs, cluster)
    return _Chosen(
        ranges=[(s[0], s[-1]) for s in ids],
        subs=subs,
        logicals=list(so.submesh_logical_shapes or [(h * d,) for h, d in subs]),
        devices=devices,
    )


def _stage_plan(model, chosen: _Chosen, k: int, starts, ends) -> StagePlan:
    """Stage ``k``'s final cost (composed, refined whole, or one whole ILP) as a plan."""
    method, cluster = model.method, model.cluster
    (i, j), sub, logical = chosen.ranges[k], chosen.subs[k], chosen.logicals[k]
    if chosen.composed is not None:
        sc = chosen.composed[k]
        # Every config of the chosen submesh (logical mesh and layout; with memory_lean the
        # ZeRO-3 column too), solved whole: the composition ranks them by an estimate, the
        # whole ILP by the stage's own cost.
        for cfg in chosen.to_refine[k] if chosen.to_refine and sc is not None else ():
            whole = model.cost(starts[i], ends[j], sub, cfg.shape, cfg.layout)
            if whole is not None and whole.latency < sc.latency:
                sc, logical = whole, cfg.shape
    else:
        model.stats.cost_entries += not isinstance(method.stage_option, AutoStageOption)
        sc = model.cost(starts[i], ends[j], sub, logical)
    if sc is None:
        raise MemoryBudgetError(
            f"memory_budget: stage of layers {i}..{j} on submesh {sub} does not fit "
            f"{format_bytes(_budget(method, cluster), 2)} per device",
            None,
        )
    sc = _with_launches(model, sc, sub, logical)
    sl = slice_stage(model.forward.jaxpr, starts[i], ends[j], model.capture.diff)
    return StagePlan(
        i, j, starts[i], ends[j], sub, tuple(chosen.devices[k]), logical, sc.latency,
        sc.memory(1), sc.in_specs, sc.out_specs, sc.inner_specs, sl.boundary_bytes,
        sc.residual_bytes,
    )  # fmt: skip


def _cost_entries(model, starts, ends, shapes, configs, option, progress):
    """StageCost of every (first layer, last layer, submesh, config) that has a plan, and the
    per-layer tables individual mode composed them from."""
    L = len(starts)
    entries: dict[tuple[int, int, int, int], StageCost] = {}
    tables: dict[tuple[int, int], _LayerTable] = {}
    n_cfg = sum(len(c) for c in configs)
    individual = option.profiling == "individual"
    total = L * n_cfg if individual else L * (L + 1) // 2 * n_cfg
    requests = [
        (starts[i], ends[j], sub, cfg)
        for si, sub in enumerate(shapes)
        for cfg in configs[si]
        for i in range(L)
        for j in ([i] if individual else range(i, L))
    ]
    if progress:
        progress(f"stage costs: {len(requests)} (layer range, mesh) pairs")
    model.prefetch(requests)
    done = 0
    for si, sub in enumerate(shapes):
        for ci, (logical, layout) in enumerate(configs[si]):
            if individual:
                _config_entries(model, starts, ends, sub, si, ci, configs, entries, tables)
                done += L
                if progress:
                    progress(f"stage costs {done}/{total}")
                continue
            for i in range(L):
                for j in range(i, L):
                    sc = model.cost(starts[i], ends[j], sub, logical, layout)
                    done += 1
                    if progress:
                        progress(f"stage costs {done}/{total}")
                    if sc is not None:
                        entries[(i, j, si, ci)] = _with_launches(model, sc, sub, logical)
    model.stats.cost_entries += L * (L + 1) // 2 * n_cfg
    return entries, tables


def _config_entries(model, starts, ends, sub, si: int, ci: int, configs, entries, tables) -> dict:
    """Compose the layer table of submesh ``si``'s config ``ci`` and its cost entries, which
    replace that config's in ``entries`` and are returned."""
    logical, layout = configs[si][ci]
    table = tables[(si, ci)] = _layer_table(model, starts, ends, sub, logical, layout)
    bound_alignments(model, table, starts, ends, sub, configs[si][ci])
    return _table_entries(model, table, sub, si, ci, configs, entries)


def _table_entries(model, table, sub, si: int, ci: int, configs, entries) -> dict:
    """The cost entries composed from submesh ``si``'s config ``ci``'s layer table, which
    replace that config's in ``entries`` and are returned."""
    logical = configs[si][ci].shape
    fresh = {}
    for i in range(len(table.costs)):
        for j, sc in enumerate(_composed_row(table, i), start=i):
            entries.pop((i, j, si, ci), None)
            if sc is not None:
                fresh[(i, j, si, ci)] = _with_launches(model, sc, sub, logical)
    entries.update(fresh)
    return fresh


def _stage_problem(entries, L, shapes, C, budget, cluster, B, names) -> StageProblem:
    """The DP's table over the searched ``shapes``: latency where the stage fits ``budget``
    with one micro-batch in flight, and how many later stages' worth of in-flight
    micro-batches it can hold."""
    cost = np.full((L, L, len(shapes), C), np.inf)
    max_succ = np.zeros((L, L, len(shapes), C), dtype=np.int64)
    _fill_cells(cost, max_succ, entries.items(), budget)
    n, m = cluster.num_hosts, cluster.devices_per_host
    return StageProblem(n, m, cost, max_succ, B, names, tuple(shapes))


def _fill_cells(cost: np.ndarray, max_succ: np.ndarray, items, budget: float) -> None:
    """Write each entry's latency and ``max_succ`` into the DP's arrays (where it fits)."""
    L = cost.shape[0]
    for (i, j, si, ci), sc in items:
        if sc.memory(1) > budget:
            continue
        cost[i, j, si, ci] = sc.latency
        k = 1
        while k < L and sc.memory(k + 1) <= budget:
            k += 1
        max_succ[i, j, si, ci] = k - 1


def _least_pipeline_memory(
    forward,
    capture,
    cluster,
    method,
    state_total,
    param_total,
    starts,
    ends,
    shapes,
    configs,
    names,
) -> float:
    """Smallest budget at which the DP finds a slicing, from stage plans made without a budget
    (each such plan stays feasible at any budget above its memory, so this budget fits)."""
    unlimited = dataclasses.replace(method, memory_budget=math.inf)
    free_model = _StageModel(forward, capture, cluster, unlimited, state_total, param_total)
    if method.stage_option.profiling == "individual":  # its layers priced as plan_pipeline's
        free_model.composed_layers = frozenset(zip(starts, ends, strict=True))
    option = method.stage_option
    entries, _ = _cost_entries(free_model, starts, ends, shapes, configs, option, None)
    L, C = len(starts), max(len(c) for c in configs)
    candidates = sorted({sc.memory(k) for sc in entries.values() for k in range(1, L + 1)})

    def feasible(m: float) -> bool:
        prob = _stage_problem(entries, L, shapes, C, m, cluster, method.num_micro_batches, names)
        try:
            solve_stages(prob)
        except InfeasibleError:
            return False
        return True

    lo, hi = 0, len(candidates) - 1
    if not candidates or not feasible(candidates[hi]):
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]
