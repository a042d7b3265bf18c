"""Plan and lower a step for ``PipeshardParallel``; ``PipeshardExecutable`` runs it locally."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr
from jax.sharding import NamedSharding, PartitionSpec

from .._heap import lenient_gc, release_free_memory
from ..cluster.spec import ClusterSpec
from ..errors import ConfigError, MemoryBudgetError
from ..graph.grad_capture import GradCapture, TracedStep, trace_with_grads
from ..graph.jaxpr_walk import flatten_calls
from ..graph.planning_stats import PlanningStats
from ..graph.scan_split import (
    PieceMap,
    even_lengths,
    layer_scans,
    row_sliced_inputs,
    split_scans,
)
from ..inspect.program_collectives import StepCollectives, step_collectives
from ..options.pipeshard import AutoLayerOption, PipeshardParallel
from ..runtime.instructions import format_stream, program_runs
from ..runtime.local import InstructionTiming, LocalRuntime
from ..shard.executable import dynamic_leaves
from ..shard.solve_pool import session_pool, solve_session
from .latency_floors import step_floor
from .lower.compile import CompiledPipeline, StageLowering, compile_pipeline, grad_equation
from .micro_batch_search import micro_batch_candidates, search_micro_batches
from .plan import PipeshardPlan, RowSplit, ScanSplit
from .plan_check import check_plan
from .refine import refine_stages
from .schedules import make_schedule
from .simulate import simulate_plan
from .stacked_rows import join_rows, take_rows, union_sharding
from .stage_cost import shared_cost_models
from .stage_search import BEAT, LEAST_MEMORY, WHILE_SETTLING, plan_pipeline

__all__ = [
    "PipeshardExecutable",
    "PreparedStep",
    "StepFun",
    "add_buffers",
    "apply_scan_splits",
    "arg_layouts",
    "compile_pipeshard",
    "leaf_paths",
    "plan_pipeshard",
    "prepare_step",
    "split_leaf_indices",
    "stage_lowerings",
    "trace_step",
    "traced_floor",
]


@dataclass(eq=False)
class PipeshardExecutable:
    """A pipelined step for one argument signature."""

    fun_name: str
    plan: PipeshardPlan
    compiled: CompiledPipeline
    runtime: LocalRuntime
    in_tree: Any
    out_tree: Any
    static_argnums: tuple[int, ...]
    planning_time: float
    extra: dict[str, Any] = field(default_factory=dict)
    #: The user's flat leaves <-> the step's when scanned stacks are split into row pieces.
    pieces: PieceMap | None = None

    def __call__(self, *args: Any) -> Any:
        return self._run(args, None)

    def profile(self, *args: Any) -> tuple[Any, list[InstructionTiming]]:
        """One step with every instruction timed (run back to back, each waiting for its
        results): the step's outputs and the measured per-instruction intervals."""
        timeline: list[InstructionTiming] = []
        return self._run(args, timeline), timeline

    def _run(self, args: tuple[Any, ...], timeline: list[InstructionTiming] | None) -> Any:
        flat = dynamic_leaves(args, self.static_argnums, self.in_tree, self.fun_name)
        if self.pieces is not None:
            layouts = self.extra.get("arg_layouts") or self.extra.setdefault(
                "arg_layouts", arg_layouts(self.compiled)
            )
            flat = self.pieces.split_inputs(flat, lambda x, a, b, i: take_rows(x, a, b, layouts[i]))
        self._check_donated(flat)
        buffers = {name: leaf for name, leaf in zip(self.compiled.arg_names, flat, strict=True)}
        buffers = self.runtime.execute(self.compiled.stream, buffers, timeline)
        outs = [
            self.compiled.out_literals[o] if n is None else buffers[n]
            for o, n in enumerate(self.compiled.out_names)
        ]
        if self.pieces is not None:
            outs = self.pieces.join_outputs(outs, lambda parts: join_rows(parts, self.fun_name))
        return jax.tree.unflatten(self.out_tree, outs)

    def _check_donated(self, flat: list[Any]) -> None:
        """Warn (once) when a donated argument is not in the layout it is consumed in: it is
        copied into that layout and the copy donated, so the caller's array survives."""
        if self.extra.get("warned_donation"):
            return
        moved = []
        for name, key in self.compiled.donation.items():
            leaf = flat[self.compiled.arg_names.index(name)]
            sharding = getattr(leaf, "sharding", None)
            want = self.compiled.layouts[key]
            if sharding is None or not sharding.is_equivalent_to(want, leaf.ndim):
                moved.append(int(name[3:]))
        if moved:
            self.extra["warned_donation"] = True
            warnings.warn(
                f"{self.fun_name}: donated argument leaves {moved[:8]}"
                f"{' ...' if len(moved) > 8 else ''} are not in their planned layouts; each is "
                "copied into its layout once and the copy donated (pass the previous step's "
                "outputs to donate without a copy)",
                stacklevel=3,
            )

    def input_layouts(self, avals: Sequence[Any]) -> list[Any]:
        """Per flat argument leaf (``avals``: their shapes), the layout the step first reads
        it in (a stacked leaf cut into row pieces: the pieces' layouts joined along its layer
        axis, or the first piece's mesh, replicated, when they cannot be; None: unread)."""
        layouts = self.extra.get("arg_layouts") or self.extra.setdefault(
            "arg_layouts", arg_layouts(self.compiled)
        )
        if self.pieces is None:
            return list(layouts)
        parts: dict[int, list[tuple[int, Any]]] = {}
        for i, (k, a, b) in enumerate(self.pieces.inputs):
            parts.setdefault(k, []).append((0 if a is None else b - a, layouts[i]))
        out = []
        for k in sorted(parts):
            got = parts[k]
            if len(got) == 1:
                out.append(got[0][1])
                continue
            equal = len({n for n, _ in got}) == 1
            ndim = len(avals[k].shape)
            joined = union_sharding([lay for _, lay in got], ndim) if equal else None
            first = got[0][1]
            out.append(joined or (NamedSharding(first.mesh, PartitionSpec()) if first else None))
        return out

    def trace(self, path: str | Path, *args: Any, png: bool = True) -> list[InstructionTiming]:
        """One profiled step (``profile``) written as a Chrome trace to ``path`` from the
        measured intervals, one track per mesh named like ``PipeshardPlan.timeline``'s, plus
        a Gantt chart beside it (same stem, .png); returns the timings.

        Instructions run back to back while profiled, so the trace shows where each mesh's
        time goes, not how much the meshes overlap in a plain step.
        """
        from ..inspect.timeline import write_measured_trace

        _, timings = self.profile(*args)
        write_measured_trace(
            path, timings, self.plan, self.fun_name, how="instructions back to back", png=png
        )
        return timings

    def instructions(self, limit: int | None = 60) -> str:
        """The step's instruction stream, one line each."""
        return format_stream(self.compiled.stream, limit)

    def get_hlo_text(self, program: str) -> str:
        """The compiled HLO of one program (``fwd0``, ``bwd1``, ``sync0``, ``apply1``, ...;
        ``collectives()`` lists them) for the arguments it ran with: run a step first."""
        return self.runtime.hlo_text(program)

    def collectives(self) -> StepCollectives:
        """Per program (stage, role, runs per step), the collectives of its compiled HLO;
        ``.per_step()`` totals one step. Run a step first."""
        return step_collectives(program_runs(self.compiled.stream), self.runtime.hlo_text)


@dataclass(frozen=True)
class StepFun:
    """The user's step over flat array leaves, static arguments put back in their places;
    picklable, so that Ray workers can trace the same step."""

    fun: Callable[..., Any]
    static: tuple[tuple[int, Any], ...]
    in_tree: Any

    def __call__(self, *leaves: Any) -> Any:
        args: list[Any] = list(jax.tree.unflatten(self.in_tree, leaves))
        for i, value in self.static:
            args.insert(i, value)
        return self.fun(*args)

    @property
    def leaf_names(self) -> list[str]:
        """Each flat leaf's path in the dynamic arguments (``[2]['x']``), as errors name it."""
        return leaf_paths(self.in_tree)


def leaf_paths(tree_def: Any) -> list[str]:
    """Each leaf's key path in a pytree of structure ``tree_def`` (``[2]['x']``)."""
    tree = jax.tree.unflatten(tree_def, range(tree_def.num_leaves))
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def add_buffers(a: Any, b: Any) -> Any:
    """The runtime's ACCUMULATE: one jitted add, shared by every stage."""
    return _ADD(a, b)


_ADD = jax.jit(jnp.add)


@dataclass(frozen=True)
class PreparedStep:
    """A pipeshard step traced with ``alpa_mini.grad`` captured, and its plan. With the
    plan's scan splits applied, ``step`` reads row pieces of stacked leaves: ``pieces``
    maps the user's flat leaves to its own. ``step`` and ``out_tree`` are None where only
    the loss was traced (``prepare_step(loss_only=True)``)."""

    step: ClosedJaxpr | None
    out_tree: Any
    capture: GradCapture
    forward: ClosedJaxpr
    plan: PipeshardPlan
    pieces: PieceMap | None = None
    traced: TracedStep | None = None  # as traced, before scan splits


def prepare_step(
    step_fun: Callable[..., Any],
    avals: list[Any],
    roles: list[str],
    method: PipeshardParallel,
    cluster: ClusterSpec,
    progress: Callable[[str], None] | None = None,
    earlier: TracedStep | None = None,
    on_traced: Callable[[TracedStep], None] | None = None,
    traced: TracedStep | None = None,
    loss_only: bool = False,
) -> PreparedStep:
    """Trace the step and plan it, or check that ``method.plan`` was made for this step.
    Scans over stacked layers are split into sub-scans first when the layer option may cut
    between their iterations (the plan records how). ``num_micro_batches=None``: planned at
    each count the search tries (``micro_batch_search``), the fastest kept. ``earlier``: the
    step traced at another count, whose full-shape replay may be reused; ``on_traced`` gets
    this count's trace before planning (which may then find that nothing fits); ``traced``:
    this count's trace, made ahead (``trace_ahead``). ``loss_only``: for a plan alone, trace
    the step only as far as its grad call where that suffices (``trace_with_grads``). Planning
    solves its ILPs in child processes (``solve_session``): for a step with
    ``WARM_POOL_BYTES`` of parameters they start here, so that they are ready by the time
    tracing is done; otherwise when enough ILPs need them."""
    with _planning(method.plan is None):
        if method.plan is None and _param_bytes(avals, roles) >= WARM_POOL_BYTES:
            session_pool()  # its children start (imports, ~0.4 s) while the step is traced
        if method.num_micro_batches is None:
            if method.plan is None:
                return _searched(step_fun, avals, roles, method, cluster, progress, loss_only)
            method = dataclasses.replace(method, num_micro_batches=method.plan.num_micro_batches)
        t0 = time.perf_counter()
        if traced is None:
            traced = trace_with_grads(
                step_fun, avals, roles, method.num_micro_batches, "pipeline",
                earlier=earlier, loss_only=loss_only and method.plan is None,
            )  # fmt: skip
        step, out_shape, capture, forward = _traced_parts(traced)
        plan = method.plan
        splits = plan.scan_splits if plan is not None else _scan_splits(forward, capture, method)
        rows = plan.row_splits if plan is not None else _row_splits(forward, capture)
        if step is None and (splits or rows):  # pieces change the step as well: trace it whole
            traced = trace_with_grads(step_fun, avals, roles, method.num_micro_batches, "pipeline")
            step, out_shape, capture, forward = _traced_parts(traced)
        if on_traced is not None:
            on_traced(traced)
        try:
            step, capture, forward, pieces = apply_scan_splits(
                step, capture, forward, splits, roles, rows
            )
        except ValueError as err:  # only a saved plan's splits can be wrong
            raise ConfigError(f"plan.{err}") from None
        if plan is None:
            trace_seconds = time.perf_counter() - t0
            plan = _plan(forward, capture, avals, roles, method, cluster, progress)
            stats = dataclasses.replace(
                plan.planning,
                trace_seconds=trace_seconds,
                total_seconds=time.perf_counter() - t0,
            )
            plan = dataclasses.replace(plan, planning=stats, scan_splits=splits, row_splits=rows)
        else:
            check_plan(plan, cluster, forward, capture, method.num_micro_batches)
        out_tree = None if step is None else jax.tree.structure(out_shape)
        return PreparedStep(step, out_tree, capture, forward, plan, pieces, traced)


@contextlib.contextmanager
def _planning(active: bool) -> Iterator[None]:
    """While a step is planned (``active``): ILPs solved in child processes, and a garbage
    collector that rescans the heap less often (``_heap.lenient_gc``)."""
    if not active:
        yield
        return
    with solve_session(), lenient_gc():
        yield


#: Parameter bytes from which a step's layer ILPs are surely many and large enough to be
#: solved in child processes (``stage_cost.POOL_MIN_NODES``; GPT-3 350M holds 1.4 GB): their
#: pool is started before tracing rather than when the first ILPs are ready.
WARM_POOL_BYTES = 1 << 30


def _param_bytes(avals: Sequence[Any], roles: Sequence[str]) -> float:
    return sum(_nbytes(a) for a, r in zip(avals, roles, strict=True) if r == "param")


def _searched(
    step_fun: Callable[..., Any],
    avals: list[Any],
    roles: list[str],
    method: PipeshardParallel,
    cluster: ClusterSpec,
    progress: Callable[[str], None] | None,
    loss_only: bool = False,
) -> PreparedStep:
    """The step prepared at the micro-batch count with the fastest predicted plan."""
    t0 = time.perf_counter()
    batch = [a for a, r in zip(avals, roles, strict=True) if r == "batch"]
    # A count must divide every batch leaf's rows; a step without (splittable) batch leaves
    # has only B = 1.
    rows = math.gcd(*(int(a.shape[0]) for a in batch)) if all(a.ndim for a in batch) else 1

    # The first count's trace, whose replay later ones reuse (kept even where nothing fits at
    # that count: the trace is made before the planning that finds so).
    first: list[TracedStep] = []

    candidates = micro_batch_candidates(max(rows, 1), cluster.num_devices)
    # Counts traced ahead, while an earlier count's settling left the planner's core idle.
    ahead: dict[int, TracedStep | Exception] = {}
    planned: set[int] = set()

    def trace_ahead(b: int) -> None:
        """Trace the counts beside ``b`` (the search plans one of them next)."""
        i = candidates.index(b)
        for c in candidates[max(i - 1, 0) : i + 2]:
            if first and c not in planned and c not in ahead:
                try:
                    ahead[c] = trace_with_grads(
                        step_fun, avals, roles, c, "pipeline", earlier=first[0]
                    )
                except Exception as err:  # raised again if the search plans c
                    ahead[c] = err.with_traceback(None)

    def plan_at(b: int, beat: float = math.inf) -> tuple[PreparedStep, float]:
        if progress is not None:
            progress(f"micro-batches: planning B={b}")
        planned.add(b)
        at = dataclasses.replace(method, num_micro_batches=b)
        earlier = first[0] if first else None
        traced = ahead.pop(b, None)
        if isinstance(traced, Exception):
            raise traced
        token = BEAT.set(beat)  # a count that cannot beat the fastest so far stops early
        meanwhile = WHILE_SETTLING.set(functools.partial(trace_ahead, b))
        try:
            prepared = prepare_step(
                step_fun, avals, roles, at, cluster, progress, earlier,
                on_traced=None if first else first.append, traced=traced, loss_only=loss_only,
            )  # fmt: skip
        finally:
            WHILE_SETTLING.reset(meanwhile)
            BEAT.reset(token)
        return prepared, _ranked_time(prepared.plan, method)

    failed: MemoryBudgetError | None = None
    with shared_cost_models():
        skip = LEAST_MEMORY.set(False)  # an infeasible count's least memory is not needed...
        searching = _SEARCHING.set(True)
        try:
            prepared, _, tried, dominated = search_micro_batches(candidates, plan_at)
        except MemoryBudgetError as err:
            failed = err
        finally:
            _SEARCHING.reset(searching)
            LEAST_MEMORY.reset(skip)
        if failed is not None:  # ...unless no count fits
            raise _least_memory_error(failed, lambda: plan_at(candidates[-1])) from None
        at = dataclasses.replace(method, num_micro_batches=prepared.plan.num_micro_batches)
        refined = refine_stages(
            prepared.plan, prepared.forward, prepared.capture, cluster, at, _sizes(avals, roles),
            progress,
        )  # fmt: skip
    prepared = dataclasses.replace(prepared, plan=refined)
    stats = dataclasses.replace(
        prepared.plan.planning or PlanningStats(),
        total_seconds=time.perf_counter() - t0,
        micro_batches_tried=tuple(tried),
        micro_batches_dominated=tuple(dominated),
    )
    return dataclasses.replace(prepared, plan=dataclasses.replace(prepared.plan, planning=stats))


#: Set while the micro-batch search plans its counts: they are ranked by their stage DP's
#: objective, and only the chosen count is refined (``refine.refine_stages``).
_SEARCHING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "alpa_mini_searching_micro_batches", default=False
)


def _ranked_time(plan: PipeshardPlan, method: PipeshardParallel) -> float:
    """The time the micro-batch search ranks a count by: its stage DP's objective, which is
    what counts stopped at their bound are compared with, unless the chosen stages were
    refined whole (which only lowers the plan's predicted time); for several stages, the
    larger of that and the simulated time, which adds the transfers between stages (the
    simulator may also overlap the last stages' tail of work the objective counts, so the
    larger keeps a count's DP bound below its time)."""
    refined = getattr(method.stage_option, "refine", False)
    solution = plan.stage_solution
    own = plan.predicted_time if refined or solution is None else solution.objective
    if len(plan.stages) > 1 and plan.cluster_spec is not None:
        return max(own, simulate_plan(plan, plan.cluster_spec).iteration_time)
    return own


def _least_memory_error(err: MemoryBudgetError, plan_largest: Callable[[], Any]) -> Exception:
    """No count fits: the search's error, with the least memory that would fit at the largest
    count (usually the least of any: smaller micro-batches hold less, unless their rows split
    badly over the data-parallel axes), which planning it once more works out."""
    try:
        plan_largest()
    except MemoryBudgetError as full:
        return MemoryBudgetError(f"{err}; at the largest count, {full}", full.min_budget)
    return err  # it fits now: the search's error stands (planning is deterministic)


def apply_scan_splits(
    step: ClosedJaxpr,
    capture: GradCapture,
    forward: ClosedJaxpr,
    splits: Sequence[ScanSplit],
    roles: Sequence[str],
    rows: Sequence[RowSplit] = (),
) -> tuple[ClosedJaxpr, GradCapture, ClosedJaxpr, PieceMap | None]:
    """A traced step with a plan's scan and row splits applied (unchanged, and no piece
    map, when it has none)."""
    if not splits and not rows:
        return step, capture, forward, None
    _check_splits(forward, splits)
    if len({r.input for r in rows}) != len(rows):
        raise ValueError(f"row_splits: a loss input is split twice ({[r.input for r in rows]})")
    split = split_scans(
        step, capture, forward, {s.eqn: s.lengths for s in splits}, roles,
        {r.input: r.lengths for r in rows},
    )  # fmt: skip
    return split.step, split.capture, split.forward, split.pieces


def _check_splits(forward: ClosedJaxpr, splits: Sequence[ScanSplit]) -> None:
    """Each split names a distinct scan of the loss and lengths that sum to its length."""
    eqns = forward.jaxpr.eqns
    seen: set[int] = set()
    for i, s in enumerate(splits):
        if not 0 <= s.eqn < len(eqns) or eqns[s.eqn].primitive.name != "scan":
            raise ValueError(
                f"scan_splits[{i}].eqn: {s.eqn} is not a scan of the loss (its scans: "
                f"{[k for k, e in enumerate(eqns) if e.primitive.name == 'scan']})"
            )
        if s.eqn in seen:
            raise ValueError(f"scan_splits[{i}].eqn: equation {s.eqn} is split twice")
        seen.add(s.eqn)
        n = eqns[s.eqn].params["length"]
        if sum(s.lengths) != n or min(s.lengths, default=0) < 1:
            raise ValueError(
                f"scan_splits[{i}].lengths: {list(s.lengths)} is invalid; expected positive "
                f"lengths that sum to the scan's {n} iterations"
            )


def _scan_splits(
    forward: ClosedJaxpr, capture: GradCapture, method: PipeshardParallel
) -> tuple[ScanSplit, ...]:
    """How ``AutoLayerOption(layer_num=L)`` may cut scanned stacks: each into min(L, length)
    sub-scans of near-equal length, so the clustering can cut between them (the layers of a
    stack are alike, so equal runs balance). Markers never cut inside a scan."""
    option = method.layer_option
    if not isinstance(option, AutoLayerOption) or option.layer_num < 2:
        return ()
    found = []
    for i in layer_scans(forward, capture):
        n = forward.jaxpr.eqns[i].params["length"]
        found.append(ScanSplit(i, even_lengths(n, min(n, option.layer_num))))
    return tuple(found)


def _row_splits(forward: ClosedJaxpr, capture: GradCapture) -> tuple[RowSplit, ...]:
    """Stacks a loop reads row by row (``w[i]``), each split into the pieces it reads, so
    that every block reads, differentiates and updates a parameter of its own (read whole,
    a stack is one parameter every block's gradient is padded to)."""
    return tuple(RowSplit(j, n) for j, n in sorted(row_sliced_inputs(forward, capture).items()))


def plan_pipeshard(
    step_fun: Callable[..., Any],
    avals: list[Any],
    roles: list[str],
    method: PipeshardParallel,
    cluster: ClusterSpec,
    progress: Callable[[str], None] | None = None,
) -> PipeshardPlan:
    """Plan only (no devices needed, nothing allocated or compiled); ``alpa_mini.plan``."""
    return prepare_step(step_fun, avals, roles, method, cluster, progress, loss_only=True).plan


def compile_pipeshard(
    fun: Callable[..., Any],
    step_fun: Callable[..., Any],
    avals: list[Any],
    roles: list[str],
    in_tree: Any,
    static: tuple[tuple[int, Any], ...],
    method: PipeshardParallel,
    cluster: ClusterSpec,
    donated: Sequence[int] = (),
) -> PipeshardExecutable:
    """Trace with ``alpa_mini.grad`` captured, plan (or replay ``method.plan``), lower;
    ``donated``: argument leaves the step may consume."""
    t0 = time.perf_counter()
    prepared = prepare_step(step_fun, avals, roles, method, cluster)
    plan = prepared.plan
    donated = split_leaf_indices(prepared.pieces, donated)
    devices = jax.devices()[: cluster.num_devices]
    lowering = stage_lowerings(plan, [tuple(devices[d] for d in s.devices) for s in plan.stages])
    schedule = make_schedule(plan.schedule, plan.num_stages, plan.num_micro_batches)
    compiled = compile_pipeline(
        prepared.step,
        prepared.capture,
        prepared.forward,
        lowering,
        schedule,
        donated,
        method.shards_optimizer_state,
        method.fuse_programs,
    )
    runtime = LocalRuntime(compiled.programs, compiled.layouts, add_buffers)
    return PipeshardExecutable(
        fun_name=getattr(fun, "__name__", "step"),
        plan=plan,
        compiled=compiled,
        runtime=runtime,
        in_tree=in_tree,
        out_tree=prepared.out_tree,
        static_argnums=tuple(i for i, _ in static),
        planning_time=time.perf_counter() - t0,
        extra={"schedule": schedule},
        pieces=prepared.pieces,
    )


def split_leaf_indices(pieces: PieceMap | None, leaves: Sequence[int]) -> list[int]:
    """The split step's input leaves that hold rows of the given user leaves."""
    if pieces is None:
        return list(leaves)
    chosen = set(leaves)
    return [i for i, (k, _, _) in enumerate(pieces.inputs) if k in chosen]


def arg_layouts(compiled: CompiledPipeline) -> list[Any]:
    """Per step input, the layout it is first consumed in (None: never read on a mesh)."""
    first: dict[str, Any] = {}
    for name, key in compiled.donation.items():
        first[name] = compiled.layouts[key]
    for ins in compiled.stream:
        src, layout = getattr(ins, "src", None), getattr(ins, "layout", None)
        if src in compiled.arg_names and layout is not None and src not in first:
            first[src] = compiled.layouts[layout]
    return [first.get(n) for n in compiled.arg_names]


def stage_lowerings(plan: PipeshardPlan, devices: list[tuple[Any, ...]]) -> list[StageLowering]:
    """What ``compile_pipeline`` needs of each planned stage, on the given devices."""
    return [
        StageLowering(
            s.eqn_start,
            s.eqn_end,
            devs,
            s.logical_shape,
            s.in_specs or None,
            s.out_specs or None,
            s.inner_specs,
        )
        for s, devs in zip(plan.stages, devices, strict=True)
    ]


def _nbytes(a: Any) -> float:
    return float(math.prod(a.shape) * a.dtype.itemsize)


def trace_step(
    fun: Callable[..., Any], avals: list[Any], roles: Sequence[str], num_micro_batches: int
) -> tuple:
    """The step's jaxpr with ``alpa_mini.grad`` captured, its capture and the flat forward."""
    return _traced_parts(trace_with_grads(fun, avals, roles, num_micro_batches, "pipeline"))


def traced_floor(
    fun: Callable[..., Any],
    avals: list[Any],
    roles: Sequence[str],
    method: PipeshardParallel,
    cluster: ClusterSpec,
) -> float:
    """``latency_floors.step_floor`` of the step traced with one micro-batch, cut into layers
    by ``method.layer_option``: the seconds per iteration no plan of it beats on ``cluster``."""
    _, _, capture, forward = trace_step(fun, avals, roles, 1)
    one = dataclasses.replace(method, num_micro_batches=1, plan=None)
    return step_floor(forward, capture, cluster, one, _sizes(avals, roles))


def _traced_parts(traced: TracedStep) -> tuple:
    """(step jaxpr, output shapes, the grad call's capture, its flat loss); the step and its
    output shapes are None where only the loss was traced (its one capture)."""
    step = traced.closed
    if step is None:
        capture: GradCapture = traced.captures[0]
    else:
        g = grad_equation(step.jaxpr)
        capture = traced.captures[step.jaxpr.eqns[g].params["index"]]
    return step, traced.out_shape, capture, flatten_calls(capture.loss)


def _plan(forward, capture, avals, roles, method, cluster, progress) -> PipeshardPlan:
    """Two-level planning of a traced step; optimiser state is sized from the ``state`` args."""
    sizes = _sizes(avals, roles)
    plan = plan_pipeline(
        forward,
        capture,
        cluster,
        method,
        state_bytes_total=sizes[0],
        param_bytes_total=sizes[1],
        progress=progress,
    )
    release_free_memory()  # the cost tables and ILPs are garbage now
    if _SEARCHING.get():  # the search refines the count it chooses, once
        return plan
    return refine_stages(plan, forward, capture, cluster, method, sizes, progress)


def _sizes(avals: Sequence[Any], roles: Sequence[str]) -> tuple[float, float]:
    """The step's optimiser-state and parameter bytes."""
    state = sum(_nbytes(a) for a, r in zip(avals, roles, strict=True) if r == "state")
    return state, _param_bytes(avals, roles)
